"""A placed plan priced before its devices are made (:class:`LazyPlan`).

Placement (:meth:`~.search.Planner.place`) gives every stage slot a TP group: slots in (first
layer, replica) order take the groups of their class in node order. What the cost model reads of
the result is only the node of every slot (whether neighbouring stages share a node, whether the
holders of a layer range share one). :func:`place_lazily` works that out with one integer array
per replica kind, from the node of every group of each class, and returns a :class:`LazyPlan`
that :meth:`~.cost.CostModel.evaluate` prices from it; its replicas and devices (one object per
GPU: 131,072 of them at the largest scale) are made by the eager placement the first time
someone reads them, so the same plan as the eager one.

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from .plan_doc import Plan, PlanReplica
from .cluster import Device

ClassKey = tuple[int, float]  # (tp, pace) of a TP group
KindSpec = tuple[tuple[ClassKey, ...], tuple[int, ...], int, int]  # (stage classes, layers per stage, mbs, count)


class LazyPlan(Plan):
    """A :class:`~.plan_doc.Plan` whose prices (:meth:`priced_replicas`, :meth:`holder_nodes`,
    :meth:`uniform_dims`, :attr:`num_gpus`) are known before its replicas and unused devices are
    made; ``make`` makes them (the eager placement) on first access. Equal, field by field, to the
    plan ``make`` returns."""

    def __init__(self, num_layers: int, kind: str, priced: list[tuple[int, tuple]],
                 holders: tuple[dict[tuple[int, int], int], int, int], dims: tuple[int, int, int] | None,
                 num_gpus: int, make: Callable[[], Plan]) -> None:
        d = self.__dict__
        d["num_layers"], d["kind"] = num_layers, kind
        d["_priced"], d["_holders"], d["_dims"], d["_gpus"], d["_make"] = priced, holders, dims, num_gpus, make

    def _made(self) -> Plan:
        d = self.__dict__
        p = d.get("_plan")
        if p is None:
            p = d["_plan"] = d["_make"]()
            if p.kind != self.kind or len(p.replicas) != len(d["_priced"]):  # pragma: no cover - a bug
                raise AssertionError("lazy placement: the placed plan differs from the priced one")
        return p

    @property  # type: ignore[override]
    def replicas(self) -> tuple[PlanReplica, ...]:
        return self._made().replicas

    @property  # type: ignore[override]
    def unused(self) -> tuple[Device, ...]:
        return self._made().unused

    @property
    def is_placed(self) -> bool:
        """Whether the devices have been made."""
        return "_plan" in self.__dict__

    @property
    def num_gpus(self) -> int:
        return self.__dict__["_gpus"]

    @property
    def num_replicas(self) -> int:
        return len(self.__dict__["_priced"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (self.num_layers, self.kind, self.replicas, self.unused) == \
            (other.num_layers, other.kind, other.replicas, other.unused)

    def __hash__(self) -> int:
        return hash((self.num_layers, self.replicas, self.unused, self.kind))

    def holder_nodes(self) -> tuple[dict[tuple[int, int], int], int, int]:
        by_range, first, last = self.__dict__["_holders"]
        return dict(by_range), first, last


def place_lazily(num_layers: int, kinds: Sequence[KindSpec], class_nodes: Mapping[ClassKey, np.ndarray],
                 make: Callable[[], Plan]) -> LazyPlan:
    """The plan :meth:`~.search.Planner.place` makes of replica ``kinds`` (in order: stage classes,
    layers per stage, micro-batches, how many replicas) on groups whose nodes per class, in node
    order, are ``class_nodes``; ``make`` is that eager placement. Raises :class:`IndexError` as
    ``place`` does when a class runs out of groups."""
    # slots in (first layer, replica, stage) order, a kind's replicas as one block (as place does)
    blocks: dict[int, list[tuple[int, int, int, ClassKey]]] = {}
    mats: list[np.ndarray] = []
    for q, (order, counts, _, n) in enumerate(kinds):
        first = 0
        for j, (k, cnt) in enumerate(zip(order, counts)):
            blocks.setdefault(first, []).append((q, n, j, k))
            first += cnt
        mats.append(np.empty((n, len(order)), dtype=np.int64))
    idx: dict[ClassKey, int] = {}
    for first in sorted(blocks):
        for q, n, j, k in blocks[first]:
            arr = class_nodes.get(k)
            i0 = idx.get(k, 0)
            have = 0 if arr is None else len(arr)
            if i0 + n > have:
                raise IndexError(f"placement: {n} groups of class {k} wanted, {have - i0} left")
            mats[q][:, j] = arr[i0:i0 + n]  # type: ignore[index]
            idx[k] = i0 + n
    priced: list[tuple[int, tuple]] = []
    by_range: dict[tuple[int, int], int] = {}
    ends: list[int | None] = [None, None]  # the first stages' node, the last stages' node
    dims_shape: tuple | None = None
    grid = True
    gpus = 0
    mbs: set[int] = set()
    for (order, counts, m, n), nodes in zip(kinds, mats):
        if n == 0:
            continue
        S = len(order)
        bounds = np.cumsum((0,) + tuple(counts)).tolist()
        shape = tuple((k[0], (bounds[j], bounds[j + 1]), k[1]) for j, k in enumerate(order))
        gpus += n * sum(k[0] for k in order)
        mbs.add(m)
        if S > 1:
            keys: dict[tuple[bool, ...], tuple] = {}  # flags -> the key (one object per distinct row)
            for row in map(tuple, (nodes[:, :-1] == nodes[:, 1:]).tolist()):
                key = keys.get(row)
                if key is None:
                    key = keys[row] = (m, (shape, row))
                priced.append(key)
        else:
            key = (m, (shape, ()))
            priced.extend([key] * n)
        lo, hi = nodes.min(axis=0).tolist(), nodes.max(axis=0).tolist()
        for j, (_, lay, _) in enumerate(shape):
            v = lo[j] if lo[j] == hi[j] else -1
            prev = by_range.get(lay, v)
            by_range[lay] = v if prev == v else -1
        for e, j in ((0, 0), (1, S - 1)):
            v = lo[j] if lo[j] == hi[j] else -1
            ends[e] = v if ends[e] in (None, v) else -1
        tl = tuple((t, lay) for t, lay, _ in shape)
        if dims_shape is None:
            dims_shape = tl
        grid = grid and tl == dims_shape and len({t for t, _ in tl}) == 1
    R = len(priced)
    dims = (dims_shape[0][0], len(dims_shape), R) if grid and dims_shape is not None else None
    kind = "uniform" if dims is not None and len(mbs) == 1 else "heterogeneous"
    holders = (by_range, -1 if ends[0] is None else ends[0], -1 if ends[1] is None else ends[1])
    return LazyPlan(num_layers, kind, priced, holders, dims, gpus, make)
