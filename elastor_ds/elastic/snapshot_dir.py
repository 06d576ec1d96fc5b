"""The node's memory-snapshot directory of ``elastor run`` (``--snapshot-dir``).

The controller creates it once per job (default ``/dev/shm/elastor-<rdzv id>-<host>-<pid>``, mode
0700), exports it to every (re)launch of its workers as ``ELASTOR_SNAPSHOT_DIR`` (trainers with
``"memory_snapshot"`` write their snapshots under ``local/`` there; files on tmpfs outlive a killed
worker) and removes it when the job ends: never on restarts. A directory the user named and that
already existed is kept; only what a job puts there (``local/``, ``peer/``) is removed, at the end
and, as stale leftovers of an earlier job, at the start.

A directory the controller creates gets an owner marker (``.elastor-owner``: host, pid, the
pid's start time and pid namespace). A controller that was SIGKILLed cannot remove its directory, so every
``elastor run`` first sweeps the default base (``/dev/shm``) and the parent of its own directory
for stale ones (:func:`sweep_stale`) and removes, logged, only a directory that is named
``elastor-*``, is a real directory (not a link) owned by this user, holds a valid marker written
on this host in this pid namespace, and whose pid is not alive (or is alive but started at
another time: a reused pid). A live job's directory, one without a marker, another user's,
another host's or another pid namespace's (a container sharing /dev/shm) is never touched.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

log = logging.getLogger("elastor.run")

ENV_SNAPSHOT_DIR = "ELASTOR_SNAPSHOT_DIR"
JOB_SUBDIRS = ("local", "peer")
OWNER_MARKER = ".elastor-owner"
NAME_RE = re.compile(r"^elastor-[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class SnapshotDir:
    path: str
    created: bool   # made by this controller: removed whole at the end


def default_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def default_path(rdzv_id: str) -> str:
    base = default_base()
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", f"{rdzv_id}-{socket.gethostname()}")[:100]
    return os.path.join(base, f"elastor-{clean}-{os.getpid()}")


def prepare(path: Optional[str], rdzv_id: str) -> SnapshotDir:
    """Create the directory (or accept an existing empty-or-ours one) and export it."""
    p = os.path.abspath(path) if path else default_path(rdzv_id)
    for base in dict.fromkeys((default_base(), os.path.dirname(p))):
        sweep_stale(base, keep=p)
    created = not os.path.lexists(p)
    if not created and (not os.path.isdir(p) or os.path.islink(p)):
        raise ConfigError(f"--snapshot-dir {p}: exists and is not a directory; name a new directory (on /dev/shm for "
                          f"memory speed)")
    if not created:   # a new job never restores another job's snapshots (a controller killed before cleanup)
        for sub in JOB_SUBDIRS:
            if os.path.lexists(os.path.join(p, sub)):
                log.warning("removing stale memory snapshots of an earlier job under %s", os.path.join(p, sub))
                shutil.rmtree(os.path.join(p, sub), ignore_errors=True)
    try:
        os.makedirs(p, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--snapshot-dir {p}: cannot create it ({e.strerror}); name a writable directory, e.g. "
                          f"under /dev/shm") from None
    if created:
        write_owner(p)
    os.environ[ENV_SNAPSHOT_DIR] = p
    log.info("memory snapshots of this node: %s (%s)", p, "created" if created else "existing")
    return SnapshotDir(p, created)


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``, clock ticks since boot),
    or None when it does not exist or ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()   # after "pid (comm) "; comm may hold spaces
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, start: Optional[str]) -> bool:
    """``pid`` runs and (when its start time was recorded and /proc can tell) is the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # another user's process holds the pid: alive, but not ours
    now = _start_time(pid)
    return start is None or now is None or now == start


def _pid_namespace() -> Optional[str]:
    """This process's pid namespace (``pid:[4026531836]``): a pid means something only inside it
    (containers of one pod share a host name and may share /dev/shm, not their pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def write_owner(path: str) -> None:
    """The owner marker of a directory this controller created (written whole: temp file + rename)."""
    rec = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
           "pidns": _pid_namespace()}
    tmp = os.path.join(path, OWNER_MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f)
    os.replace(tmp, os.path.join(path, OWNER_MARKER))


def _owner(path: str) -> Optional[dict]:
    """The marker of ``path`` when it is a regular file holding a well-formed record, else None."""
    m = os.path.join(path, OWNER_MARKER)
    try:
        fd = os.open(m, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        import stat as stat_mod
        if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "r", encoding="utf-8") as f:
            fd = -1
            rec = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    if (not isinstance(rec, dict) or not isinstance(rec.get("host"), str) or not isinstance(rec.get("pid"), int)
            or isinstance(rec.get("pid"), bool) or rec["pid"] <= 0
            or not (rec.get("start") is None or isinstance(rec.get("start"), str))
            or not (rec.get("pidns") is None or isinstance(rec.get("pidns"), str))):
        return None
    return rec


def sweep_stale(base: str, keep: Optional[str] = None) -> list[str]:
    """Remove the snapshot directories under ``base`` that a dead ``elastor run`` on this host left
    behind (see the module docstring for what qualifies); returns the paths removed."""
    removed: list[str] = []
    host = socket.gethostname()
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for e in entries:
        if not NAME_RE.match(e.name) or (keep and os.path.abspath(e.path) == os.path.abspath(keep)):
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        rec = _owner(e.path)
        if rec is None or rec["host"] != host or rec["pid"] == os.getpid() or rec.get("pidns") != _pid_namespace():
            continue   # not ours to judge: no marker, another host, or a pid of another pid namespace
        if _alive(rec["pid"], rec.get("start")):
            continue
        log.warning("removing the stale memory-snapshot directory %s: its elastor run (pid %d on %s) is gone",
                    e.path, rec["pid"], host)
        shutil.rmtree(e.path, ignore_errors=True)
        if not os.path.lexists(e.path):
            removed.append(e.path)
    return removed


def cleanup(sd: SnapshotDir) -> None:
    """The job ended: remove what it put there."""
    if sd.created:
        shutil.rmtree(sd.path, ignore_errors=True)
    else:
        for sub in JOB_SUBDIRS:
            shutil.rmtree(os.path.join(sd.path, sub), ignore_errors=True)
    log.info("removed the memory snapshots under %s", sd.path)
