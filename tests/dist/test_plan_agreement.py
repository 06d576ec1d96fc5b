"""The save-plan agreement runs beside the snapshot copy (``CheckpointEngine.save``): a rank whose
shards match the cached plan copies under it while the ranks agree in a helper thread. On two gloo
ranks with POSIX storage: saves with unchanged shards take that path and commit exactly; a save
where only ONE rank's shards changed is planned again and copied again on the rank that had
speculated, and commits the new shards bit for bit (nothing dropped).

With ``live_write`` the agreement runs on the writer's group after ``save`` returns: the writer joins
it before it reads anything, and where it failed the writers plan again on their group while a
fence waits for the new plan and copies under it. Oracle: the hand-set values, loaded whole after
every saved tensor was overwritten with NaN right after the fence (or the wait)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_world
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import engine as engine_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.comm import TorchComm
from elastor_ds.layout.region import Region


def _rows(rank: int, t: torch.Tensor) -> TensorShard:
    return TensorShard("w", (8, 6), Region((rank * 4, 0), (4, 6)), t)


def _worker(rank: int, world: int, root: str) -> None:
    made = []
    real = engine_mod._Agreement

    class Spy(real):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)
    engine_mod._Agreement = Spy
    comm = TorchComm.create(60)
    eng = CheckpointEngine(root, comm, keep=5)
    w = torch.full((4, 6), float(rank + 1))
    b = torch.arange(4096.0)   # replicated: the plan has one rank write it
    st = eng.save(1, [_rows(rank, w), full_shard("b", b)])
    eng.wait()
    assert not st.plan_cached and made == []            # the first save plans (no cached plan)
    (writer,) = [r for r, its in enumerate(eng._plan.items) if any(i.name == "b" for i in its)]
    st = eng.save(2, [_rows(rank, w * 10), full_shard("b", b * 10)])
    eng.wait()
    assert st.plan_cached and made == [1]               # cached plan, agreed beside the copy
    # the rank that wrote "b" drops it: the other rank's shards are unchanged, so it copies under
    # the old plan beside the agreement, learns the plan changed, and must copy again (now with "b")
    mine = [_rows(rank, w * 100)] + ([] if rank == writer else [full_shard("b", b * 100)])
    st = eng.save(3, mine)
    eng.wait()
    assert not st.plan_cached and not st.dropped
    assert len(made) == (1 if rank == writer else 2)    # the writer knew its shards changed
    st = eng.save(4, [_rows(rank, w * 1000)] + mine[1:])
    eng.wait()
    assert st.plan_cached and len(made) == (2 if rank == writer else 3)
    comm.barrier()
    for step, scale in ((2, 10.0), (3, 100.0)):
        out, ob = torch.zeros(8, 6), torch.zeros(4096)
        res = eng.load(f"{root}/{commit_mod.step_dirname(step)}", [full_shard("w", out), full_shard("b", ob)])
        assert res.step == step
        assert torch.equal(out[:4], torch.full((4, 6), scale)) and torch.equal(out[4:], torch.full((4, 6), 2 * scale))
        assert torch.equal(ob, b * scale), (step, ob[:4])
    eng.finalize()
    comm.close()
    engine_mod._Agreement = real


def test_the_plan_agreement_runs_beside_the_copy_and_a_change_on_one_rank_replans(tmp_path):
    root = str(tmp_path / "ck")
    run_world(_worker, 2, root, timeout_s=90)
    assert [s for s, _ in commit_mod.list_committed(root)] == [1, 2, 3, 4]


def _live_worker(rank: int, world: int, root: str, then: str, strided: bool) -> None:
    comm = TorchComm.create(60)
    eng = CheckpointEngine(root, comm, keep=5, live_write=True)
    training = dist.new_group(backend="gloo")   # the trainer's own collectives (a gradient all-reduce)
    bmat = torch.arange(4096.0).reshape(64, 64)

    def b(scale: float) -> torch.Tensor:
        """``bmat * scale``; ``strided``: held transposed in memory, which only torch's strided copy
        reads (no live write for the rank whose plan has it: its save copies)."""
        v = bmat * scale
        return v.t().contiguous().t() if strided else v

    def save(step: int, shards: list) -> "engine_mod.SaveStats":
        st = eng.save(step, shards)
        # forward and backward before the optimizer step: a collective of the trainer's, which every
        # rank reaches only once its save() returned (a save that waited for a peer's fence would hang)
        grad = torch.ones(3)
        dist.all_reduce(grad, group=training)
        assert grad.tolist() == [2.0, 2.0, 2.0]
        if then == "fence":   # the optimizer step right after the save, then the state changes
            eng.fence()
        else:                 # no optimizer step before the next save or the end
            eng.wait()
        for sh in shards:
            sh.tensor.fill_(float("nan"))
        eng.wait()
        return st

    w = torch.full((4, 6), float(rank + 1))
    st = save(1, [_rows(rank, w.clone()), full_shard("b", b(1.0))])
    assert not st.plan_cached
    (writer,) = [r for r, its in enumerate(eng._plan.items) if any(i.name == "b" for i in its)]
    st = save(2, [_rows(rank, w * 10), full_shard("b", b(10.0))])
    assert st.plan_cached and not st.dropped
    assert st.live == (not strided or rank != writer)
    # the rank that wrote "b" drops it: it plans again inside save(); the other rank's save starts
    # under the old plan, and its writer plans again (its fence, if it comes first, waits for that);
    # with "b" strided, that rank's new plan cannot be read live: its writer copies under it
    mine = [_rows(rank, w * 100)] + ([] if rank == writer else [full_shard("b", b(100.0))])
    st = save(3, mine)
    assert not st.plan_cached and not st.dropped
    assert st.live == (not strided or rank == writer)
    st = save(4, [_rows(rank, w * 1000)] + ([] if rank == writer else [full_shard("b", b(1000.0))]))
    assert st.plan_cached
    comm.barrier()
    for step, scale in ((1, 1.0), (2, 10.0), (3, 100.0), (4, 1000.0)):
        out, ob = torch.zeros(8, 6), torch.zeros(64, 64)
        res = eng.load(f"{root}/{commit_mod.step_dirname(step)}", [full_shard("w", out), full_shard("b", ob)])
        assert res.step == step
        assert torch.equal(out[:4], torch.full((4, 6), scale)) and torch.equal(out[4:], torch.full((4, 6), 2 * scale))
        assert torch.equal(ob, bmat * scale), (step, ob[0, :4])
    eng.finalize()
    comm.close()


@pytest.mark.parametrize("strided", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("then", ["fence", "wait"])
def test_live_writes_agree_on_the_plan_after_save_and_plan_again_in_the_writers(tmp_path, then, strided):
    root = str(tmp_path / "ck")
    run_world(_live_worker, 2, root, then, strided, timeout_s=90)
    assert [s for s, _ in commit_mod.list_committed(root)] == [1, 2, 3, 4]
