"""Megatron-LM hooks (training_hooks.load_checkpoint) with a corrupt newest checkpoint: saved at
TP2, one byte flipped in iteration 7, loaded at TP1 x PP2: falls back to iteration 5 (same loss as
when it was saved) by default; with --no-elastor-fallback every rank raises CorruptCheckpointError."""
from __future__ import annotations

import argparse
import json
import os

import pytest

from dist_utils import run_world

pytestmark = pytest.mark.integration


def _worker(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.errors import CorruptCheckpointError
    from elastor_ds.integrations.megatron import initialize_from_layout, training_hooks as th
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import eval_loss, fixed_batch, tiny_gpt_config, train_step
    from megatron_standins import _Sched, _Stepper

    cfg = tiny_gpt_config(num_layers=2)
    batch = fixed_batch(cfg)
    ck = os.path.join(root, "ck")
    args = argparse.Namespace(elastor=True, elastor_async=False, elastor_keep=3, elastor_plan=None,
                              elastor_fallback=True, vocab_size=cfg.vocab_size,
                              make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                              num_layers=cfg.num_layers, save=ck, load=ck, consumed_train_samples=0,
                              skipped_train_samples=0, consumed_valid_samples=0, global_batch_size=4,
                              finetune=False, no_load_optim=False, no_load_rng=False, distributed_timeout_minutes=2)
    grid = initialize_from_layout(Layout.uniform(2, 1, 1, cfg.num_layers))
    m = build_gpt(cfg, grid, parallel_output=False)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    torch.manual_seed(0)
    losses = {}
    for it in (5, 7):
        train_step(m, cfg, batch, _Stepper(opt))
        losses[it] = eval_loss(m, cfg, batch)
        th.save_checkpoint(it, [m], opt, _Sched(it), float(it), args)
        th.finalize()
    dist.barrier()
    if rank == 0:
        d = os.path.join(ck, "step_000000007")
        man = json.load(open(os.path.join(d, "manifest.json")))
        ch = man["tensors"]["decoder.layers.1.mlp.linear_fc1.weight"]["chunks"][0]
        with open(os.path.join(d, ch["file"]), "r+b") as f:
            f.seek(ch["offset"] + 37)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x08]))
    dist.barrier()
    th.reset()
    grid = initialize_from_layout(Layout.uniform(1, 2, 1, cfg.num_layers, [0, 1, 2]))
    m2 = build_gpt(cfg, grid, parallel_output=False)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    args2 = argparse.Namespace(**vars(args))
    args2.save = os.path.join(root, "ck2")
    it, flops = th.load_checkpoint([m2], opt2, _Sched(0), args2)
    assert (it, flops) == (5, 5.0), (it, flops)
    loss = eval_loss(m2, cfg, batch)
    assert abs(loss - losses[5]) <= 1e-5 * abs(losses[5]), (loss, losses)
    th.reset()
    args2.elastor_fallback = False
    with pytest.raises(CorruptCheckpointError, match="decoder.layers.1.mlp.linear_fc1.weight"):
        th.load_checkpoint([m2], opt2, _Sched(0), args2)
    th.reset()
    dist.barrier()


def test_megatron_hooks_fall_back_from_a_corrupt_checkpoint(tmp_path):
    pytest.importorskip("megatron.core")
    run_world(_worker, 2, str(tmp_path), timeout_s=150)
