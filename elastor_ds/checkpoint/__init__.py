"""Partition-agnostic, asynchronous, deduplicated checkpoints (public API).

Pipeline, one module per stage::

    save: shards -> planning.save_plan (pure) -> staging (snapshot) -> writer -> commit
    load: commit (resolve) -> planning.manifest (read once) -> planning.load_plan (pure) -> reader
    engine.py: the collective orchestration of both (async save, agreement, fallback)

``storage/`` is where the bytes go (the backend an engine takes: ``posix`` shared storage, fsynced;
``tmpfs`` node memory, never fsynced). ``planning/`` is pure (no torch, no I/O). Also here:
``fileformat`` (the data file format, CRCs), ``shards``
(TensorShard), ``state`` (RNG, JSON), ``verify``, ``convert``, ``cli``. The names below are
resolved lazily so that importing a planning module does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointEngine": "engine",
    "SaveStats": "engine",
    "LoadResult": "engine",
    "OpenCheckpoint": "engine",
    "VerifyMode": "engine",
    "TensorShard": "shards",
    "Manifest": "planning.manifest",
    "PosixStorage": "storage",
    "TmpfsStorage": "storage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'elastor_ds.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
