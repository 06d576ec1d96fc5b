"""Rank 0 hosts the default store (``MASTER_ADDR``, as torchrun and Megatron-LM start a job) and
leaves the checkpoint group last: its ``finalize`` returns only once every rank has finished its
own (QA round 6, Q6-1: Megatron-LM preempted under ``elastor run`` exited 1 in 2 of 5 tries, rank 3
failing with "Connection reset by peer" in the commit's broadcast after rank 0, which had committed
the step, exited and took the store with it).

Rank 1 finishes its save and then dawdles 2 s before ``finalize`` (a descheduled rank); rank 0
ends its process the moment its own ``finalize`` returns. Oracles: rank 0's ``finalize`` took at
least those 2 s, rank 1's ``finalize`` still succeeds (the store is there), and the step reads back."""
from __future__ import annotations

import os
import time

import torch

from dist_utils import run_world  # noqa: E402 - tests/helpers on sys.path (conftest)


def _job(rank: int, world: int, root: str, out: str) -> None:
    from elastor_ds.checkpoint import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    from elastor_ds.comm.collectives import TorchComm

    comm = TorchComm.create(timeout_s=60, liveness_s=20)
    eng = CheckpointEngine(root, comm, keep=2)
    eng.save(1, [full_shard(f"w{rank}", torch.full((1024,), float(rank + 1)))])
    eng.wait()
    if rank != 0:
        time.sleep(2.0)
    t0 = time.monotonic()
    eng.finalize()
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{time.monotonic() - t0:.3f}")
        os._exit(0)   # the store goes with this process


def test_rank_0_waits_for_every_rank_before_it_leaves(tmp_path):
    root, out = str(tmp_path / "ck"), str(tmp_path / "rank0_finalize_s")
    run_world(_job, 3, root, out, timeout_s=60)
    assert float(open(out).read()) >= 1.5
    from elastor_ds.checkpoint import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    outs = [torch.zeros(1024) for _ in range(3)]
    assert CheckpointEngine(root).load(None, [full_shard(f"w{r}", outs[r]) for r in range(3)]).step == 1
    for r in range(3):
        assert torch.equal(outs[r], torch.full((1024,), float(r + 1))), r
