"""Process groups of a (possibly heterogeneous) layout, derived as pure functions.

Three kinds of groups, all as sorted tuples of global ranks:

* **stage TP groups**: the ``tp`` ranks of each stage (``Stage.ranks``);
* **replica groups**: all ranks of one replica (its pipeline; DeepSpeed's "model parallel" group);
* **split all-reduce groups**: for gradient synchronisation across replicas whose TP splits differ.

Split all-reduce, how the groups are derived (:func:`split_reduce_plan`):

1. every rank announces what it holds: for each parameter, its canonical name, global shape and
   :class:`~elastor_ds.layout.Piece` list (local box <-> region of the global tensor);
2. per tensor, the regions of all holders cut the global tensor along every piece boundary, in every
   dimension (:func:`~elastor_ds.layout.region.split_points`): the **finest common sub-regions**
   ("cells"). Every cell is either wholly inside or wholly outside each holder's pieces;
3. a cell's holder set is the ranks whose pieces contain it. Cells whose holders span two or more
   replicas are reduced among exactly those ranks; cells with the same holder set (across all
   tensors) share one flat buffer and one all-reduce over that rank set;
4. a holder contributes its gradient only if it is the lowest-ranked holder *of its replica*
   (TP-replicated parameters such as layer norms are held, with equal gradients, by every TP rank of
   a stage: summing them all would count that replica twice); the others contribute zeros and
   receive the sum;
5. the lowest-ranked holder of a cell *owns* it for the global gradient norm (each element counted once).

Bytes sent per rank (ring all-reduce of ``n`` elements among ``k`` ranks sends ``2 (k-1)/k * n``
elements per rank), :func:`split_reduce_bytes`: a rank sends ``sum over its cells of
2 (k_c - 1)/k_c * numel_c * elem_bytes``, where ``k_c`` is the cell's number of holders (one per
replica, or more for TP-replicated tensors). A uniform TP x PP x DP grid's DP all-reduce sends
``2 (dp-1)/dp * n_local * elem_bytes`` (:func:`uniform_dp_bytes`): for a uniform layout the split
all-reduce degenerates to exactly that (one cell group per DP group). Under heterogeneous TP a rank
of a TP1 replica holds whole tensors that TP2 ranks of another replica hold in halves, so its
tensors split into cells reduced in two groups of the same size ``k``: the bytes are those of a DP
all-reduce of its local parameters. TP-replicated tensors (layer norms) of a TP-``t`` stage are
reduced among more ranks than there are replicas (``k`` up to the sum of the holders' TP degrees);
they are small.

The deterministic creation order (:func:`creation_order`) is what every rank must follow: ``new_group``
is collective over the world, and one rank creating its groups in another order hangs the job.

Pure: no torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..errors import LayoutError
from ..layout import Layout, Piece, Region, TensorSpec, rank_tensors
from ..layout.region import split_points

# (canonical name, global shape, pieces) of one local parameter
HeldTensor = tuple[str, tuple[int, ...], tuple[Piece, ...]]


@dataclass(frozen=True)
class Cell:
    """One finest common sub-region of a tensor, as a holding rank sees it."""

    name: str
    region: Region            # in the global tensor
    local: Region             # the same elements in this rank's local tensor
    holders: tuple[int, ...]  # sorted ranks holding the cell (the reduction group when it spans replicas)
    contributes: bool         # this rank adds its gradient (lowest holder of its replica)
    owner: bool               # this rank counts the cell in the global gradient norm (lowest holder)
    cross_replica: bool       # holders span two or more replicas: needs the all-reduce


def needs_hetero(layout: Layout) -> bool:
    """True when ``layout`` is not one TP x PP x DP grid with equal micro-batches (replicas or stages
    differ in TP, boundaries or micro-batches): such plans run on the heterogeneous runtime. A grid
    runs as the framework's own grid (its rank order)."""
    if not layout.is_uniform() or len({s.tp for s in layout.replicas[0].stages}) > 1:
        return True
    return len({r.micro_batches for r in layout.replicas}) > 1


def stage_groups(layout: Layout) -> list[tuple[int, ...]]:
    """The TP group of every stage of every replica, sorted."""
    return sorted({tuple(sorted(s.ranks)) for r in layout.replicas for s in r.stages})


def replica_groups(layout: Layout) -> list[tuple[int, ...]]:
    """All ranks of each replica, sorted."""
    return sorted(tuple(sorted(x for s in r.stages for x in s.ranks)) for r in layout.replicas)


def _cells_of(shape: tuple[int, ...], regions: Iterable[Region]) -> list[Region]:
    pts = split_points(list(regions), len(shape))
    for d, n in enumerate(shape):  # the whole tensor's edges too
        pts[d] = sorted(set(pts[d]) | {0, n})
    out = []
    for idx in itertools.product(*[range(len(p) - 1) for p in pts]):
        offs = tuple(pts[d][i] for d, i in enumerate(idx))
        sizes = tuple(pts[d][i + 1] - pts[d][i] for d, i in enumerate(idx))
        if all(sizes):
            out.append(Region(offs, sizes))
    return out


def split_reduce_plan(held: Mapping[int, Sequence[HeldTensor]],
                      replica_of: Mapping[int, int]) -> dict[int, list[Cell]]:
    """Per rank, the cells of every tensor it holds (sorted by tensor name, then region).

    ``held[rank]``: what the rank holds; ``replica_of[rank]``: its replica. Raises LayoutError when
    two ranks disagree on a tensor's global shape."""
    by_name: dict[str, list[tuple[int, Piece]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, tensors in held.items():
        for name, shape, pieces in tensors:
            shape = tuple(shape)
            if shapes.setdefault(name, shape) != shape:
                raise LayoutError(f"tensor {name}: rank {rank} holds it with global shape {shape} but another rank "
                                  f"with {shapes[name]}; every replica must build the same model")
            for p in pieces:
                by_name.setdefault(name, []).append((rank, p))
    out: dict[int, list[Cell]] = {r: [] for r in held}
    for name in sorted(by_name):
        entries = by_name[name]
        for cell in _cells_of(shapes[name], (p.global_ for _, p in entries)):
            holding = [(r, p) for r, p in entries if p.global_.contains(cell)]
            if not holding:
                continue
            holders = tuple(sorted({r for r, _ in holding}))
            reps = {replica_of[r] for r in holders}
            first_of_replica = {}
            for r in holders:
                first_of_replica.setdefault(replica_of[r], r)
            for r, p in holding:
                local = Region(tuple(lo + (c - g) for lo, c, g in zip(p.local.offsets, cell.offsets, p.global_.offsets)),
                               cell.sizes)
                out[r].append(Cell(name, cell, local, holders, first_of_replica[replica_of[r]] == r,
                                   holders[0] == r, len(reps) > 1))
    return out


def reduce_groups(plan: Mapping[int, Sequence[Cell]]) -> list[tuple[int, ...]]:
    """The distinct rank sets that run a split all-reduce, sorted."""
    return sorted({c.holders for cells in plan.values() for c in cells if c.cross_replica})


def creation_order(layout: Layout, extra: Iterable[Sequence[int]] = ()) -> list[tuple[int, ...]]:
    """Every group of the runtime, once, in the one order all ranks create them: singletons, stage
    TP groups, replica groups, then ``extra`` (e.g. :func:`reduce_groups`), each sorted, deduplicated
    keeping the first occurrence."""
    seen: dict[tuple[int, ...], None] = {}
    singles = [(r,) for r in range(layout.world_size)]
    for g in itertools.chain(singles, stage_groups(layout), replica_groups(layout),
                             sorted(tuple(sorted(x)) for x in extra)):
        seen.setdefault(tuple(g), None)
    return list(seen)


def layout_held(specs: Sequence[TensorSpec], layout: Layout) -> dict[int, list[HeldTensor]]:
    """What every rank holds of ``specs`` under ``layout`` (for planning without a model)."""
    return {r: [(s.name, tuple(s.shape), h.pieces) for s, h in rank_tensors(specs, layout, r)]
            for r in range(layout.world_size)}


def replica_of(layout: Layout) -> dict[int, int]:
    return {r: layout.position(r).replica for r in range(layout.world_size)}


def split_reduce_bytes(cells: Sequence[Cell], elem_bytes: int = 4) -> int:
    """Bytes one rank sends in the split all-reduce (ring all-reduce per holder set)."""
    total = 0.0
    for c in cells:
        if c.cross_replica:
            k = len(c.holders)
            total += 2.0 * (k - 1) / k * c.region.numel * elem_bytes
    return int(round(total))


def uniform_dp_bytes(local_numel: int, dp: int, elem_bytes: int = 4) -> int:
    """Bytes one rank sends in a uniform grid's DP ring all-reduce of its ``local_numel`` gradients."""
    return int(round(2.0 * (dp - 1) / dp * local_numel * elem_bytes)) if dp > 1 else 0


# ---- ZeRO-1 across heterogeneous replicas ----------------------------------------------------------
@dataclass(frozen=True)
class ShardPart:
    """This rank's share of the optimizer state of one (param group, holder set) buffer.

    The buffer is the concatenation of the flattened cells (in plan order) whose holders are
    ``holders`` and whose parameters sit in optimizer param group ``group``; it is padded to
    ``len(holders) * chunk`` elements and holder ``i`` owns ``[i * chunk, (i + 1) * chunk)`` of it,
    clipped to the ``numel`` real elements: ``[start, end)``."""

    group: int
    holders: tuple[int, ...]
    cells: tuple[Cell, ...]
    numel: int
    chunk: int
    start: int
    end: int


def zero_partition(cells: Sequence[Cell], rank: int, group_of: Mapping[str, int]) -> list[ShardPart]:
    """ZeRO-1 over the holders of each block: ``rank``'s share of the optimizer state of each
    (param group, holder set) buffer of its cross-replica ``cells`` (plan order kept within a
    buffer, so every holder sees the same buffer). Every element of every cross-replica cell is
    owned by exactly one of its holders; holders' shares differ by at most ``chunk`` elements."""
    buffers: dict[tuple[int, tuple[int, ...]], list[Cell]] = {}
    for c in cells:
        if c.cross_replica:
            buffers.setdefault((group_of[c.name], c.holders), []).append(c)
    out = []
    for (g, holders), cs in sorted(buffers.items()):
        n = sum(c.region.numel for c in cs)
        k = len(holders)
        chunk = -(-n // k)
        i = holders.index(rank)
        out.append(ShardPart(g, holders, tuple(cs), n, chunk, min(i * chunk, n), min((i + 1) * chunk, n)))
    return out


def zero_state_numel(cells: Sequence[Cell], rank: int) -> tuple[int, int]:
    """(elements of optimizer state this rank keeps under ZeRO-1, elements it would keep without):
    for the memory model's check (one param group)."""
    parts = zero_partition(cells, rank, {c.name: 0 for c in cells})
    local = sum(c.region.numel for c in cells if not c.cross_replica)
    return sum(p.end - p.start for p in parts) + local, sum(c.region.numel for c in cells)
