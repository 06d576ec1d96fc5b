"""Megatron-core adapter: parallel_state from an elastor layout, GPT parameter and Adam-state
shards, save/load through the checkpoint engine, and Megatron checkpoint import/export.

The only package of elastor_ds that imports megatron (lazily, inside functions). The names below
load on first use (PEP 562), so ``elastor`` subcommands that never touch Megatron (``run``,
``plan``, ``verify``...) do not import torch to build their parser.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "MegatronGrid": "parallel", "check_layout": "parallel", "initialize_from_layout": "parallel",
    "megatron_rank": "parallel", "pipeline_layer_layout": "parallel", "teardown": "parallel",
    "GPTSpecConfig": "specs", "gpt_tensor_specs": "specs", "padded_vocab_size": "specs",
    "ensure_adam_state": "state", "gpt_shards": "state", "load_gpt": "state", "save_gpt": "state",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
