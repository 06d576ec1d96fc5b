"""A load given a path costs one collective on the checkpoint group when every rank succeeds: its
closing agreement, with the manifest read inside it (issue 23: ``open()``'s own agreement on the
manifest first was one more arrival barrier and all-reduce on every load).

Two gloo ranks save row halves and load column halves. The test counts every arrival on the
group's liveness barrier (each collective passes it once) and every object gather, around
``load``; the loaded bytes are checked against the saved tensors. A load through ``open()`` (the
Megatron hooks' route) keeps its two agreements."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_world
from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.comm import TorchComm
from elastor_ds.layout.region import Region

pytestmark = [pytest.mark.timeout(120)]


def _worker(rank: int, world: int, root: str) -> None:
    comm = TorchComm.create(60)
    w = torch.randn(64, 2048, generator=torch.Generator().manual_seed(9))
    eng = CheckpointEngine(root, comm, async_save=False)
    eng.save(3, [TensorShard("w", (64, 2048), Region((32 * rank, 0), (32, 2048)), w[32 * rank:32 * (rank + 1)])])
    eng.finalize()

    arrivals, gathers = [], []
    real_arrive = comm.liveness.arrive
    real_gather = comm.all_gather_object

    def arrive(what, *a, **k):
        arrivals.append(what)
        return real_arrive(what, *a, **k)

    def gather(obj):
        gathers.append(obj)
        return real_gather(obj)
    comm.liveness.arrive = arrive
    comm.all_gather_object = gather

    eng2 = CheckpointEngine(root, comm)
    arrivals.clear()
    dst = torch.full((64, 1024), float("nan"))
    res = eng2.load(None, [TensorShard("w", (64, 2048), Region((0, 1024 * rank), (64, 1024)), dst)])
    assert res.step == 3 and torch.equal(dst, w[:, 1024 * rank:1024 * (rank + 1)])
    assert arrivals == ["all_equal"], arrivals
    assert gathers == []

    arrivals.clear()
    dst.fill_(float("nan"))
    opened = eng2.open(None)
    eng2.load(opened, [TensorShard("w", (64, 2048), Region((0, 1024 * rank), (64, 1024)), dst)])
    assert torch.equal(dst, w[:, 1024 * rank:1024 * (rank + 1)])
    assert arrivals == ["all_equal", "all_equal"], arrivals
    eng2.finalize()
    comm.close()


def test_a_load_is_one_agreement(tmp_path):
    run_world(_worker, 2, str(tmp_path / "ck"), timeout_s=60)
