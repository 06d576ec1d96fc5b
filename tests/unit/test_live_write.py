"""Live writes (``CheckpointEngine(live_write=True)``): the writer reads the live CPU tensors until
``fence()`` and staging after it. Oracles: clones of the tensors taken before the save (what a
load must give back, bit for bit), the full CRC verification of the committed files, and the
tensors' own version counters for the contract's guard."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from elastor_ds.checkpoint import direct_write
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.checkpoint.storage import PosixStorage, TmpfsStorage
from elastor_ds.checkpoint.verify import verify
from elastor_ds.errors import AsyncSaveError, LiveStateChangedError
from elastor_ds.layout.region import Region


def state():
    """About 25 MiB: a box of 8 column tiles (16 MiB), a strided column slice of a wider tensor
    (tiled too), a flat vector, a bfloat16 matrix (a dtype numpy lacks) and a 0-d scalar."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(512, 8192, generator=g)
    wide = torch.randn(128, 16384, generator=g)
    b = wide[:, 4096:12288]
    c = torch.randn(1 << 20, generator=g)
    d = torch.randn(64, 4096, generator=g).to(torch.bfloat16)
    e = torch.tensor(3.5)
    shards = [full_shard("a", a), TensorShard("b", (128, 8192), Region((0, 0), (128, 8192)), b),
              full_shard("c", c), full_shard("d", d), full_shard("e", e)]
    return shards, [a, b, c, d, e]


def load_back(root, like):
    outs = [torch.zeros_like(t) for t in like]
    eng = CheckpointEngine(root)
    shards = [full_shard("a", outs[0]), TensorShard("b", (128, 8192), Region((0, 0), (128, 8192)), outs[1]),
              full_shard("c", outs[2]), full_shard("d", outs[3]), full_shard("e", outs[4])]
    res = eng.load(None, shards)
    eng.finalize()
    return res, outs


def live_engine(tmp_path, poisoned: bool = False):
    """(root, tensors, clones, shards, engine with live writes). ``poisoned``: a first save (step 1)
    has allocated the staging buffer, which is then filled with 0xA5, so a writer that reads it
    instead of the live tensors (or a fallback that does not stage first) writes garbage."""
    root = str(tmp_path / "ck")
    shards, tensors = state()
    eng = CheckpointEngine(root, live_write=True)
    if poisoned:
        eng.save(1, shards)
        eng.wait()
        eng.staging.buf.fill_(0xA5)
    return root, tensors, [t.clone() for t in tensors], shards, eng


def assert_loads(root, want, step):
    res, got = load_back(root, want)
    assert res.step == step
    for w, g, name in zip(want, got, "abcde"):
        assert torch.equal(w, g), name
    return res


def committed(root):
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())


def bump(tensors):
    with torch.no_grad():
        for t in tensors:
            t.add_(1)


def test_a_fence_in_the_middle_of_the_write_keeps_the_state_of_the_save(tmp_path, monkeypatch):
    """The disk is held until the writer has read a few chunks of the live tensors; then the
    fence copies only the rest into staging, the test changes every tensor in place, and the disk
    is released: the checkpoint holds the values at save() exactly, and its CRCs verify."""
    root = str(tmp_path / "ck")
    shards, tensors = state()
    want = [t.clone() for t in tensors]
    entered, release = threading.Event(), threading.Event()
    real = os.writev

    def held(fd, bufs):
        entered.set()
        assert release.wait(30)
        return real(fd, bufs)
    monkeypatch.setattr(os, "writev", held)
    eng = CheckpointEngine(root, live_write=True, writer_sched="nice")
    st = eng.save(7, shards)
    assert st.live and st.bytes_written > 20 << 20
    gate = eng._job.gate
    assert any(len(sp) == 4 for sp in eng.staging._program.spans)   # column tiles are among the chunks
    eng.staging.buf.fill_(0xA5)   # staging holds garbage: whatever the file has came from the live tensors or the fence
    assert entered.wait(30)
    t0 = time.monotonic()
    while gate.cursor < 2 and time.monotonic() - t0 < 30:   # the copier fills the free bounce buffers
        time.sleep(0.005)
    assert gate.cursor >= 2
    eng.fence()
    bump(tensors)                       # the optimizer step, after the fence
    release.set()
    done = eng.wait()
    eng.finalize()
    assert 0 < done.fence_bytes < done.bytes_written   # the writer had read some chunks live
    res, got = load_back(root, want)
    assert res.step == 7
    for w, g, name in zip(want, got, "abcde"):
        assert torch.equal(w, g), name
    assert verify(res.step_dir) == []


@pytest.mark.parametrize("o_direct", [True, False])
def test_no_fence_until_durable_reads_the_live_tensors_and_the_fallback_stages_them(tmp_path, monkeypatch, o_direct):
    """The optimizer step comes after the write: the save is exact over a poisoned staging buffer
    and a late fence does nothing. Where the file system refuses O_DIRECT, the buffered fallback
    reads each chunk twice (CRCs, then the write), so the writer first copies the live tensors into
    staging: the bytes are still those of the save."""
    if not o_direct:
        monkeypatch.setattr(direct_write, "_unsupported", {-7})
        monkeypatch.setattr(direct_write, "_device_of", lambda folder: -7)
    root, tensors, want, shards, eng = live_engine(tmp_path, poisoned=True)
    eng.save(2, shards)
    done = eng.wait()
    eng.fence()
    bump(tensors)
    eng.finalize()
    assert done.live and done.fence_bytes == 0
    assert verify(assert_loads(root, want, 2).step_dir) == []


def test_a_fence_right_after_save_copies_everything_and_is_exact(tmp_path):
    root, tensors, want, shards, eng = live_engine(tmp_path, poisoned=True)
    eng.save(2, shards)
    eng.fence()
    bump(tensors)
    done = eng.wait()
    eng.finalize()
    assert 0 < done.fence_bytes <= done.bytes_written
    assert_loads(root, want, 2)


def test_a_tensor_changed_without_a_fence_drops_the_save_on_its_version_counter(tmp_path, monkeypatch):
    """The contract broken: an in-place change while the writer still reads. The save fails with a
    typed error naming the tensor, nothing is committed (``latest`` stays at the last good step),
    and the next save, fenced, works."""
    root = str(tmp_path / "ck")
    shards, tensors = state()
    eng = CheckpointEngine(root, live_write=True)
    eng.save(1, shards)
    eng.wait()
    release = threading.Event()
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: (release.wait(30), real(fd, bufs))[1])
    eng.save(2, shards)
    with torch.no_grad():
        tensors[2].mul_(2)              # no fence first
    release.set()
    with pytest.raises(LiveStateChangedError) as ei:
        eng.wait()
    assert isinstance(ei.value, AsyncSaveError) and "'c'" in str(ei.value) and "fence()" in str(ei.value)
    assert committed(root) == [1]                 # nothing of step 2 was committed
    want = [t.clone() for t in tensors]
    eng.save(3, shards)
    eng.fence()
    bump(tensors)
    eng.wait()
    eng.finalize()
    _, got = load_back(root, want)
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_a_change_before_the_fence_is_caught_by_the_fence(tmp_path, monkeypatch):
    release = threading.Event()
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: (release.wait(30), real(fd, bufs))[1])
    shards, tensors = state()
    eng = CheckpointEngine(str(tmp_path / "ck"), live_write=True)
    eng.save(1, shards)
    with torch.no_grad():
        tensors[0][0, 0] += 1
    eng.fence()
    release.set()
    with pytest.raises(LiveStateChangedError, match="'a' changed in place before the fence"):
        eng.wait()
    eng.finalize()


def test_storage_that_cannot_read_live_and_device_less_buffered_writes_copy_at_save(tmp_path):
    shards, _ = state()
    eng = CheckpointEngine(str(tmp_path / "ck"), storage=PosixStorage(str(tmp_path / "ck"), direct_io=False),
                           live_write=True)
    st = eng.save(1, shards)
    eng.finalize()
    assert not st.live and st.stall_s > 0


@pytest.mark.parametrize("storage", ["posix", "tmpfs"])
def test_a_shard_whose_strides_need_torchs_copy_is_saved_by_a_copy_at_save(tmp_path, storage):
    """A transposed matrix (no stride-1 rows): no live views of it, so the save copies as before
    (live False, a stall), and the bytes are the values at save(). ``tmpfs``: a memory snapshot
    (staged in place) likewise."""
    root = str(tmp_path / "ck")
    t = torch.randn(64, 48).t()                  # strides (1, 48)
    want = t.clone()
    eng = CheckpointEngine(root, live_write=True, **({"storage": TmpfsStorage(root)} if storage == "tmpfs" else {}))
    st = eng.save(1, [full_shard("t", t)])
    bump([t])
    eng.wait()
    eng.finalize()
    assert not st.live
    out = torch.zeros(48, 64)
    CheckpointEngine(root).load(None, [full_shard("t", out)])
    assert torch.equal(out, want)



def _resident_share(addr: int, nbytes: int) -> float:
    """The share of the pages of ``[addr, addr + nbytes)`` present in memory (bit 63 of each
    page's entry in /proc/self/pagemap, readable by the process itself)."""
    first, last = addr // 4096, (addr + nbytes - 1) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    entries = np.frombuffer(raw, dtype=np.uint64)
    return float(((entries >> np.uint64(63)) & np.uint64(1)).mean())


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads page residency from /proc")
@pytest.mark.parametrize("live", [True, False], ids=["live", "copy-first"])
def test_a_live_write_that_ends_before_the_fence_takes_no_staging_memory(tmp_path, live):
    """Oracle: the kernel's page tables. Three saves of 64 MiB that end before any fence: with live
    writes none of the staging buffer's pages is in memory (the writer read the live tensors, and
    memory an allocator hands out again is given back first); a copy-first save copied the state
    into every one of them (the check that the measure sees a copy)."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(4096, 2048, generator=g) for _ in range(2)]   # 64 MiB
    eng = CheckpointEngine(str(tmp_path / "ck"), live_write=live)
    for step in (1, 2, 3):
        st = eng.save(step, [full_shard(f"t{i}", t) for i, t in enumerate(tensors)])
        eng.wait()
        assert st.live == live and st.fence_bytes == 0
    share = _resident_share(eng.staging.buf.data_ptr(), eng.staging.buf.numel())
    eng.finalize()
    if live:
        assert share < 0.01, f"{share:.1%} of the staging buffer is resident after live saves"
    else:
        assert share > 0.99, f"{share:.1%}: a copy-first save's staging buffer should be resident"


@pytest.mark.parametrize("storage", ["posix", "tmpfs"], ids=["storage-save", "memory-snapshot"])
def test_a_fence_interrupted_part_way_drops_the_save(tmp_path, monkeypatch, storage):
    """Ctrl-C (or a SIGTERM handler that exits) lands in the fence's copy after its first chunk:
    staging (the mapped file, for a memory snapshot) then holds only part of the unread chunks. The
    writer goes on; the save must be dropped on its typed error, never committed with the unfilled
    bytes (garbage 0xA5 in the staging buffer of a storage save, the previous snapshot's bytes in
    a memory snapshot's recycled file) that its CRCs would vouch for."""
    from elastor_ds.checkpoint import live
    root = str(tmp_path / "ck")
    shards, tensors = state()
    kw = {"storage": TmpfsStorage(root)} if storage == "tmpfs" else {"writer_sched": "nice"}
    eng = CheckpointEngine(root, live_write=True, keep=1, **kw)
    eng.save(1, shards)                 # step 1 commits; its staging (or file) is then reused
    eng.fence()
    eng.wait()
    if eng.staging.buf is not None:
        eng.staging.buf.fill_(0xA5)
    bump(tensors)
    go = threading.Event()
    real_let_in = live.LiveGate.let_fence_in

    def held(self):                     # the writer waits before its first piece until the fence is over
        assert go.wait(30)
        real_let_in(self)

    monkeypatch.setattr(live.LiveGate, "let_fence_in", held)
    st = eng.save(2, shards)
    assert st.live
    chunks = eng._job.gate.chunks
    real_stage_from = chunks.stage_from

    def interrupted(start):             # the first chunk copied, then the signal arrives
        dst, src = real_stage_from.__self__.copies[0]
        np.copyto(dst, src)
        raise KeyboardInterrupt
    chunks.stage_from = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.fence()
    finally:
        chunks.stage_from = real_stage_from
    bump(tensors)                        # the step goes on after the interrupt (or the process exits)
    go.set()
    with pytest.raises(LiveStateChangedError, match="interrupted"):
        eng.wait()
    eng.finalize()
    assert committed(root) == [1]        # nothing of step 2; step 1 still loads


@pytest.mark.parametrize("step_by", ["torch", "numpy"])
def test_o_direct_refused_after_the_writer_let_go_of_the_tensors_drops_the_save(tmp_path, monkeypatch, step_by):
    """A small file: the first write's EINVAL (a file system that opens O_DIRECT but refuses the
    write) only surfaces when the writer finishes, after it had read every chunk and released the
    gate. The fence then copies nothing and the optimizer steps; the buffered fallback must not
    read the tensors again (they hold the next step's values). The save is dropped, the device is
    remembered, and the next save goes through the page cache from the start and is exact."""
    import errno
    root = str(tmp_path / "ck")
    a, b = torch.full((1 << 18,), 1.0), torch.full((1 << 18,), 2.0)   # 1 MiB each: fewer than 3 bounce buffers
    shards = [full_shard("a", a), full_shard("b", b)]
    real_writev, refused = os.writev, []

    def writev(fd, views):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_writev(fd, views)
    monkeypatch.setattr(direct_write.os, "writev", writev)
    monkeypatch.setattr(direct_write, "_unsupported", set())
    released, stepped = threading.Event(), threading.Event()
    real_finish = direct_write._Bounce.finish

    def finish(self):                   # the gate was released just before: training steps now
        released.set()
        assert stepped.wait(30)
        return real_finish(self)
    monkeypatch.setattr(direct_write._Bounce, "finish", finish)
    eng = CheckpointEngine(root, live_write=True, writer_sched="nice")
    eng.save(1, shards)
    assert released.wait(30)
    eng.fence()
    if step_by == "torch":
        bump([a, b])
    else:
        for t in (a, b):
            t.numpy()[:] += 1
    stepped.set()
    with pytest.raises(LiveStateChangedError, match="refused O_DIRECT"):
        eng.wait()
    assert refused and committed(root) == []
    want = [a.clone(), b.clone()]
    st = eng.save(2, shards)
    eng.fence()
    bump([a, b])
    eng.wait()
    eng.finalize()
    got = [torch.zeros_like(a), torch.zeros_like(b)]
    res = CheckpointEngine(root).load(None, [full_shard("a", got[0]), full_shard("b", got[1])])
    assert res.step == 2 and all(torch.equal(w, g) for w, g in zip(want, got)), (st.live, got[0][:2])


def test_inference_mode_tensors_are_copied_at_save(tmp_path):
    """Tensors made under ``torch.inference_mode()`` have no version counter, so the live write's
    guard cannot watch them: the save copies at save() (no error), and the checkpoint holds the
    values at save() although they change right after."""
    root = str(tmp_path / "ck")
    with torch.inference_mode():
        t = torch.randn(256, 4096)
    want = t.clone()
    eng = CheckpointEngine(root, live_write=True)
    st = eng.save(1, [full_shard("t", t)])
    with torch.inference_mode():
        t.add_(1)
    eng.wait()
    eng.finalize()
    assert not st.live and st.stall_s > 0
    out = torch.zeros(256, 4096)
    CheckpointEngine(root).load(None, [full_shard("t", out)])
    assert torch.equal(out, want)


def test_a_parameter_changed_in_place_outside_the_step_is_caught_through_the_deepspeed_shards(tmp_path, monkeypatch):
    """The DeepSpeed integration's shards view the parameters' memory with their version counter
    (``detach()``; a ``.data`` alias has a counter of its own, so a change through the parameter
    went unseen): weights changed in place before the fence drop a live save by name."""
    from elastor_ds.integrations.deepspeed.state import model_shards
    lin = torch.nn.Linear(1024, 1024)
    engine = type("Engine", (), {"module": lin})()
    shards = model_shards(engine)
    assert {s.tensor.data_ptr() for s in shards} == {lin.weight.data_ptr(), lin.bias.data_ptr()}
    release = threading.Event()
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: (release.wait(30), real(fd, bufs))[1])
    eng = CheckpointEngine(str(tmp_path / "ck"), live_write=True)
    eng.save(1, shards)
    with torch.no_grad():
        lin.weight.mul_(2)              # e.g. weights rescaled by the training script, no fence
    release.set()
    with pytest.raises(LiveStateChangedError, match="weight"):
        eng.wait()
    eng.finalize()
    assert committed(str(tmp_path / "ck")) == []


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_fence_waiting_for_a_writer_that_plans_again_boosts_it(tmp_path, monkeypatch):
    """While a live save's writer plans again (its plan agreement failed) it holds the job's lock on
    idle cycles only (``SCHED_IDLE``); a fence that comes then waits for that lock. The writer's
    group must run at normal priority while the fence waits (the kernel's record of the holder's
    policy), or a trainer that keeps every core busy would stall in the fence until a core idles."""
    release = threading.Event()
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: (release.wait(30), real(fd, bufs))[1])
    shards, _ = state()
    eng = CheckpointEngine(str(tmp_path / "ck"), live_write=True, writer_sched="idle", writer_deadline_s=60)
    eng.save(1, shards)
    job = eng._job
    held, policy, fenced = threading.Event(), [], threading.Event()

    def planning_again():              # a thread of the writer's group that holds the job's lock
        eng.writer_priority.enter()
        with job.lock:
            tid = threading.get_native_id()
            policy.append(os.sched_getscheduler(tid))
            held.set()
            t0 = time.monotonic()
            while os.sched_getscheduler(tid) == os.SCHED_IDLE and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            policy.append(os.sched_getscheduler(tid))
        eng.writer_priority.leave()
    holder = threading.Thread(target=planning_again)
    holder.start()
    assert held.wait(30)
    fencer = threading.Thread(target=lambda: (eng.fence(), fenced.set()))
    fencer.start()
    holder.join(30)
    assert fenced.wait(30)
    release.set()
    eng.wait()
    eng.finalize()
    assert policy == [os.SCHED_IDLE, os.SCHED_OTHER]
