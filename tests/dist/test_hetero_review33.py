"""Heterogeneous plans on DeepSpeed, review 33 (3 gloo ranks, plan pp2+pp1 of the toy pipeline).

* ``engine.save_checkpoint`` wrote DeepSpeed's own files by default, under the same names from every
  replica (``mp_rank_00_model_states.pt``, ``layer_NN-model_states.pt``: each replica is a grid of
  data-parallel size 1), the last writer silently winning; ``load_checkpoint`` then died on a bare
  AssertionError. Now DeepSpeed's native write is skipped under a heterogeneous plan (one warning),
  elastor's checkpoint is written and reloads bit-identically; an explicit ``"deepspeed_native": true``
  is refused at initialize, ``load_checkpoint`` and a save with nothing to write name the fix.
  Oracles: the directory listing on disk (names written by hand) and the parameters each rank held
  when it saved (``torch.equal``).
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402

MB = 2
PLAN = {"version": 1, "replicas": [
    {"micro_batches": 3, "stages": [{"tp": 1, "layers": [0, 3]}, {"tp": 1, "layers": [3, 8]}]},
    {"micro_batches": 1, "stages": [{"tp": 1, "layers": [0, 8]}]}]}


def _engine(rank: int, plan: dict, elastor: dict | None):
    import hetero_scenarios as hs

    from elastor_ds import deepspeed as eds
    from elastor_ds.layout import Layout
    from elastor_ds.testing import toy_pipe as toy
    layers = toy.layers(num_blocks=6)
    layout = Layout.from_json(plan, len(layers))
    model = eds.PipelineModule(layers, loss_fn=toy.loss_fn, plan=layout)
    cfg = hs.ds_config(MB)
    if elastor is not None:
        cfg["elastor"] = elastor
    engine, _, _, _ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    pos = layout.position(rank)
    offset = sum(r.micro_batches for r in layout.replicas[:pos.replica])
    total = sum(r.micro_batches for r in layout.replicas)
    it = hs.replica_batches(int(engine.global_steps), offset, layout.replicas[pos.replica].micro_batches, total, MB)
    return engine, it


def _save_worker(rank: int, world: int, ck: str, other: str, out: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime

    res: dict = {}
    HeteroRuntime.release()
    # an explicit "deepspeed_native": true cannot be honoured: refused at initialize, on every rank
    try:
        _engine(rank, PLAN, {"checkpoint": {"dir": ck, "deepspeed_native": True}})
        res["explicit"] = "accepted"
    except ConfigError as e:
        res["explicit"] = str(e)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "not written" in record.getMessage():
                records.append(record)

    logging.getLogger("elastor_ds").addHandler(Keep())
    engine, it = _engine(rank, PLAN, {"checkpoint": {"dir": ck, "async": False}})
    for _ in range(2):
        engine.train_batch(it)
    engine.save_checkpoint(ck, tag="t1")                    # into elastor's own folder (the usual migration)
    engine.train_batch(it)
    engine.save_checkpoint(other, tag="t2", client_state={"epoch": 3})   # a folder of its own
    engine.elastor.wait()
    dist.barrier()
    held = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    res["warnings"] = len(records)
    # without an elastor checkpoint, or with on_save_checkpoint off, nothing could be written: refused
    session = engine.elastor
    engine.elastor = None
    try:
        engine.save_checkpoint(other, tag="t3")
        res["no_elastor"] = "accepted"
    except ConfigError as e:
        res["no_elastor"] = str(e)
    engine.elastor = session
    engine.train_batch(it)                                  # the weights move on
    res["moved"] = any(not torch.equal(p, held[n]) for n, p in engine.module.named_parameters())
    try:
        engine.load_checkpoint(ck, tag="t1")
        res["ds_load"] = "accepted"
    except ConfigError as e:
        res["ds_load"] = str(e)
    engine.elastor.load(ck)
    res["step"] = int(engine.global_steps)
    res["client"] = engine.elastor_client_state()
    res["identical"] = all(torch.equal(p, held[n]) for n, p in engine.module.named_parameters())
    res["names"] = sorted(held)
    engine.train_batch(it)                                  # and training continues after the load
    engine.elastor.finalize()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.barrier()


def _listing(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def test_save_checkpoint_writes_no_clobbered_deepspeed_files(tmp_path):
    ck, other, out = str(tmp_path / "ck"), str(tmp_path / "other"), str(tmp_path / "out.json")
    run_world(_save_worker, 3, ck, other, out, timeout_s=120)
    with open(out) as f:
        res = json.load(f)
    for r, got in enumerate(res):
        assert got["explicit"].startswith("elastor.checkpoint.deepspeed_native: true with heterogeneous plan "
                                          "R0(mb3)[tp1:0-3|tp1:3-8] R1(mb1)[tp1:0-8]: "), (r, got["explicit"])
        assert 'set "deepspeed_native": false' in got["explicit"]
        assert "add \"elastor\": {\"checkpoint\": {\"dir\"" in got["no_elastor"], got["no_elastor"]
        assert got["ds_load"].startswith(f"engine.load_checkpoint({ck}) under heterogeneous plan"), got["ds_load"]
        assert f"engine.elastor.load({ck!r})" in got["ds_load"]
        assert got["moved"] and got["identical"], (r, got)
        assert got["step"] == 3 and got["client"] == {"epoch": 3}
        assert got["warnings"] == (1 if r == 0 else 0)     # once, on rank 0
    # each rank held its own replica's parameters (pp2 stages split them; the pp1 rank holds all)
    assert len(res[2]["names"]) == len(res[0]["names"]) + len(res[1]["names"])
    # DeepSpeed's files (tag folders, mp_rank_*, layer_*) are nowhere; elastor's two steps are
    assert not os.path.exists(other)
    top = sorted(os.listdir(ck))
    assert top == ["latest", "step_000000002", "step_000000003"], top
    files = _listing(ck)
    assert not [f for f in files if "model_states" in f or "optim_states" in f or f.startswith(("t1", "t2"))], files
    with open(os.path.join(ck, "latest")) as f:
        assert f.read().strip() == "step_000000003"


# ---- ranks with different plans -------------------------------------------------------------------
MIRRORED = {"version": 1, "replicas": [PLAN["replicas"][1], PLAN["replicas"][0]]}
TWO_DEVICES = {"version": 1, "replicas": [
    {"micro_batches": 3, "stages": [{"tp": 1, "layers": [0, 3]}, {"tp": 1, "layers": [3, 8]}]}]}


def _disagree_worker(rank: int, world: int, plans: dict, out: str) -> None:
    import faulthandler
    import sys

    import torch.distributed as dist

    faulthandler.dump_traceback_later(25, exit=True, file=sys.stderr)   # a hang fails the test, bounded

    from elastor_ds import deepspeed as eds
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime
    from elastor_ds.testing import toy_pipe as toy

    HeteroRuntime.release()
    try:
        eds.PipelineModule(toy.layers(num_blocks=6), loss_fn=toy.loss_fn, plan=plans.get(str(rank), PLAN))
        got = "built"
    except ConfigError as e:
        got = str(e)
    HeteroRuntime.release()
    faulthandler.cancel_dump_traceback_later()
    with open(f"{out}.{rank}", "w") as f:
        f.write(got)
    dist.barrier()


@pytest.mark.parametrize("plans,expect", [
    # rank 2 holds the mirrored plan: before, the ranks created each other's groups and hung in new_group
    ({"2": MIRRORED}, "the ranks hold 2 different plans: ranks 0, 1 hold R0(mb3)[tp1:0-3|tp1:3-8] "
                      "R1(mb1)[tp1:0-8] (fingerprint {a}); rank 2 holds R0(mb1)[tp1:0-8] R1(mb3)[tp1:0-3|tp1:3-8] "
                      "(fingerprint {b}): give every rank the same plan"),
    # rank 1 holds a uniform plan for 2 devices: before, rank 1 alone went DeepSpeed's way and raised
    # ('must provide num_stages or topology') while the others hung creating the heterogeneous groups
    ({"1": TWO_DEVICES}, "the ranks hold 2 different plans: ranks 0, 2 hold R0(mb3)[tp1:0-3|tp1:3-8] "
                         "R1(mb1)[tp1:0-8] (fingerprint {a}); rank 1 holds tp1.pp2.dp1(layers [0, 3, 8]) "
                         "(fingerprint {c}): give every rank the same plan"),
])
def test_ranks_with_different_plans_are_told_not_hung(tmp_path, plans, expect):
    from elastor_ds.layout import Layout
    fp = {k: Layout.from_json(p, 8).fingerprint()[:15] for k, p in (("a", PLAN), ("b", MIRRORED), ("c", TWO_DEVICES))}
    out = str(tmp_path / "res")
    run_world(_disagree_worker, 3, plans, out, timeout_s=30)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            got = f.read()
        assert got.startswith(expect.format(**fp)), (r, got)
        assert "\n" not in got


def test_ranks_with_the_same_plan_build(tmp_path):
    out = str(tmp_path / "res")
    run_world(_disagree_worker, 3, {}, out, timeout_s=30)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            assert f.read() == "built"


# ---- release() destroys the runtime's groups ------------------------------------------------------
def _release_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed.distributed_c10d as c10d

    from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime

    HeteroRuntime.release()
    res = []
    for i, zero in enumerate((0, 1, 0)):
        before = set(c10d._world.pg_map)
        engine, it = _engine_zero(rank, zero)
        loss = float(engine.train_batch(it))
        during = set(c10d._world.pg_map)
        ours = set(engine.elastor_runtime.groups.values())
        HeteroRuntime.release()
        after = set(c10d._world.pg_map)
        res.append({"loss": loss, "ours": len(ours), "ours_new": ours <= during - before,
                    "ours_gone": not (ours & after), "rest_kept": after == during - ours})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)


def _engine_zero(rank: int, zero: int):
    import hetero_scenarios as hs

    from elastor_ds import deepspeed as eds
    from elastor_ds.layout import Layout
    from elastor_ds.testing import toy_pipe as toy
    layout = Layout.from_json(PLAN, 8)
    model = eds.PipelineModule(toy.layers(num_blocks=6), loss_fn=toy.loss_fn, plan=layout)
    cfg = hs.ds_config(MB, {"zero_optimization": {"stage": zero}})
    engine, _, _, _ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    pos = layout.position(rank)
    offset = sum(r.micro_batches for r in layout.replicas[:pos.replica])
    return engine, hs.replica_batches(0, offset, layout.replicas[pos.replica].micro_batches, 4, MB)


def test_release_destroys_the_runtime_groups(tmp_path):
    """Before, release() left every group of the runtime registered: each plan run in one process added
    its stage, replica, split all-reduce and ZeRO-1 groups for good. Oracle: torch's own registry of
    process groups (``_world.pg_map``) before, during and after each runtime."""
    out = str(tmp_path / "res")
    run_world(_release_worker, 3, out, timeout_s=60)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        # the pp2 ranks: own singleton, replica, one split all-reduce group; the pp1 rank: singleton, two
        assert [x["ours"] for x in res] == [3, 3, 3], (r, res)
        assert all(x["ours_new"] and x["ours_gone"] and x["rest_kept"] for x in res), (r, res)
        # each fresh runtime trains the same first step (ZeRO-1 or not: the same global loss)
        assert res[0]["loss"] == res[1]["loss"] == res[2]["loss"], (r, res)
