"""Loads from memory (a tmpfs step directory, peer copies held here) run in cache-sized pieces
(issue 23: two ranks loading 256 MiB each from tmpfs took 2.4-2.5x the cached-read floor when each
8 MiB read was staged whole, then checked and copied).

- Bit-exact reshards through the piece path: dtypes of 1, 2, 4 and 8 bytes (bfloat16 included),
  1-, 2- and 3-D tensors, row and column splits, 4 KiB and 64 KiB CRC blocks, several piece sizes.
  The test's own source counts the data reads, so a load that quietly took the whole-read path
  fails here.
- A flipped byte in the memory copy: the load names the block that holds it, the destination
  element it belongs to never receives the bad value, and with storage behind the memory copy the
  load completes from storage.
- ``_piece_cuts`` on real load plans: every cut checked against the plan by brute force.

Oracles: the tensors that were saved (kept here), the manifest's chunk geometry (for where a byte
lands), and a brute-force check of the cut rules; never the reader's own account."""
from __future__ import annotations

import logging
import math
import os
import random
import shutil

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import reader as reader_mod
from elastor_ds.checkpoint.planning.load_plan import Request, plan_load
from elastor_ds.checkpoint.planning.manifest import DTYPE_SIZES, SNAPSHOT_BLOCK_SIZE
from elastor_ds.checkpoint.reader import read_shards
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.snapshot.peer_sources import COMPLETE, PEER_DIR, PeerCopySource
from elastor_ds.checkpoint.sources import LOCAL_MEMORY, STORAGE, DirSource
from elastor_ds.errors import CorruptCheckpointError
from elastor_ds.layout.region import Region

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

KIB = 1024


def _tensors() -> dict[str, torch.Tensor]:
    """Row halves of >= 1 MiB are stored as column tiles (``save_plan.column_tiles``), so a column
    half is a staged read of whole tiles (0.5-2 MiB): the reads the piece path cuts."""
    g = torch.Generator().manual_seed(23)
    return {
        "w32": torch.randn(512, 4096, generator=g),                                  # 4-byte: 2 MiB reads
        "bf16": torch.randn(256, 8192, generator=g).to(torch.bfloat16),              # 2-byte
        "i64": torch.randint(-2**40, 2**40, (64, 4096), generator=g),                # 8-byte
        "u8": torch.randint(0, 256, (256, 32768), generator=g, dtype=torch.uint8),   # 1-byte
        "odd": torch.randn(258, 6144, generator=g),   # tiles of 129 rows x 6 KiB: a short last block, rows off the grid
        "cube": torch.randn(8, 24, 1536, generator=g),                               # 3-D: strided reads
        "vec": torch.randn(300_000, generator=g),                                    # 1-D, 1.2 MB
    }


def _halves(shape: tuple[int, ...], dim: int, k: int) -> Region:
    offs = [0] * len(shape)
    sizes = list(shape)
    sizes[dim] = shape[dim] // 2
    offs[dim] = k * sizes[dim]
    return Region(tuple(offs), tuple(sizes))


def _save(root: str, ts: dict[str, torch.Tensor], block_size: int) -> str:
    """Each tensor saved as halves along dim 0 (two shards: two writers' worth of chunks)."""
    eng = CheckpointEngine(root, async_save=False, block_size=block_size)
    shards = []
    for name, t in ts.items():
        for k in range(2):
            r = _halves(tuple(t.shape), 0, k)
            shards.append(TensorShard(name, tuple(t.shape), r, t[tuple(slice(o, o + n) for o, n in
                                                                     zip(r.offsets, r.sizes))]))
    eng.save(1, shards)
    eng.wait()
    return commit_mod.resolve(root)


class _Counting(DirSource):
    """A local-memory source that records the length of every data-file read."""

    def __init__(self, step_dir: str, name: str = LOCAL_MEMORY):
        super().__init__(step_dir, name)
        self.lengths: list[int] = []
        self.reads: list[tuple[str, int, int]] = []

    def read_into(self, relpath, offset, views):
        if relpath.endswith(".safetensors"):
            n = sum(len(v) for v in views)
            self.lengths.append(n)
            self.reads.append((relpath, offset, n))
        return super().read_into(relpath, offset, views)


def _load(step: str, ts: dict[str, torch.Tensor], dim: int, sources) -> dict[str, torch.Tensor]:
    """Every tensor's half ``1`` along ``dim`` (the last dim for 1-D: dim 0), NaN/garbage-filled first."""
    man = commit_mod.read_manifest(step)
    out, shards = {}, []
    for name, t in ts.items():
        d = min(dim, t.dim() - 1)
        r = _halves(tuple(t.shape), d, 1)
        dst = torch.full(r.sizes, 7, dtype=t.dtype) if not t.is_floating_point() else \
            torch.full(r.sizes, float("nan"), dtype=t.dtype)
        out[name] = dst
        shards.append(TensorShard(name, tuple(t.shape), r, dst))
    read_shards(step, man, shards, sources=sources)
    return out


def _expect(t: torch.Tensor, dim: int) -> torch.Tensor:
    d = min(dim, t.dim() - 1)
    r = _halves(tuple(t.shape), d, 1)
    return t[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.sizes))]


@pytest.mark.parametrize("block_size", [4 * KIB, SNAPSHOT_BLOCK_SIZE])
@pytest.mark.parametrize("piece", [16 * KIB, 72 * KIB, 1 << 20])
@pytest.mark.parametrize("dim", [1, 2])
def test_memory_loads_in_pieces_are_bit_exact(tmp_path, monkeypatch, block_size, piece, dim):
    monkeypatch.setattr(reader_mod, "MEMORY_PIECE", piece)
    ts = _tensors()
    step = _save(str(tmp_path / "ck"), ts, block_size)
    src = _Counting(step)
    got = _load(step, ts, dim, [src])
    for name, t in ts.items():
        assert torch.equal(got[name].view(torch.uint8) if t.dtype == torch.bfloat16 else got[name],
                           _expect(t, dim).view(torch.uint8) if t.dtype == torch.bfloat16 else _expect(t, dim)), name
    man = commit_mod.read_manifest(step)
    reqs = [Request(n, _halves(tuple(t.shape), min(dim, t.dim() - 1), 1), i) for i, (n, t) in enumerate(ts.items())]
    ops = [op for op in plan_load(man.tensors, reqs).reads]
    big = [op for op in ops if op.length >= 2 * piece and op.repeat == 1]
    assert big, "the layout has no read long enough to be cut: the test tests nothing"
    assert sum(src.lengths) == sum(op.length * op.repeat for op in ops)   # every planned byte read once
    # each long read is read whole (straight into a destination) or in pieces that tile it; where
    # it is whole tiles, each piece is under two pieces plus the grid where block ends meet row
    # starts (elsewhere a row that starts off the block grid may make a piece longer)
    cut = 0
    for op in big:
        got = sorted((o, n) for f, o, n in src.reads if f == op.file and op.offset <= o < op.offset + op.length)
        if got == [(op.offset, op.length)]:
            continue
        cut += 1
        assert [o for o, _ in got] == [op.offset + sum(n for _, n in got[:i]) for i in range(len(got))], got
        assert sum(n for _, n in got) == op.length
        if all(len(c.sizes) == 2 and c.contiguous for c in op.copies):
            # whole tiles: a cut can go wherever a block end meets a row start
            grid = math.lcm(block_size, *(c.src_strides[0] * c.itemsize for c in op.copies))
            assert max(n for _, n in got) < 2 * piece + grid, got
    assert cut, "no read was cut into pieces"
    src.close()


def test_pieces_cast_and_fill_parameters(tmp_path, monkeypatch):
    """Through the piece path: a bfloat16 checkpoint into float32 destinations (``allow_cast``,
    torch's converting copy), and destinations that are parameters requiring grad."""
    monkeypatch.setattr(reader_mod, "MEMORY_PIECE", 32 * KIB)
    ts = {n: t for n, t in _tensors().items() if n in ("bf16", "w32")}
    step = _save(str(tmp_path / "ck"), ts, 4 * KIB)
    man = commit_mod.read_manifest(step)
    cast = torch.full((256, 4096), float("nan"))                               # bf16 [256, 8192] -> fp32
    param = torch.nn.Parameter(torch.full((512, 2048), float("nan")))          # fp32, requires grad
    src = _Counting(step)
    read_shards(step, man, [TensorShard("bf16", (256, 8192), Region((0, 4096), (256, 4096)), cast),
                            TensorShard("w32", (512, 4096), Region((0, 2048), (512, 2048)), param)],
                allow_cast=True, sources=[src])
    src.close()
    assert torch.equal(cast, ts["bf16"][:, 4096:].float())
    assert torch.equal(param.detach(), ts["w32"][:, 2048:]) and param.requires_grad
    assert max(src.lengths) < 2 * 32 * KIB + 4 * KIB   # read in pieces


def test_row_halves_from_memory_land_straight_in_the_destinations(tmp_path, monkeypatch):
    """Row halves saved, row halves loaded: each read lands in its destination as it is (no piece
    buffer to pass through), one read per planned read."""
    monkeypatch.setattr(reader_mod, "MEMORY_PIECE", 16 * KIB)
    g = torch.Generator().manual_seed(3)   # halves under 1 MiB: not cut into column tiles
    ts = {"w": torch.randn(64, 2048, generator=g), "v": torch.randn(100_000, generator=g)}
    step = _save(str(tmp_path / "ck"), ts, 4 * KIB)
    src = _Counting(step)
    got = _load(step, ts, 0, [src])
    for name, t in ts.items():
        assert torch.equal(got[name].view(torch.uint8), _expect(t, 0).view(torch.uint8)), name
    man = commit_mod.read_manifest(step)
    reqs = [Request(n, _halves(tuple(t.shape), 0, 1), i) for i, (n, t) in enumerate(ts.items())]
    ops = plan_load(man.tensors, reqs).reads
    assert min(op.length for op in ops) >= 2 * 16 * KIB   # long enough to be cut, were they staged
    assert sorted(src.lengths) == sorted(op.length for op in ops)
    src.close()


def test_peer_copies_held_here_are_read_in_pieces(tmp_path, monkeypatch):
    """A peer copy held in this node's snapshot directory (``PeerCopySource``) is memory too."""
    monkeypatch.setattr(reader_mod, "MEMORY_PIECE", 64 * KIB)
    ts = {n: t for n, t in _tensors().items() if n in ("w32", "u8")}   # tiled: a cut fits every block
    step = _save(str(tmp_path / "ck"), ts, SNAPSHOT_BLOCK_SIZE)
    held = tmp_path / "snap" / PEER_DIR / "node1" / os.path.basename(step)
    shutil.copytree(step, held)
    (held / COMPLETE).write_text("")

    class Counting(PeerCopySource):
        def __init__(self, *a):
            super().__init__(*a)
            self.lengths: list[int] = []

        def read_into(self, relpath, offset, views):
            if relpath.endswith(".safetensors"):
                self.lengths.append(sum(len(v) for v in views))
            return super().read_into(relpath, offset, views)
    src = Counting(str(tmp_path / "snap"), os.path.basename(step))
    got = _load(step, ts, 1, [src])
    for name, t in ts.items():
        assert torch.equal(got[name].view(torch.uint8), _expect(t, 1).view(torch.uint8)), name
    assert src.bytes_read > 0 and max(src.lengths) <= 2 * 64 * KIB + SNAPSHOT_BLOCK_SIZE
    # w32's column half alone is 4 MiB: in pieces, that is dozens of reads
    assert len(src.lengths) > 32


def test_storage_sources_keep_whole_reads(tmp_path, monkeypatch):
    """Storage is read whole (O_DIRECT or buffered, checked on the verify thread): not in pieces."""
    monkeypatch.setattr(reader_mod, "MEMORY_PIECE", 16 * KIB)
    ts = _tensors()
    step = _save(str(tmp_path / "ck"), ts, 4 * KIB)
    src = _Counting(step, STORAGE)
    got = _load(step, ts, 1, [src])
    for name, t in ts.items():
        assert torch.equal(got[name].view(torch.uint8), _expect(t, 1).view(torch.uint8)), name
    # column halves of the tiled tensors: whole reads of 0.5-2 MiB, never 16 KiB pieces
    assert max(src.lengths) > 2 * 16 * KIB
    src.close()


def _element_of_byte(man, fname: str, off: int) -> tuple[str, tuple[int, ...]]:
    """(tensor, global index) of the element that byte ``off`` of ``fname`` belongs to, from the
    manifest's chunk geometry (row-major chunks)."""
    for name, te in man.tensors.items():
        for c in te.chunks:
            if c.file == fname and c.offset <= off < c.offset + c.length:
                e = (off - c.offset) // DTYPE_SIZES[te.dtype]
                idx = []
                for n in reversed(c.region.sizes):
                    idx.append(e % n)
                    e //= n
                return name, tuple(o + i for o, i in zip(c.region.offsets, reversed(idx)))
    raise AssertionError(f"byte {off} of {fname} is in no chunk")


@pytest.mark.parametrize("block_size", [4 * KIB, SNAPSHOT_BLOCK_SIZE])
def test_flipped_byte_in_memory_copy(tmp_path, monkeypatch, caplog, block_size):
    monkeypatch.setattr(reader_mod, "MEMORY_PIECE", 32 * KIB)
    ts = {"w32": _tensors()["w32"]}
    good = _save(str(tmp_path / "ck"), ts, block_size)
    mem = str(tmp_path / "shm" / os.path.basename(good))
    shutil.copytree(good, mem)
    man = commit_mod.read_manifest(good)
    fname = sorted(f for f in os.listdir(mem) if f.endswith(".safetensors"))[0]
    # a byte of a chunk the column-half load needs, well inside the data (not its first piece)
    cands = [c for c in man.tensors["w32"].chunks if c.file == fname and c.region.offsets[1] >= 2048]
    chunk = cands[len(cands) // 2]
    flip = chunk.offset + chunk.length // 2 + 5
    with open(os.path.join(mem, fname), "r+b") as f:
        f.seek(flip)
        b = f.read(1)
        f.seek(flip)
        f.write(bytes([b[0] ^ 0x40]))
    name, gidx = _element_of_byte(man, fname, flip)
    assert name == "w32" and gidx[1] >= 2048
    didx = (gidx[0], gidx[1] - 2048)   # in the column half [512, 2048:4096]

    # memory only: the load fails naming the block, and the bad element never lands
    dst = torch.full((512, 2048), float("nan"))
    src = DirSource(mem, LOCAL_MEMORY)
    with pytest.raises(CorruptCheckpointError) as ei:
        read_shards(mem, man, [TensorShard("w32", (512, 4096), Region((0, 2048), (512, 2048)), dst)], sources=[src])
    src.close()
    msg = str(ei.value)
    assert f"{block_size}-byte block at byte " in msg, msg
    at = int(msg.split(f"{block_size}-byte block at byte ")[1].split()[0])
    assert at <= flip < at + block_size and (at - chunk.offset) % block_size == 0, (at, flip)
    assert torch.isnan(dst[didx]), "the element of the corrupt block was copied before its check"

    # memory first, storage behind it: the file is read again from storage, bit exact
    caplog.set_level(logging.WARNING)
    dst = torch.full((512, 2048), float("nan"))
    srcs = [DirSource(mem, LOCAL_MEMORY), DirSource(good, STORAGE)]
    read_shards(mem, man, [TensorShard("w32", (512, 4096), Region((0, 2048), (512, 2048)), dst)], sources=srcs)
    for s in srcs:
        s.close()
    assert torch.equal(dst, ts["w32"][:, 2048:])
    assert any("reading it from storage" in r.getMessage() for r in caplog.records)


def _cut_ok(op, p: int) -> bool:
    """Brute force: a cut at ``p`` splits no check off a block end and no copy inside a row."""
    for chk in op.checks:
        s0 = chk.offset - op.offset
        if s0 < p < s0 + chk.length:
            if chk.table is None or (p - s0) % chk.block_size:
                return False
    for c in op.copies:
        s0 = c.buf_offset
        span = (sum((n - 1) * s for n, s in zip(c.sizes, c.src_strides)) + 1) * c.itemsize if c.sizes else c.itemsize
        if s0 < p < s0 + span:
            row = c.src_strides[0] * c.itemsize
            if not c.sizes or c.sizes[0] <= 1 or (p - s0) % row:
                return False
    return True


def test_piece_cuts_respect_blocks_and_rows(tmp_path):
    rng = random.Random(7)
    ts = _tensors()
    step = _save(str(tmp_path / "ck"), ts, 4 * KIB)
    man = commit_mod.read_manifest(step)
    seen = 0
    for trial in range(60):
        reqs = []
        for i, (n, t) in enumerate(ts.items()):
            d = rng.randrange(t.dim())
            parts = rng.choice([2, 3, 4])
            size = t.shape[d] // parts
            k = rng.randrange(parts)
            offs = [0] * t.dim()
            sizes = list(t.shape)
            offs[d], sizes[d] = k * size, size
            reqs.append(Request(n, Region(tuple(offs), tuple(sizes)), i))
        piece = rng.choice([8 * KIB, 20 * KIB, 64 * KIB, 100 * KIB])
        for op in plan_load(man.tensors, reqs).reads:
            cuts = reader_mod._piece_cuts(op, piece)
            if cuts is None:
                continue
            seen += 1
            assert cuts[0] == 0 and cuts[-1] == op.length
            assert all(a < b for a, b in zip(cuts, cuts[1:]))
            assert all(_cut_ok(op, p) for p in cuts[1:-1]), (op, cuts)
    assert seen > 50
