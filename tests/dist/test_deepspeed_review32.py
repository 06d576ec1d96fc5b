"""Review 32 of the DeepSpeed integration: what an elastor save/resume lost or changed that
DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` of the same engine keeps.

Oracles, independent of the code under test: DeepSpeed's own save/load of the same engine (its
optimizer state, buffers, scheduler, client state), the losses of an uninterrupted run, and values
computed by hand. Each world is one process (gloo, CPU) unless the bug needs more ranks.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402


def _cfg(ck: str, load: str, zero: int = 0, mb: int = 4, gas: int = 1, dp: int = 1, opt: bool = True,
         sched: bool = True, **elastor_ckpt) -> dict:
    c: dict = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
               "train_batch_size": mb * gas * dp, "zero_optimization": {"stage": zero},
               "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
               "elastor": {"checkpoint": {"dir": ck, "load": load, "async": False, **elastor_ckpt}}}
    if opt:
        c["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
    if sched:
        c["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}}
    return c


def _base_opt(engine):
    o = engine.optimizer
    return o.optimizer if hasattr(o, "single_partition_of_fp32_groups") else o


def _opt_state(engine) -> dict:
    """The base optimizer's state, by parameter index, cloned (comparable after the engine trains on)."""
    sd = _base_opt(engine).state_dict()
    return {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
            for k, v in sd["state"].items()}


def _assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for i in want:
        assert sorted(got[i]) == sorted(want[i]), i
        for k, v in want[i].items():
            g = got[i][k]
            if torch.is_tensor(v):
                assert torch.is_tensor(g) and g.shape == v.shape and torch.equal(g.float(), v.float()), (i, k, g, v)
            else:
                assert g == v, (i, k)


def _plain_steps(engine, n: int, seed: int) -> list[float]:
    """``n`` optimizer steps of a plain (non-pipeline) engine on a fixed batch stream."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n * engine.gradient_accumulation_steps()):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


# --- 1. ZeRO-0 and a one-element parameter ------------------------------------------------------

def _one_element_worker(rank: int, world: int, d: str) -> None:
    from elastor_ds import deepspeed as eds

    def build(load):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        one = model[2].bias                                   # one element: Linear(16, 1).bias
        assert one.numel() == 1
        rest = [p for p in model.parameters() if p is not one]
        # the one-element parameter first in its group: the group's step count is read from it
        groups = [{"params": rest}, {"params": [one], "weight_decay": 0.0}]
        e, _, _, _ = eds.initialize(model=model, model_parameters=groups,
                                    config=_cfg(os.path.join(d, "ck_" + os.path.basename(load)), load))
        return e

    a = build("none")
    _plain_steps(a, 3, 1)
    a.save_checkpoint(os.path.join(d, "native"))           # DeepSpeed's files and an elastor checkpoint
    a.elastor.finalize()
    b = build(os.path.join(d, "ck_none"))                   # elastor's resume
    c = build("none")
    c.load_checkpoint(os.path.join(d, "native"))            # DeepSpeed's resume: the oracle
    res = {"elastor": _opt_state(b), "deepspeed": _opt_state(c)}
    res["losses"] = {k: _plain_steps(e, 2, 2) for k, e in (("a", a), ("b", b), ("c", c))}
    for e in (b, c):
        e.elastor.finalize()
    torch.save(res, os.path.join(d, "res.pt"))


def test_one_element_parameter_keeps_its_adam_moments_under_zero0(tmp_path):
    """Before: per-element state was saved only for numel() > 1 and a group's ``step`` only when its
    first parameter had more than one element; Linear(16, 1).bias lost its moments and every load
    failed "optimizer.exp_avg.2.bias is not in checkpoint"."""
    run_world(_one_element_worker, 1, str(tmp_path), timeout_s=120)
    res = torch.load(str(tmp_path / "res.pt"))
    ds = res["deepspeed"]
    assert any(v["exp_avg"].shape == (1,) for v in ds.values())    # the oracle holds the bias's moments
    _assert_same_state(res["elastor"], ds)
    assert res["losses"]["b"] == res["losses"]["a"] == res["losses"]["c"]
