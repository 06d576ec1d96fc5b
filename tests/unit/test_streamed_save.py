"""Copy-first saves whose writer starts during the copy (``CheckpointEngine._save_streamed``): the
writer writes each piece of the staging buffer once the copy has passed it. Oracles: clones of the
tensors taken before the save (what a load must give back, bit for bit), the committed files' full
CRC verification, and a staging buffer poisoned with 0xA5 before the save (a writer that runs
ahead of the copy writes the poison)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import direct_write
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.staging import CopyProgress, StagingBuffer
from elastor_ds.checkpoint.verify import verify
from elastor_ds.errors import AsyncSaveError

from test_live_write import assert_loads, state


def slow_copy(monkeypatch, fail_at=None):
    """The copy advances in 1 MiB pieces and the writer's direct writes are 2 MiB (so there are
    many of each); at 90 % (past the boxes of column tiles, which the writer takes once the whole
    box is copied) the copy waits (up to 20 s) for the writer's first write of the data file. ``fail_at``: the copy raises at that piece instead. Returns the list of
    (copied bytes, total) seen at each write."""
    monkeypatch.setattr(StagingBuffer, "PROGRESS_PIECE", 1 << 20)
    monkeypatch.setattr(direct_write, "DIRECT_CHUNK", 2 << 20)
    real = CopyProgress.advance
    calls = [0]
    current: list = []
    wrote = threading.Event()

    def advance(self, upto):
        current[:] = [self]
        calls[0] += 1
        if fail_at is not None and calls[0] == fail_at:
            raise MemoryError("injected: the copy failed")
        if fail_at is None and upto >= self.total * 9 // 10 and self.done < self.total * 9 // 10:
            wrote.wait(20)   # a writer that waits for the whole copy never writes here: 20 s, then the test fails
        return real(self, upto)
    monkeypatch.setattr(CopyProgress, "advance", advance)
    seen = []
    real_writev = os.writev

    def writev(fd, bufs):
        if current:
            seen.append((current[0].done, current[0].total))
            wrote.set()
        return real_writev(fd, bufs)
    monkeypatch.setattr(os, "writev", writev)
    return seen


def test_the_writer_writes_while_the_copy_goes_on_and_the_bytes_are_the_saves(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    shards, tensors = state()
    eng = CheckpointEngine(root)
    eng.save(1, shards)
    eng.wait()
    eng.staging.buf.fill_(0xA5)          # whatever the writer takes before the copy passed it is garbage
    with torch.no_grad():
        for t in tensors:
            t.add_(1)
    want = [t.clone() for t in tensors]
    seen = slow_copy(monkeypatch)
    st = eng.save(2, shards)
    with torch.no_grad():                # the optimizer step right after save() returns
        for t in tensors:
            t.mul_(3)
    done = eng.wait()
    eng.finalize()
    assert not st.live and st.bytes_written > 20 << 20
    # the disk had pieces while the copy was still running: the writer did not wait for its end
    assert any(d < total for d, total in seen), seen[:5]
    assert done.durable_s > 0
    assert verify(assert_loads(root, want, 2).step_dir) == []


def test_a_copy_that_fails_fails_the_save_on_the_training_thread_and_in_the_writer(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    shards, tensors = state()
    eng = CheckpointEngine(root)
    eng.save(1, shards)
    eng.wait()
    slow_copy(monkeypatch, fail_at=4)
    with pytest.raises(MemoryError, match="injected"):
        eng.save(2, shards)
    with pytest.raises(AsyncSaveError, match="the snapshot copy into the staging buffer failed"):
        eng.wait()
    assert [s for s, _ in commit_mod.list_committed(root)] == [1]   # nothing of step 2
    monkeypatch.undo()
    want = [t.clone() for t in tensors]
    eng.save(3, shards)                  # the engine goes on
    eng.wait()
    eng.finalize()
    assert_loads(root, want, 3)
