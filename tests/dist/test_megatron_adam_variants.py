"""The megatron-core library API (``save_gpt`` / ``load_gpt``) with two ordinary optimizer set-ups
that it used to get wrong: torch ``Adam(amsgrad=True)`` (its ``max_exp_avg_sq`` was not saved, and
the first step after a load raised ``KeyError``) and a frozen parameter outside the optimizer
(``save_gpt`` refused: "optimizer has no state"). Saved at TP2, resumed at TP1 x PP2 on the same
two gloo ranks; the oracle is the uninterrupted run: one more step after the resume gives its
loss, and the restored amsgrad maxima equal the saver's (consolidated, bit for bit)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("megatron.core")

from dist_utils import run_world  # noqa: E402

LOSS_RTOL = 1e-6


def _worker(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.integrations.megatron import initialize_from_layout, load_gpt, save_gpt, teardown
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import eval_loss, fixed_batch, tiny_gpt_config, train_step

    cfg = tiny_gpt_config(num_layers=2)
    batch = fixed_batch(cfg)
    comm = TorchComm.create(60)
    out: dict = {}
    frozen = "embedding.position_embeddings.weight"

    def setup(layout, amsgrad, freeze):
        torch.manual_seed(0)
        grid = initialize_from_layout(layout)
        m = build_gpt(cfg, grid, parallel_output=False)
        if freeze and frozen in dict(m.named_parameters()):   # stage 0 only under PP2
            m.get_parameter(frozen).requires_grad_(False)
        return m, torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2, amsgrad=amsgrad)

    src, dst = Layout.uniform(2, 1, 1, 2), Layout.uniform(1, 2, 1, 2)
    for tag, amsgrad, freeze in (("amsgrad", True, False), ("frozen", False, True)):
        m, opt = setup(src, amsgrad, freeze)
        for _ in range(3):
            train_step(m, cfg, batch, opt)
        eng = CheckpointEngine(os.path.join(root, tag), comm, async_save=False)
        save_gpt(eng, 3, m, cfg, src, opt)
        saved_frozen = m.get_parameter(frozen).detach().clone() if freeze and rank == 0 else None
        train_step(m, cfg, batch, opt)
        want = eval_loss(m, cfg, batch)   # the uninterrupted run, one step on
        teardown()
        m2, opt2 = setup(dst, amsgrad, freeze)
        load_gpt(eng, None, m2, cfg, dst, opt2)
        if freeze and rank == 0:   # stage 0 holds the position embeddings
            out["frozen_equal"] = bool(torch.equal(m2.get_parameter(frozen).detach(), saved_frozen))
        train_step(m2, cfg, batch, opt2)
        out[tag] = [want, eval_loss(m2, cfg, batch)]
        teardown()
    if rank == 0:
        from elastor_ds.checkpoint import commit as commit_mod
        man = commit_mod.read_manifest(commit_mod.resolve(os.path.join(root, "amsgrad")))
        out["amsgrad_tensors"] = sorted(n for n in man.tensors if n.startswith("optimizer.max_exp_avg_sq."))
        man = commit_mod.read_manifest(commit_mod.resolve(os.path.join(root, "frozen")))
        out["frozen_opt"] = sorted(n for n in man.tensors if n.startswith("optimizer.") and frozen in n)
        out["frozen_weight"] = frozen in man.tensors
        with open(os.path.join(root, "out.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()


def test_amsgrad_and_a_frozen_parameter_save_and_resume_under_another_layout(tmp_path):
    run_world(_worker, 2, str(tmp_path), timeout_s=150)
    r = json.loads((tmp_path / "out.json").read_text())
    for tag in ("amsgrad", "frozen"):
        want, got = r[tag]
        assert abs(got - want) <= LOSS_RTOL * abs(want), (tag, got, want)
    # every parameter's amsgrad maximum is in the checkpoint (the tiny GPT has 2 layers: > 10 tensors)
    assert len(r["amsgrad_tensors"]) > 10 and "optimizer.max_exp_avg_sq.embedding.word_embeddings.weight" in \
        r["amsgrad_tensors"], r["amsgrad_tensors"]
    # the frozen parameter: its weights saved and restored, no optimizer state made up for it
    assert r["frozen_weight"] and r["frozen_opt"] == [] and r["frozen_equal"], r
