"""Partition-agnostic, asynchronous, deduplicated checkpoints (public API).

Pipeline: save = snapshot -> save plan (pure) -> write -> commit; load = manifest -> load plan
(pure) -> read -> place. The names below are resolved lazily so that importing a pure planning
module (``manifest``, ``save_plan``, ``load_plan``) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointEngine": "engine",
    "SaveStats": "engine",
    "LoadResult": "engine",
    "TensorShard": "shards",
    "Manifest": "manifest",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'elastor_ds.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
