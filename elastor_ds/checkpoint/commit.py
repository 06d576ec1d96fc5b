"""The on-disk commit protocol: step directories, the manifest written last, ``latest``, retention.

Layout of a checkpoint root::

    root/
      latest                      # text: name of the newest committed step dir (moved last)
      step_000000100/             # committed: has manifest.json
        manifest.json
        data_00000.safetensors ...
        rank_state/rank_00000.json ...
      .tmp_step_000000200_<id>/   # a save in progress (never a checkpoint)

Commit (rank 0, after every rank's data files are fsynced):
1. write ``manifest.json`` into the temp dir (temp name, fsync, rename, fsync dir);
2. rename the temp dir to ``step_<step>``; fsync the root;
3. write ``latest`` atomically (temp, fsync, rename, fsync root);
4. retention: delete the oldest committed dirs beyond ``keep`` (never the newest) and stale temp
   dirs of steps up to the newest committed one (never a newer save's temp dir in progress).

A directory without ``manifest.json`` is never treated as a checkpoint.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Optional

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError
from .manifest import MANIFEST_NAME, Manifest
from .storage import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{9,})$")
TMP_PREFIX = ".tmp_step_"


def step_dirname(step: int) -> str:
    return f"step_{step:09d}"


def tmp_dirname(step: int, nonce: str) -> str:
    return f"{TMP_PREFIX}{step:09d}_{nonce}"


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def list_committed(root: str) -> list[tuple[int, str]]:
    """(step, path) of committed checkpoints under ``root``, oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for n in names:
        m = _STEP_RE.match(n)
        if m and is_committed(os.path.join(root, n)):
            out.append((int(m.group(1)), os.path.join(root, n)))
    return sorted(out)


def read_latest(root: str) -> Optional[str]:
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(root, name) if name else None


def resolve(path: str) -> str:
    """A committed step directory from ``path`` (a step dir, or a root with ``latest``)."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if is_committed(path):
        return path
    latest = read_latest(path)
    if latest is not None:
        if not is_committed(latest):
            raise IncompleteCheckpointError(f"{path}/latest points to {latest}, which has no {MANIFEST_NAME}: "
                                            f"it was never committed; use an older step dir or fallback")
        return latest
    committed = list_committed(path)
    if committed:
        log.warning("%s has no 'latest' pointer; using the newest committed checkpoint %s", path, committed[-1][1])
        return committed[-1][1]
    if _STEP_RE.match(os.path.basename(path)) or os.path.basename(path).startswith(TMP_PREFIX):
        raise IncompleteCheckpointError(f"{path} has no {MANIFEST_NAME}: the save never committed, so it is not a "
                                        f"checkpoint; load the previous step dir or the root")
    raise CheckpointNotFoundError(f"{path} holds no elastor checkpoint (no {MANIFEST_NAME}, no 'latest', no step_* dirs)")


def read_manifest(step_dir: str) -> Manifest:
    p = os.path.join(step_dir, MANIFEST_NAME)
    try:
        with open(p, encoding="utf-8") as f:
            return Manifest.loads(f.read(), where=p)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{step_dir} has no {MANIFEST_NAME}: it was never committed") from None


def commit(root: str, tmp_dir: str, manifest: Manifest, keep: int, retention: bool = True) -> str:
    """Steps 1-3 above, and step 4 unless ``retention`` is False (the caller then runs
    :func:`apply_retention` itself, e.g. after telling the other ranks the save is durable).
    Returns the committed step directory."""
    atomic_write_text(os.path.join(tmp_dir, MANIFEST_NAME), manifest.dumps())
    final = os.path.join(root, step_dirname(manifest.step))
    if os.path.exists(final):  # re-save of the same step: move the old one aside first
        aside = os.path.join(root, tmp_dirname(manifest.step, f"replaced{int(time.time() * 1e6)}"))
        os.replace(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(tmp_dir, final)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST), os.path.basename(final) + "\n")
    if retention:
        apply_retention(root, keep, protect=final)
    return final


def apply_retention(root: str, keep: int, protect: str | None = None) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep`` (>= 1) and stale temp dirs."""
    keep = max(1, keep)
    removed = []
    committed = list_committed(root)
    for _, path in committed[:-keep]:
        if protect and os.path.abspath(path) == os.path.abspath(protect):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    newest = max((s for s, _ in committed), default=-1)
    for n in os.listdir(root):
        p = os.path.join(root, n)
        if not n.startswith(TMP_PREFIX):
            continue
        try:
            tmp_step = int(n[len(TMP_PREFIX):].split("_", 1)[0])
        except ValueError:
            continue
        if tmp_step <= newest:  # a later save may already be writing its own (newer) temp dir
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("retention removed %s", ", ".join(os.path.basename(p) for p in removed))
    return removed
