"""The compact plan document (version 2): replica groups with counts and device ranges, read and
validated without one JSON value per GPU.

Version 1 lists every replica, every stage's device names and ranks: 10-17 MB at 131,072 GPUs,
over a second of CPU to parse and read. Version 2 carries the same plan as::

    {"version": 2, "num_layers": L,
     "nodes": [["node0", 8], ["node1", [0, 1, 2, 4, 5, 6, 7]], ...],
     "replica_groups": [{"count": n, "micro_batches": m, "stages": [
         {"tp": k, "layers": [first, last_exclusive], "devices": [[start, step, count], {"at": [p, ...]}]}]}],
     "unused_devices": [[start, step, count], ...], ...}

``nodes`` is the device table: each node's name and its usable GPU ids (a count ``k`` means ids
``0..k-1``), node by node in the cluster's order, ids ascending; a device's *position* is its index in
that table. A group stands for ``count`` consecutive replicas with the same micro-batches and stages
(TP degree, layer range). A stage's ``devices`` gives, replica by replica, where that stage sits: a
segment ``[start, step, count]`` places ``count`` replicas' stages at first positions ``start,
start + step, ...``, each on ``tp`` consecutive positions; ``{"at": [...]}`` places one replica's
stage on exactly those positions (a TP group of non-consecutive GPUs). ``unused_devices`` lists
positions the same way (one device each). Every position is used exactly once or unused; ranks are
the used positions in table order (the canonical order of version 1).

:func:`decode` checks every field and raises :class:`~elastor_ds.errors.LayoutError` naming the bad
value; :func:`encode_devices` and :func:`segments` make the fields. Pure: numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import is_not
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import LayoutError

COMPACT_FORMAT_VERSION = 2
MAX_DEVICES = 1 << 18       # 262,144, the planner's bound on usable GPUs
MAX_GPUS_PER_NODE = 64
# micro-batches of one optimizer step, all replicas together: the planner's own bound (global batch /
# micro-batch size, elastor_ds.plan.cli.MAX_MICRO_BATCHES); a plan from someone else is held to it
MAX_MICRO_BATCHES = 1 << 22
MAX_GPU_ID = 1 << 20
_IDS = {k: tuple(range(k)) for k in range(MAX_GPUS_PER_NODE + 1)}


@dataclass(frozen=True)
class GroupStage:
    tp: int
    layers: tuple[int, int]
    positions: np.ndarray  # (count, tp) device positions, replica by replica


@dataclass(frozen=True)
class ReplicaGroup:
    count: int
    micro_batches: int
    stages: tuple[GroupStage, ...]


@dataclass(frozen=True)
class CompactPlan:
    """A decoded version-2 document: the device table and the replica groups, validated."""

    num_layers: int
    node_names: tuple[str, ...]
    node_gpus: tuple[tuple[int, ...], ...]
    node_of: np.ndarray        # position -> index into node_names
    gpu_of: np.ndarray         # position -> GPU id
    groups: tuple[ReplicaGroup, ...]
    unused: np.ndarray         # positions

    @property
    def num_devices(self) -> int:
        return len(self.node_of)

    def device_names(self) -> list[str]:
        return [f"{n}:{g}" for n, gs in zip(self.node_names, self.node_gpus) for g in gs]

    def ranks(self) -> np.ndarray:
        """Position -> rank (-1 for unused positions): used positions in table order."""
        used = np.ones(self.num_devices, dtype=bool)
        used[self.unused] = False
        return np.where(used, np.cumsum(used) - 1, -1)


def _int(v: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise LayoutError(f"plan document {where}={v!r}: must be an integer")
    if v < lo or (hi is not None and v > hi):
        raise LayoutError(f"plan document {where}={v}: must be in [{lo}, {hi if hi is not None else 'inf'}]")
    return v


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise LayoutError(f"plan document {where}: expected a list, got {type(v).__name__}")
    return v


def _table(nodes: Any) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    fast = _counts_table(nodes)
    if fast is not None:
        return fast
    names: list[str] = []
    gpus: list[tuple[int, ...]] = []
    total = 0
    for i, e in enumerate(_list(nodes, "nodes")):
        if type(e) is list and len(e) == 2 and type(e[0]) is str and e[0] and type(e[1]) is int and \
                0 <= e[1] <= MAX_GPUS_PER_NODE:  # the common entry: [name, GPU count]
            names.append(e[0])
            gpus.append(_IDS[e[1]])
            total += e[1]
            if total > MAX_DEVICES:
                raise LayoutError(f"plan document nodes: more than {MAX_DEVICES:,} devices")
            continue
        where = f"nodes[{i}]"
        if not isinstance(e, list) or len(e) != 2 or not isinstance(e[0], str) or not e[0]:
            raise LayoutError(f"plan document {where}={e!r}: expected [node name, GPU count or GPU ids]")
        if isinstance(e[1], list):
            ids = tuple(_int(g, f"{where} GPU id", 0, MAX_GPU_ID - 1) for g in e[1])
            if len(ids) > MAX_GPUS_PER_NODE or any(a >= b for a, b in zip(ids, ids[1:])):
                raise LayoutError(f"plan document {where}: GPU ids {list(ids)[:8]} must be ascending, distinct, at "
                                  f"most {MAX_GPUS_PER_NODE}")
        else:
            ids = _IDS[_int(e[1], f"{where} GPU count", 0, MAX_GPUS_PER_NODE)]
        names.append(e[0])
        gpus.append(ids)
        total += len(ids)
        if total > MAX_DEVICES:
            raise LayoutError(f"plan document nodes: more than {MAX_DEVICES:,} devices")
    if len(set(names)) != len(names):
        raise LayoutError("plan document nodes: node names must be distinct")
    return tuple(names), tuple(gpus)


def _counts_table(nodes: Any) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None:
    """:func:`_table` of a table whose every entry is ``[name, GPU count]`` (what the writer makes
    of nodes with GPUs 0..k-1), checked with C-level passes over the entries; None when some entry
    is of another form (or wrong: :func:`_table` checks it one by one and names it)."""
    if type(nodes) is not list or not nodes or set(map(type, nodes)) != {list} or set(map(len, nodes)) != {2}:
        return None
    names, counts = zip(*nodes)
    if set(map(type, names)) != {str} or not all(names) or set(map(type, counts)) != {int} or \
            min(counts) < 0 or max(counts) > MAX_GPUS_PER_NODE:
        return None
    if sum(counts) > MAX_DEVICES:
        raise LayoutError(f"plan document nodes: more than {MAX_DEVICES:,} devices")
    if len(set(names)) != len(names):
        raise LayoutError("plan document nodes: node names must be distinct")
    return names, tuple(map(_IDS.__getitem__, counts))


def _positions(spec: Any, tp: int, count: int, n_dev: int, where: str) -> np.ndarray:
    """The (count, tp) positions of a stage's ``devices`` field."""
    rows: list[np.ndarray] = []
    have = 0
    for k, seg in enumerate(_list(spec, where)):
        w = f"{where}[{k}]"
        if isinstance(seg, dict):
            at = _list(seg.get("at"), w + ".at")
            if set(seg) != {"at"} or len(at) != tp:
                raise LayoutError(f"plan document {w}={seg!r}: expected {{\"at\": [{tp} device positions]}}")
            rows.append(np.asarray([[_int(p, w + ".at", 0, n_dev - 1) for p in at]], dtype=np.int64))
            have += 1
        elif isinstance(seg, list) and len(seg) == 3:
            start = _int(seg[0], w + " start", 0, n_dev - 1)
            step = _int(seg[1], w + " step", -n_dev, n_dev)
            n = _int(seg[2], w + " count", 1, count - have)
            last = start + step * (n - 1)
            if min(start, last) < 0 or max(start, last) + tp > n_dev:
                raise LayoutError(f"plan document {w}={seg}: positions {start}..{last} (+{tp} each) run outside the "
                                  f"{n_dev:,} devices of 'nodes'")
            first = start + step * np.arange(n, dtype=np.int64)
            rows.append(first[:, None] + np.arange(tp, dtype=np.int64)[None, :])
            have += n
        else:
            raise LayoutError(f"plan document {w}={seg!r}: expected [start, step, count] or {{\"at\": [...]}}")
    if have != count:
        raise LayoutError(f"plan document {where}: places {have} replicas, the group has {count}")
    return np.concatenate(rows) if len(rows) > 1 else rows[0]


def decode(doc: Mapping[str, Any]) -> CompactPlan:
    """Check and decode a version-2 document (see the module docstring)."""
    if doc.get("version") != COMPACT_FORMAT_VERSION:
        raise LayoutError(f"plan document version {doc.get('version')!r}: expected {COMPACT_FORMAT_VERSION}")
    L = _int(doc.get("num_layers"), "num_layers", 1, 1 << 16)
    names, gpus = _table(doc.get("nodes"))
    size_l = list(map(len, gpus))
    n_dev = sum(size_l)
    sizes = np.asarray(size_l, dtype=np.int64)
    node_of = np.repeat(np.arange(len(names), dtype=np.int64), sizes)
    starts = np.cumsum(sizes) - sizes
    gpu_of = np.arange(n_dev, dtype=np.int64) - np.repeat(starts, sizes)  # ids 0..k-1 on every node ...
    for i in compress(range(len(gpus)), map(is_not, gpus, map(_IDS.__getitem__, size_l))):
        ids = gpus[i]  # ... but where the table lists them
        gpu_of[starts[i]:starts[i] + len(ids)] = ids
    groups: list[ReplicaGroup] = []
    placed: list[np.ndarray] = []  # every stage's positions: counted once at the end
    total = 0
    for gi, gj in enumerate(_list(doc.get("replica_groups"), "replica_groups")):
        w = f"replica_groups[{gi}]"
        if not isinstance(gj, dict):
            raise LayoutError(f"plan document {w}: expected an object")
        count = _int(gj.get("count"), w + ".count", 1, MAX_DEVICES)
        mb = _int(gj.get("micro_batches"), w + ".micro_batches", 1, MAX_MICRO_BATCHES)
        stages = []
        expect = 0
        for si, sj in enumerate(_list(gj.get("stages"), w + ".stages")):
            ws = f"{w}.stages[{si}]"
            if not isinstance(sj, dict):
                raise LayoutError(f"plan document {ws}: expected an object")
            tp = _int(sj.get("tp"), ws + ".tp", 1, MAX_GPUS_PER_NODE)
            lay = _list(sj.get("layers"), ws + ".layers")
            if len(lay) != 2:
                raise LayoutError(f"plan document {ws}.layers={lay}: expected [first, last_exclusive]")
            a, b = _int(lay[0], ws + ".layers[0]", 0, L), _int(lay[1], ws + ".layers[1]", 0, L)
            if a != expect or b <= a:
                raise LayoutError(f"plan document {ws}.layers=[{a}, {b}]: stages must cover [0, {L}) in order, "
                                  f"each at least one layer (this one should start at {expect})")
            expect = b
            total += count * tp
            if total > n_dev:
                raise LayoutError(f"plan document {ws}: the replica groups use more devices than the {n_dev:,} of "
                                  f"'nodes'")
            pos = _positions(sj.get("devices"), tp, count, n_dev, ws + ".devices")
            placed.append(pos.ravel())
            stages.append(GroupStage(tp, (a, b), pos))
        if expect != L:
            raise LayoutError(f"plan document {w}: its stages cover layers [0, {expect}), the model has {L}")
        groups.append(ReplicaGroup(count, mb, tuple(stages)))
    if not groups:
        raise LayoutError("plan document replica_groups: a plan needs at least one replica")
    unused = np.zeros(0, dtype=np.int64)
    if doc.get("unused_devices"):
        n_unused = _count(doc["unused_devices"])
        if total + n_unused != n_dev:
            raise LayoutError(f"plan document unused_devices: lists {n_unused:,} devices; 'nodes' has {n_dev:,}, the "
                              f"replica groups use {total:,}")
        unused = _positions(doc["unused_devices"], 1, n_unused, n_dev, "unused_devices").ravel()
    placed.append(unused)
    seen = np.bincount(np.concatenate(placed), minlength=n_dev)  # how often each position is placed
    bad = np.flatnonzero(seen > 1)  # a device placed twice first, then one placed nowhere
    if not len(bad):
        bad = np.flatnonzero(seen != 1)
    if len(bad):
        p = int(bad[0])
        dev = f"{names[node_of[p]]}:{gpu_of[p]}"
        raise LayoutError(f"plan document: device {dev} (position {p}) is placed {int(seen[p])} times; every device "
                          f"of 'nodes' is used once or listed unused")
    return CompactPlan(L, names, gpus, node_of, gpu_of, tuple(groups), unused)


def _count(spec: Any) -> int:
    """Replicas a ``devices`` list places (to size ``unused_devices``)."""
    n = 0
    for seg in _list(spec, "unused_devices"):
        if isinstance(seg, list) and len(seg) == 3 and isinstance(seg[2], int) and not isinstance(seg[2], bool):
            n += max(seg[2], 0)
        else:
            n += 1
    return n


def segments(values: Sequence[int]) -> list[list[int]]:
    """``values`` as arithmetic runs ``[start, step, count]`` (greedy, left to right)."""
    out: list[list[int]] = []
    i, n = 0, len(values)
    while i < n:
        if i + 1 == n:
            out.append([values[i], 1, 1])
            break
        step = values[i + 1] - values[i]
        j = i + 1
        while j + 1 < n and values[j + 1] - values[j] == step:
            j += 1
        out.append([values[i], step, j - i + 1])
        i = j + 1
    return out


def encode_devices(rows: Sequence[Sequence[int]]) -> list:
    """A stage's ``devices`` field from its positions, replica by replica: runs of TP groups on
    consecutive ascending positions as segments, any other group as ``{"at": [...]}``."""
    out: list = []
    firsts: list[int] = []
    for row in rows:
        p0 = row[0]
        if all(p == p0 + k for k, p in enumerate(row)):
            firsts.append(p0)
            continue
        if firsts:
            out.extend(segments(firsts))
            firsts = []
        out.append({"at": list(row)})
    if firsts:
        out.extend(segments(firsts))
    return out


def fold_runs(items: Sequence[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal items as (item, how many)."""
    out: list[tuple[Any, int]] = []
    for x in items:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


def to_replicas_json(cp: CompactPlan) -> list[dict[str, Any]]:
    """Version 1's ``replicas`` (devices and ranks per stage) of a decoded document."""
    names = cp.device_names()
    rank = cp.ranks().tolist()
    out: list[dict[str, Any]] = []
    for g in cp.groups:
        rows = [s.positions.tolist() for s in g.stages]
        for t in range(g.count):
            out.append({"micro_batches": g.micro_batches, "stages": [
                {"tp": s.tp, "layers": list(s.layers), "devices": [names[p] for p in r[t]],
                 "ranks": [rank[p] for p in r[t]]} for s, r in zip(g.stages, rows)]})
    return out
