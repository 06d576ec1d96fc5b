"""Live memory snapshots (``memory_snapshot.live_write``: an engine on node-local tmpfs storage,
staged in place, with ``live_write=True``): ``save()`` copies nothing, the writer copies the live
tensors into the mapped data file until ``fence()``, and the fence copies the rest. Oracles:
clones of the tensors taken before the save (what a load gives back, bit for bit), a full CRC
verification of the committed files, the recycled file's old bytes (a writer that skips a chunk
leaves them there), and the tensors' version counters for the contract's guard."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import live as live_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.planning.manifest import SNAPSHOT_BLOCK_SIZE
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.checkpoint.storage import TmpfsStorage
from elastor_ds.checkpoint.verify import verify
from elastor_ds.errors import LiveStateChangedError
from elastor_ds.layout.region import Region


def state():
    """About 9 MiB: a box saved as column tiles of a wider tensor (rows of 16 KiB), a flat vector
    longer than the writer's piece, a bfloat16 matrix, a matrix with rows longer than a piece and
    a 0-d scalar."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(256, 8192, generator=g)
    b = wide[:, 2048:6144]
    c = torch.randn(600_000, generator=g)
    d = torch.randn(64, 1024, generator=g).to(torch.bfloat16)
    r = torch.randn(3, 300_000, generator=g)     # 1.2 MB rows: a row is copied in parts
    e = torch.tensor(2.25)
    shards = [TensorShard("b", (256, 4096), Region((0, 0), (256, 4096)), b), full_shard("c", c),
              full_shard("d", d), full_shard("r", r), full_shard("e", e)]
    return shards, [b, c, d, r, e]


NAMES = "bcdre"


def engine(root):
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, optimistic_plan=True,
                           block_size=SNAPSHOT_BLOCK_SIZE, writer_nice=0, writer_sched="nice", live_write=True)
    return eng


def load_back(root, like):
    outs = [torch.zeros_like(t) for t in like]
    shards = [TensorShard("b", (256, 4096), Region((0, 0), (256, 4096)), outs[0]), full_shard("c", outs[1]),
              full_shard("d", outs[2]), full_shard("r", outs[3]), full_shard("e", outs[4])]
    eng = CheckpointEngine(root)
    res = eng.load(None, shards)
    eng.finalize()
    return res, outs


def assert_loads(root, want, step):
    res, got = load_back(root, want)
    assert res.step == step
    for w, g, name in zip(want, got, NAMES):
        assert torch.equal(w, g), name
    assert verify(res.step_dir) == []
    return res


def bump(tensors):
    with torch.no_grad():
        for t in tensors:
            t.add_(1)


def test_the_writer_copies_the_live_tensors_into_the_file_and_save_copies_nothing(tmp_path):
    """Three snapshots, each waited for before the optimizer step: every one loads back exact and
    verifies. Files cycle (keep 1: step 3 reuses step 1's file, which holds step 1's bytes), so a
    chunk the writer skipped would keep stale values."""
    root = str(tmp_path / "mem")
    shards, tensors = state()
    eng = engine(root)
    for step in (1, 2, 3):
        want = [t.clone() for t in tensors]
        st = eng.save(step, shards)
        assert st.live
        eng.wait()
        eng.fence()
        bump(tensors)
        assert_loads(root, want, step)
    eng.finalize()


def after_a_first_snapshot(tmp_path):
    """(root, shards, tensors, live engine, the values the next snapshot must hold): one snapshot
    committed, then the tensors changed (the next optimizer step)."""
    root = str(tmp_path / "mem")
    shards, tensors = state()
    eng = engine(root)
    eng.save(1, shards)
    eng.wait()
    bump(tensors)
    return root, shards, tensors, eng, [t.clone() for t in tensors]


def held_writer(monkeypatch):
    """The writer's copy into the file starts only once the returned event is set."""
    from elastor_ds.checkpoint import engine as engine_mod
    go = threading.Event()
    real = engine_mod.fill_in_place

    def held(*a, **k):
        assert go.wait(30)
        return real(*a, **k)
    monkeypatch.setattr(engine_mod, "fill_in_place", held)
    return go


def test_save_copies_nothing_and_a_fence_right_after_it_copies_everything(tmp_path, monkeypatch):
    """Step 2 gets a new file (step 1's is still the committed one): right after save() its data
    section is still all zeros, so the training thread copied nothing; the fence then copies the
    whole state, the tensors change, and the snapshot holds the values at save()."""
    root, shards, tensors, eng, want = after_a_first_snapshot(tmp_path)
    go = held_writer(monkeypatch)
    st = eng.save(2, shards)
    data = eng._job.staged.data
    assert st.live and data.numel() == st.bytes_written and int(data.count_nonzero()) == 0
    eng.fence()
    bump(tensors)
    go.set()
    done = eng.wait()
    eng.finalize()
    assert done.fence_bytes == done.bytes_written
    assert_loads(root, want, 2)


def test_a_fence_in_the_middle_keeps_the_state_of_the_save(tmp_path, monkeypatch):
    """The writer is stopped after it has copied a few pieces; the fence copies the rest, the
    tensors change, and the writer goes on: the snapshot holds the values at save()."""
    root, shards, tensors, eng, want = after_a_first_snapshot(tmp_path)
    pieces, go = [], threading.Event()
    real = live_mod.LiveGate.source

    def counted(self, k):
        pieces.append(k)
        if len(pieces) == 6:
            assert go.wait(30)
        return real(self, k)
    monkeypatch.setattr(live_mod.LiveGate, "source", counted)
    eng.save(2, shards)
    t0 = time.monotonic()
    while len(pieces) < 6 and time.monotonic() - t0 < 30:
        time.sleep(0.002)
    # the writer waits inside the lock on its sixth piece: the fence waits for it, so let it go
    # from another thread once the fence is blocked on the lock
    threading.Timer(0.2, go.set).start()
    eng.fence()
    bump(tensors)
    done = eng.wait()
    eng.finalize()
    assert 0 < done.fence_bytes < done.bytes_written
    assert_loads(root, want, 2)


def test_a_change_without_a_fence_drops_the_snapshot(tmp_path, monkeypatch):
    root = str(tmp_path / "mem")
    shards, tensors = state()
    eng = engine(root)
    eng.save(1, shards)
    eng.wait()
    go = threading.Event()
    real = live_mod.LiveGate.release

    def late(self):
        assert go.wait(30)
        return real(self)
    monkeypatch.setattr(live_mod.LiveGate, "release", late)
    eng.save(2, shards)
    with torch.no_grad():
        tensors[1].mul_(2)               # no fence first
    go.set()
    with pytest.raises(LiveStateChangedError, match="'c'"):
        eng.wait()
    assert [s for s, _ in commit_mod.list_committed(root)] == [1]    # nothing of step 2 was committed
    want = [t.clone() for t in tensors]
    eng.save(3, shards)                  # the next snapshot, fenced, works
    eng.fence()
    bump(tensors)
    eng.wait()
    eng.finalize()
    assert_loads(root, want, 3)

