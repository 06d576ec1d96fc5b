"""Memory-snapshot engines skip the per-save plan agreement (``optimistic_plan``): on two gloo ranks,
a save where only ONE rank's shard layout changed must be dropped on both (no hang, nothing
committed, no temp dir left), and the next save re-plans and commits exactly."""
from __future__ import annotations

import os

import torch

from dist_utils import run_world
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.checkpoint.storage import TmpfsStorage
from elastor_ds.comm import TorchComm
from elastor_ds.layout.region import Region


def _rows(rank: int, t: torch.Tensor) -> TensorShard:
    return TensorShard("w", (8, 6), Region((rank * 4, 0), (4, 6)), t)


def _worker(rank: int, world: int, root: str) -> None:
    comm = TorchComm.create(60)
    eng = CheckpointEngine(root, comm, TmpfsStorage(root), keep=2, optimistic_plan=True)
    w = torch.full((4, 6), float(rank + 1))
    st = eng.save(1, [_rows(rank, w)])
    eng.wait()
    assert not st.dropped
    # only rank 1 gains a tensor: its metadata no longer matches the cached plan, rank 0's does
    extra = [full_shard("b", torch.arange(5.0))] if rank == 1 else []
    st = eng.save(2, [_rows(rank, w * 10)] + extra)
    eng.wait()
    assert st.dropped and eng.saves_dropped == 1
    comm.barrier()
    assert [s for s, _ in commit_mod.list_committed(root)] == [1]
    assert not [n for n in os.listdir(root) if n.startswith(commit_mod.TMP_PREFIX)]
    # every rank now has the new layout: the next save plans again (a collective) and commits
    b = [full_shard("b", torch.arange(5.0))]
    st = eng.save(3, [_rows(rank, w * 100)] + b)
    eng.wait()
    assert not st.dropped and not st.plan_cached
    st = eng.save(4, [_rows(rank, w * 1000)] + b)   # and then the cached plan again, no collective
    eng.wait()
    assert not st.dropped and st.plan_cached
    out = torch.zeros(8, 6)
    ob = torch.zeros(5)
    res = eng.load(None, [full_shard("w", out), full_shard("b", ob)])
    assert res.step == 4
    assert torch.equal(out[:4], torch.full((4, 6), 1000.0)) and torch.equal(out[4:], torch.full((4, 6), 2000.0))
    assert torch.equal(ob, torch.arange(5.0))
    eng.finalize()
    comm.close()


def test_a_layout_change_on_one_rank_drops_that_snapshot_on_every_rank(tmp_path):
    root = str(tmp_path / "mem")
    run_world(_worker, 2, root, timeout_s=60)
    assert [s for s, _ in commit_mod.list_committed(root)] == [3, 4]
