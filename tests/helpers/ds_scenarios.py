"""Worker side of the DeepSpeed multi-process tests and bench: train the toy pipeline under one layout.

``run_specs(rank, world, specs, outdir)`` runs several scenarios one after another in one spawned
world (saving the import and spawn cost); rank 0 writes ``<outdir>/<name>.json`` with the per-step
losses.
"""
from __future__ import annotations

import json
import os
from typing import Any


def ds_config(spec: dict[str, Any]) -> dict[str, Any]:
    mb, gas, dp = spec["mb"], spec["gas"], spec["dp"]
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "train_batch_size": mb * gas * dp,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": spec["zero"]},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if spec.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if spec.get("elastor") is not None:
        cfg["elastor"] = spec["elastor"]
    if spec.get("ds_universal_load"):
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def build(spec: dict[str, Any]):
    from elastor_ds import deepspeed as eds
    from elastor_ds.testing import toy_pipe as toy

    model = eds.PipelineModule(toy.layers(num_blocks=spec.get("blocks", 6), hidden=spec.get("hidden", 32)),
                               num_stages=spec["pp"], loss_fn=toy.loss_fn,
                               **({"plan": spec["plan"]} if spec.get("plan") else {"boundaries": spec.get("boundaries")}))
    engine, _, _, _ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config(spec))
    return engine


def run_one(rank: int, spec: dict[str, Any], outdir: str) -> None:
    import torch.distributed as dist
    from elastor_ds.testing import toy_pipe as toy

    engine = build(spec)
    client_state = None
    if spec.get("ds_universal_load"):  # DeepSpeed's own loader reads an exported universal checkpoint
        path, client_state = engine.load_checkpoint(spec["ds_universal_load"])
        assert path is not None, spec
        client_state = {k: v for k, v in client_state.items() if k == "epoch"}
    start = int(engine.global_steps)
    it = toy.batches(start, engine.grid.get_data_parallel_rank(), spec["dp"], spec["gas"], spec["mb"])
    losses = []
    for _ in range(spec["steps"]):
        losses.append(float(engine.train_batch(it)))
        if int(engine.global_steps) in spec.get("save_at", ()):
            engine.save_checkpoint(spec["native_dir"], client_state={"epoch": 7})
    if engine.elastor is not None:
        engine.elastor.finalize()
    out = {"start": start, "losses": losses, "lr": engine.get_lr()[0],
           "client_state": client_state if client_state is not None else engine.elastor_client_state(), "global_samples": int(engine.global_samples),
           "live_saves": [bool(s.live) for s in engine.elastor.stats] if engine.elastor is not None else []}
    if rank == 0:
        with open(os.path.join(outdir, spec["name"] + ".json"), "w") as f:
            json.dump(out, f)
    dist.barrier()


def run_specs(rank: int, world: int, specs: list[dict[str, Any]], outdir: str) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING)
    for spec in specs:
        run_one(rank, spec, outdir)
