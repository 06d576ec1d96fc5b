"""Column tiles cut by the writer (issue 23): the snapshot copies each box whole, row-major, and the
writer streams its column tiles with ``writev``. Oracles: the safetensors library reading the
file, slices of the source tensors, and ``zlib.crc32`` of prefixes of the contiguous bytes."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import torch
from safetensors.torch import load_file

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.fileformat import RowRuns, runs_cumulative_crcs, write_runs
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.verify import verify
from elastor_ds.layout.region import Region


def _prefix_crcs(data: bytes, block: int) -> list[int]:
    return [zlib.crc32(data[:min(len(data), e)]) for e in range(block, len(data) + block, block)]


def test_row_runs_crcs_and_writes_equal_the_contiguous_bytes(tmp_path):
    """Rows of 12 bytes, 20 bytes apart, blocks of 8 (a block spans two rows) and of 12 (a row is
    a block) and of 64: every cumulative CRC is zlib's CRC of the contiguous prefix, and the file
    written holds exactly the rows back to back (a pipe-free regular file: one writev)."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, size=20 * 9 + 7, dtype=np.uint8)
    runs = RowRuns(memoryview(base), 5, 9, 12, 20)
    want = b"".join(bytes(base[5 + r * 20:5 + r * 20 + 12]) for r in range(9))
    assert len(runs) == len(want) == 108
    for block in (8, 12, 64, 108, 4096):
        assert list(runs_cumulative_crcs(runs, block)) == _prefix_crcs(want, block), block
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_runs(fd, runs)
    finally:
        os.close(fd)
    assert path.read_bytes() == want


def test_a_box_of_tiles_is_snapshotted_whole_and_written_as_tiles(tmp_path):
    """A 2-D shard of 64 x 8192 fp32 (2 MiB: 8 column tiles) and a column slice of a wider tensor
    (a strided source, 4 tiles): the data file holds each tile's exact values (safetensors reads
    them), every file passes the full CRC verification, and a column-half load reads back exactly."""
    root = str(tmp_path / "ck")
    a = torch.randn(64, 8192)
    wide = torch.randn(64, 16384)
    b = wide[:, 4096:12288]                      # not contiguous: whole rows of it are 32 KiB runs
    shards = [TensorShard("a", (64, 8192), Region((0, 0), (64, 8192)), a),
              TensorShard("b", (64, 8192), Region((0, 0), (64, 8192)), b)]
    eng = CheckpointEngine(root)
    for step in (1, 2):                          # the second save reuses the cached copy program
        a.add_(1.0)
        b.add_(1.0)
        st = eng.save(step, shards)
        eng.wait()
        assert st.bytes_written == 2 * 64 * 8192 * 4
        # the staging buffer holds box a row-major, then box b row-major
        staged = eng.staging.buf[:st.bytes_written].view(torch.float32)
        assert torch.equal(staged[:64 * 8192].view(64, 8192), a)
        assert torch.equal(staged[64 * 8192:].view(64, 8192), b)
    step_dir = commit_mod.resolve(root)
    assert verify(step_dir) == []
    got = load_file(os.path.join(step_dir, "data_00000.safetensors"))
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    for name, src in (("a", a), ("b", b)):
        regions = [c["region"] for c in man["tensors"][name]["chunks"]]
        assert regions == [[[0, c], [64, 1024]] for c in range(0, 8192, 1024)]
        for (offs, sizes) in regions:
            assert torch.equal(got[f"{name}#{offs[0]},{offs[1]}"], src[:, offs[1]:offs[1] + sizes[1]])
    dst = torch.zeros(64, 4096)
    CheckpointEngine(root).load(None, [TensorShard("b", (64, 8192), Region((0, 4096), (64, 4096)), dst)])
    assert torch.equal(dst, b[:, 4096:])


def test_block_crcs_in_a_background_thread_pause_and_stay_exact():
    """Off the main thread, loops of small-block CRCs pause every GIL_PAUSE_BYTES (to hand the GIL
    to training): the values must not change. 3 MiB + 100 bytes, 4 KiB blocks, contiguous and as
    rows of 4 KiB 8 KiB apart; oracle: the standard zlib module, block by block."""
    import threading

    from elastor_ds.checkpoint import fileformat as ff

    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, size=(3 << 20) + 100, dtype=np.uint8)
    want, c = [], 0
    raw = data.tobytes()
    for i in range(0, len(raw), 4096):
        c = zlib.crc32(raw[i:i + 4096], c)
        want.append(c)
    wide = np.zeros(2 * len(data) + 8192, dtype=np.uint8)
    rows = len(data) // 4096
    for r in range(rows):
        wide[r * 8192:r * 8192 + 4096] = data[r * 4096:(r + 1) * 4096]
    runs = RowRuns(memoryview(wide), 0, rows, 4096, 8192)
    got: dict = {}
    sleeps = []
    real_sleep = ff.time.sleep

    def worker():
        got["flat"] = ff.cumulative_crcs(memoryview(data), 4096)
        got["runs"] = ff.runs_cumulative_crcs(runs, 4096)
    ff.time.sleep = lambda s: (sleeps.append(s), real_sleep(s))
    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    finally:
        ff.time.sleep = real_sleep
    assert list(got["flat"]) == want
    assert list(got["runs"]) == want[:rows]
    assert len(sleeps) >= 2 * 2 and set(sleeps) == {ff.GIL_PAUSE_S}   # it did pause, both loops


def test_the_writer_thread_runs_at_a_lower_priority_and_bad_values_are_refused(tmp_path):
    """Linux: the background writer's nice value is the training thread's + writer_nice (read back
    with getpriority on its native id while it is alive); 0 leaves it equal; out-of-range values
    are refused with a message naming the value."""
    import sys
    import threading

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = torch.randn(8, 8)
    for inc, want in ((5, min(19, mine + 5)), (0, mine)):
        eng = CheckpointEngine(str(tmp_path / f"n{inc}"), writer_nice=inc)
        eng.save(1, [TensorShard("t", (8, 8), Region((0, 0), (8, 8)), t)])
        eng.wait()
        assert eng._thread is not None and eng._thread.is_alive()
        assert os.getpriority(os.PRIO_PROCESS, eng._thread.native_id) == want
        eng.finalize()
    for bad in (-1, 20):
        with pytest.raises(ValueError, match=f"writer_nice={bad}"):
            CheckpointEngine(str(tmp_path / "bad"), writer_nice=bad)
