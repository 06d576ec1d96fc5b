"""Load planning: which bytes of which files fill which parts of the requested shards.

Given the manifest and the regions this rank needs (one per destination shard), intersect each
request with the saved chunks (all regions of the same global tensor) and emit byte-range reads:

1. For every (request, chunk) overlap, the needed sub-box of the chunk is a set of contiguous
   runs in the file (row-major). One contiguous span -> one read. Several runs along dim 0
   (a TP split on dim 1): dense runs (>= 1/4 of a row) -> sequential covering reads in blocks
   of rows (cold-cache readahead makes them faster than many small preads); sparse runs -> one
   strided op (a pread per run straight into the destination row). Otherwise one covering read.
2. Reads are sorted by (file, offset) and coalesced when they overlap or touch, so each needed
   byte is read once and sequentially; a merged read carries all its copies.
3. A copy says where its elements sit in the read buffer (offset + element strides) and which
   box of the destination shard they fill. The executor reads straight into destination memory
   when the copies tile the read exactly and are contiguous, otherwise through a staging buffer.

Pure: no torch, no I/O.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import TensorMismatchError
from ..layout.region import Region, contiguous_strides
from .manifest import DTYPE_SIZES, TensorEntry


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
    crc32: int | None = None     # set when the copy is one whole saved chunk (checked after reading)
    file: str = ""

    @property
    def contiguous(self) -> bool:
        return self.src_strides == contiguous_strides(self.sizes) or _numel(self.sizes) <= 1

    @property
    def nbytes(self) -> int:
        return _numel(self.sizes) * self.itemsize


@dataclass(frozen=True)
class ReadOp:
    """Read ``length`` bytes at ``offset`` (``repeat`` times, ``stride`` bytes apart: a strided op
    reads the same-sized run of every outer row of a 2-D-like box; its one copy's ``dst`` is the
    whole box and run ``k`` fills row ``k`` of it)."""

    file: str
    offset: int
    length: int
    copies: tuple[Copy, ...]
    repeat: int = 1
    stride: int = 0


@dataclass(frozen=True)
class LoadPlan:
    reads: tuple[ReadOp, ...]

    @property
    def bytes_read(self) -> int:
        return sum(r.length * r.repeat for r in self.reads)

    @property
    def bytes_needed(self) -> int:
        return sum(c.nbytes for r in self.reads for c in r.copies)


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def plan_load(tensors: Mapping[str, TensorEntry], requests: Sequence[Request],
              run_threshold: int = 4096, max_merge: int = 256 * 1024 * 1024) -> LoadPlan:
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
            raw.extend(_reads_for(ch.file, ch.offset, ch.region, inter, req, entry.dtype, itemsize, run_threshold,
                                  ch.crc32))
        if covered != req.region.numel:
            raise TensorMismatchError(f"tensor {req.name}: the checkpoint covers {covered} of the {req.region.numel} "
                                      f"elements of {req.region}; the checkpoint is incomplete")
    return LoadPlan(tuple(_coalesce(raw, max_merge)))


def _reads_for(file: str, chunk_off: int, chunk: Region, inter: Region, req: Request, dtype: str,
               itemsize: int, run_threshold: int, crc: int | None = None,
               block_bytes: int = 16 * 1024 * 1024) -> list[ReadOp]:
    sub = inter.relative_to(chunk)
    strides = contiguous_strides(chunk.sizes)
    dst = inter.relative_to(req.region)
    nd = chunk.ndim
    # d_star: first dim after which the sub-box spans the chunk fully
    d_star = 0
    for d in range(nd - 1, -1, -1):
        if sub.sizes[d] != chunk.sizes[d]:
            d_star = d
            break
    else:
        d_star = 0
    outer = _numel(sub.sizes[:d_star]) if nd else 1
    run_elems = _numel(sub.sizes[d_star:]) if nd else 1
    if outer > 1 and d_star == 1 and run_elems * 4 >= strides[0] and run_elems * itemsize >= 512:
        # dense runs (>= 1/4 of each row): sequential covering reads in blocks of rows beat
        # per-run preads (cold-cache readahead); at most 4x the needed bytes, usually 2x
        rows_per = max(1, block_bytes // (strides[0] * itemsize))
        ops = []
        for r0 in range(0, sub.sizes[0], rows_per):
            n = min(rows_per, sub.sizes[0] - r0)
            offs = (sub.offsets[0] + r0,) + sub.offsets[1:]
            first = sum(o * s for o, s in zip(offs, strides))
            sizes = (n,) + sub.sizes[1:]
            last = first + sum((k - 1) * s for k, s in zip(sizes, strides))
            dbox = Region((dst.offsets[0] + r0,) + dst.offsets[1:], sizes)
            ops.append(ReadOp(file, chunk_off + first * itemsize, (last - first + 1) * itemsize,
                              (Copy(req.target, 0, sizes, strides, dbox, itemsize, dtype, None, file),)))
        return ops
    if outer > 1 and run_elems * itemsize >= run_threshold and d_star == 1:
        start = sum(o * s for o, s in zip(sub.offsets, strides))
        return [ReadOp(file, chunk_off + start * itemsize, run_elems * itemsize,
                       (Copy(req.target, 0, sub.sizes, contiguous_strides(sub.sizes), dst, itemsize, dtype,
                             None, file),), repeat=outer, stride=strides[0] * itemsize)]
    if outer > 1 and run_elems * itemsize >= run_threshold:
        ops = []
        for idx in itertools.product(*[range(s) for s in sub.sizes[:d_star]]):
            offs = tuple(o + i for o, i in zip(sub.offsets[:d_star], idx)) + sub.offsets[d_star:]
            start = sum(o * s for o, s in zip(offs, strides))
            sizes = (1,) * d_star + sub.sizes[d_star:]
            dbox = Region(tuple(o + i for o, i in zip(dst.offsets[:d_star], idx)) + dst.offsets[d_star:], sizes)
            ops.append(ReadOp(file, chunk_off + start * itemsize, run_elems * itemsize,
                              (Copy(req.target, 0, sizes, contiguous_strides(sizes), dbox, itemsize, dtype),)))
        return ops
    first = sum(o * s for o, s in zip(sub.offsets, strides))
    last = first + sum((n - 1) * s for n, s in zip(sub.sizes, strides))
    whole = sub == Region.full(chunk.sizes)
    return [ReadOp(file, chunk_off + first * itemsize, (last - first + 1) * itemsize,
                   (Copy(req.target, 0, sub.sizes, strides, dst, itemsize, dtype,
                         crc if whole else None, file),))]


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
                                                 c.itemsize, c.dtype, c.crc32, c.file) for c in op.copies)
                out[-1] = ReadOp(cur.file, cur.offset, max(end, op.offset + op.length) - cur.offset, copies)
                continue
        out.append(op)
    return out
