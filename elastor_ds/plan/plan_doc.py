"""The plan as a value (:class:`Plan`: replicas -> stages -> TP degree, layer range, devices, plus
micro-batches per replica) and its versioned JSON document, which ``Layout.from_json`` loads.

Document (version 1)::

    {"version": 1, "num_gpus": N, "num_layers": L, "predicted_iteration_time_s": t,
     "uniform_baseline": {...}, "replicas": [{"micro_batches": m, "stages": [
         {"tp": k, "layers": [first, last_exclusive], "devices": ["node0:0", ...], "ranks": [...],
          "memory_gb": g, "time_per_micro_batch_s": s}]}],
     "unused_devices": [...], "cost_breakdown": {...}}

Version 2 (``compact=True``, what ``elastor plan --json`` writes above :data:`COMPACT_ABOVE_GPUS`
GPUs) carries the same plan as replica groups and device ranges
(:mod:`~elastor_ds.layout.compact_plan`); :func:`plan_from_document` and ``Layout.from_json`` read both.
A plan read from version 2 is made per replica group: the replicas with their shape keys and the
index of stages by node at once, each replica's stages (and their devices) the first time they are
read, from its group's arrays (the re-plan reads a handful; ``tests/unit/test_plan_doc_load.py``).

Ranks number the used devices in canonical device order (node by node, GPU id ascending), so a
launcher that starts one process per used device in that order gets rank ``i`` on ``ranks[i]``.

Pure: no torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, repeat
from operator import and_, attrgetter, eq, is_, lt, not_
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..errors import ConfigError, LayoutError
from ..layout.compact_plan import COMPACT_FORMAT_VERSION, decode, encode_devices, fold_runs, segments
from ..layout.layout import PLAN_FORMAT_VERSION, Layout, gap_report, json_fingerprint
from .cluster import _ONES as _NODE_ONES
from .cluster import Cluster, Device
from .gcpause import gc_paused

COMPACT_ABOVE_GPUS = 4096  # `elastor plan --json` writes version 2 above this many usable GPUs
_GPUS, _SPEEDS = attrgetter("gpus"), attrgetter("speeds")
_ONES = _NODE_ONES  # speeds of a node whose GPUs all run at speed 1 (a Node's default: identical items)
_NO_NODE = SimpleNamespace(gpus=None, speeds=None)  # stands for a node the cluster does not have
_new_object, _set_attr = object.__new__, object.__setattr__


@dataclass(frozen=True)
class PlanStage:
    tp: int
    layers: tuple[int, int]  # [first, last)
    devices: tuple[Device, ...]
    # derived once at construction (a 131,072-GPU plan reads them for every stage, many times)
    speed: float = field(init=False, compare=False, repr=False)  # the TP group's pace: its slowest GPU
    node: int = field(init=False, compare=False, repr=False)     # the devices' node index, -1 if several

    def __post_init__(self) -> None:
        devs = self.devices
        n = devs[0].node if devs else -1
        sp = devs[0].speed if devs else 1.0
        for d in devs:
            if d.speed < sp:
                sp = d.speed
            if d.node != n:
                n = -1
        object.__setattr__(self, "speed", sp)
        object.__setattr__(self, "node", n)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @staticmethod
    def of_group(tp: int, layers: tuple[int, int], devices: tuple[Device, ...], speed: float,
                 node: int) -> "PlanStage":
        """A stage on a TP group whose pace (slowest GPU) and node the caller already knows (the
        planner's groups carry them): the same value as ``PlanStage(tp, layers, devices)`` without
        the pass over the devices (a 131,072-GPU plan makes tens of thousands of stages)."""
        st = object.__new__(PlanStage)
        object.__setattr__(st, "__dict__", {"tp": tp, "layers": layers, "devices": devices, "speed": speed,
                                            "node": node})
        return st

    @staticmethod
    def column(tp: int, layers: tuple[int, int], devices: Iterable[tuple[Device, ...]], speeds: Iterable[float],
               nodes: Iterable[int]) -> list["PlanStage"]:
        """``[PlanStage.of_group(tp, layers, d, s, n) for d, s, n in zip(devices, speeds, nodes)]``
        (stage ``j`` of every replica of a group), with C-level passes instead of a call per stage:
        a reader of a 131,072-GPU document makes tens of thousands of them."""
        fields = [{"tp": tp, "layers": layers, "devices": d, "speed": s, "node": n}
                  for d, s, n in zip(devices, speeds, nodes)]
        out = list(map(_new_object, repeat(PlanStage, len(fields))))
        deque(map(_set_attr, out, repeat("__dict__"), fields), 0)
        return out


@dataclass(frozen=True)
class PlanReplica:
    stages: tuple[PlanStage, ...]
    micro_batches: int

    def __getattr__(self, name: str) -> Any:
        # A replica of a loaded plan document (plan_from_document, version 2) is made without its
        # stages: they are made the first time they are read, from its replica group's arrays
        # (_GroupStages), the same values as made at once. Only a missing attribute comes here.
        if name == "stages":
            lazy = self.__dict__.get("_lazy")
            if lazy is not None:
                return lazy[0].stages_for(self, lazy[1])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        # a pickled or copied replica carries its stages, not its group's arrays
        d = dict(self.__dict__)
        if d.pop("_lazy", None) is not None:
            d["stages"] = self.stages
        return d

    @property
    def num_gpus(self) -> int:
        k = self.__dict__.get("_shape")
        if k is not None:  # (tp, layers, speed) per stage: without making the stages of a loaded replica
            return sum([t for t, _, _ in k[0]])
        return sum(s.tp for s in self.stages)

    def shape_key(self) -> tuple:
        """What the replica's price depends on besides its micro-batches: per stage (tp, layers,
        speed), per boundary whether both sides share a node. Made once per replica."""
        k = self.__dict__.get("_shape")
        if k is None:
            st = self.stages
            k = (tuple([(s.tp, s.layers, s.speed) for s in st]),
                 tuple([a.node == b.node != -1 for a, b in zip(st, st[1:])]))
            object.__setattr__(self, "_shape", k)
        return k

    @staticmethod
    def of(stages: tuple[PlanStage, ...], micro_batches: int, shape: tuple) -> "PlanReplica":
        """``PlanReplica(stages, micro_batches)`` whose :meth:`shape_key` the caller already knows
        (a reader of a 131,072-GPU document makes tens of thousands of replicas)."""
        r = object.__new__(PlanReplica)
        object.__setattr__(r, "__dict__", {"stages": stages, "micro_batches": micro_batches, "_shape": shape})
        return r

    def with_micro_batches(self, m: int) -> "PlanReplica":
        """The same stages with ``m`` micro-batches (its shape key carried over; a loaded replica's
        stages still made when first read)."""
        d = self.__dict__
        if "stages" not in d:
            r = object.__new__(PlanReplica)
            object.__setattr__(r, "__dict__", {"micro_batches": m, "_shape": d["_shape"], "_lazy": d["_lazy"]})
            return r
        r = PlanReplica(self.stages, m)
        if "_shape" in self.__dict__:
            object.__setattr__(r, "_shape", self.__dict__["_shape"])
        return r


class _DeviceTable:
    """The devices of a loaded document's table by position, without a tuple of all of them:
    ``runs`` of positions, each ``(first position, source tuple, offset)``: position ``p`` of the
    run is ``source[offset + p - first]``, source None standing for ``cluster.device_tuple()``,
    else the devices made for a changed node; ``n`` positions in all. While the cluster has not
    made its device tuple (a cluster made for the recovery has not), devices on its runs are made
    from the arrays (node index now, node name, GPU id, speed by position): the same values."""

    def __init__(self, runs: list[tuple[int, tuple[Device, ...] | None, int]], n: int, cluster: Cluster,
                 node_at: np.ndarray, node_of: np.ndarray, names: Sequence[str], gpu_of: np.ndarray,
                 speed_at: np.ndarray) -> None:
        self.runs = runs
        self.firsts = [r[0] for r in runs] + [n]
        self.cluster = cluster
        self.arrays = (node_at, node_of, names, gpu_of, speed_at)
        self._all: tuple[Device, ...] | None = None

    def make(self, idx: Any) -> tuple[Device, ...]:
        """The devices at positions ``idx`` (a slice or an integer array), made from the arrays."""
        node_at, node_of, names, gpu_of, speed_at = self.arrays
        return tuple(map(tuple.__new__, repeat(Device), zip(
            node_at[idx].tolist(), map(names.__getitem__, node_of[idx].tolist()), gpu_of[idx].tolist(),
            speed_at[idx].tolist())))

    def slice(self, p: int, q: int) -> tuple[Device, ...]:
        """The devices at positions ``p`` to ``q - 1``."""
        k = bisect_right(self.firsts, p) - 1
        a, src, off = self.runs[k]
        if q <= self.firsts[k + 1]:
            if src is None:
                src = self.cluster.__dict__.get("_devices")  # Cluster.device_tuple's, if made
                if src is None:
                    return self.make(slice(p, q))
            return src[off + p - a:off + q - a]
        return tuple(chain.from_iterable(self.slice(i, i + 1) for i in range(p, q)))

    def all(self) -> tuple[Device, ...]:
        """Every device, by position (made once; the cluster's device tuple shared)."""
        d = self._all
        if d is None:
            have = self.cluster.device_tuple()
            parts = [(have if src is None else src)[off:off + b - a] for (a, src, off), b in zip(self.runs,
                                                                                              self.firsts[1:])]
            d = self._all = parts[0] if len(parts) == 1 else tuple(chain.from_iterable(parts))
        return d


class _GroupStages:
    """The stages of the replicas of one replica group of a loaded version-2 document, made when a
    replica's :attr:`PlanReplica.stages` is first read: per stage its TP degree and layers, per
    replica and stage the first device position (``rows[j]``: all positions, for a stage whose TP
    groups are not consecutive positions), pace and node, and the devices of the table. Replica by
    replica while few are read (the re-plan reads a handful); after :attr:`BULK` of them, the
    stages of the whole group at once, column by column (a reader of every replica then pays what
    a loader making them at once pays)."""

    BULK = 32

    def __init__(self, specs: tuple[tuple[int, tuple[int, int]], ...], devices: _DeviceTable,
                 firsts: np.ndarray, rows: list[np.ndarray | None], paces: np.ndarray, nodes: np.ndarray) -> None:
        self.specs, self.devices, self.rows = specs, devices, rows
        self.arrays = (firsts, paces, nodes)
        self.replicas: list[PlanReplica] = []  # the group's replicas, in order (set by the loader)
        self.made = 0
        self.all_made = False

    def stages_for(self, rep: PlanReplica, i: int) -> tuple[PlanStage, ...]:
        """Replica ``i``'s stages, stored on it and on ``rep`` (replica ``i`` or a copy of it with
        other micro-batches: both hold the same tuple, as copies of a made replica do)."""
        orig = self.replicas[i]
        st = orig.__dict__.get("stages")
        if st is None:
            self.made += 1
            if self.made > self.BULK and not self.all_made:
                self.all_made = True
                self._make_all()
                st = orig.__dict__["stages"]
            else:
                f, p, n = (a[i].tolist() for a in self.arrays)
                dev = self.devices
                st = tuple([PlanStage.of_group(tp, lay, dev.slice(f[j], f[j] + tp) if self.rows[j] is None
                                               else dev.make(self.rows[j][i]), p[j], n[j])
                            for j, (tp, lay) in enumerate(self.specs)])
                st = orig.__dict__.setdefault("stages", st)
        if rep is not orig:
            rep.__dict__["stages"] = st
        return st

    def _make_all(self) -> None:
        """The stages of every replica of the group not made yet, column by column."""
        firsts, paces, nodes = self.arrays
        dev = self.devices.all()
        cols = []
        for j, (tp, lay) in enumerate(self.specs):
            rows = self.rows[j]
            if rows is None:
                devs = [dev[a:a + tp] for a in firsts[:, j].tolist()]
            else:
                devs = [tuple(map(dev.__getitem__, r)) for r in rows.tolist()]
            cols.append(PlanStage.column(tp, lay, devs, paces[:, j].tolist(), nodes[:, j].tolist()))
        for r, st in zip(self.replicas, zip(*cols)):
            r.__dict__.setdefault("stages", st)


@dataclass(frozen=True)
class Plan:
    """One candidate layout on concrete devices. ``kind`` is ``"uniform"`` or ``"heterogeneous"``."""

    num_layers: int
    replicas: tuple[PlanReplica, ...]
    unused: tuple[Device, ...] = ()
    kind: str = "heterogeneous"

    def used_devices(self) -> list[Device]:
        return sorted((d for r in self.replicas for s in r.stages for d in s.devices),
                      key=lambda d: (d.node, d.local_id))

    @property
    def num_gpus(self) -> int:
        return sum(r.num_gpus for r in self.replicas)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def priced_replicas(self) -> list[tuple[int, tuple]]:
        """Per replica, in order, what its price depends on: ``(micro_batches, shape key)``
        (:meth:`PlanReplica.shape_key`). Replicas of one shape may share the key object, so a
        pricer can fold them by identity before comparing values. Made once per plan."""
        v = self.__dict__.get("_priced")
        if v is None:
            v = [(r.micro_batches, r.shape_key()) for r in self.replicas]
            object.__setattr__(self, "_priced", v)
        return v

    def replicas_on(self, nodes: Iterable[int]) -> list[int]:
        """The indices of the replicas with a stage on one of ``nodes`` (node indices; -1: a
        stage across nodes), ascending. An index of (node, replica) pairs sorted by node, made once
        per plan (a loaded plan gets it while it is read)."""
        v = self.__dict__.get("_by_node")
        if v is None:
            ns, rs = [], []
            for i, r in enumerate(self.replicas):
                for s in r.stages:
                    ns.append(s.node)
                    rs.append(i)
            a, b = np.asarray(ns, dtype=np.int64), np.asarray(rs, dtype=np.int64)
            order = np.argsort(a, kind="stable")
            v = (a[order], b[order])
            object.__setattr__(self, "_by_node", v)
        keys, idx = v
        out: set[int] = set()
        for n in nodes:
            lo, hi = np.searchsorted(keys, n, "left"), np.searchsorted(keys, n, "right")
            out.update(idx[lo:hi].tolist())
        return sorted(out)

    def holder_nodes(self) -> tuple[dict[tuple[int, int], int], int, int]:
        """Where the holders of each layer range sit: per stage layer range, the node every stage
        of that range is on (-1: more than one node); the same for the first and for the last
        stages of all replicas. What the gradient sync's price depends on besides the shapes."""
        by_range: dict[tuple[int, int], int] = {}
        first_node: int | None = None
        last_node: int | None = None
        done: set[int] = set()  # ids of stage shapes whose ranges, first and last stage span nodes already
        seen: dict[tuple, int] = {}  # shape value -> id of the first object with it
        for r in self.replicas:
            shape = r.shape_key()[0]
            sid = id(shape)
            if sid in done:  # -1 stays -1: nothing this replica holds can change
                continue
            sid = seen.setdefault(shape, sid)
            if sid in done:
                continue
            st = r.stages
            for s in st:
                n = s.node
                prev = by_range.get(s.layers, n)
                by_range[s.layers] = n if prev == n else -1
            n0, n1 = st[0].node, st[-1].node
            first_node = n0 if first_node in (None, n0) else -1
            last_node = n1 if last_node in (None, n1) else -1
            if first_node == -1 and last_node == -1 and all(by_range[s.layers] == -1 for s in st):
                done.add(sid)
                done.add(id(shape))
        return by_range, -1 if first_node is None else first_node, -1 if last_node is None else last_node

    def rank_of(self) -> dict[Device, int]:
        return {d: i for i, d in enumerate(self.used_devices())}

    def layout_fingerprint(self) -> str:
        """``Layout.from_json(document).fingerprint()`` of this plan's document, hashed straight from
        the replicas: the same value without expanding and checking a Layout of every rank."""
        return json_fingerprint({"version": PLAN_FORMAT_VERSION, "num_layers": self.num_layers,
                                 "num_gpus": self.num_gpus, "replicas": self.replicas_json()})

    def describe(self) -> str:
        """Short text, e.g. ``(mb16)[tp1:0-6|tp4:6-32] (mb16)[tp2:0-32]``; consecutive identical
        replicas are folded (``12x(mb16)[...]``), repeated stages too (``tp8:0-10|7x tp8:10+10``:
        seven stages of ten layers from layer 10). Made once per plan."""
        cached = self.__dict__.get("_describe")
        if cached is None:
            cached = self._describe()
            object.__setattr__(self, "_describe", cached)
        return cached

    def _describe(self) -> str:
        parts: list[str] = []
        prev, n = None, 0
        texts: dict[int, str] = {}  # id of a shape -> its text (the shapes are kept alive by the plan)
        for m, key in self.priced_replicas():
            shape = key[0]  # (tp, layers, pace) per stage
            body = texts.get(id(shape))
            if body is None:
                body = texts[id(shape)] = _stages_text(shape)
            txt = f"(mb{m})[" + body + "]"
            if txt == prev:
                n += 1
                continue
            if prev is not None:
                parts.append((f"{n}x" if n > 1 else "") + prev)
            prev, n = txt, 1
        parts.append((f"{n}x" if n > 1 else "") + str(prev))
        return " ".join(parts)

    def replica_kinds(self) -> list[tuple[int, int, "PlanReplica"]]:
        """Replicas of the same shape (micro-batches, TP degrees, layer ranges) folded, in order of
        first appearance: (index of the first, how many, the first)."""
        kinds: dict[tuple, list] = {}
        for i, r in enumerate(self.replicas):
            k = (r.micro_batches, tuple((s.tp, s.layers) for s in r.stages))
            if k in kinds:
                kinds[k][1] += 1
            else:
                kinds[k] = [i, 1, r]
        return [(i, n, r) for i, n, r in kinds.values()]

    def replicas_json(self, stage_extra: list[list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
        ranks = self.rank_of()
        out = []
        for ri, r in enumerate(self.replicas):
            stages = []
            for si, s in enumerate(r.stages):
                sj: dict[str, Any] = {"tp": s.tp, "layers": [s.layers[0], s.layers[1]],
                                      "devices": [d.name for d in s.devices],
                                      "ranks": [ranks[d] for d in s.devices]}
                if stage_extra is not None:
                    sj.update(stage_extra[ri][si])
                stages.append(sj)
            out.append({"micro_batches": r.micro_batches, "stages": stages})
        return out

    def compact_json(self, stage_extra: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        """The version-2 fields (:mod:`~elastor_ds.layout.compact_plan`): ``nodes`` (the device
        table: every used and unused device, node by node, GPU ids ascending), ``replica_groups``
        (runs of consecutive replicas with the same micro-batches, TP degrees, layers and
        ``stage_extra``) and ``unused_devices``."""
        devs = [d for r in self.replicas for s in r.stages for d in s.devices]
        devs.extend(self.unused)
        devs.sort(key=_canonical)
        pos = {d: i for i, d in enumerate(devs)}
        nodes: list[list[Any]] = []
        last = None
        for d in devs:
            if d.node != last:
                nodes.append([d.node_name, []])
                last = d.node
            nodes[-1][1].append(d.local_id)
        for e in nodes:
            if e[1] == list(range(len(e[1]))):
                e[1] = len(e[1])
        groups: list[dict[str, Any]] = []
        key = None
        rows: list[list[list[int]]] = []
        for ri, r in enumerate(self.replicas):
            extra = stage_extra[ri] if stage_extra is not None else [{}] * len(r.stages)
            k = (r.micro_batches, tuple((s.tp, s.layers, tuple(sorted(e.items()))) for s, e in zip(r.stages, extra)))
            if k != key:
                rows = [[] for _ in r.stages]
                groups.append({"count": 0, "micro_batches": r.micro_batches, "stages": [
                    dict({"tp": s.tp, "layers": [s.layers[0], s.layers[1]]}, **e, devices=rows[j])
                    for j, (s, e) in enumerate(zip(r.stages, extra))]})
                key = k
            groups[-1]["count"] += 1
            for j, s in enumerate(r.stages):
                rows[j].append([pos[d] for d in s.devices])
        for g in groups:
            for st in g["stages"]:
                st["devices"] = encode_devices(st["devices"])
        return {"nodes": nodes, "replica_groups": groups,
                "unused_devices": segments(sorted(pos[d] for d in self.unused))}

    def to_layout(self) -> Layout:
        return Layout.from_json({"version": PLAN_FORMAT_VERSION, "num_layers": self.num_layers,
                                 "replicas": self.replicas_json()})

    def uniform_dims(self) -> tuple[int, int, int] | None:
        """(tp, pp, dp) when this is a TP x PP x DP grid (same boundaries everywhere), else None.
        Worked out once per plan."""
        d = self.__dict__
        if "_dims" not in d:
            object.__setattr__(self, "_dims", self._uniform_dims())
        return d["_dims"]

    def _uniform_dims(self) -> tuple[int, int, int] | None:
        priced = self.priced_replicas()
        if not priced:
            return None
        first: tuple | None = None
        ids: set[int] = set()  # stage shapes already compared (one object is shared by many replicas)
        for _, key in priced:
            shape = key[0]
            if id(shape) in ids:
                continue
            ids.add(id(shape))
            tl = tuple((t, lay) for t, lay, _ in shape)
            if first is None:
                first = tl
                if any(t != tl[0][0] for t, _ in tl):
                    return None
            elif tl != first:
                return None
        return first[0][0], len(first), len(priced)  # type: ignore[index]


def _stages_text(stages: tuple[tuple[int, tuple[int, int], float], ...]) -> str:
    """``tp8:0-10|tp8:10-20|tp8:20-30`` with runs of three or more stages of the same TP degree and
    layer count folded: ``3x tp8:0+10``. ``stages``: (tp, layers, pace) per stage (a shape key's)."""
    out: list[str] = []
    i = 0
    while i < len(stages):
        tp, (a, b), _ = stages[i]
        j = i + 1
        while j < len(stages) and stages[j][0] == tp and stages[j][1][1] - stages[j][1][0] == b - a:
            j += 1
        if j - i >= 3:
            out.append(f"{j - i}x tp{tp}:{a}+{b - a}")
        else:
            out.extend(f"tp{t}:{lay[0]}-{lay[1]}" for t, lay, _ in stages[i:j])
        i = j
    return "|".join(out)


def device_ranges(names: list[str], limit: int = 4) -> str:
    """Device names summarised: ``node0:0-7`` for a node's consecutive GPUs, ``node0:0-7 .. node9:0-7
    (10 nodes x 8)`` when there are many."""
    per: dict[str, list[int]] = {}
    for n in names:
        node, _, gpu = n.rpartition(":")
        per.setdefault(node, []).append(int(gpu) if gpu.isdigit() else -1)
    parts = []
    for node, gpus in per.items():
        gpus.sort()
        runs, start = [], 0
        for k in range(1, len(gpus) + 1):
            if k == len(gpus) or gpus[k] != gpus[k - 1] + 1:
                runs.append(f"{gpus[start]}" if k - 1 == start else f"{gpus[start]}-{gpus[k - 1]}")
                start = k
        parts.append(f"{node}:{','.join(runs)}")
    if len(parts) <= limit:
        return " ".join(parts)
    sizes = {len(g) for g in per.values()}
    each = f" x {sizes.pop()}" if len(sizes) == 1 else ""
    return f"{parts[0]} .. {parts[-1]} ({len(parts):,} nodes{each})"


def plan_from_document(doc: Mapping[str, Any], cluster: Cluster) -> tuple[Plan, Cluster]:
    """The :class:`Plan` a plan document (``elastor plan --json``) describes and the cluster it was
    made for (its used and unused devices), both numbered like ``cluster`` (the cluster now): node
    ``i`` of both is ``cluster.nodes[i]`` by name; nodes the document names that ``cluster`` no
    longer has follow. Speeds come from ``cluster`` (1.0 on nodes it no longer has). Raises
    :class:`ConfigError` on a malformed document."""
    try:
        with gc_paused():
            return _plan_from_document(doc, cluster)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"previous plan: malformed plan document ({type(e).__name__}: {e}); write one with "
                          f"`elastor plan ... --json`") from None


def _doc_int(v: Any, what: str, lo: Optional[int] = 0) -> int:
    """A plan document's integer field: a JSON integer (not a bool, a string or a float) >= ``lo``
    (None: any; the caller names the fault)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"previous plan: {what} must be an integer{'' if lo is None else f' >= {lo}'} (got "
                          f"{str(v)[:40]!r} of type {type(v).__name__}); regenerate it with `elastor plan ... --json`")
    if lo is not None and v < lo:
        raise ConfigError(f"previous plan: {what} must be >= {lo} (got {v})")
    return v


def _plan_from_document(doc: Mapping[str, Any], cluster: Cluster) -> tuple[Plan, Cluster]:
    from .cluster import Node
    version = doc.get("version", PLAN_FORMAT_VERSION) if isinstance(doc, Mapping) else None
    if isinstance(version, bool) or not isinstance(version, int):   # true and 1.0 are not version 1
        version = None
    if version == COMPACT_FORMAT_VERSION:
        return _plan_from_compact(doc, cluster)
    if version != PLAN_FORMAT_VERSION:
        raise ConfigError(f"previous plan: expected a version-{PLAN_FORMAT_VERSION} or -{COMPACT_FORMAT_VERSION} plan "
                          f"document (a JSON object), got version {doc.get('version') if isinstance(doc, Mapping) else '?'}")
    L = _doc_int(doc["num_layers"], "num_layers", 1)
    if "num_gpus" in doc:   # informational (recomputed), but a document that holds it must hold an integer
        _doc_int(doc["num_gpus"], "num_gpus", 1)
    index = cluster.node_index()
    known: dict[str, Device] = {}
    gone: dict[str, int] = {}
    nodes_seen: dict[str, tuple[int, dict[int, float] | None]] = {}  # node name -> (index, GPU speeds)
    new_device = tuple.__new__

    def device(name: str) -> Device:
        d = known.get(name)
        if d is not None:
            return d
        node, sep, gpu = str(name).rpartition(":")
        if not sep or not gpu.isdigit() or len(gpu) > 7:
            raise ConfigError(f"previous plan: device name {name!r} is not NODE:GPU")
        g = int(gpu)
        seen = nodes_seen.get(node)
        if seen is None:
            ni = index.get(node)
            if ni is None:
                seen = (gone.setdefault(node, len(cluster.nodes) + len(gone)), None)
            else:
                nd = cluster.nodes[ni]
                seen = (ni, dict(zip(nd.gpus, nd.speeds)))
            nodes_seen[node] = seen
        ni, table = seen
        d = known[name] = new_device(Device, (ni, node, g, 1.0 if table is None else table.get(g, 1.0)))
        return d

    if L < 1:
        raise LayoutError(f"num_layers={L}: must be >= 1")
    # Layout.from_json's checks (layers, TP degrees, ranks), made here without building the layout
    reps = []
    shapes: dict[tuple, tuple] = {}
    ranks: list[int] = []
    for ri, rj in enumerate(doc["replicas"]):
        stages = []
        expect = 0
        for si, sj in enumerate(rj["stages"]):
            where = f"replica {ri} stage {si}"
            if "devices" not in sj:   # a layout document (ranks only), e.g. the one a trainer takes
                raise ConfigError(f"previous plan: {where} has no 'devices' (the NODE:GPU names of its ranks): "
                                  f"--from-plan needs the plan document `elastor plan ... --json` writes, which "
                                  f"says where every stage ran")
            devs = tuple(device(n) for n in sj["devices"])
            lay = sj["layers"]
            tp = _doc_int(sj["tp"], f"{where} tp", 1)
            if not isinstance(lay, list) or len(lay) != 2:
                raise ConfigError(f"previous plan: {where} layers must be [first, last_exclusive] (got {str(lay)[:40]})")
            if tp != len(devs):
                raise ConfigError(f"previous plan: {where} lists {len(devs)} devices for tp={tp}")
            first, last = _doc_int(lay[0], f"{where} layers[0]"), _doc_int(lay[1], f"{where} layers[1]")
            if last < first:   # both >= 0 (_doc_int)
                raise LayoutError(f"stage layer range [{first}, {last}) is invalid: need 0 <= first <= last")
            if first != expect:
                raise LayoutError(f"replica {ri} stage {si} starts at layer {first} but the previous stage ends at "
                                  f"{expect}: stages must cover [0, {L}) contiguously")
            expect = last
            if "ranks" in sj:
                rk = [_doc_int(r, f"{where} ranks", None) for r in sj["ranks"]]
                if len(rk) != tp:
                    raise LayoutError(f"stage with tp={tp} lists {len(rk)} ranks {rk}: give exactly tp ranks")
                ranks.extend(rk)
            else:
                ranks.extend(range(len(ranks), len(ranks) + tp))
            stages.append(PlanStage(tp, (first, last), devs))
        if expect != L:
            raise LayoutError(f"replica {ri} covers layers [0, {expect}) but the model has {L}")
        rep = PlanReplica(tuple(stages), _doc_int(rj["micro_batches"], f"replica {ri} micro_batches", 1))
        sk = rep.shape_key()
        object.__setattr__(rep, "_shape", shapes.setdefault(sk, sk))  # one object per shape: pricing folds by id
        reps.append(rep)
    if not reps:
        raise LayoutError("a layout needs at least one replica")
    if sorted(ranks) != list(range(len(ranks))):
        _bad_ranks(ranks)
    unused = tuple(device(n) for n in doc.get("unused_devices", ()))
    if len(known) != sum(len(s.devices) for r in reps for s in r.stages) + len(unused):
        raise ConfigError("previous plan: a device is listed twice")
    kind = "uniform" if doc.get("kind") == "uniform" else "heterogeneous"
    plan = Plan(L, tuple(reps), unused, kind)
    per: dict[int, list[Device]] = {}
    for d in known.values():
        per.setdefault(d.node, []).append(d)
    nodes = []
    for i in range(len(cluster.nodes) + len(gone)):
        devs = sorted(per.get(i, ()), key=lambda d: d.local_id)
        name = cluster.nodes[i].name if i < len(cluster.nodes) else next(k for k, v in gone.items() if v == i)
        nodes.append(Node(name, tuple(d.local_id for d in devs), tuple(d.speed for d in devs)))
    old = Cluster(tuple(nodes), cluster.gpu_memory_gb, cluster.intra_node_bandwidth_gbs,
                  cluster.inter_node_bandwidth_gbs)
    return plan, old


def _plan_from_compact(doc: Mapping[str, Any], cluster: Cluster) -> tuple[Plan, Cluster]:
    """:func:`plan_from_document` of a version-2 document: checked by
    :func:`~elastor_ds.layout.compact_plan.decode`, then one pass over the replica groups; the
    node and pace of every stage and each replica's shape key come from arrays, not from the
    devices one by one. The table's nodes are compared with the cluster's in C-level passes (only
    the changed, gone and slowed ones one by one), its devices are runs of slices of the cluster's
    device tuple (:class:`_DeviceTable`), and each replica's stages are made when first read
    (:class:`_GroupStages`): work per node and per replica group, not per GPU or stage."""
    from .cluster import Node
    cp = decode(doc)
    now = cluster.nodes
    n_now = len(now)
    names, gpus = cp.node_names, cp.node_gpus
    n_tab = len(names)
    sizes = list(map(len, gpus))
    first = list(accumulate(sizes, initial=0))  # per table node: its first position (and one past the last)
    # Per table node, with C-level passes: its index now (by name; n_now where the cluster has no
    # such node), the cluster's node of that name, whether that node has the table's GPU ids
    # (then its devices are the cluster's own) and all of them at speed 1. Only the other nodes
    # (changed, gone, slowed: a few after a failure) are looked at one by one.
    index = cluster.node_index()
    in_order = n_tab == n_now and names == tuple(index)  # the cluster's nodes in its order (a failed node stays listed)
    if in_order:
        nis: list[int] = list(range(n_now))
        have_node: list[Any] = list(now)
        old_nodes: list[Node | None] = list(now)  # the cluster the document was made for, numbered like now
    else:
        nis = list(map(index.get, names, repeat(n_now)))
        have_node = list(map((now + (_NO_NODE,)).__getitem__, nis))
        old_nodes = [None] * n_now
        named = list(map(lt, nis, repeat(n_now)))
        deque(map(old_nodes.__setitem__, compress(nis, named), compress(have_node, named)), 0)
    same = list(map(eq, map(_GPUS, have_node), gpus))
    plain = list(map(eq, map(_SPEEDS, have_node), map(_ONES.__getitem__, sizes)))
    speed_at = np.ones(cp.num_devices, dtype=float)
    gone: list[Node] = []  # nodes the cluster no longer has: numbered after its nodes, speed 1
    fresh: dict[int, tuple[Device, ...]] = {}  # table node -> its devices, where not the cluster's own
    new_device = tuple.__new__
    for t in compress(range(n_tab), map(not_, map(and_, same, plain))):
        ids, k, a = gpus[t], sizes[t], first[t]
        nd = have_node[t]
        if same[t]:  # the cluster's own node and devices, some GPU not at speed 1
            speed_at[a:a + k] = nd.speeds
            continue
        if nis[t] == n_now:
            ni = nis[t] = n_now + len(gone)
            sp = _ONES[k]
            gone.append(Node(names[t], ids, sp))
        else:
            ni = nis[t]
            table = dict(zip(nd.gpus, nd.speeds))
            sp = tuple(table.get(g, 1.0) for g in ids)
            old_nodes[ni] = Node(names[t], ids, sp)
            speed_at[a:a + k] = sp
        fresh[t] = tuple(map(new_device, repeat(Device), zip(repeat(ni), repeat(names[t]), ids, sp)))
    empty: tuple = ()
    if not in_order:
        for i in compress(range(n_now), map(is_, old_nodes, repeat(None))):  # nodes the document does not name
            old_nodes[i] = Node(now[i].name, empty, empty)
    node_idx = np.asarray(nis, dtype=np.int64)
    # the devices of the table as runs of positions: table nodes whose devices are consecutive in
    # the cluster's device tuple (all of it when nothing changed) are a slice of that tuple (shared
    # with it once the cluster has made it), the other nodes' devices were made above
    starts_now = cluster.node_starts()
    if in_order:  # runs: the stretches between the nodes made above
        cuts = sorted(fresh)
        bounds = sorted({0, n_tab, *cuts, *(t + 1 for t in cuts)})
    else:
        size_a = np.asarray(sizes, dtype=np.int64)
        own_a = np.where(np.asarray(same, dtype=bool), np.asarray(starts_now + [0], dtype=np.int64)[
            np.minimum(node_idx, n_now)], -1)
        cut = np.flatnonzero((own_a[1:] < 0) | (own_a[:-1] < 0) | (own_a[1:] != own_a[:-1] + size_a[:-1])) + 1
        bounds = [0] + cut.tolist() + [n_tab]
    runs = [(first[a], fresh[a], 0) if a in fresh else (first[a], None, starts_now[nis[a]]) for a in bounds[:-1]]
    node_of = cp.node_of                   # position -> table node (ascending)
    node_at = node_idx[node_of]            # position -> node index in the cluster now
    devices = _DeviceTable(runs, first[n_tab], cluster, node_at, node_of, names, cp.gpu_of, speed_at)
    all_one = not bool((speed_at != 1.0).any())  # every device at speed 1: every pace 1
    reps: list[PlanReplica] = []
    shapes: dict[tuple, tuple] = {}
    stage_nodes: list[np.ndarray] = []   # (node, replica) of every stage, for Plan.replicas_on
    stage_reps: list[np.ndarray] = []
    for g in cp.groups:
        # stage by stage (stage j of every replica of the group): node, pace and first device
        # position of every replica's stage; the stages themselves are made when first read
        S, n = len(g.stages), g.count
        node_m = np.empty((n, S), dtype=np.int64)
        pace_m = np.empty((n, S), dtype=float)
        first_m = np.empty((n, S), dtype=np.int64)
        rows: list[np.ndarray | None] = []
        for j, s in enumerate(g.stages):
            pos = s.positions
            first_m[:, j] = f0 = pos[:, 0]
            if s.tp == 1 or bool((np.diff(pos, axis=1) == 1).all()):  # consecutive positions: a slice of the table
                rows.append(None)
                # the table lists devices node by node: one node iff the first and last are on it
                node_m[:, j] = np.where(node_of[f0] == node_of[pos[:, -1]], node_at[f0], -1)
            else:  # positions one by one
                rows.append(pos)
                nodes = node_at[pos]
                lo, hi = nodes.min(axis=1), nodes.max(axis=1)
                node_m[:, j] = np.where(lo == hi, lo, -1)
            pace_m[:, j] = 1.0 if all_one else speed_at[pos].min(axis=1)
        flags_m = (node_m[:, :-1] == node_m[:, 1:]) & (node_m[:, 1:] != -1)
        # each replica's shape key (paces, whether neighbouring stages share a node): one object
        # per distinct row of (paces, flags), found by np.unique rather than replica by replica
        both = np.concatenate([pace_m, flags_m], axis=1)
        if bool((both == both[0]).all()):
            first_row, inverse = [0], None
        else:
            _, fr, inverse = np.unique(both, axis=0, return_index=True, return_inverse=True)
            first_row = fr.tolist()
        keys = []
        for r in first_row:
            sk = (tuple([(s.tp, s.layers, v) for s, v in zip(g.stages, pace_m[r].tolist())]),
                  tuple(flags_m[r].tolist()))
            keys.append(shapes.setdefault(sk, sk))
        sks = [keys[0]] * n if inverse is None else list(map(keys.__getitem__, inverse.reshape(-1).tolist()))
        stage_nodes.append(node_m.ravel())
        stage_reps.append(np.repeat(np.arange(len(reps), len(reps) + n, dtype=np.int64), S))
        gs = _GroupStages(tuple((s.tp, s.layers) for s in g.stages), devices, first_m, rows, pace_m, node_m)
        fields = [{"micro_batches": g.micro_batches, "_shape": k, "_lazy": lz}
                  for k, lz in zip(sks, zip(repeat(gs), range(n)))]
        made = list(map(_new_object, repeat(PlanReplica, n)))
        deque(map(_set_attr, made, repeat("__dict__"), fields), 0)
        gs.replicas = made
        reps.extend(made)
    nodes_flat, reps_flat = np.concatenate(stage_nodes), np.concatenate(stage_reps)
    order = np.argsort(nodes_flat, kind="stable")
    by_node = (nodes_flat[order], reps_flat[order])
    # the unused devices (a few): made from the arrays, the same values as the cluster's own
    unused = devices.make(cp.unused)
    kind = "uniform" if doc.get("kind") == "uniform" else "heterogeneous"
    plan = Plan(cp.num_layers, tuple(reps), unused, kind)
    object.__setattr__(plan, "_by_node", by_node)
    old = Cluster(tuple(old_nodes) + tuple(gone), cluster.gpu_memory_gb, cluster.intra_node_bandwidth_gbs,
                  cluster.inter_node_bandwidth_gbs)
    return plan, old


def _bad_ranks(ranks: list[int]) -> None:
    """Raise what :class:`~elastor_ds.layout.Layout` says of ranks that are not ``0..n-1`` once each."""
    seen: set[int] = set()
    for r in ranks:
        if r < 0:
            raise LayoutError(f"rank {r} is negative")
        if r in seen:
            raise LayoutError(f"rank {r} appears twice: every rank holds one place")
        seen.add(r)
    raise LayoutError(f"ranks must be 0..{len(seen) - 1} without gaps; {gap_report(seen, len(seen))}")


def _canonical(d: Device) -> tuple[int, int]:
    return d.node, d.local_id


def _scored_json(plan: Plan, cost: Any, num_micro_batches: int, micro_batch_size: int,
                 compact: bool = False) -> dict[str, Any]:
    """Plan + cost as the version-1 document, or version 2 (``compact``: replica groups and device
    ranges) (``cost`` is a :class:`~.cost.CostBreakdown`)."""
    gib = float(1 << 30)
    extra = [[{"memory_gb": round(rc.stage_memory_bytes[j] / gib, 3),
               "time_per_micro_batch_s": rc.stage_times_s[j]}
              for j in range(len(rep.stages))]
             for rep, rc in zip(plan.replicas, cost.replicas)]
    t = cost.iteration_time_s
    doc: dict[str, Any] = {
        "version": PLAN_FORMAT_VERSION,
        "kind": plan.kind,
        "num_gpus": plan.num_gpus,
        "num_layers": plan.num_layers,
        "num_micro_batches": num_micro_batches,
        "micro_batch_size": micro_batch_size,
        "predicted_iteration_time_s": t,
        "predicted_samples_per_s": num_micro_batches * micro_batch_size / t if t > 0 else None,
        "description": plan.describe(),
    }
    if compact:
        doc["version"] = COMPACT_FORMAT_VERSION
        doc.update(plan.compact_json(extra))
        cb = cost.to_dict()
        cb["replica_groups"] = [dict(r, count=n) for r, n in fold_runs(cb.pop("replicas"))]
        doc["cost_breakdown"] = cb
    else:
        doc["replicas"] = plan.replicas_json(extra)
        doc["unused_devices"] = [d.name for d in plan.unused]
        doc["cost_breakdown"] = cost.to_dict()
    dims = plan.uniform_dims()
    if dims is not None:
        doc["tp"], doc["pp"], doc["dp"] = dims
        doc["boundaries"] = [s.layers[0] for s in plan.replicas[0].stages] + [plan.num_layers]
    return doc


def plan_document(result: Any, num_micro_batches: int, micro_batch_size: int,
                  inputs: dict[str, Any] | None = None, compact: bool = False) -> dict[str, Any]:
    """The full plan document of a :class:`~.search.PlanResult`: the chosen plan at top level,
    the best uniform plan under ``uniform_baseline`` and the runners-up under ``alternatives``.
    ``compact``: version 2 (replica groups and device ranges, :mod:`~elastor_ds.layout.compact_plan`),
    what ``elastor plan --json`` writes above :data:`COMPACT_ABOVE_GPUS` GPUs."""
    best = result.best
    doc = _scored_json(best.plan, best.cost, num_micro_batches, micro_batch_size, compact)
    doc["num_usable_gpus"] = result.num_usable()
    if result.uniform is not None:
        u = _scored_json(result.uniform.plan, result.uniform.cost, num_micro_batches, micro_batch_size, compact)
        doc["uniform_baseline"] = u
        doc["speedup_vs_uniform"] = u["predicted_iteration_time_s"] / doc["predicted_iteration_time_s"]
    else:
        doc["uniform_baseline"] = None
        doc["speedup_vs_uniform"] = None
    doc["alternatives"] = [{"kind": a.plan.kind, "description": a.plan.describe(), "num_gpus": a.plan.num_gpus,
                            "predicted_iteration_time_s": a.cost.iteration_time_s} for a in result.alternatives]
    if inputs is not None:
        doc["inputs"] = inputs
    doc["fingerprint"] = best.plan.layout_fingerprint()  # the layout of the replicas just written
    return doc
