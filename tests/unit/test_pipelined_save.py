"""The writer follows the snapshot copy (``StageProgress``): a save to POSIX storage hands the job
to the writer before the copy into the staging buffer ends, and the writer reads no byte of the
buffer before the copy has made it final. Checked against the tensors themselves (bit for bit,
read back by the engine and by the safetensors library), with the copy slowed down so that the
writer is ahead of it, over a staging buffer that still holds the previous save's bytes."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import staging as staging_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.errors import AsyncSaveError


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 2 MiB each: "w" and "v" are stored as column tiles (the writer gathers their rows), "b" flat
    return {"w": torch.randn(256, 2048, generator=g), "v": torch.randn(512, 1024, generator=g),
            "b": torch.randn(300_001, generator=g)}


def _load(eng, root, names_shapes) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(s) for n, s in names_shapes.items()}
    eng.load(None, [full_shard(n, t) for n, t in out.items()])
    return out


def test_the_writer_starts_during_the_copy_and_waits_for_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(staging_mod.StagingBuffer, "PIPE_PIECE", 256 * 1024)
    asked_early = threading.Event()   # the writer asked for bytes the copy had not finished
    calls: list[tuple[int, int]] = []
    orig_wait, orig_advance = staging_mod.StageProgress.wait_addr, staging_mod.StageProgress.advance

    def wait_addr(self, end_addr):
        need = min(end_addr - self.base, self.total)
        if 0 < end_addr - self.base <= self.total and self.done < need:
            asked_early.set()
        orig_wait(self, end_addr)
        calls.append((need, self.done))   # what it asked for, what was final when it went on

    def advance(self, pos):
        time.sleep(0.01)   # a slow copy: the writer catches up with it and must wait
        orig_advance(self, pos)
    monkeypatch.setattr(staging_mod.StageProgress, "wait_addr", wait_addr)
    monkeypatch.setattr(staging_mod.StageProgress, "advance", advance)
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root)
    first, second = _tensors(1), _tensors(2)
    eng.save(1, [full_shard(n, t) for n, t in first.items()])
    eng.wait()
    asked_early.clear()
    calls.clear()
    # the same buffer again, with other values: a writer running ahead would write step 1's bytes
    st = eng.save(2, [full_shard(n, t) for n, t in second.items()])
    eng.wait()
    assert asked_early.is_set(), "the writer never asked for bytes before the copy finished them"
    assert calls and all(done >= need for need, done in calls)
    assert st.stall_s > 0
    got = _load(eng, root, {n: t.shape for n, t in second.items()})
    for n, t in second.items():
        assert torch.equal(got[n], t), n
    # the library's own reader of the rank's data file: the same values (a tile is a column block)
    step = os.path.join(root, commit_mod.step_dirname(2))
    data = load_file(os.path.join(step, next(f for f in os.listdir(step) if f.endswith(".safetensors"))))
    b = np.concatenate([v for k, v in sorted(data.items()) if k.startswith("b")])
    assert np.array_equal(b, second["b"].numpy())
    wcols = sorted((k, v) for k, v in data.items() if k.startswith("w"))
    assert sum(v.size for _, v in wcols) == second["w"].numel() and len(wcols) > 1   # tiled
    eng.finalize()


def test_a_failed_copy_fails_the_save_and_the_next_one_works(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root)
    first = _tensors(1)
    eng.save(1, [full_shard(n, t) for n, t in first.items()])
    eng.wait()
    orig_run = staging_mod.StagingBuffer.run

    def failing_run(self, prog, progress):
        progress.advance(4096)
        err = MemoryError("injected: the copy into the staging buffer failed")
        progress.fail(err)
        raise err
    monkeypatch.setattr(staging_mod.StagingBuffer, "run", failing_run)
    second = _tensors(2)
    with pytest.raises(MemoryError, match="injected"):
        eng.save(2, [full_shard(n, t) for n, t in second.items()])
    with pytest.raises(AsyncSaveError, match="snapshot copy into the staging buffer failed"):
        eng.wait()
    assert commit_mod.read_latest(root).endswith(commit_mod.step_dirname(1))
    assert not os.path.exists(os.path.join(root, commit_mod.step_dirname(2)))
    monkeypatch.setattr(staging_mod.StagingBuffer, "run", orig_run)
    third = _tensors(3)
    eng.save(3, [full_shard(n, t) for n, t in third.items()])
    eng.wait()
    got = _load(eng, root, {n: t.shape for n, t in third.items()})
    assert all(torch.equal(got[n], t) for n, t in third.items())
    eng.finalize()
