"""Worker side of the heterogeneous DeepSpeed tests: train the toy pipeline under a plan (several plans
one after another in one spawned world), rank 0 writes per-step losses and the final parameters
(canonical names -> full tensors gathered from the holders)."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

LR = 1e-2


def ds_config(mb: int, extra: dict | None = None) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": mb,
           "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
           "gradient_clipping": 1.0}
    cfg.update(extra or {})
    return cfg


def replica_batches(step: int, offset: int, count: int, total: int, micro: int, seq: int = 16, vocab: int = 64):
    """Micro-batches ``offset .. offset+count-1`` of every global batch of ``total`` micro-batches."""
    from elastor_ds.testing import toy_pipe as toy
    while True:
        for m in range(count):
            base = (step * total + offset + m) * micro
            xs, ys = zip(*(toy.sample(base + j, seq, vocab) for j in range(micro)))
            yield torch.stack(xs), torch.stack(ys)
        step += 1


def run_plan(rank: int, spec: dict[str, Any], outdir: str) -> None:
    import torch.distributed as dist

    from elastor_ds import deepspeed as eds
    from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime
    from elastor_ds.layout import Layout
    from elastor_ds.testing import toy_pipe as toy

    HeteroRuntime.release()
    layers = toy.layers(num_blocks=spec.get("blocks", 6))
    layout = Layout.from_json(spec["plan"], len(layers))
    model = eds.PipelineModule(layers, loss_fn=toy.loss_fn, plan=layout)
    cfg = ds_config(spec["mb"], spec.get("ds"))
    if spec.get("elastor"):
        cfg["elastor"] = spec["elastor"]
    engine, _, _, _ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    pos = layout.position(rank)
    offset = sum(r.micro_batches for r in layout.replicas[:pos.replica])
    total = sum(r.micro_batches for r in layout.replicas)
    start = int(engine.global_steps)
    it = replica_batches(start, offset, layout.replicas[pos.replica].micro_batches, total, spec["mb"])
    losses = [float(engine.train_batch(it)) for _ in range(spec["steps"])]
    if engine.elastor is not None:
        engine.elastor.finalize()
    # final parameters: every rank sends what it holds (canonical = DeepSpeed layer names here)
    mine = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    # per rank: elements of per-element optimizer state (Adam's two moments) actually allocated
    state = sum(v.numel() for st in engine.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    if rank == 0:
        params: dict[str, torch.Tensor] = {}
        for part in got:
            for n, t in part.items():
                params.setdefault(n, t)
        torch.save(params, os.path.join(outdir, spec["name"] + ".pt"))
        with open(os.path.join(outdir, spec["name"] + ".json"), "w") as f:
            json.dump({"start": start, "losses": losses, "global_samples": int(engine.global_samples),
                       "opt_state_numel": states, "param_numel": [sum(t.numel() for t in part.values()) for part in got]},
                      f)
    dist.barrier()


def run_specs(rank: int, world: int, specs: list[dict[str, Any]], outdir: str) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING)
    for spec in specs:
        run_plan(rank, spec, outdir)
