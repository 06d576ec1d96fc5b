"""The node's memory-snapshot directory of ``elastor run`` (``--snapshot-dir``).

The controller prepares it once per job, exports it to every (re)launch of its workers as
``ELASTOR_SNAPSHOT_DIR`` (trainers with ``"memory_snapshot"`` write their snapshots under ``local/``
there; files on tmpfs outlive a killed worker) and cleans it when the job ends: never on restarts.

Whose directory it is (never delete what we did not create; assume a hostile local user):
1. the default is a new directory ``/dev/shm/elastor-<rdzv id>-<host>-<pid>-<random>``, made with
   ``mkdir(0700)`` (fails if the name exists: an unpredictable name nobody can squat) and removed
   whole at the end;
2. a directory the user names is made the same way when it does not exist (removed whole at the
   end); when it exists it must be a real directory (not a symlink) of this user, private (mode
   0700), and either empty or marked by an earlier ``elastor run`` whose controller is gone. Anything
   else is refused with exit 2 naming it: a non-empty directory that is not ours (``$HOME``), a
   live job's directory, another user's, a group/world-accessible one. Only what the job put there
   (``local/``, ``peer/``, the marker) is removed from it at the end;
3. every existing component of the path is checked first: owned by root or this user, a symlink
   only when root or this user owns it, and no directory writable by others without the sticky bit
   (another user could swap what we create there);
4. checked again after creation (``lstat``: a private real directory of ours), and at cleanup the
   directory must still be the same inode before anything in it is removed.

A directory the controller prepares gets an owner marker (``.elastor-owner``: host, pid, the pid's
start time and pid namespace, and whether this job created the directory). A controller that was
SIGKILLed cannot clean up, so every ``elastor run`` first sweeps the default base (``/dev/shm``) and
the parent of its own directory for stale ones (:func:`sweep_stale`) and cleans, logged, only a
directory that is named ``elastor-*``, is a real directory (not a link) owned by this user, holds a
valid marker written on this host in this pid namespace, and whose pid is not alive (or is alive
but started at another time: a reused pid): removed whole when the marker says the job created it,
else only the job's entries. A live job's directory, one without a marker, another user's, another
host's or another pid namespace's (a container sharing /dev/shm) is never touched.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat as stat_mod
import tempfile
from dataclasses import dataclass
from typing import Optional

from ..checkpoint import private_dir
from ..errors import ConfigError
from .protocol import ENV_SNAPSHOT_DIR

log = logging.getLogger("elastor.run")

JOB_SUBDIRS = ("local", "peer")
OWNER_MARKER = ".elastor-owner"
NAME_RE = re.compile(r"^elastor-[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class SnapshotDir:
    path: str
    created: bool   # made by this controller: removed whole at the end
    ident: tuple[int, int] = (0, 0)   # (st_dev, st_ino) when prepared: cleanup touches only this directory


def default_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def default_path(rdzv_id: str) -> str:
    """A fresh, unpredictable default path (``elastor-<id>-<host>-<pid>-<random>``)."""
    base = default_base()
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", f"{rdzv_id}-{socket.gethostname()}")[:100]
    return os.path.join(base, f"elastor-{clean}-{os.getpid()}-{secrets.token_hex(6)}")


SETTING = "--snapshot-dir"


def _refuse(p: str, why: str, fix: str = "name a new directory (on /dev/shm for memory speed)") -> ConfigError:
    return private_dir.refuse(SETTING, p, why, fix)


def check_components(p: str) -> None:
    private_dir.check_components(p, SETTING)


def _check_private(p: str) -> os.stat_result:
    return private_dir.check_private(p, SETTING)


def _mkdir_private(p: str) -> bool:
    return private_dir.mkdir_private(p, SETTING)


def prepare(path: Optional[str], rdzv_id: str) -> SnapshotDir:
    """Create the directory (or accept an existing empty-or-stale-ours one) and export it; see the
    module docstring for what is refused (:class:`ConfigError`, exit 2)."""
    p = os.path.abspath(os.path.expanduser(path)) if path else None
    for base in dict.fromkeys((default_base(),) + ((os.path.dirname(p),) if p else ())):
        sweep_stale(base, keep=p)
    if p is None:
        check_components(os.path.join(default_base(), "x"))
        for _ in range(100):
            p = default_path(rdzv_id)
            if _mkdir_private(p):
                break
        else:
            raise _refuse(default_base(), "cannot create a fresh snapshot directory in it")
        created = True
    else:
        if p == os.sep:
            raise _refuse(p, "is the root directory")
        check_components(p)
        private_dir.make_parents(p, SETTING)   # missing folders: ours, 0700 whatever the umask, checked after
        created = _mkdir_private(p)
        if not created:
            _accept_existing(p)
    st = _check_private(p)   # after creation: a private real directory of ours
    try:
        write_owner(p, created)
    except OSError as e:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(p)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        from ..checkpoint.storage.tmpfs import mount_point
        sv = os.statvfs(os.path.dirname(p))
        raise _refuse(p, f"its file system is full ({sv.f_bavail * sv.f_frsize / 2 ** 20:.1f} MiB free of "
                         f"{sv.f_blocks * sv.f_frsize / 2 ** 20:.1f} MiB): not even the owner marker fits",
                      f"free that tmpfs (`df -h {mount_point(os.path.dirname(p))}`), or name a directory on a tmpfs "
                      f"with room") from None
    os.environ[ENV_SNAPSHOT_DIR] = p
    log.info("memory snapshots of this node: %s (%s)", p, "created" if created else "existing, empty or ours")
    return SnapshotDir(p, created, (st.st_dev, st.st_ino))


def _accept_existing(p: str) -> None:
    """An existing ``--snapshot-dir``: private and ours, and empty or left by a dead ``elastor run``
    (then only that job's entries are removed)."""
    _check_private(p)
    try:
        entries = sorted(os.listdir(p))
    except OSError as e:
        raise _refuse(p, f"cannot list it ({e.strerror})") from None
    if not entries:
        return
    rec = _owner(p)
    if rec is None:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise _refuse(p, f"is not empty ({shown}) and was not prepared by elastor run; nothing in it is touched",
                      "name an empty or new directory")
    if rec["host"] != socket.gethostname() or rec.get("pidns") != _pid_namespace() or _alive(rec["pid"], rec.get("start")):
        raise _refuse(p, f"belongs to a live elastor run (pid {rec['pid']} on {rec['host']}); sharing it would delete "
                         f"that job's snapshots", "give each job its own directory")
    extra = [e for e in entries if e not in JOB_SUBDIRS + (OWNER_MARKER,)]
    if extra:
        raise _refuse(p, f"holds files elastor run did not put there ({', '.join(extra[:3])})",
                      "name an empty or new directory")
    log.warning("removing stale memory snapshots of an earlier job (pid %d, gone) under %s", rec["pid"], p)
    _remove_job_entries(p)


def _remove_job_entries(p: str) -> None:
    for sub in JOB_SUBDIRS:
        q = os.path.join(p, sub)
        if os.path.islink(q):
            os.unlink(q)
        else:
            shutil.rmtree(q, ignore_errors=True)
    try:
        os.unlink(os.path.join(p, OWNER_MARKER))
    except FileNotFoundError:
        pass


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


def write_owner(path: str, created: bool = True) -> None:
    """The owner marker of a directory this controller prepared (written whole: a new temp file,
    never through a link, then renamed); ``created``: the job made the directory itself."""
    rec = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
           "pidns": _pid_namespace(), "created": bool(created)}
    tmp = os.path.join(path, f"{OWNER_MARKER}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(rec, f)
        os.replace(tmp, os.path.join(path, OWNER_MARKER))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)   # e.g. a full file system: no half-written marker left behind
        raise


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
            or not (rec.get("pidns") is None or isinstance(rec.get("pidns"), str))
            or not isinstance(rec.get("created", True), bool)):
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
        if rec.get("created", True):
            log.warning("removing the stale memory-snapshot directory %s: its elastor run (pid %d on %s) is gone",
                        e.path, rec["pid"], host)
            shutil.rmtree(e.path, ignore_errors=True)
            if not os.path.lexists(e.path):
                removed.append(e.path)
        else:   # the user's own directory: only what that job put there
            log.warning("removing the stale memory snapshots under %s: its elastor run (pid %d on %s) is gone",
                        e.path, rec["pid"], host)
            _remove_job_entries(e.path)
    return removed


def cleanup(sd: SnapshotDir) -> None:
    """The job ended: remove what it put there (the whole directory when it made it), and only
    when the path is still the directory it prepared (not a link or a swapped directory)."""
    try:
        st = os.lstat(sd.path)
    except OSError:
        return
    if stat_mod.S_ISLNK(st.st_mode) or (sd.ident != (0, 0) and (st.st_dev, st.st_ino) != sd.ident):
        log.warning("memory-snapshot directory %s was replaced during the job: left as it is", sd.path)
        return
    if sd.created:
        shutil.rmtree(sd.path, ignore_errors=True)
    else:
        _remove_job_entries(sd.path)
    log.info("removed the memory snapshots under %s", sd.path)
