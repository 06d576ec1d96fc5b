"""The node's memory-snapshot directory of ``elastor run`` (``--snapshot-dir``).

The controller creates it once per job (default ``/dev/shm/elastor-<rdzv id>-<host>-<pid>``, mode
0700), exports it to every (re)launch of its workers as ``ELASTOR_SNAPSHOT_DIR`` (trainers with
``"memory_snapshot"`` write their snapshots under ``local/`` there; files on tmpfs outlive a killed
worker) and removes it when the job ends: never on restarts. A directory the user named and that
already existed is kept; only what a job puts there (``local/``, ``peer/``) is removed, at the end
and, as stale leftovers of an earlier job, at the start.
"""
from __future__ import annotations

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


@dataclass(frozen=True)
class SnapshotDir:
    path: str
    created: bool   # made by this controller: removed whole at the end


def default_path(rdzv_id: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", f"{rdzv_id}-{socket.gethostname()}")[:100]
    return os.path.join(base, f"elastor-{clean}-{os.getpid()}")


def prepare(path: Optional[str], rdzv_id: str) -> SnapshotDir:
    """Create the directory (or accept an existing empty-or-ours one) and export it."""
    p = os.path.abspath(path) if path else default_path(rdzv_id)
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
    os.environ[ENV_SNAPSHOT_DIR] = p
    log.info("memory snapshots of this node: %s (%s)", p, "created" if created else "existing")
    return SnapshotDir(p, created)


def cleanup(sd: SnapshotDir) -> None:
    """The job ended: remove what it put there."""
    if sd.created:
        shutil.rmtree(sd.path, ignore_errors=True)
    else:
        for sub in JOB_SUBDIRS:
            shutil.rmtree(os.path.join(sd.path, sub), ignore_errors=True)
    log.info("removed the memory snapshots under %s", sd.path)
