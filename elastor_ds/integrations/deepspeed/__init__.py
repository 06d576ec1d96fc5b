"""DeepSpeed integration: the ``"elastor"`` config section, explicit pipeline boundaries, save/resume hooks.

Usage (one changed call plus a config section)::

    from elastor_ds import deepspeed as eds
    model = eds.PipelineModule(layers, num_stages=3, boundaries=[0, 2, 5, 8])  # or plan=...
    # or, from the config's "elastor": {"plan": "plan.json" | {...} | "auto", "model": {...}, "profile": ...}:
    model = eds.PipelineModule(layers, loss_fn=loss_fn, plan=eds.resolve_plan(cfg, num_layers=len(layers)))
    engine, opt, _, sched = eds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for batch in ...: engine.train_batch(it)      # saves when due
    engine.elastor.finalize()                     # wait for the last background save

Only this package (and tests/bench) imports deepspeed; :mod:`.config` is pure and imports nothing
heavy, the rest is loaded on first use.
"""
from __future__ import annotations

from typing import Any

from .config import CheckpointConfig, ElastorConfig, parse_elastor_section, split_ds_config

__all__ = ["initialize", "init_distributed", "PipelineModule", "ElastorConfig", "CheckpointConfig",
           "parse_elastor_section", "split_ds_config", "ElastorCheckpointer", "check_version", "resolve_plan"]

_LAZY = {"initialize": "api", "init_distributed": "api", "PipelineModule": "pipe",
         "ElastorCheckpointer": "runtime", "check_version": "compat", "resolve_plan": "autoplan"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
