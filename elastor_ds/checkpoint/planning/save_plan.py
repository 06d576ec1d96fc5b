"""Save planning: deduplicate what the ranks hold and pick exactly one writer per region.

Input: every rank's shard metadata (tensor name, global shape, dtype, held region). Output: a
:class:`SavePlan` listing, per rank, the regions it writes. The plan is a pure function of the
gathered metadata, so every rank computes the same plan (or rank 0 computes and broadcasts it).

Steps:
1. Group shards by tensor; check that all ranks agree on the global shape and dtype.
2. Units: if the distinct held regions of a tensor are pairwise disjoint (uniform layouts, ZeRO
   partitions) each distinct region is a unit held by the ranks that hold it; otherwise (replicas
   with different TP degrees hold overlapping regions) the tensor is cut into the grid of all
   region boundaries and each covered cell is a unit.
3. Coverage: every element of every tensor must be held by some rank, else :class:`ShardingError`.
4. Balanced choice (greedy LPT, deterministic): units sorted by bytes (descending), then tensor
   name, then offsets; each goes to the holder with the fewest bytes so far, ties to the lowest rank.
5. Cells that went to the same writer are merged back into larger boxes, dim by dim.
6. Column tiles: a written 2-D box of >= 1 MiB is stored as up to 8 column tiles, cut at global
   column multiples of ``cols / T`` (T in 8, 4, 2; tile rows >= 4 KiB). A later TP split of the
   columns (the usual reshard of a row-split save) then reads whole tiles, contiguously, instead of
   half of every row; a row split still reads one contiguous run per tile.

Pure: no torch, no I/O.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from ...errors import ShardingError
from ...layout.region import Region
from .manifest import DTYPE_SIZES, has_control_chars


@dataclass(frozen=True)
class ShardMeta:
    """What one rank holds of one tensor (metadata only)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    region: Region

    def to_tuple(self) -> tuple:
        return (self.name, self.shape, self.dtype, self.region.offsets, self.region.sizes)

    @staticmethod
    def from_tuple(t: Sequence) -> "ShardMeta":
        return ShardMeta(t[0], tuple(t[1]), t[2], Region(tuple(t[3]), tuple(t[4])))


def metas_to_text(metas: Sequence[ShardMeta]) -> str:
    """A rank's shard metadata as one JSON text, for the plan's all-gather: the object collectives'
    codec (:mod:`elastor_ds.comm.wire`) moves a str at memory speed, where its per-value Python
    encoding of the tuples cost ~10x pickle's time at thousands of shards."""
    return json.dumps([m.to_tuple() for m in metas], separators=(",", ":"))


def metas_from_text(text: str, rank: int) -> list[ShardMeta]:
    """:func:`metas_to_text`'s list back, checked for its shape (another rank's bytes: a malformed
    one is a :class:`ShardingError` naming ``rank``, never a crash in the planner)."""
    def bad(why: str) -> ShardingError:
        return ShardingError(f"rank {rank} sent shard metadata that is not valid ({why})")

    if not isinstance(text, str):
        raise bad(f"a {type(text).__name__}, not the JSON text")
    try:
        rows = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad(f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(rows, list):
        raise bad("not a list")
    out = []
    for t in rows:
        if not (isinstance(t, list) and len(t) == 5 and isinstance(t[0], str) and isinstance(t[2], str)
                and all(isinstance(v, list) and all(type(x) is int for x in v) for v in (t[1], t[3], t[4]))):
            raise bad(f"an entry {str(t)[:120]}")
        out.append(ShardMeta(t[0], tuple(t[1]), t[2], Region(tuple(t[3]), tuple(t[4]))))
    return out


@dataclass(frozen=True)
class WriteItem:
    """Rank writes ``region`` of tensor ``name``, taken from its local shard number ``shard``."""

    name: str
    region: Region
    shard: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.region.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class SavePlan:
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (global shape, dtype)
    items: tuple[tuple[WriteItem, ...], ...]          # per rank, in file order

    def bytes_per_rank(self) -> list[int]:
        return [sum(i.nbytes for i in its) for its in self.items]

    def fingerprint(self) -> str:
        h = hashlib.sha1()
        for r, its in enumerate(self.items):
            for i in its:
                h.update(repr((r, i.name, i.region.offsets, i.region.sizes, i.shard)).encode())
        return h.hexdigest()[:16]


def plan_save(per_rank: Sequence[Sequence[ShardMeta]]) -> SavePlan:
    """Compute the deduplicated, balanced save plan from every rank's shard metadata.

    Ranks with equal shard lists (the data-parallel replicas of a stage) are taken together: the
    lists are checked and indexed once per group, and the balanced choice (step 4) keeps one
    (bytes written, rank) heap per group, so the work grows with the groups, not the ranks (the
    plan is the same as choosing among every holder one by one)."""
    groups, reps = _rank_groups(per_rank)
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    by_tensor: dict[str, list[tuple[Region, int, int]]] = {}
    for gid, metas in enumerate(reps):
        rank = groups[gid][0]
        for idx, m in enumerate(metas):
            if m.name not in tensors and (not isinstance(m.name, str) or not m.name or has_control_chars(m.name)):
                # the reader's schema refuses these: a checkpoint saved with one could never be loaded
                raise ShardingError(f"tensor name {m.name!r} (rank {rank}): names must be non-empty strings without "
                                    f"control characters; rename the shard")
            prev = tensors.setdefault(m.name, (m.shape, m.dtype))
            if prev != (m.shape, m.dtype):
                raise ShardingError(f"tensor {m.name}: rank {rank} says shape {m.shape} dtype {m.dtype}, another "
                                    f"rank says shape {prev[0]} dtype {prev[1]}; all ranks must agree")
            if m.dtype not in DTYPE_SIZES:
                raise ShardingError(f"tensor {m.name}: dtype {m.dtype} is not supported")
            if not Region.full(m.shape).contains(m.region):
                raise ShardingError(f"tensor {m.name}: rank {rank} holds {m.region} outside the global shape {m.shape}")
            if m.region.numel:
                by_tensor.setdefault(m.name, []).append((m.region, gid, idx))

    # units: (bytes, name, region, holders[(group, shard)])
    units: list[tuple[int, str, Region, list[tuple[int, int]]]] = []
    for name in sorted(tensors):
        shape, dtype = tensors[name]
        held = by_tensor.get(name, [])
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:
            continue
        if not held:
            raise ShardingError(f"tensor {name} of shape {shape}: no rank holds any part of it")
        distinct: dict[Region, list[tuple[int, int]]] = {}
        for reg, gid, idx in held:
            distinct.setdefault(reg, []).append((gid, idx))
        regions = sorted(distinct)
        if _pairwise_disjoint(regions):
            covered = sum(r.numel for r in regions)
            if covered != numel:
                raise ShardingError(f"tensor {name} of shape {shape}: ranks hold {covered} of {numel} elements; "
                                    f"some region is held by no rank (check the layout and sharding rules)")
            for reg in regions:
                units.append((reg.numel * DTYPE_SIZES[dtype], name, reg, sorted(distinct[reg])))
        else:
            units.extend(_grid_units(name, shape, dtype, distinct))

    units.sort(key=lambda u: (-u[0], u[1], u[2].offsets))
    # per group: (bytes so far, rank) of its ranks, least first: the group's best writer on top
    heaps = [[(0, r) for r in ranks] for ranks in groups]  # ranks ascending: already a heap
    assigned: dict[str, list[tuple[Region, int, int]]] = {}
    for nbytes, name, reg, holders in units:
        best: tuple[int, int] | None = None
        best_gid = best_idx = -1
        for gid, idx in holders:  # sorted: a group's smallest shard index first
            top = heaps[gid][0]
            if best is None or top < best:
                best, best_gid, best_idx = top, gid, idx
        load, rank = heapq.heappop(heaps[best_gid])
        heapq.heappush(heaps[best_gid], (load + nbytes, rank))
        assigned.setdefault(name, []).append((reg, rank, best_idx))

    items: list[list[WriteItem]] = [[] for _ in per_rank]
    for name, regs in assigned.items():
        shape, dtype = tensors[name]
        for reg, rank, idx in _merge(regs, per_rank):
            for tile in column_tiles(shape, dtype, reg):
                items[rank].append(WriteItem(name, tile, idx, dtype))
    ordered = tuple(tuple(sorted(its, key=lambda i: (-DTYPE_SIZES[i.dtype], i.name, i.region.offsets)))
                    if its else () for its in items)
    return SavePlan(tensors, ordered)


def _rank_groups(per_rank: Sequence[Sequence[ShardMeta]]) -> tuple[list[list[int]], list[Sequence[ShardMeta]]]:
    """Ranks with equal shard lists, in order of their first rank: (ranks of each group, its list).
    The same list object is recognised without comparing its items."""
    groups: list[list[int]] = []
    reps: list[Sequence[ShardMeta]] = []
    by_id: dict[int, int] = {}
    by_value: dict[tuple, int] = {}
    for rank, metas in enumerate(per_rank):
        gid = by_id.get(id(metas))
        if gid is None:
            key = tuple(metas)
            gid = by_value.get(key)
            if gid is None:
                gid = by_value[key] = len(groups)
                groups.append([])
                reps.append(metas)
            by_id[id(metas)] = gid
        groups[gid].append(rank)
    return groups, reps


TILE_MIN_BYTES = 1 << 20
TILE_MIN_ROW_BYTES = 4096
TILE_COUNTS = (8, 4, 2)


def column_tiles(shape: Sequence[int], dtype: str, reg: Region) -> list[Region]:
    """``reg`` cut into column tiles at global multiples of ``cols / T`` (step 6), or ``[reg]``."""
    if len(shape) != 2 or reg.sizes[0] < 2 or reg.numel * DTYPE_SIZES[dtype] < TILE_MIN_BYTES:
        return [reg]
    cols = shape[1]
    width = next((cols // t for t in TILE_COUNTS
                  if cols % t == 0 and cols // t * DTYPE_SIZES[dtype] >= TILE_MIN_ROW_BYTES), 0)
    if not width:
        return [reg]
    c0, c1 = reg.offsets[1], reg.ends[1]
    cuts = [c0] + [c for c in range((c0 // width + 1) * width, c1, width)] + [c1]
    if len(cuts) <= 2:
        return [reg]
    return [Region((reg.offsets[0], a), (reg.sizes[0], b - a)) for a, b in zip(cuts, cuts[1:])]


def _pairwise_disjoint(regions: Sequence[Region]) -> bool:
    if len(regions) > 256:  # avoid quadratic blow-up; the grid path handles any case
        return False
    for a, b in itertools.combinations(regions, 2):
        if a.intersect(b) is not None:
            return False
    return True


def _grid_units(name: str, shape: tuple[int, ...], dtype: str,
                distinct: dict[Region, list[tuple[int, int]]]):
    ndim = len(shape)
    pts = [sorted({0, shape[d]} | {r.offsets[d] for r in distinct} | {r.ends[d] for r in distinct})
           for d in range(ndim)]
    cells: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for reg, holders in distinct.items():
        ranges = [range(bisect.bisect_left(pts[d], reg.offsets[d]), bisect.bisect_left(pts[d], reg.ends[d]))
                  for d in range(ndim)]
        for idx in itertools.product(*ranges):
            cells.setdefault(idx, []).extend(holders)
    total = 1
    for d in range(ndim):
        total *= len(pts[d]) - 1
    if len(cells) != total:
        missing = next(idx for idx in itertools.product(*[range(len(p) - 1) for p in pts]) if idx not in cells)
        reg = _cell_region(pts, missing)
        raise ShardingError(f"tensor {name} of shape {shape}: region {reg} is held by no rank")
    for idx in sorted(cells):
        reg = _cell_region(pts, idx)
        yield reg.numel * DTYPE_SIZES[dtype], name, reg, sorted(set(cells[idx]))


def _cell_region(pts: list[list[int]], idx: tuple[int, ...]) -> Region:
    return Region(tuple(pts[d][i] for d, i in enumerate(idx)),
                  tuple(pts[d][i + 1] - pts[d][i] for d, i in enumerate(idx)))


def _merge(regs: list[tuple[Region, int, int]], per_rank) -> Iterable[tuple[Region, int, int]]:
    """Merge boxes with the same writer and shard that touch along one dim, dim by dim."""
    boxes = list(regs)
    if len(boxes) < 2:
        return boxes
    ndim = boxes[0][0].ndim
    for d in reversed(range(ndim)):
        groups: dict[tuple, list[tuple[Region, int, int]]] = {}
        for reg, rank, idx in boxes:
            key = (rank, idx) + tuple((reg.offsets[e], reg.sizes[e]) for e in range(ndim) if e != d)
            groups.setdefault(key, []).append((reg, rank, idx))
        out = []
        for key in sorted(groups):
            run = sorted(groups[key], key=lambda b: b[0].offsets[d])
            cur = run[0]
            for nxt in run[1:]:
                if cur[0].ends[d] == nxt[0].offsets[d]:
                    sizes = list(cur[0].sizes)
                    sizes[d] += nxt[0].sizes[d]
                    cur = (Region(cur[0].offsets, tuple(sizes)), cur[1], cur[2])
                else:
                    out.append(cur)
                    cur = nxt
            out.append(cur)
        boxes = out
    # a merged box must still lie inside the writer's shard region
    for reg, rank, idx in boxes:
        if not per_rank[rank][idx].region.contains(reg):  # pragma: no cover - defensive
            raise AssertionError(f"merged box {reg} escapes rank {rank}'s shard")
    return boxes
