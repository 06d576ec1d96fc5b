"""A placed plan priced before its devices are made (:class:`LazyPlan`), and the placement that
makes them from device positions (:func:`place_columns`).

Placement (:meth:`~.search.Planner.place`) gives every stage slot a TP group: slots in (first
layer, replica) order take the groups of their class in node order. What the cost model reads of
the result is only the node of every slot (whether neighbouring stages share a node, whether the
holders of a layer range share one). :func:`place_lazily` works that out with one integer array
per replica kind, from the node of every group of each class, and returns a :class:`LazyPlan`
that :meth:`~.cost.CostModel.evaluate` prices from it. Its replicas and devices (one object per
GPU: 131,072 of them at the largest scale) are made the first time someone reads them, by
:func:`place_columns`: the same slot assignment applied to the groups' device positions (one
integer array per class, no group objects), one stage column (stage ``j`` of every replica of a
kind) at a time, each TP group a slice of the cluster's device tuple. The same plan as the eager
placement, field by field (``tests/unit/test_plan_lazy.py``).

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

from itertools import repeat
from typing import Callable, Mapping, Sequence

import numpy as np

from .cluster import Cluster, Device
from .gcpause import gc_paused
from .plan_doc import Plan, PlanReplica, PlanStage

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
            with gc_paused():  # tens of thousands of stages: no young-generation collections between them
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
                 class_positions: Callable[[], Mapping[ClassKey, np.ndarray]], cluster: Cluster) -> LazyPlan:
    """The plan :meth:`~.search.Planner.place` makes of replica ``kinds`` (in order: stage classes,
    layers per stage, micro-batches, how many replicas) on groups whose nodes per class, in node
    order, are ``class_nodes`` and whose devices are ``class_positions()`` (per class, one row of
    positions in ``cluster.device_tuple()`` per group, same order; called when the devices are
    first read). Raises :class:`IndexError` as ``place`` does when a class runs out of groups."""
    # slots in (first layer, replica, stage) order, a kind's replicas as one block (as place does)
    blocks: dict[int, list[tuple[int, int, int, ClassKey]]] = {}
    mats: list[np.ndarray] = []
    starts: list[list[int]] = []  # per kind and stage: the index of its first group in its class
    for q, (order, counts, _, n) in enumerate(kinds):
        first = 0
        for j, (k, cnt) in enumerate(zip(order, counts)):
            blocks.setdefault(first, []).append((q, n, j, k))
            first += cnt
        mats.append(np.empty((n, len(order)), dtype=np.int64))
        starts.append([0] * len(order))
    idx: dict[ClassKey, int] = {}
    for first in sorted(blocks):
        for q, n, j, k in blocks[first]:
            arr = class_nodes.get(k)
            i0 = idx.get(k, 0)
            have = 0 if arr is None else len(arr)
            if i0 + n > have:
                raise IndexError(f"placement: {n} groups of class {k} wanted, {have - i0} left")
            mats[q][:, j] = arr[i0:i0 + n]  # type: ignore[index]
            starts[q][j] = i0
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

    def make() -> Plan:
        return place_columns(num_layers, kind, kinds, starts, mats, priced, class_positions(),
                             cluster.device_tuple())

    return LazyPlan(num_layers, kind, priced, holders, dims, gpus, make)


def place_columns(num_layers: int, kind: str, kinds: Sequence[KindSpec], starts: Sequence[Sequence[int]],
                  nodes: Sequence[np.ndarray], priced: Sequence[tuple[int, tuple]],
                  class_positions: Mapping[ClassKey, np.ndarray], devices: tuple[Device, ...]) -> Plan:
    """The placed plan: stage ``j`` of replica ``t`` of kind ``q`` on group ``starts[q][j] + t`` of
    its class (rows of ``class_positions``: positions in ``devices``), on node ``nodes[q][t, j]``;
    the replicas' shape keys are ``priced``'s (:meth:`~.plan_doc.Plan.priced_replicas`); the
    groups of the pool no slot takes are the unused devices, in device order."""
    of_group, of_replica = PlanStage.of_group, PlanReplica.of
    reps: list[PlanReplica] = []
    taken: list[np.ndarray] = []
    r0 = 0
    for (order, _, m, n), first, node_m in zip(kinds, starts, nodes):
        if n == 0:
            continue
        shape = priced[r0][1][0]  # (tp, layers, pace) per stage
        cols = []
        for j, (k, i0) in enumerate(zip(order, first)):
            rows = class_positions[k][i0:i0 + n]
            taken.append(rows.ravel())
            tp = k[0]
            if tp == 1 or bool((np.diff(rows, axis=1) == 1).all()):  # consecutive: a slice of the tuple
                devs = [devices[p:p + tp] for p in rows[:, 0].tolist()]
            else:
                devs = [tuple([devices[p] for p in row]) for row in rows.tolist()]
            cols.append(list(map(of_group, repeat(tp), repeat(shape[j][1]), devs, repeat(k[1]),
                                 node_m[:, j].tolist())))
        reps.extend(map(of_replica, zip(*cols), repeat(m), [key for _, key in priced[r0:r0 + n]]))
        r0 += n
    left = np.zeros(len(devices), dtype=bool)
    for rows in class_positions.values():
        left[rows.ravel()] = True
    if taken:
        left[np.concatenate(taken)] = False
    unused = tuple(map(devices.__getitem__, np.flatnonzero(left).tolist()))
    return Plan(num_layers, tuple(reps), unused, kind)
