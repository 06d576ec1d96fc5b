"""Load planning: which bytes of which files fill which parts of the requested shards, and which
block checksums prove those bytes.

Given the manifest and the regions this rank needs (one per destination shard), intersect each
request with the saved chunks (all regions of the same global tensor) and emit byte-range reads:

1. For every (request, chunk) overlap, the needed sub-box of the chunk is a set of contiguous
   runs in the file (row-major). With verification on, every run is widened to the chunk's CRC
   block boundaries (format 2: fixed-size blocks; format 1: the whole chunk), so each read covers
   whole blocks and carries a :class:`Check` per run: the bytes read must reproduce the chunk's
   cumulative block CRCs. Nothing is read that is not verified.
2. Runs along dim 0 (a TP split on dim 1) become one strided op (a pread per row) when the widened
   runs leave gaps; when the widened runs touch, covering reads in groups of rows.
3. Reads are sorted by (file, offset) and coalesced when they overlap or touch, so each byte is
   read once and sequentially; a merged read carries all its copies and checks.
4. A copy says where its elements sit in the read buffer (offset + element strides) and which
   box of the destination shard they fill. The executor reads straight into destination memory
   when the copies tile the read exactly and are contiguous, otherwise through a staging buffer.

Pure: no torch, no I/O.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ...errors import TensorMismatchError
from ...layout.region import Region, contiguous_strides
from .manifest import DTYPE_SIZES, Chunk, TensorEntry


@dataclass(frozen=True)
class Request:
    """Destination ``target`` needs ``region`` of tensor ``name`` (destination shape == region.sizes)."""

    name: str
    region: Region
    target: int


@dataclass(frozen=True)
class Copy:
    target: int
    buf_offset: int              # bytes from the start of the read
    sizes: tuple[int, ...]
    src_strides: tuple[int, ...]  # element strides within the read buffer
    dst: Region                  # box inside the destination shard
    itemsize: int
    dtype: str
    file: str = ""

    @property
    def contiguous(self) -> bool:
        return self.src_strides == contiguous_strides(self.sizes) or _numel(self.sizes) <= 1

    @property
    def nbytes(self) -> int:
        return _numel(self.sizes) * self.itemsize


@dataclass(frozen=True)
class Check:
    """Bytes ``[offset, offset + length)`` of ``file`` are blocks ``first .. first + count - 1`` of a
    chunk of ``tensor`` whose table entries start at ``base`` in ``table``: their CRC32 seeded with
    entry ``base + first - 1`` (0 when ``first`` is 0) must equal entry ``base + first + count - 1``.
    Without a table (format 1) the bytes are a whole chunk whose CRC32 must be ``crc``."""

    offset: int
    length: int
    tensor: str
    file: str
    table: Optional[str]
    base: int = 0
    first: int = 0
    count: int = 0
    crc: Optional[int] = None
    block_size: int = 0

    def entries(self, k: int = 0, step: int = 0) -> tuple[int, int]:
        """(seed entry or -1, expected entry) of this check shifted by ``k`` runs of ``step`` blocks."""
        first = self.first + k * step
        return (self.base + first - 1 if first > 0 else -1), self.base + first + self.count - 1


@dataclass(frozen=True)
class ReadOp:
    """Read ``length`` bytes at ``offset`` (``repeat`` times, ``stride`` bytes apart: a strided op
    reads the same-sized run of every outer row of a 2-D-like box; its one copy's ``dst`` is the
    whole box and run ``k`` fills row ``k`` of it). ``checks`` verify the bytes read; for a strided
    op they describe run 0 and run ``k``'s are shifted by ``k * stride`` bytes and
    ``k * check_step`` table entries."""

    file: str
    offset: int
    length: int
    copies: tuple[Copy, ...]
    repeat: int = 1
    stride: int = 0
    checks: tuple[Check, ...] = ()
    check_step: int = 0


@dataclass(frozen=True)
class LoadPlan:
    reads: tuple[ReadOp, ...]

    @property
    def bytes_read(self) -> int:
        return sum(r.length * r.repeat for r in self.reads)

    @property
    def bytes_needed(self) -> int:
        return sum(c.nbytes for r in self.reads for c in r.copies)

    @property
    def table_bytes(self) -> int:
        """Bytes of block-CRC tables the checks read."""
        return sum((hi - lo + 1) * 4 for lo, hi in self.table_ranges().values())

    def table_ranges(self) -> dict[str, tuple[int, int]]:
        """Per CRC table, the lowest and highest entry the checks use."""
        out: dict[str, tuple[int, int]] = {}
        for r in self.reads:
            for c in r.checks:
                if c.table is None:
                    continue
                seed, _ = c.entries()
                _, hi = c.entries(max(0, r.repeat - 1), r.check_step)
                lo = seed if seed >= 0 else c.base
                cur = out.get(c.table)
                out[c.table] = (lo, hi) if cur is None else (min(cur[0], lo), max(cur[1], hi))
        return out


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def plan_load(tensors: Mapping[str, TensorEntry], requests: Sequence[Request], run_threshold: int = 4096,
              max_merge: int = 256 * 1024 * 1024, verify: bool = True) -> LoadPlan:
    """The reads that fill ``requests``; with ``verify`` every byte read is covered by a check."""
    raw: list[ReadOp] = []
    for req in requests:
        entry = tensors.get(req.name)
        if entry is None:
            raise TensorMismatchError(f"tensor {req.name!r} is not in the checkpoint; it has "
                                      f"{len(tensors)} tensors (see `elastor inspect`). Load a subset "
                                      f"(names=...) or check the parameter naming")
        if not Region.full(entry.shape).contains(req.region):
            raise TensorMismatchError(f"tensor {req.name}: requested {req.region} lies outside the saved global "
                                      f"shape {entry.shape}; the model config differs from the checkpoint's")
        itemsize = DTYPE_SIZES[entry.dtype]
        covered = 0
        for ch in entry.chunks:
            inter = ch.region.intersect(req.region)
            if inter is None:
                continue
            covered += inter.numel
            raw.extend(_ChunkReads(ch, entry, inter, req, itemsize, verify).ops(run_threshold))
        if covered != req.region.numel:
            raise TensorMismatchError(f"tensor {req.name}: the checkpoint covers {covered} of the {req.region.numel} "
                                      f"elements of {req.region}; the checkpoint is incomplete")
    return LoadPlan(tuple(_coalesce(raw, max_merge)))


class _ChunkReads:
    """The reads (and checks) that bring one request's overlap with one chunk into memory."""

    GROUP_BYTES = 16 * 1024 * 1024  # covering reads go in groups of rows of about this size

    def __init__(self, ch: Chunk, entry: TensorEntry, inter: Region, req: Request, itemsize: int, verify: bool):
        self.ch, self.entry, self.req, self.itemsize = ch, entry, req, itemsize
        self.sub = inter.relative_to(ch.region)
        self.dst = inter.relative_to(req.region)
        self.strides = contiguous_strides(ch.region.sizes)
        if not verify or (ch.blocks is None and ch.crc32 is None):
            self.block = 0                      # no check: read exactly what is needed
        elif ch.blocks is not None:
            self.block = ch.blocks.size
        else:
            self.block = max(1, ch.length)      # format 1: only the whole chunk can be checked

    # -- byte ranges within the chunk
    def widen(self, s: int, e: int) -> tuple[int, int]:
        b = self.block
        if not b:
            return s, e
        return s // b * b, min(-(-e // b) * b, self.ch.length)

    def check(self, ws: int, we: int) -> tuple[Check, ...]:
        ch = self.ch
        if not self.block or we <= ws:
            return ()
        off = ch.offset + ws
        if ch.blocks is None:
            return (Check(off, we - ws, self.entry.name, ch.file, None, crc=ch.crc32, block_size=ch.length),)
        b = self.block
        return (Check(off, we - ws, self.entry.name, ch.file, ch.blocks.table, ch.blocks.index, ws // b,
                      -(-we // b) - ws // b, None, b),)

    def op(self, s: int, e: int, sizes: tuple[int, ...], dbox: Region, src_strides: tuple[int, ...]) -> ReadOp:
        """One read covering needed bytes ``[s, e)`` of the chunk (widened to blocks)."""
        ws, we = self.widen(s, e)
        ch = self.ch
        return ReadOp(ch.file, ch.offset + ws, we - ws,
                      (Copy(self.req.target, s - ws, sizes, src_strides, dbox, self.itemsize, self.entry.dtype,
                            ch.file),), checks=self.check(ws, we))

    def ops(self, run_threshold: int) -> list[ReadOp]:
        sub, strides, it, nd = self.sub, self.strides, self.itemsize, self.ch.region.ndim
        d_star = 0
        for d in range(nd - 1, -1, -1):
            if sub.sizes[d] != self.ch.region.sizes[d]:
                d_star = d
                break
        outer = _numel(sub.sizes[:d_star]) if nd else 1
        run = (_numel(sub.sizes[d_star:]) if nd else 1) * it
        first = sum(o * s for o, s in zip(sub.offsets, strides)) * it
        last = first + sum((n - 1) * s for n, s in zip(sub.sizes, strides)) * it + it
        if self.block and self.ch.blocks is None:  # format 1: read and check the whole chunk
            return [self.op(first, last, sub.sizes, self.dst, strides)]
        if outer > 1 and d_star == 1:
            return self._rows(first, run, run_threshold)
        if outer > 1 and run >= run_threshold:
            out = []
            for idx in itertools.product(*[range(s) for s in sub.sizes[:d_star]]):
                offs = tuple(o + i for o, i in zip(sub.offsets[:d_star], idx)) + sub.offsets[d_star:]
                s0 = sum(o * s for o, s in zip(offs, strides)) * it
                sizes = (1,) * d_star + sub.sizes[d_star:]
                dbox = Region(tuple(o + i for o, i in zip(self.dst.offsets[:d_star], idx)) + self.dst.offsets[d_star:],
                              sizes)
                out.append(self.op(s0, s0 + run, sizes, dbox, contiguous_strides(sizes)))
            return out
        return [self.op(first, last, sub.sizes, self.dst, strides)]

    def _rows(self, first: int, run: int, run_threshold: int) -> list[ReadOp]:
        """The needed bytes are ``rows`` runs of ``run`` bytes, one per row of ``row`` bytes."""
        sub, strides, it, ch = self.sub, self.strides, self.itemsize, self.ch
        rows, row = sub.sizes[0], strides[0] * it
        ws0, we0 = self.widen(first, first + run)
        ws1, _ = self.widen(first + row, first + row + run)
        touching = ws1 <= we0
        if not self.block:
            touching = run * 4 >= row and run >= 512 or run < run_threshold  # dense: covering reads
        if touching:  # covering reads in groups of rows
            per = max(1, self.GROUP_BYTES // row)
            out = []
            for r0 in range(0, rows, per):
                n = min(per, rows - r0)
                s = first + r0 * row
                e = s + (n - 1) * row + run
                sizes = (n,) + sub.sizes[1:]
                dbox = Region((self.dst.offsets[0] + r0,) + self.dst.offsets[1:], sizes)
                out.append(self.op(s, e, sizes, dbox, strides))
            return out
        b = self.block
        if b and (row % b or ws0 != (first // b) * b):  # rows not block-aligned alike: one op per row
            out = []
            for k in range(rows):
                sizes = (1,) + sub.sizes[1:]
                dbox = Region((self.dst.offsets[0] + k,) + self.dst.offsets[1:], sizes)
                out.append(self.op(first + k * row, first + k * row + run, sizes, dbox, contiguous_strides(sizes)))
            return out
        copy = Copy(self.req.target, first - ws0, sub.sizes, contiguous_strides(sub.sizes), self.dst, it,
                    self.entry.dtype, ch.file)
        return [ReadOp(ch.file, ch.offset + ws0, we0 - ws0, (copy,), repeat=rows, stride=row,
                       checks=self.check(ws0, we0), check_step=row // b if b else 0)]


def _coalesce(ops: list[ReadOp], max_merge: int) -> list[ReadOp]:
    ops.sort(key=lambda o: (o.file, o.offset, o.length))
    out: list[ReadOp] = []
    for op in ops:
        if out and op.repeat == 1 and out[-1].repeat == 1:
            cur = out[-1]
            end = cur.offset + cur.length
            if (op.file == cur.file and op.offset <= end
                    and max(end, op.offset + op.length) - cur.offset <= max_merge):
                shift = op.offset - cur.offset
                copies = cur.copies + tuple(Copy(c.target, c.buf_offset + shift, c.sizes, c.src_strides, c.dst,
                                                 c.itemsize, c.dtype, c.file) for c in op.copies)
                checks = cur.checks + op.checks
                out[-1] = ReadOp(cur.file, cur.offset, max(end, op.offset + op.length) - cur.offset, copies,
                                 checks=checks)
                continue
        out.append(op)
    return out
