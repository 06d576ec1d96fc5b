"""Block CRCs taken during the snapshot copy (staging.BlockCrcs, StagingBuffer.snapshot(block_crcs=))
equal the writer's own pass over the buffer (fileformat.cumulative_crcs): any span sizes (empty,
under, at and over a block), any feeding pieces; and a memory snapshot written that way reads back
and passes full verification."""
import random

import numpy as np
import pytest
import torch

from elastor_ds.checkpoint.fileformat import cumulative_crcs
from elastor_ds.checkpoint.staging import BlockCrcs, StagingBuffer


def _spans(sizes):
    out, pos = [], 0
    for n in sizes:
        out.append((pos, n))
        pos += n
    return out, pos


@pytest.mark.parametrize("seed", range(6))
def test_fed_in_any_pieces_equals_the_writers_pass(seed):
    rng = random.Random(seed)
    bs = rng.choice([16, 64, 4096])
    sizes = [rng.choice([0, 1, bs - 1, bs, bs + 1, 3 * bs, rng.randrange(1, 5 * bs)]) for _ in range(rng.randrange(1, 12))]
    spans, total = _spans(sizes)
    data = np.frombuffer(bytes(rng.getrandbits(8) for _ in range(total)), dtype=np.uint8)
    mv = memoryview(data)
    want = [cumulative_crcs(mv[p:p + n], bs) for p, n in spans]
    crcs = BlockCrcs(spans, bs, mv)
    pos = 0
    while pos < total:
        pos = min(total, pos + rng.randrange(1, 3 * bs))
        crcs.feed(pos)
    crcs.feed(total)
    assert crcs.result() == want


def test_unfed_spans_are_an_error():
    crcs = BlockCrcs([(0, 10), (10, 10)], 4, memoryview(bytes(20)))
    crcs.feed(12)
    with pytest.raises(AssertionError):
        crcs.result()


def test_snapshot_takes_the_block_crcs_of_what_it_copied():
    from elastor_ds.checkpoint.planning.save_plan import WriteItem
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.layout.region import Region

    flat = torch.randn(300_000)
    a, b = flat[:200_000].view(400, 500), flat[200_000:].view(200, 500)   # adjacent: one merged copy
    c = torch.randn(70, 10)[:, 2:7]                                        # a column tile (2-D copy)
    shards = [TensorShard("a", (400, 500), Region((0, 0), (400, 500)), a),
              TensorShard("b", (200, 500), Region((0, 0), (200, 500)), b),
              TensorShard("c", (70, 5), Region((0, 0), (70, 5)), c)]
    items = [WriteItem("a", Region((0, 0), (400, 500)), 0, "float32"), WriteItem("b", Region((0, 0), (200, 500)), 1, "float32"),
             WriteItem("c", Region((0, 0), (70, 5)), 2, "float32")]
    dst = torch.empty(sum(it.nbytes for it in items), dtype=torch.uint8)
    sb = StagingBuffer(pin_memory=False)
    sb.CRC_PIECE = 100_000   # pieces that cut blocks and runs at odd places
    for _ in range(2):
        flat.add_(1.0)
        spans = sb.snapshot(items, shards, buf=dst, block_crcs=65536)
        mv = memoryview(dst.numpy())
        assert sb.block_tables == [cumulative_crcs(mv[p:p + n], 65536) for p, n in spans]
    # a copy program with torch's strided copies runs out of buffer order: no tables, the writer computes them
    d = torch.randn(6, 6).to(torch.bfloat16).t()
    shards.append(TensorShard("d", (6, 6), Region((0, 0), (6, 6)), d))
    items2 = [*items, WriteItem("d", Region((0, 0), (6, 6)), 3, "bfloat16")]
    dst2 = torch.empty(sum(it.nbytes for it in items2), dtype=torch.uint8)
    sb.snapshot(items2, shards, buf=dst2, block_crcs=65536)
    assert sb.block_tables is None


def test_memory_snapshot_with_copy_time_crcs_verifies(tmp_path):
    from elastor_ds.checkpoint import CheckpointEngine
    from elastor_ds.checkpoint.planning.manifest import SNAPSHOT_BLOCK_SIZE
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.checkpoint.storage import TmpfsStorage
    from elastor_ds.checkpoint.verify import verify
    from elastor_ds.layout.region import Region

    root = str(tmp_path / "mem")
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, block_size=SNAPSHOT_BLOCK_SIZE)
    w = torch.randn(700, 300)
    e = torch.empty(0)
    shards = [TensorShard("w", (700, 300), Region((0, 0), (700, 300)), w), TensorShard("e", (0,), Region((0,), (0,)), e)]
    for step in (1, 2, 3):
        w.add_(1.0)
        eng.save(step, shards)
        eng.wait()
        assert eng.staging.block_tables is not None
    from elastor_ds.checkpoint import commit as commit_mod
    assert verify(commit_mod.resolve(root)) == []   # sizes and file CRCs
    out = torch.empty(700, 300)
    # every byte read is checked against its block CRC (the tables the copy took)
    eng.load(root, [TensorShard("w", (700, 300), Region((0, 0), (700, 300)), out)], strict=False,
             verify_checksums="chunks")
    assert torch.equal(out, w)
    eng.finalize()


def test_a_block_table_costs_about_four_bytes_an_entry_while_it_is_built():
    """A 4 KiB-block table has an entry per 4 KiB of data: as Python ints in a list (~36 bytes an
    entry) 256 MiB of data held ~2.3 MiB until the table file was written, a 17 GiB shard ~160 MiB.
    The writer's tables (flat and row-run buffers) and the snapshot copy's stay near 4 bytes an
    entry, and their values are the CRCs of the data's prefixes (zlib, block by block)."""
    import tracemalloc
    import zlib

    from elastor_ds.checkpoint.fileformat import RowRuns, runs_cumulative_crcs

    data = np.random.default_rng(7).integers(0, 256, size=(32 << 20) + 123, dtype=np.uint8)
    mv = memoryview(data)
    rows = len(data) // 4096
    c, want = 0, []   # the oracle: zlib over each 4 KiB block in turn (the last one short)
    for i in range(0, len(data), 4096):
        c = zlib.crc32(mv[i:i + 4096], c)
        want.append(c)
    bound = 8 * len(want) + (64 << 10)   # the array's growth slack and one piece's short list

    def traced(fn):
        tracemalloc.start()
        try:
            got = fn()
            return got, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    flat, peak = traced(lambda: cumulative_crcs(mv, 4096))
    assert peak < bound and list(flat) == want, ("flat", peak, bound)
    runs, peak = traced(lambda: runs_cumulative_crcs(RowRuns(mv, 0, rows, 4096, 4096), 4096))
    assert peak < bound and list(runs) == want[:rows], ("runs", peak, bound)

    def snapshot_copy():
        b = BlockCrcs([(0, len(data))], 4096, mv)
        for end in range(1 << 20, len(data) + (1 << 20), 1 << 20):
            b.feed(min(end, len(data)))
        return b.result()[0]
    table, peak = traced(snapshot_copy)
    assert peak < bound and list(table) == want, ("BlockCrcs", peak, bound)


def test_the_device_copy_program_merges_adjacent_items_and_copies_every_byte():
    """The device-to-host copy program (built once per plan; before it, every snapshot of CUDA
    shards looped over every item in Python on the training thread): items adjacent in one
    storage and in the buffer become one copy, a column tile and a transposed bfloat16 tensor are
    copied alone. Run here on CPU tensors (the same torch ``copy_`` calls a GPU runs with
    ``non_blocking``); oracle: each item's bytes taken from its source tensor directly."""
    from elastor_ds.checkpoint.planning.save_plan import WriteItem
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.checkpoint.staging import _DeviceCopyProgram
    from elastor_ds.layout.region import Region

    flat = torch.randn(300_000)                      # a ZeRO flat partition: four parameters in a row
    views = [flat[:100_000].view(200, 500), flat[100_000:150_000], flat[150_000:250_000].view(100, 1000),
             flat[250_000:].view(50, 1000)]
    c = torch.randn(70, 10)[:, 2:7]                  # a column tile
    d = torch.randn(6, 6).to(torch.bfloat16).t()     # any other strides
    srcs = [*views, c, d]
    shards = [TensorShard(f"t{i}", tuple(t.shape), Region.full(tuple(t.shape)), t) for i, t in enumerate(srcs)]
    items = [WriteItem(f"t{i}", Region.full(tuple(t.shape)), i, str(t.dtype).replace("torch.", ""))
             for i, t in enumerate(srcs)]
    buf = torch.zeros(sum(it.nbytes for it in items), dtype=torch.uint8)
    prog = _DeviceCopyProgram(items, shards, buf)
    assert len(prog.pairs) == 3                      # the four flat pieces as one copy, c, d
    for dst, src in prog.pairs:
        dst.copy_(src)
    want = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in srcs)
    assert buf.numpy().tobytes() == want
    assert [s[1] for s in prog.spans] == [it.nbytes for it in items]
    assert prog.valid_for(items, shards, buf) and not prog.valid_for(items, list(shards), buf)
