"""Single-process engine behaviour: strided (row-parallel) reshard reads, casts, subsets, clear errors,
retention, and safetensors interoperability of the data files."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.errors import TensorMismatchError
from elastor_ds.layout.region import Region


def test_row_parallel_reshard_reads_exact_bytes(tmp_path):
    eng = CheckpointEngine(str(tmp_path))
    w = torch.randn(64, 4096)
    # saved as two row halves (two "ranks" worth of shards from one process)
    eng.save(1, [TensorShard("w", (64, 4096), Region((0, 0), (32, 4096)), w[:32]),
                 TensorShard("w", (64, 4096), Region((32, 0), (32, 4096)), w[32:])])
    eng.wait()
    # TP2 over columns (8 KiB runs of 16 KiB rows, block-aligned): one verified pread per row, the
    # needed bytes plus the block-CRC table entries (4 bytes per 4 KiB block) and nothing else
    dst = torch.zeros(64, 2048)
    res = eng.load(None, [TensorShard("w", (64, 4096), Region((0, 2048), (64, 2048)), dst)])
    assert torch.equal(dst, w[:, 2048:])
    table = (64 * 4 - 1) * 4  # entries 1..255 of 256 per chunk pair, contiguous over both chunks
    assert res.bytes_needed == 64 * 2048 * 4 and res.bytes_read <= res.bytes_needed + table
    # TP8 over columns of wide rows: the 2 MiB tensor was stored as 8 column tiles, so the slice is
    # one whole tile read contiguously (plus its 64 table entries)
    wide = torch.randn(64, 8192)
    eng.save(2, [full_shard("wide", wide)])
    eng.wait()
    dst8 = torch.zeros(64, 1024)
    res = eng.load(None, [TensorShard("wide", (64, 8192), Region((0, 3072), (64, 1024)), dst8)])
    assert torch.equal(dst8, wide[:, 3072:4096])
    assert res.bytes_needed == 64 * 1024 * 4
    assert res.bytes_read == res.bytes_needed + 64 * 4
    # non-contiguous destination (a transposed view) takes the staged path
    big = torch.zeros(2048, 64)
    eng.load(str(tmp_path / "step_000000001"), [TensorShard("w", (64, 4096), Region((0, 0), (64, 2048)), big.t())])
    assert torch.equal(big.t(), w[:, :2048])


def test_cast_subset_and_errors(tmp_path):
    eng = CheckpointEngine(str(tmp_path))
    a, b = torch.randn(10, 3), torch.randn(4)
    eng.save(5, [full_shard("a", a), full_shard("b", b)], extra={"it": 5})
    eng.wait()
    half = torch.zeros(10, 3, dtype=torch.bfloat16)
    with pytest.raises(TensorMismatchError, match="dtype float32 != destination bfloat16"):
        eng.load(None, [full_shard("a", half)])
    eng.load(None, [full_shard("a", half)], allow_cast=True)
    assert torch.equal(half, a.to(torch.bfloat16))
    with pytest.raises(TensorMismatchError, match=r"global shape \(10, 3\) != model \(10, 4\)"):
        eng.load(None, [full_shard("a", torch.zeros(10, 4))])
    with pytest.raises(TensorMismatchError, match="'c' is not in checkpoint"):
        eng.load(None, [full_shard("c", torch.zeros(1))])
    res = eng.load(None, [full_shard("c", torch.zeros(1)), full_shard("b", torch.zeros(4))], strict=False)
    assert res.extra == {"it": 5}


def test_retention_and_safetensors_interop(tmp_path):
    eng = CheckpointEngine(str(tmp_path), keep=2)
    t = torch.arange(12, dtype=torch.int32).view(3, 4)
    for step in (1, 2, 3):
        eng.save(step, [full_shard("t", t + step)])
        eng.wait()
    steps = [s for s, _ in commit_mod.list_committed(str(tmp_path))]
    assert steps == [2, 3]
    d = commit_mod.resolve(str(tmp_path))
    loaded = load_file(os.path.join(d, "data_00000.safetensors"))
    assert torch.equal(next(iter(loaded.values())), t + 3)


def test_crc32_combine_matches_zlib():
    import zlib

    from elastor_ds.checkpoint.storage import crc32_combine
    rng = torch.Generator().manual_seed(0)
    for n1, n2 in [(0, 5), (7, 0), (100, 1000), (1 << 20, 12345), (3, 1)]:
        a = torch.randint(0, 256, (n1,), generator=rng, dtype=torch.uint8).numpy().tobytes()
        b = torch.randint(0, 256, (n2,), generator=rng, dtype=torch.uint8).numpy().tobytes()
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
