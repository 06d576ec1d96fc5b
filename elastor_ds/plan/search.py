"""Strategy search: the best plan for the GPUs that are left, heterogeneous or uniform.

Steps (:func:`plan`):

1. **TP groups** (per node, power-of-two sizes <= nominal TP that divide the heads, query groups and
   FFN width; never across nodes). GPUs of a node are sorted by speed (fastest first, then id) and
   carved largest group first, so slow GPUs end up together in small groups. Candidate groupings:
   every node greedy with a cap ``c`` (7 GPUs, cap 4 -> 4+2+1; cap 2 -> 2+2+2+1), full nodes and
   short nodes with different caps, and on small clusters every partition of every node (exhaustive).
2. **Replicas from groups.** Small clusters (<= 8 groups): *exhaustive* over every multiset
   partition of the groups into replicas, including leaving groups idle. Larger clusters:
   *heuristic* LPT (largest capacity first to the replica with least capacity) for many replica
   counts ``R`` (so the DP degree may change), coarse grid then local refinement around the best.
   LPT runs on classes with multiplicities, so identical nodes cost nothing extra.
3. **Stage order** per replica: *exhaustive* over distinct orders when there are <= 120 of them,
   otherwise a few heuristic orders (TP descending / ascending, fastest last).
4. **Layer split** per replica: *exact* dynamic program minimising the slowest stage under each
   stage's memory limit (``f[j][k] = min_n max(f[j-1][k-n], c_j(n))`` with ``n <= n_max(j)``).
   Cached per (replica signature, R): identical replicas are solved once.
5. **Micro-batches**: *exact* minimisation of ``max_i (o_i m_i + b_i)`` with ``sum m_i = M`` and
   ``m_i >= 1`` (``o_i`` slowest stage, ``b_i`` bubble + transfer): start from the continuous lower
   bound, then the greedy that always increments the replica whose next value is smallest. Optimal:
   whenever it would step above the optimum ``T*``, every replica already holds the most
   micro-batches it can within ``T*``, and those sum to ``>= M``.
6. **Placement**: slots in order of (first layer, replica) take groups of their class in node
   order, so the replicas of a layer share a node where possible (gradient sync stays on NVLink).
   The best few candidates by estimate are placed and priced exactly by
   :meth:`CostModel.evaluate`.
7. **Uniform baseline**: every TP x PP x DP grid (every DP dividing ``M``, GPUs may stay idle,
   uneven stage boundaries from the same DP; a grid whose lower bound cannot make the best few
   estimates is not split). A grid of more than one stage is priced at ZeRO-1 at most (DeepSpeed's
   PipelineEngine refuses ZeRO-2/3). The better of the two is returned, with both predictions.

Everything iterates in sorted order and breaks ties on explicit keys: same inputs, same plan.
Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from ..errors import PlanningError
from .cluster import Cluster, Device
from .comm_cost import CollectiveKind
from .cost import HETERO_MAX_ZERO, GiB, CostBreakdown, CostModel
from .gcpause import gc_paused
from .lazy_plan import place_lazily
from .plan_doc import Plan, PlanReplica, PlanStage
from .scored import ScoredPlan

log = logging.getLogger(__name__)

ClassKey = tuple[int, float]  # (tp, speed)


class Group(NamedTuple):
    """A TP group: ``tp`` GPUs of one node; runs at its slowest GPU's speed. Make one with
    :meth:`of`, which works out its class ``key`` and node-order ``sort_key`` once (a named tuple:
    a 131,072-GPU cluster has tens of thousands of groups)."""

    devices: tuple[Device, ...]
    tp: int
    speed: float
    node: int
    key: ClassKey
    sort_key: tuple[int, int]

    @staticmethod
    def of(devices: tuple[Device, ...]) -> "Group":
        sp = min(d.speed for d in devices)
        first = devices[0]
        return tuple.__new__(Group, (devices, len(devices), sp, first.node, (len(devices), sp),
                                     (first.node, first.local_id)))


@dataclass(frozen=True)
class ReplicaSolution:
    """Best stage order and layer split of one replica signature."""

    order: tuple[ClassKey, ...]
    counts: tuple[int, ...]
    slowest: float
    p2p: float

    @property
    def num_stages(self) -> int:
        return len(self.order)


class GroupPool:
    """The TP groups of one way of cutting every node (a *grouping*), made on first use: the search
    prices class counts; only the candidates it places need the groups themselves."""

    def __init__(self, make: "Callable[[], list[Group]]", classes: Sequence[ClassKey], counts: Sequence[int],
                 key: tuple, nodes: "Callable[[], dict[ClassKey, np.ndarray]] | None" = None,
                 positions: "Callable[[], dict[ClassKey, np.ndarray]] | None" = None) -> None:
        self._make = make
        self._nodes = nodes
        self._positions = positions
        self._groups: tuple[Group, ...] | None = None
        self._class_nodes: dict[ClassKey, np.ndarray] | None = None
        self._class_positions: dict[ClassKey, np.ndarray] | None = None
        self.classes, self.counts, self.key = tuple(classes), tuple(counts), key

    def class_nodes(self) -> dict[ClassKey, np.ndarray]:
        """Per class, the node of each of its groups in node order (what :meth:`groups` would
        give), without making the groups when the pool knows how."""
        if self._class_nodes is None:
            if self._nodes is not None and self._groups is None:
                self._class_nodes = self._nodes()
            else:
                per: dict[ClassKey, list[int]] = {}
                for g in self.groups:
                    per.setdefault(g.key, []).append(g.node)
                self._class_nodes = {k: np.asarray(v, dtype=np.int64) for k, v in per.items()}
        return self._class_nodes

    def class_positions(self, devices: Sequence[Device]) -> dict[ClassKey, np.ndarray]:
        """Per class, the devices of each of its groups in node order (the rows of :meth:`groups`
        of that class) as positions in ``devices`` (the cluster's :meth:`~.cluster.Cluster.device_tuple`):
        a (groups, tp) integer array; without making the groups when the pool knows how."""
        if self._class_positions is None:
            if self._positions is not None and self._groups is None:
                self._class_positions = self._positions()
            else:
                at = {(d.node, d.local_id): i for i, d in enumerate(devices)}
                per: dict[ClassKey, list[list[int]]] = {}
                for g in self.groups:
                    per.setdefault(g.key, []).append([at[(d.node, d.local_id)] for d in g.devices])
                self._class_positions = {k: np.asarray(v, dtype=np.int64) for k, v in per.items()}
        return self._class_positions

    @property
    def groups(self) -> tuple[Group, ...]:
        if self._groups is None:
            gs = self._make()
            gs.sort(key=lambda g: g.sort_key)
            self._groups = tuple(gs)
        return self._groups

    @property
    def num_groups(self) -> int:
        return sum(self.counts)

    @property
    def num_gpus(self) -> int:
        return sum(c[0] * n for c, n in zip(self.classes, self.counts))


@dataclass(frozen=True)
class Candidate:
    """A plan before placement: replica kinds with multiplicities and micro-batches."""

    estimate: float
    kinds: tuple[tuple[ReplicaSolution, int, int], ...]  # (solution, micro_batches, how many replicas)
    pool: GroupPool                                      # the groups the replicas are placed on
    tie: tuple = ()

    @property
    def num_replicas(self) -> int:
        return sum(n for _, _, n in self.kinds)

    @property
    def groups(self) -> tuple[Group, ...]:
        return self.pool.groups


@dataclass
class PlanResult:
    """The chosen plan, the best uniform plan, and the runners-up (best first)."""

    best: ScoredPlan
    uniform: ScoredPlan | None
    heterogeneous: ScoredPlan | None
    alternatives: list[ScoredPlan] = field(default_factory=list)
    usable: tuple[Device, ...] = ()
    search_stats: dict = field(default_factory=dict)
    cluster: Cluster | None = None  # the cluster planned for (``usable`` may be left empty then)

    def num_usable(self) -> int:
        return len(self.usable) if self.usable or self.cluster is None else self.cluster.num_gpus


# ---- step 1: TP groups ------------------------------------------------------------------------
def greedy_parts(n: int, cap: int) -> tuple[int, ...]:
    """Largest power-of-two parts <= cap summing to n (7, cap 4 -> (4, 2, 1))."""
    out, t = [], cap
    while n > 0:
        while t > n:
            t //= 2
        out.append(t)
        n -= t
    return tuple(out)


def all_parts(n: int, tps: Sequence[int]) -> list[tuple[int, ...]]:
    """Every partition of n into allowed sizes, parts non-increasing, largest parts first."""
    sizes = sorted(tps, reverse=True)
    out: list[tuple[int, ...]] = []

    def rec(rem: int, mx: int, acc: list[int]) -> None:
        if rem == 0:
            out.append(tuple(acc))
            return
        for s in sizes:
            if s <= mx and s <= rem:
                acc.append(s)
                rec(rem - s, s, acc)
                acc.pop()

    rec(n, sizes[0] if sizes else 0, [])
    return out


def carve(devices: Sequence[Device], parts: Sequence[int], large_fast: bool = True) -> list[Group]:
    """Cut one node's devices into groups of the given sizes, GPUs of similar speed together: the
    fastest GPUs go into the largest groups (``large_fast``) or into the smallest ones."""
    devs = list(devices)
    if any(d.speed != devs[0].speed for d in devs) or any(a.local_id > b.local_id for a, b in zip(devs, devs[1:])):
        devs.sort(key=lambda d: (-d.speed, d.local_id))
    out, i = [], 0
    for p in sorted(parts, reverse=large_fast):
        part = devs[i:i + p]
        if any(a.local_id > b.local_id for a, b in zip(part, part[1:])):
            part.sort(key=lambda d: d.local_id)
        out.append(Group.of(tuple(part)))
        i += p
    return out


def node_devices(cluster: Cluster) -> list[list[Device]]:
    """Each node's devices, GPU ids ascending: slices of :meth:`Cluster.device_tuple`, which lists
    them node by node."""
    devs = cluster.device_tuple()
    per: list[list[Device]] = []
    i = 0
    for n in cluster.nodes:
        k = len(n.gpus)
        per.append(list(devs[i:i + k]))
        i += k
    return per


def grouping_candidates(cluster: Cluster, tps: Sequence[int], exhaustive: bool) -> list[tuple[tuple[int, ...], ...]]:
    """Per-node part lists. Exhaustive on small clusters, else capped-greedy combinations."""
    counts = [len(n.gpus) for n in cluster.nodes]
    seen: set = set()
    out = []
    if exhaustive:
        per_node = [all_parts(c, tps) if c else [()] for c in counts]
        for combo in itertools.product(*per_node):
            if combo not in seen:
                seen.add(combo)
                out.append(combo)
        return out
    full = max(counts, default=0)
    for cf in sorted(tps, reverse=True):
        for cd in sorted(tps, reverse=True):
            combo = tuple(greedy_parts(c, cf if c == full else cd) for c in counts)
            if combo not in seen:
                seen.add(combo)
                out.append(combo)
    return out


# ---- step 4: exact layer split ----------------------------------------------------------------
def _stage_values(per_layer: Sequence[float], extra: Sequence[float], max_layers: Sequence[int],
                  L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(a, e, caps, vals)``: ``vals[j, n - 1] = n * per_layer[j] + extra[j]`` for ``n <= caps[j]``
    (``caps`` = ``max_layers`` capped at ``L``), ``inf`` beyond; every row ascending."""
    a = np.asarray(per_layer, dtype=float)
    e = np.asarray(extra, dtype=float)
    mx = np.minimum(np.asarray(max_layers), L)
    n = np.arange(1, L + 1)
    vals = n[None, :] * a[:, None] + e[:, None]
    vals[n[None, :] > mx[:, None]] = math.inf
    return a, e, mx, vals


def _min_max(vals: np.ndarray, k: int) -> float:
    """The min-max time of ``k`` layers over the stages of ``vals`` (rows of :func:`_stage_values`),
    each stage at least one layer: a bound ``T`` admits such a split iff every stage can hold one
    layer within ``T`` and together they can hold ``k`` (a stage holds any count from 1 up to the
    number of its values <= ``T``). So the optimum is the larger of the slowest one-layer stage and
    the ``k``-th smallest of all values (inf when none)."""
    return max(float(vals[:, 0].max()), float(np.partition(vals.ravel(), k - 1)[k - 1]))


def split_layers(per_layer: Sequence[float], extra: Sequence[float], max_layers: Sequence[int],
                 num_layers: int) -> tuple[float, tuple[int, ...]] | None:
    """Exact min-max split of ``num_layers`` contiguous layers over stages in order.

    Stage ``j`` with ``n`` layers costs ``n * per_layer[j] + extra[j]`` and may hold
    ``1 <= n <= max_layers[j]``. Returns (slowest stage time, layers per stage) or None when no
    split fits. Ties go as in the dynamic program over (stage, layers placed) ``f[j][k] = min_n
    max(f[j-1][k-n], c_j(n))``: from the last stage back, each stage takes the smallest count that
    keeps its prefix at the prefix's own optimum ``f[j][k]``. Both the optimum and that count
    follow from :func:`_min_max` (the smallest ``n`` with ``k - n`` no more than the layers the
    stages before can hold within ``f[j][k]``), so no table is built: O(S) partial sorts.
    """
    S, L = len(per_layer), num_layers
    if S > L or any(m < 1 for m in max_layers):
        return None
    vals = _stage_values(per_layer, extra, max_layers, L)[3]
    top = _min_max(vals, L)
    if not math.isfinite(top):
        return None
    counts = [0] * S
    rem, v = L, top
    for j in range(S - 1, 0, -1):
        head = vals[:j]
        c = max(1, rem - int(np.count_nonzero(head <= v)))
        counts[j] = c
        rem -= c
        v = _min_max(head, rem)
    counts[0] = rem
    return top, tuple(counts)


def split_layers_parametric(per_layer: Sequence[float], extra: Sequence[float], max_layers: Sequence[int],
                            num_layers: int) -> tuple[float, tuple[int, ...]] | None:
    """Same optimum as :func:`split_layers`; the split gives later stages as many layers as they
    can take (better for long pipelines: later stages keep fewer activations). The bound is the
    smallest value ``n * per_layer[j] + extra[j]`` at which every stage can take one layer and
    together they can take ``num_layers``, counting with a relative tolerance of 1e-12 (a value a
    rounding error above the bound still counts). :func:`_min_max` gives the exact bound; the
    tolerance can only lower it by a rounding error, so only the values just below it are tried."""
    S, L = len(per_layer), num_layers
    if S > L or any(m < 1 for m in max_layers):
        return None
    a, e, mx, vals = _stage_values(per_layer, extra, max_layers, L)
    if int(mx.sum()) < L:
        return None

    def take(T: float) -> np.ndarray:
        return np.minimum(mx, np.floor((T - e) / a * (1 + 1e-12) + 1e-9)).astype(np.int64)

    exact = _min_max(vals, L)
    if not math.isfinite(exact):  # every stage holds a layer and together L (checked above): the times overflowed
        raise PlanningError(f"the stage times overflow a float (per layer {float(a.max()):.4g} s, fixed "
                            f"{float(e.max()):.4g} s): a profile or cluster figure is far out of range; check "
                            f"--profile and the GPU speeds")
    flat = vals.ravel()
    near = flat[(flat <= exact) & (flat >= exact - 1e-8 * (float(a.max()) + abs(exact)))]
    cap = None
    # ascending, each once (sorted(set()): np.unique's first call imports numpy.ma, 20-30 ms); ``exact``
    # is among them, always feasible
    for T in (near.tolist() if near.size == 1 else sorted(set(near.tolist()))):
        t = take(T)
        if t.min() >= 1 and t.sum() >= L:
            cap = t
            break
    if cap is None:  # pragma: no cover - the exact bound counts at least as many layers
        raise PlanningError(f"the layer split's bound {exact!r} s admits no split (a rounding fault of the stage "
                            f"times per layer {a.tolist()[:8]!r}): check --profile and the GPU speeds")
    counts = [1] * S
    rem = L - S
    capl = cap.tolist()
    for j in range(S - 1, -1, -1):  # fill from the back (later stages keep fewer activations)
        add = min(capl[j] - 1, rem)
        counts[j] += add
        rem -= add
    al, el = a.tolist(), e.tolist()  # Python floats: the same products and sums as numpy's
    slow = max(c * al[j] + el[j] for j, c in enumerate(counts))
    return float(slow), tuple(counts)


# ---- step 5: exact micro-batch assignment -----------------------------------------------------
def assign_micro_batches(kinds: Sequence[tuple[float, float, int]], total: int) -> list[list[tuple[int, int]]] | None:
    """Minimise ``max (o m + b)`` over replicas with ``sum m = total``, ``m >= 1``.

    ``kinds`` lists ``(o, b, count)`` for groups of identical replicas. Returns, per kind, a list of
    ``(m, how many replicas get m)``, larger m first; None if there are more replicas than
    micro-batches. Exact (see module docstring, step 5).
    """
    R = sum(c for _, _, c in kinds)
    if R > total or R == 0:
        return None
    lo = max(o + b for o, b, _ in kinds)
    # the continuous optimum: above ``lo`` every replica holds (T - b) / o >= 1 micro-batches, so
    # sum c (T - b) / o = total is linear in T; a hair below it, every replica's count that fits
    # (o m + b <= T) is part of the optimum, and the greedy below adds the rest in order
    inv = sum(c / o for o, _, c in kinds)
    if sum(c * (lo - b) / o for o, b, c in kinds) < total:
        lo = max(lo, (total + sum(c * b / o for o, b, c in kinds)) / inv * (1 - 1e-9))
    ms = [_most_within(o, b, lo, total) for o, b, _ in kinds]
    if sum(m * c for m, (_, _, c) in zip(ms, kinds)) > total:  # float safety net
        ms = [1] * len(kinds)
    rem = total - sum(m * c for m, (_, _, c) in zip(ms, kinds))
    heap = [(o * (m + 1) + b, q, m, c) for q, (m, (o, b, c)) in enumerate(zip(ms, kinds))]
    heapq.heapify(heap)
    out: list[list[tuple[int, int]]] = [[] for _ in kinds]
    while rem > 0:
        _, q, m, c = heapq.heappop(heap)
        o, b, _ = kinds[q]
        if c <= rem:
            rem -= c
            heapq.heappush(heap, (o * (m + 2) + b, q, m + 1, c))
        else:
            out[q].append((m + 1, rem))
            out[q].append((m, c - rem))
            rem = 0
    for _, q, m, c in heap:
        out[q].append((m, c))
    return [sorted(x, reverse=True) for x in out]


def _most_within(o: float, b: float, T: float, most: int) -> int:
    """The largest ``m`` in ``1..min(floor((T - b) / o), most)`` with ``o m + b <= T`` (1 when none):
    the quotient rounded down, then made exact by bisection (``o m + b`` is non-decreasing in ``m``
    in floats too, as rounding is monotone). A quotient far above ``most`` (a replica a million
    times faster than another) or one that is not finite costs nothing: before, a count of 1e200
    was stepped down by one while the float product did not change, for ever."""
    x = (T - b) / o
    hi = max(1, int(x)) if x < most else most   # NaN and inf: the whole range
    if hi == 1 or o * hi + b <= T:
        return hi
    lo = 1                                      # hi does not fit; lo fits, or it is 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if o * mid + b <= T:
            lo = mid
        else:
            hi = mid
    return lo


# ---- the searcher -----------------------------------------------------------------------------
class Planner:
    """Runs the search for one cost model; caches replica sub-problems across candidates."""

    SMALL_GROUPS = 8        # exhaustive replica partitions up to this many groups
    MAX_ORDERS = 120        # exhaustive stage orders up to this many distinct orders
    LARGE_GPUS = 4096       # from here on: fewer candidates priced exactly (each costs O(GPUs))

    def __init__(self, cost: CostModel, top_k: int = 3) -> None:
        self.cost = cost
        self.model, self.training, self.cluster = cost.model, cost.training, cost.cluster
        self.L = self.model.num_layers
        self.M = self.training.num_micro_batches
        self.tps = self.training.valid_tps(self.model)
        self.top_k = max(1, top_k)
        self._rep_cache: dict = {}
        self._split_cache: dict = {}
        self._mx_cache: dict = {}
        self._extra_cache: dict = {}  # TP degrees of a replica's stages -> their extra times
        self._order_info: dict = {}   # order -> per-layer times, extra times, TP degrees, distinct TPs
        self._orders_cache: dict = {}  # signature -> stage orders tried
        self._sol_info: dict = {}     # (order, counts) -> (candidate sort key, largest share of a sync)
        self._per_node: list[list[Device]] | None = None
        self.max_orders = self.MAX_ORDERS if self.cluster.num_gpus <= 64 else 6
        self.node_gpus = self.cluster.max_gpus_per_node
        self.large = self.cluster.num_gpus > self.LARGE_GPUS
        self.stats = {"candidates": 0, "replica_subproblems": 0, "splits": 0, "groupings": 0}
        self.single_node = sum(1 for _ in itertools.islice(filter(None, map(len, map(_gpus, self.cluster.nodes))),
                                                   2)) <= 1
        # nodes by type: the multiset of their GPU speeds (fastest first); the cost model sees a
        # node only through it, so groupings and class counts are worked out once per type
        self._types_cache: dict[tuple[float, ...], list[int]] | None = None

    @property
    def _devices(self) -> tuple[Device, ...]:
        return self.cluster.device_tuple()

    @property
    def _types(self) -> dict[tuple[float, ...], list[int]]:
        if self._types_cache is None:
            # nodes by the identity of their speeds tuple first (nodes made alike share one), then
            # those tuples by type; each type's nodes ascending, types in order of their first node
            by_id: dict[int, tuple[tuple[float, ...], list[int]]] = {}
            for i, sp in enumerate(map(_speeds, self.cluster.nodes)):
                e = by_id.get(id(sp))
                if e is None:
                    e = by_id[id(sp)] = (sp, [])
                e[1].append(i)
            merged: dict[tuple[float, ...], list[list[int]]] = {}
            for sp, idx in by_id.values():  # in order of first node
                merged.setdefault(tuple(sorted(sp, reverse=True)), []).append(idx)
            types: dict[tuple[float, ...], list[int]] = {}
            for key, lists in sorted(merged.items(), key=lambda kv: kv[1][0][0]):
                types[key] = lists[0] if len(lists) == 1 else sorted(i for lst in lists for i in lst)
            self._types_cache = types
        return self._types_cache

    def per_node(self) -> list[list[Device]]:
        if self._per_node is None:
            self._per_node = node_devices(self.cluster)
        return self._per_node

    # -- replica sub-problem --------------------------------------------------------------------
    def _solve_order(self, order: tuple[ClassKey, ...], R: int,
                     zero: int | None = None) -> tuple[float, tuple[int, ...]] | None:
        S, L = len(order), self.L
        info = self._order_info.get(order)
        if info is None:  # what the split needs besides the memory caps: once per order
            c = self.cost
            tps = tuple(tp for tp, _ in order)
            per = [c.layer_time(tp) / sp for tp, sp in order]
            extra = list(self._extra_times(tps))
            extra[-1] += c.head_time(order[-1][0]) / order[-1][1]
            info = self._order_info[order] = (per, extra, tps, tuple(sorted(set(tps))))
        per, extra, tps, widths = info
        caps = self.cost.max_layers_all
        if len(widths) == 1:
            mx = caps(widths[0], S, R, zero)
            if max(mx) > L:
                mx = tuple(min(v, L) for v in mx)
        else:
            tables = {tp: caps(tp, S, R, zero) for tp in widths}
            mx = tuple(min(tables[tp][j], L) for j, tp in enumerate(tps))
        key = (order, mx)  # R and ZeRO matter only through the memory caps
        res = self._split_cache.get(key, self)
        if res is not self:
            return res
        self.stats["splits"] += 1
        res = _split(per, extra, mx, self.L)
        self._split_cache[key] = res
        return res

    def _extra_times(self, tps: tuple[int, ...]) -> tuple[float, ...]:
        """:meth:`~.cost.CostModel.stage_extra_time` of every stage of a replica with TP degrees
        ``tps`` (once per ``tps``)."""
        v = self._extra_cache.get(tps)
        if v is None:
            c = self.cost
            if c.measured(CollectiveKind.P2P) is None and c.measured(CollectiveKind.TP_ALL_REDUCE) is None:
                # nothing measured: only the first stage's embedding (stage_extra_time gives 0.0 for the rest)
                v = (c.stage_extra_time(tps, 0),) + (0.0,) * (len(tps) - 1)
            else:
                v = tuple(c.stage_extra_time(tps, j) for j in range(len(tps)))
            self._extra_cache[tps] = v
        return v

    def _max_layers(self, tp: int, pos: int, S: int, R: int, zero: int | None = None) -> int:
        key = (tp, pos, S, R, zero)
        v = self._mx_cache.get(key)
        if v is None:
            v = self._mx_cache[key] = self.cost.max_layers(tp, pos, S, R, zero)
        return v

    def _orders(self, sig: tuple[ClassKey, ...]) -> list[tuple[ClassKey, ...]]:
        out = self._orders_cache.get(sig)
        if out is None:
            out = self._orders_cache[sig] = self._make_orders(sig)
        return out

    def _make_orders(self, sig: tuple[ClassKey, ...]) -> list[tuple[ClassKey, ...]]:
        counts: dict[ClassKey, int] = {}
        for k in sig:
            counts[k] = counts.get(k, 0) + 1
        if len(counts) == 1:
            return [sig]
        n_orders = math.factorial(len(sig))
        for v in counts.values():
            n_orders //= math.factorial(v)
        if n_orders <= self.max_orders:
            return sorted(_distinct_permutations(counts), key=_order_key)
        desc = tuple(sorted(sig, key=lambda k: (-k[0], -k[1])))
        asc = tuple(reversed(desc))
        fast_last = tuple(sorted(sig, key=lambda k: (k[1], -k[0])))
        return sorted({desc, asc, fast_last}, key=_order_key)

    def solve_replica(self, sig: tuple[ClassKey, ...], R: int) -> ReplicaSolution | None:
        """Best (order, split) for a replica made of the groups in ``sig`` (exact over the orders tried)."""
        if len(sig) > self.L:
            return None  # every stage needs at least one layer
        Rk = R if self.training.zero_stage > 0 else 1
        zero = min(self.training.zero_stage, HETERO_MAX_ZERO)  # the heterogeneous runtime's ZeRO (see cost)
        key = (sig, Rk)
        if key in self._rep_cache:
            return self._rep_cache[key]
        self.stats["replica_subproblems"] += 1
        best = None
        gpus = sum(tp for tp, _ in sig)
        same = gpus <= self.cluster.max_gpus_per_node
        for order in self._orders(sig):
            res = self._solve_order(order, Rk, zero)
            if res is None:
                continue
            slow, counts = res
            if best is None or slow < best.slowest:
                p2p = (len(order) - 1) * self.cost.fill_drain_p2p(same)
                best = ReplicaSolution(order, counts, slow, p2p)
        self._rep_cache[key] = best
        return best

    # -- candidates -----------------------------------------------------------------------------
    def _candidate(self, reps: Sequence[tuple[tuple[ClassKey, ...], int]], pool: GroupPool,
                   tie: tuple) -> Candidate | None:
        """Price replica signatures (with multiplicities) quickly: exact compute/bubble/micro-batches,
        estimated transfer and sync (placement is not known yet)."""
        self.stats["candidates"] += 1
        R = sum(n for _, n in reps)
        if R < 1 or R > self.M:
            return None
        sols = []
        for sig, n in reps:
            s = self.solve_replica(sig, R)
            if s is None:
                return None
            sols.append((s, n))
        kinds = [(s.slowest, (s.num_stages - 1) * s.slowest + s.p2p, n) for s, n in sols]
        mbs = assign_micro_batches(kinds, self.M)
        if mbs is None:
            return None
        pipe = max(o * lst[0][0] + b for (o, b, _), lst in zip(kinds, mbs))
        # a layer's holders can share a node when one stage of every replica fits on a node
        sync = self._sync_estimate([s for s, _ in sols], R, sum(n * max(tp for tp, _ in s.order) for s, n in sols))
        out = []
        for (s, _), lst in zip(sols, mbs):
            for m, n in lst:
                out.append((s, m, n))
        if len(out) > 1:
            out.sort(key=lambda x: (self._solution_info(x[0])[0], -x[1]))
        return Candidate(pipe + sync, tuple(out), pool, tie)

    def _solution_info(self, s: ReplicaSolution) -> tuple[tuple, float]:
        """(sort key of the solution in a candidate, largest parameters per GPU of one of its
        stages, embedding and output layer included): once per solution."""
        key = (s.order, s.counts)
        v = self._sol_info.get(key)
        if v is None:
            m = self.model
            S = s.num_stages
            share = 0.0
            for j, ((tp, _), n) in enumerate(zip(s.order, s.counts)):
                p = n * m.params_per_layer
                if j == 0:
                    p += m.embedding_params
                if j == S - 1 and not (m.tied_embeddings and S == 1):
                    p += m.embedding_params
                share = max(share, p / tp)
            v = self._sol_info[key] = ((-sum(t for t, _ in s.order), _order_key(s.order), s.counts), share)
        return v

    def _sync_estimate(self, sols: Sequence[ReplicaSolution], R: int, used_gpus: int) -> float:
        f = self.cost.sync_bytes_factor(R)
        if f == 0.0:
            return 0.0
        m = self.model
        zero = min(self.training.zero_stage, HETERO_MAX_ZERO)
        if all(self.cost.measured(k) is not None for k in self.cost._sync_kinds(zero)):
            # measured per-call costs: one call per holder set; a stage of width t meets about
            # max_tp / t block sets plus one set for its replicated tensors (norms) when t > 1
            max_tp = max(tp for s in sols for tp, _ in s.order)
            worst = 0.0
            for s in sols:
                S = s.num_stages
                for j, ((tp, _), n) in enumerate(zip(s.order, s.counts)):
                    p = n * m.params_per_layer + (m.embedding_params if j == 0 else 0) + \
                        (m.embedding_params if j == S - 1 and not m.tied_embeddings else 0)
                    calls = max(1, max_tp // tp) + (1 if tp > 1 else 0)
                    nbytes = p / tp * self.training.grad_bytes / calls
                    worst = max(worst, calls * self.cost.sync_call_time(R, nbytes, zero))
            return worst
        same = used_gpus <= self.cluster.max_gpus_per_node
        bw = self.cost.bandwidth(same) * 1e9
        # the slowest stage holds the most parameters per GPU (x f / bw is monotone, in floats too)
        return max(0.0, max(self._solution_info(s)[1] for s in sols) * f / bw)

    # -- heterogeneous --------------------------------------------------------------------------
    def groupings(self) -> list[GroupPool]:
        """Ways to cut every node into TP groups, each once (see step 1). Small clusters: every
        partition of every node; larger ones: capped-greedy parts per node type."""
        n_gpus = self.cluster.num_gpus
        mixed = len({sp for t in self._types for sp in t}) > 1
        flags = (True, False) if mixed else (True,)
        out: list[GroupPool] = []
        seen: set = set()
        if n_gpus <= self.SMALL_GROUPS:
            per_node = self.per_node()
            for combo in grouping_candidates(self.cluster, self.tps, True):
                for large_fast in flags:
                    groups: list[Group] = []
                    for devs, parts in zip(per_node, combo):
                        groups.extend(carve(devs, parts, large_fast))
                    sig = tuple(sorted((g.node, g.key) for g in groups))
                    if sig in seen:
                        continue
                    seen.add(sig)
                    classes, counts = _class_counts([g.key for g in groups])
                    out.append(GroupPool(lambda gs=tuple(groups): list(gs), classes, counts, sig))
            return out
        full = self.cluster.max_gpus_per_node
        tps = sorted(self.tps, reverse=True)
        for cf in tps:
            for cd in tps:
                for large_fast in flags:
                    parts = {t: greedy_parts(len(t), cf if len(t) == full else cd) for t in self._types}
                    keys: list[ClassKey] = []
                    mult: list[int] = []
                    for t, nodes in self._types.items():
                        for k in _type_classes(t, parts[t], large_fast):
                            keys.append(k)
                            mult.append(len(nodes))
                    sig = tuple(sorted((t, tuple(_type_classes(t, parts[t], large_fast))) for t in self._types))
                    if sig in seen:
                        continue
                    seen.add(sig)
                    tally: dict[ClassKey, int] = {}
                    for k, n in zip(keys, mult):
                        tally[k] = tally.get(k, 0) + n
                    classes = sorted(tally, key=lambda k: (-k[0], -k[1]))
                    out.append(GroupPool(lambda p=parts, lf=large_fast: self._carve_all(p, lf), classes,
                                         [tally[k] for k in classes], sig,
                                         lambda p=parts, lf=large_fast: self._class_nodes(p, lf),
                                         lambda p=parts, lf=large_fast: self._class_positions(p, lf)))
        return out

    def _carve_all(self, parts: dict, large_fast: bool) -> list[Group]:
        """Every node cut by its type's parts; a node's cut is made once per (parts, large_fast)
        whichever groupings share it."""
        cache = self.__dict__.setdefault("_cuts", {})
        groups: list[Group] = []
        for t, nodes in self._types.items():
            pt = parts[t]
            key = (t, pt, large_fast)
            cut = cache.get(key)
            if cut is None:
                per_node = self.per_node()
                if t and t[0] == t[-1]:  # one speed: the same GPU positions on every node of the type
                    sp, bounds, a = t[0], [], 0
                    for q in sorted(pt, reverse=large_fast):
                        bounds.append((a, a + q))
                        a += q
                    new, key_of = tuple.__new__, {q: (q, sp) for q in pt}
                    cut = []
                    for i in nodes:
                        devs = per_node[i]  # GPU ids ascending (Cluster.device_tuple)
                        for a, b in bounds:
                            ds = tuple(devs[a:b])
                            cut.append(new(Group, (ds, b - a, sp, i, key_of[b - a], (i, ds[0].local_id))))
                else:
                    cut = [g for i in nodes if per_node[i] for g in carve(per_node[i], pt, large_fast)]
                cache[key] = cut
            groups.extend(cut)
        return groups

    def _class_nodes(self, parts: dict, large_fast: bool) -> dict[ClassKey, np.ndarray]:
        """:meth:`GroupPool.class_nodes` of the grouping :meth:`_carve_all` cuts, without cutting
        the nodes of one speed (their classes are their type's)."""
        per: dict[ClassKey, list[np.ndarray]] = {}
        for t, nodes in self._types.items():
            if not t:
                continue
            if t[0] == t[-1]:
                arr = np.asarray(nodes, dtype=np.int64)
                tally: dict[ClassKey, int] = {}
                for k in _type_classes(t, parts[t], large_fast):
                    tally[k] = tally.get(k, 0) + 1
                for k, c in tally.items():
                    per.setdefault(k, []).append(arr if c == 1 else np.repeat(arr, c))
            else:
                per_node = self.per_node()
                for i in nodes:
                    for g in carve(per_node[i], parts[t], large_fast):
                        per.setdefault(g.key, []).append(np.asarray([i], dtype=np.int64))
        return {k: np.sort(np.concatenate(v), kind="stable") for k, v in per.items()}

    def _class_positions(self, parts: dict, large_fast: bool) -> dict[ClassKey, np.ndarray]:
        """:meth:`GroupPool.class_positions` of the grouping :meth:`_carve_all` cuts: the groups of
        a node of one speed are the same position ranges on every node of its type (one array
        expression per type and class); nodes of mixed speeds are cut one by one."""
        starts = np.asarray(self.cluster.node_starts(), dtype=np.int64)
        per: dict[ClassKey, list[np.ndarray]] = {}
        for t, nodes in self._types.items():
            if not t:
                continue
            pt = parts[t]
            if t[0] == t[-1]:  # _carve_all's cut: groups at offsets a..b-1 on every node of the type
                offsets: dict[int, list[int]] = {}
                a = 0
                for q in sorted(pt, reverse=large_fast):
                    offsets.setdefault(q, []).append(a)
                    a += q
                base = starts[np.asarray(nodes, dtype=np.int64)]
                for q, offs in offsets.items():
                    rows = base[:, None, None] + np.asarray(offs, dtype=np.int64)[None, :, None] + \
                        np.arange(q, dtype=np.int64)[None, None, :]
                    per.setdefault((q, t[0]), []).append(rows.reshape(-1, q))
            else:
                per_node = self.per_node()
                for i in nodes:
                    at = {d.local_id: int(starts[i]) + x for x, d in enumerate(per_node[i])}
                    for g in carve(per_node[i], pt, large_fast):
                        per.setdefault(g.key, []).append(np.asarray([[at[d.local_id] for d in g.devices]],
                                                                    dtype=np.int64))
        out: dict[ClassKey, np.ndarray] = {}
        for k, v in per.items():  # node order = device order (positions number the devices node by node)
            rows = np.concatenate(v)
            out[k] = rows[np.argsort(rows[:, 0], kind="stable")]
        return out

    def heterogeneous_candidates(self, keep: Callable[[GroupPool], bool] | None = None,
                                 prune_keep: int = 0) -> list[Candidate]:
        """Candidates of every grouping (or of those ``keep`` accepts), unplaced. ``prune_keep`` > 0:
        the coarse pass skips a replica count whose lower bound (:meth:`lpt_bound`) exceeds the
        ``prune_keep``-th best estimate so far; :attr:`prune_bar` is then the final such estimate
        (every skipped candidate is estimated above it), and the caller must check that what it
        takes from the result lies at or below it (:meth:`heterogeneous_plans` does)."""
        self.prune_bar, self.pruned = math.inf, 0
        cands: list[Candidate] = []
        pools = self.groupings()
        self.stats["groupings"] = len(pools)
        if keep is not None:
            pools = [p for p in pools if keep(p)]
        small = [(gi, p) for gi, p in enumerate(pools) if p.num_groups <= self.SMALL_GROUPS]
        for gi, pool in small:
            cands.extend(self._exhaustive_replicas(pool, gi))
        big = [(gi, p) for gi, p in enumerate(pools) if p.num_groups > self.SMALL_GROUPS]
        if not big:
            return cands
        # clusters of up to 64 GPUs: every grouping on every replica count of the ladder; larger
        # ones: every grouping on a coarse ladder, then the best few groupings on the full one;
        # both refined around their best replica counts
        coarse = self.cluster.num_gpus > 64
        counts_of = {gi: self._replica_counts(pool, coarse=coarse) for gi, pool in big}
        if coarse and prune_keep > 0:
            first = self._coarse_pruned(big, counts_of, prune_keep)
        else:
            first = {gi: self._lpt_replicas(pool, gi, counts_of[gi]) for gi, pool in big}
        ranked = sorted((min((cd.estimate for cd in lst.values() if cd is not None), default=math.inf), gi)
                        for gi, lst in first.items())
        if self.pruned and ranked[:3][-1][0] > self.prune_bar:
            # a grouping whose best count was skipped might rank among the best three: no skipping
            return self.heterogeneous_candidates(keep, 0)
        pools_by = dict(big)
        for _, gi in (ranked[:3] if coarse else ranked):
            pool, done = pools_by[gi], first[gi]
            if len(done) < len(counts_of[gi]):  # counts skipped above: made now, in the ladder's order
                made = self._lpt_replicas(pool, gi, [R for R in counts_of[gi] if R not in done])
                whole = {R: done[R] if R in done else made[R] for R in counts_of[gi]}
                done.clear()
                done.update(whole)
            done.update(self._lpt_replicas(pool, gi, [R for R in self._replica_counts(pool, coarse=False)
                                                      if R not in done]))
            self._refine(pool, gi, done)
        cands.extend(cd for lst in first.values() for cd in lst.values() if cd is not None)
        return cands

    def _coarse_pruned(self, big: Sequence[tuple[int, GroupPool]], counts_of: dict[int, list[int]],
                       keep: int) -> dict[int, dict[int, Candidate | None]]:
        """The coarse pass of :meth:`heterogeneous_candidates`, skipping the counts whose bound
        exceeds the ``keep``-th best estimate so far (they are left out of the result)."""
        worst: list[float] = []  # the keep best estimates so far, negated (a max-heap)
        first: dict[int, dict[int, Candidate | None]] = {}
        for gi, pool in big:
            classes, counts, cap = self._lpt_order(pool)
            got: dict[int, Candidate | None] = {}
            for R in counts_of[gi]:
                reps = _bulk_lpt(classes, counts, cap, R)
                if len(worst) >= keep and self.lpt_bound(reps) * (1 - 1e-9) > -worst[0]:
                    self.pruned += 1
                    continue
                cd = got[R] = self._candidate(reps, pool, (gi, R))
                if cd is not None:
                    heapq.heappush(worst, -cd.estimate)
                    if len(worst) > keep:
                        heapq.heappop(worst)
            first[gi] = got
        self.prune_bar = -worst[0] if len(worst) >= keep else math.inf
        return first

    def lpt_bound(self, reps: Sequence[tuple[tuple[ClassKey, ...], int]]) -> float:
        """A lower bound of the estimate of the candidate made of replica signatures ``reps``
        (:meth:`_candidate`), without their stage orders and layer splits: a replica of ``S``
        groups has a stage of at least ``ceil(L / S)`` layers, so its slowest stage takes at least
        that many layers' time of its fastest class, and at least one layer plus the output layer of
        any of its classes; with those slowest stages the exact micro-batch assignment
        (:func:`assign_micro_batches`, whose optimum only grows with the stage times) bounds the
        pipeline from below, and the gradient sync, transfers and embedding only add. 0 when a
        signature has more groups than layers or the replicas outnumber the micro-batches (no
        candidate then)."""
        c, L = self.cost, self.L
        per = self.__dict__.setdefault("_per_class", {})
        kinds = []
        for sig, n in reps:
            if len(sig) > L:
                return 0.0
            lo, last = math.inf, math.inf
            for k in sig:
                v = per.get(k)
                if v is None:
                    a = c.layer_time(k[0]) / k[1]
                    v = per[k] = (a, a + c.head_time(k[0]) / k[1])
                lo, last = min(lo, v[0]), min(last, v[1])
            o = max(-(-L // len(sig)) * lo, last)
            kinds.append((o, (len(sig) - 1) * o, n))
        mbs = assign_micro_batches(kinds, self.M)
        if mbs is None:
            return 0.0
        return max(o * lst[0][0] + b for (o, b, _), lst in zip(kinds, mbs))

    def _exhaustive_replicas(self, pool: GroupPool, gi: int) -> Iterator[Candidate]:
        classes, counts = pool.classes, pool.counts
        for used in _sub_vectors(counts):
            if not any(used):
                continue
            for part in _multiset_partitions(used, used):
                if len(part) > self.M:
                    continue
                reps: dict[tuple[ClassKey, ...], int] = {}
                for blk in part:
                    sig = tuple(c for c, n in zip(classes, blk) for _ in range(n))
                    reps[sig] = reps.get(sig, 0) + 1
                cand = self._candidate(sorted(reps.items()), pool, (gi, used, part))
                if cand is not None:
                    yield cand

    def _lpt_order(self, pool: GroupPool) -> tuple[list[ClassKey], list[int], dict]:
        c = self.cost
        classes = sorted(pool.classes, key=lambda k: (-k[1] / c.layer_time(k[0]), -k[0], -k[1]))
        counts = [pool.counts[pool.classes.index(k)] for k in classes]
        cap = {k: k[1] / c.layer_time(k[0]) for k in classes}
        return classes, counts, cap

    def _replica_bounds(self, pool: GroupPool) -> tuple[int, int]:
        n_groups = pool.num_groups
        return max(1, -(-n_groups // self.L)), min(self.M, n_groups)  # fewer replicas: more stages than layers

    def _replica_counts(self, pool: GroupPool, coarse: bool) -> list[int]:
        """Replica counts to try: GPUs / (TP x stages) for every TP and a geometric ladder of stage
        counts (coarse: the stage counts that divide the layers evenly or nearly, and powers of two)."""
        lo, hi = self._replica_bounds(pool)
        used_gpus = pool.num_gpus
        Rs: set[int] = set()
        ladder = _geometric(self.L)
        if coarse:
            ladder = sorted({p for p in ladder if p & (p - 1) == 0 or self.L % p == 0 or p == self.L})
        for tp in self.tps:
            for p in ladder:
                g = tp * p
                for R in (used_gpus // g, -(-used_gpus // g)):
                    if lo <= R <= hi:
                        Rs.add(R)
        return sorted(Rs)

    def _lpt_replicas(self, pool: GroupPool, gi: int, Rs: Sequence[int]) -> dict[int, Candidate | None]:
        classes, counts, cap = self._lpt_order(pool)
        return {R: self._candidate(_bulk_lpt(classes, counts, cap, R), pool, (gi, R)) for R in Rs}

    def _refine(self, pool: GroupPool, gi: int, results: dict[int, Candidate | None]) -> None:
        """Local refinement around the best few replica counts."""
        lo, hi = self._replica_bounds(pool)
        for _ in range(3):
            ranked = sorted((cd.estimate, R) for R, cd in results.items() if cd is not None)[:3]
            new = sorted({R + d for _, R in ranked for d in (-2, -1, 1, 2)
                          if lo <= R + d <= hi and R + d not in results})
            if not new:
                break
            results.update(self._lpt_replicas(pool, gi, new))

    # -- placement ------------------------------------------------------------------------------
    def place_best(self, cand: Candidate, limit: int = 256) -> tuple[Plan, CostBreakdown]:
        """:meth:`place`, then on small clusters every assignment of same-class groups to slots
        (exhaustive when there are at most ``limit``), priced exactly; the first best wins."""
        base = self.place(cand)
        best = (base, self.cost.evaluate(base))
        if self.cluster.num_gpus > 16 or len(self.cluster.nodes) < 2:
            return best
        slots: dict[ClassKey, list[tuple[int, int]]] = {}
        for ri, r in enumerate(base.replicas):
            for j, st in enumerate(r.stages):
                slots.setdefault(Group.of(st.devices).key, []).append((ri, j))
        pools: dict[ClassKey, list[Group]] = {}
        for g in cand.groups:
            pools.setdefault(g.key, []).append(g)
        keys = sorted(slots)
        # count before materialising: permutations of 15 groups would never fit in memory
        if math.prod(math.perm(len(pools[k]), len(slots[k])) for k in keys) > limit:
            return best
        options = [list(itertools.permutations(pools[k], len(slots[k]))) for k in keys]
        for choice in itertools.product(*options):
            taken = {}
            for k, groups in zip(keys, choice):
                for (ri, j), g in zip(slots[k], groups):
                    taken[(ri, j)] = g
            reps = tuple(PlanReplica(tuple(PlanStage(st.tp, st.layers, taken[(ri, j)].devices)
                                           for j, st in enumerate(r.stages)), r.micro_batches)
                         for ri, r in enumerate(base.replicas))
            used = {d for r in reps for st in r.stages for d in st.devices}
            pl = Plan(self.L, reps, tuple(d for d in self._devices if d not in used), base.kind)
            c = self.cost.evaluate(pl)
            if c.iteration_time_s < best[1].iteration_time_s:
                best = (pl, c)
        return best

    def place(self, cand: Candidate) -> Plan:
        """Assign physical groups: slots in (first layer, replica) order take groups of their class
        in node order, so a layer's replicas share nodes where possible."""
        pools: dict[ClassKey, list[Group]] = {}
        for g in cand.groups:  # in node order
            pools.setdefault(g.key, []).append(g)
        reps: list[tuple[ReplicaSolution, int]] = []
        # slots in (first layer, replica, stage) order, a kind's replicas as one block: per first
        # layer, the blocks in replica order (a replica has one stage per first layer)
        blocks: dict[int, list[tuple[int, int, int, ClassKey]]] = {}
        for sol, m, n in cand.kinds:
            first = 0
            for j, (k, cnt) in enumerate(zip(sol.order, sol.counts)):
                blocks.setdefault(first, []).append((len(reps), n, j, k))
                first += cnt
            reps.extend([(sol, m)] * n)
        taken: list[list[Group | None]] = [[None] * len(sol.counts) for sol, _ in reps]
        idx = {k: 0 for k in pools}
        for first in sorted(blocks):
            for r0, n, j, k in blocks[first]:
                i0 = idx[k]
                if i0 + n > len(pools[k]):
                    raise IndexError(f"placement: {n} groups of class {k} wanted, {len(pools[k]) - i0} left")
                for t, g in enumerate(pools[k][i0:i0 + n]):
                    taken[r0 + t][j] = g
                idx[k] = i0 + n
        out = []
        shapes: dict[int, tuple] = {}  # per solution: (tp, layers, pace) of its stages (PlanReplica.shape_key)
        for ri, (sol, m) in enumerate(reps):
            shape = shapes.get(id(sol))
            if shape is None:
                bounds = list(itertools.accumulate(sol.counts, initial=0))
                shape = shapes[id(sol)] = tuple((k[0], (bounds[j], bounds[j + 1]), k[1])
                                                for j, k in enumerate(sol.order))
            row = taken[ri]
            rep = PlanReplica(tuple([PlanStage.of_group(g.tp, lay, g.devices, g.speed, g.node)  # type: ignore[union-attr]
                                     for g, (_, lay, _) in zip(row, shape)]), m)
            # its shape key as PlanReplica.shape_key makes it (a group's class is its (tp, pace))
            object.__setattr__(rep, "_shape", (shape, tuple([a.node == b.node for a, b in  # type: ignore[union-attr]
                                                             zip(row, row[1:])])))
            out.append(rep)
        # every usable GPU is in one group of the pool: the groups no slot took are the unused GPUs
        left = [d for k, gs in pools.items() for g in gs[idx[k]:] for d in g.devices]
        left.sort(key=lambda d: (d.node, d.local_id))
        plan = Plan(self.L, tuple(out), tuple(left), "heterogeneous")
        if plan.uniform_dims() is not None and len({mm for _, mm in reps}) == 1:
            plan = Plan(self.L, plan.replicas, plan.unused, "uniform")
        return plan

    def place_lazy(self, cand: Candidate) -> Plan:
        """:meth:`place`'s plan, priced from the nodes of its slots; its devices are made when first
        read (:class:`~.lazy_plan.LazyPlan`), from the pool's device positions per class
        (:meth:`GroupPool.class_positions`) one stage column at a time (:func:`~.lazy_plan.place_columns`)."""
        pool = cand.pool
        return place_lazily(self.L, [(s.order, s.counts, m, n) for s, m, n in cand.kinds], pool.class_nodes(),
                            lambda: pool.class_positions(self._devices), self.cluster)

    def _unused(self, replicas: Sequence[PlanReplica]) -> tuple[Device, ...]:
        devices = self._devices
        n_used = sum(len(s.devices) for r in replicas for s in r.stages)
        if n_used == len(devices):
            return ()
        # the stages hold the cluster's own Device objects: compare identities (cheap to hash)
        used = {id(d) for r in replicas for s in r.stages for d in s.devices}
        out = tuple(d for d in devices if id(d) not in used)
        if len(out) + n_used != len(devices):  # a device not from this cluster: compare values
            used_v = {d for r in replicas for s in r.stages for d in s.devices}
            out = tuple(d for d in devices if d not in used_v)
        return out

    # -- uniform --------------------------------------------------------------------------------
    def _uniform_pool(self, tp: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The TP-``tp`` groups a grid can use (every node cut into ``tp``-GPU groups, fastest GPUs
        first, the rest left out), in node order: their speeds and (node, group index on the node)."""
        cache = self.__dict__.setdefault("_upools", {})
        if tp not in cache:
            cache[tp] = self._make_uniform_pool(tp)
        return cache[tp]

    def _make_uniform_pool(self, tp: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        speeds: list[float] = []
        nodes: list[int] = []
        index: list[int] = []
        for i, nd in enumerate(self.cluster.nodes):
            k = len(nd.gpus) // tp
            if not k:
                continue
            sp = nd.speeds
            if min(sp) == max(sp):  # every group at the node's one speed, in GPU id order
                speeds.extend([sp[0]] * k)
                nodes.extend([i] * k)
                index.extend(range(k))
                continue
            gs = sorted(enumerate(carve(self.per_node()[i], [tp] * k + [1] * (len(sp) - k * tp))[:k]),
                        key=lambda x: x[1].sort_key)
            speeds.extend(g.speed for _, g in gs)
            nodes.extend([i] * k)
            index.extend(j for j, _ in gs)
        return np.asarray(speeds, dtype=float), list(zip(nodes, index))

    def _uniform_devices(self, tp: int, node: int, j: int) -> tuple[Device, ...]:
        """The devices of group ``j`` of ``node`` cut for a TP-``tp`` grid (see :meth:`_uniform_pool`)."""
        devs = self.per_node()[node]
        nd = self.cluster.nodes[node]
        if min(nd.speeds) == max(nd.speeds):  # carve's order: GPU ids ascending
            return tuple(devs[j * tp:(j + 1) * tp])
        k = len(devs) // tp
        return carve(devs, [tp] * k + [1] * (len(devs) - k * tp))[j].devices

    def uniform_plans(self) -> list[ScoredPlan]:
        """Every TP x PP x DP grid (DP | M, the d*p fastest groups), best few priced exactly.

        Every DP degree dividing ``M`` is tried for every TP and stage count, largest first (fewest
        micro-batches per replica, the best estimates early); a grid whose lower bound is above the
        ``n_exact``-th best estimate so far is not split (it cannot be among the best few), and once
        the bound that does not look at the GPUs' speeds is above it, the smaller DP degrees of that
        stage count are not either (their bound only grows)."""
        c = self.cost
        est: list[tuple[float, tuple, tuple]] = []
        divisors = _divisors(self.M)[::-1]  # largest first
        n_exact = 2 if self.large else max(4, self.top_k)
        kept: list[float] = []  # the n_exact best estimates so far, as a max-heap (negated)
        L = self.L
        for tp in sorted(self.tps, reverse=True):
            speeds_arr, where = self._uniform_pool(tp)
            n = len(where)
            if not n:
                continue
            vmax = float(speeds_arr.max())
            one_speed = float(speeds_arr.min()) == vmax
            fastest = np.argsort(-speeds_arr, kind="stable")  # ties in node order
            n_top = int(np.count_nonzero(speeds_arr == vmax))  # groups at the fastest speed (fastest[:n_top])
            lt = c.layer_time(tp)
            for p in range(1, min(L, n) + 1):
                for d in divisors:
                    if d * p > n:
                        continue
                    mb = self.M // d
                    # lower bound: the slowest stage takes at least the layers' time over the
                    # stages' combined speed (at most p x the fastest group's here; it grows as d
                    # falls): a grid that cannot make the best few is not split
                    if len(kept) >= n_exact and (mb + p - 1) * L * lt / (p * vmax) > -kept[0]:
                        break
                    # stage-major: stage j of every replica on neighbouring groups (in node order)
                    k = d * p
                    if one_speed or k <= n_top:  # the k fastest groups all run at the fastest speed
                        speeds = (vmax,) * p
                    else:  # the k fastest groups in node order
                        if 8 * k < n:   # few: their positions sorted, O(k log k)
                            picked = speeds_arr[np.sort(fastest[:k])]
                        else:           # most of them: a mask over the groups, O(groups)
                            mask = np.zeros(n, dtype=bool)
                            mask[fastest[:k]] = True
                            picked = speeds_arr[mask]
                        speeds = tuple(float(v) for v in picked.reshape(p, d).min(axis=1))
                        if len(kept) >= n_exact and (mb + p - 1) * L * lt / sum(speeds) > -kept[0]:
                            continue
                    Rk = d if self.training.zero_stage > 0 else 1
                    mx = c.max_layers_all(tp, p, Rk, c.grid_zero_stage(p))  # a pipeline runs ZeRO-1 at most
                    key = ("u", tp, speeds, mx)
                    if key not in self._split_cache:
                        per = [lt / sp for sp in speeds]
                        extra = [c.stage_extra_time((tp,) * p, j) for j in range(p)]
                        extra[-1] += c.head_time(tp) / speeds[-1]
                        self._split_cache[key] = _split(per, extra, mx, L)
                    res = self._split_cache[key]
                    if res is None:
                        continue
                    slow, counts = res
                    same = tp * p <= self.cluster.max_gpus_per_node
                    t = (mb + p - 1) * slow + (p - 1) * c.fill_drain_p2p(same)
                    sol = ReplicaSolution(tuple((tp, sp) for sp in speeds), counts, slow, 0.0)
                    t += self._sync_estimate([sol], d, d * tp)
                    est.append((t, (-tp, p, d), (tp, d, counts, mb, one_speed)))
                    heapq.heappush(kept, -t)
                    if len(kept) > n_exact:
                        heapq.heappop(kept)
                    self.stats["uniform_grids"] = self.stats.get("uniform_grids", 0) + 1
        est.sort(key=lambda x: (x[0], x[1]))
        plans = []
        for _, _, (tp, d, counts, mb, one_speed) in est[:n_exact]:
            speeds_arr, where = self._uniform_pool(tp)
            p = len(counts)
            if one_speed:
                picked = range(d * p)
            else:
                picked = sorted(np.argsort(-speeds_arr, kind="stable")[:d * p].tolist())
            # (devices, pace, node) of each group; its pace is its slowest GPU's speed (the pool's)
            chosen = [(self._uniform_devices(tp, *where[i]), float(speeds_arr[i]), where[i][0]) for i in picked]
            reps = []
            for r in range(d):
                stages, first = [], 0
                for j, cnt in enumerate(counts):
                    devs, sp, node = chosen[j * d + r]
                    stages.append(PlanStage.of_group(tp, (first, first + cnt), devs, sp, node))
                    first += cnt
                reps.append(PlanReplica(tuple(stages), mb))
            plans.append(Plan(self.L, tuple(reps), self._unused(reps), "uniform"))
        scored = [ScoredPlan(pl, c.evaluate(pl)) for pl in plans]
        scored = [s for s in scored if s.cost.feasible]
        scored.sort(key=lambda s: (s.cost.iteration_time_s, _plan_tie(s.plan)))
        return scored

    def heterogeneous_plans(self) -> list[ScoredPlan]:
        if self.cluster.num_gpus <= 64:
            n_exact = max(32, 2 * self.top_k)
        else:
            n_exact = max(3, self.top_k) if self.large else max(6, self.top_k)
        # the coarse pass skips counts that cannot be among the best 8 x n_exact estimates; when
        # the candidates placed here reach past that bar (duplicates, infeasible plans), the
        # search runs again without skipping, so the result is the same either way
        cands = self.heterogeneous_candidates(prune_keep=8 * n_exact)
        scored, reached = self._place_best_few(cands, n_exact)
        if self.pruned and reached > self.prune_bar:
            scored, _ = self._place_best_few(self.heterogeneous_candidates(), n_exact)
        scored.sort(key=lambda s: (s.cost.iteration_time_s, _plan_tie(s.plan)))
        return scored

    def _place_best_few(self, cands: list[Candidate], n_exact: int) -> tuple[list[ScoredPlan], float]:
        """The first ``n_exact`` distinct feasible plans of ``cands`` by estimate, placed and priced;
        and the estimate of the last candidate looked at (inf when all were)."""
        cands.sort(key=lambda cd: (cd.estimate, cd.num_replicas, _cand_tie(cd)))
        scored, seen = [], set()
        reached = math.inf
        for cd in cands:
            if len(scored) >= n_exact:
                break
            reached = cd.estimate
            pl, cost = self.place_best(cd)
            key = tuple((r.micro_batches, tuple((st.layers, st.devices) for st in r.stages)) for r in pl.replicas)
            if key in seen:
                continue
            seen.add(key)
            if cost.feasible:
                scored.append(ScoredPlan(pl, cost))
        else:
            reached = math.inf if len(scored) < n_exact else reached
        return scored, reached


def _split(per: Sequence[float], extra: Sequence[float], mx: Sequence[int], L: int):  # noqa: ANN202
    """The exact layer split: the dynamic program for short pipelines of few layers (its tables
    are stages x layers x layers), the parametric search otherwise."""
    if len(per) <= 8 and L <= 256:
        return split_layers(per, extra, mx, L)
    return split_layers_parametric(per, extra, mx, L)


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _class_counts(keys: Sequence[ClassKey]) -> tuple[list[ClassKey], list[int]]:
    classes = sorted(set(keys), key=lambda k: (-k[0], -k[1]))
    return classes, [sum(1 for g in keys if g == c) for c in classes]


def _type_classes(speeds_desc: tuple[float, ...], parts: Sequence[int], large_fast: bool) -> list[ClassKey]:
    """The (tp, speed) classes :func:`carve` makes of a node whose GPU speeds are ``speeds_desc``."""
    out, i = [], 0
    for p in sorted(parts, reverse=large_fast):
        out.append((p, speeds_desc[i + p - 1]))
        i += p
    return out


_gpus = operator.attrgetter("gpus")
_speeds = operator.attrgetter("speeds")


def cluster_nodes(cluster: Cluster) -> list[int]:
    return [len(n.gpus) for n in cluster.nodes]


def _order_key(order: Sequence[ClassKey]) -> tuple:
    return tuple((-tp, -sp) for tp, sp in order)


def _plan_tie(plan: Plan) -> tuple:
    return (plan.kind != "uniform", len(plan.replicas), plan.describe())


def _cand_tie(cd: Candidate) -> tuple:
    return tuple((_order_key(s.order), s.counts, m, n) for s, m, n in cd.kinds)


def _geometric(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v = v + 1 if v < 8 else int(v * 1.25) + 1
    return out


def _distinct_permutations(counts: dict[ClassKey, int]) -> list[tuple[ClassKey, ...]]:
    keys = sorted(counts, key=lambda k: (-k[0], -k[1]))
    rem = dict(counts)
    total = sum(rem.values())
    out: list[tuple[ClassKey, ...]] = []
    acc: list[ClassKey] = []

    def rec() -> None:
        if len(acc) == total:
            out.append(tuple(acc))
            return
        for k in keys:
            if rem[k]:
                rem[k] -= 1
                acc.append(k)
                rec()
                acc.pop()
                rem[k] += 1

    rec()
    return out


def _sub_vectors(counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """All vectors 0 <= v <= counts, lexicographically descending."""
    return itertools.product(*(range(c, -1, -1) for c in counts))


def _multiset_partitions(rem: tuple[int, ...], max_block: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Each partition of the multiset ``rem`` (counts per class) exactly once: blocks in
    non-increasing lexicographic order."""
    if not any(rem):
        yield ()
        return
    for blk in _sub_vectors(rem):
        if not any(blk) or blk > max_block:
            continue
        rest = tuple(r - b for r, b in zip(rem, blk))
        for tail in _multiset_partitions(rest, blk):
            yield (blk,) + tail


def _bulk_lpt(classes: Sequence[ClassKey], counts: Sequence[int], cap: dict,
              R: int) -> list[tuple[tuple[ClassKey, ...], int]]:
    """LPT with multiplicities: items of each class (largest capacity first) go one each to the
    least-loaded replicas (ties: fewer GPUs, then the smaller composition); replicas with identical
    contents are kept as one kind with a count."""
    zero = (0,) * len(classes)
    kinds: dict[tuple[int, ...], int] = {zero: R}
    rank: dict[tuple[int, ...], tuple[float, int]] = {zero: (0.0, 0)}  # (load, GPUs) of a composition
    # the least (rank, composition) first: a heap of the compositions held, stale entries skipped
    heap: list[tuple[tuple[float, int], tuple[int, ...]]] = [((0.0, 0), zero)]
    for ci, (k, n) in enumerate(zip(classes, counts)):
        add, gpus = cap[k], k[0]
        while n > 0:
            while heap[0][1] not in kinds:
                heapq.heappop(heap)
            comp = heap[0][1]
            avail = kinds[comp]
            take = min(avail, n)
            n -= take
            if take == avail:
                del kinds[comp]
                heapq.heappop(heap)
            else:
                kinds[comp] = avail - take
            new = comp[:ci] + (comp[ci] + 1,) + comp[ci + 1:]
            load, g = rank[comp]
            r_new = rank[new] = (load + add, g + gpus)
            had = kinds.get(new, 0)
            if not had:
                heapq.heappush(heap, (r_new, new))
            kinds[new] = had + take
    out = []
    for comp, n in kinds.items():
        if not any(comp):
            continue  # replicas that got nothing: fewer replicas in effect
        sig = tuple(classes[i] for i, cnt in enumerate(comp) for _ in range(cnt))
        out.append((tuple(sorted(sig, key=lambda x: (-x[0], -x[1]))), n))
    return sorted(out)


# ---- entry point ------------------------------------------------------------------------------
def plan(cost: CostModel, layouts: str = "heterogeneous", top_k: int = 3, explain: bool = True) -> PlanResult:
    """Search the best plan. ``layouts="uniform"`` restricts to TP x PP x DP grids. ``explain``:
    when nothing fits, the error says what would (:func:`infeasible_message`, which plans again
    for larger clusters); else it says only that nothing fits."""
    with gc_paused():
        return _plan(cost, layouts, top_k, explain)


def _plan(cost: CostModel, layouts: str, top_k: int, explain: bool = True) -> PlanResult:
    if layouts not in ("uniform", "heterogeneous"):
        raise PlanningError(f"layouts={layouts!r}: choose 'uniform' or 'heterogeneous'")
    cluster, model, training = cost.cluster, cost.model, cost.training
    training.check_against(model)
    if cluster.num_gpus == 0:
        raise PlanningError("no usable GPUs: the cluster lists 0 GPUs; give at least one (e.g. --gpus-per-node 8)")
    pl = Planner(cost, top_k)
    if not pl.tps:
        raise PlanningError(f"no TP degree <= {training.nominal_tp} divides num_attention_heads="
                            f"{model.num_attention_heads} and num_query_groups={model.num_query_groups}")
    uniform = pl.uniform_plans()
    hetero = pl.heterogeneous_plans() if layouts == "heterogeneous" else []
    pool = sorted(uniform + hetero, key=lambda s: (s.cost.iteration_time_s, _plan_tie(s.plan)))
    if not pool:
        raise PlanningError(infeasible_message(cost) if explain else "no layout fits")
    alts = distinct_plans(pool)
    best = alts[0]
    stats = dict(pl.stats)
    stats["decision"] = _decision(best, uniform, hetero, layouts)
    log.debug("planner stats: %s", stats)
    return PlanResult(best, uniform[0] if uniform else None, hetero[0] if hetero else None,
                      alts[:top_k], cluster.device_tuple(), stats, cluster)


def distinct_plans(scored: Sequence[ScoredPlan]) -> list[ScoredPlan]:
    """``scored`` (best first) without repeats of a plan description (the first of each stays)."""
    out, seen = [], set()
    for x in scored:
        d = x.plan.describe()
        if d not in seen:
            seen.add(d)
            out.append(x)
    return out


def _decision(best: ScoredPlan, uniform: list[ScoredPlan], hetero: list[ScoredPlan], layouts: str) -> str:
    """Why the chosen plan's kind won, in numbers (a uniform plan is a stated decision)."""
    if layouts == "uniform":
        return "uniform grids only (--layouts uniform)"
    if not hetero:
        return "uniform: no heterogeneous candidate fits in memory"
    h = hetero[0].cost.iteration_time_s
    if best.plan.kind == "uniform":
        return f"uniform: predicted {best.cost.iteration_time_s:.4g} s <= best heterogeneous {h:.4g} s"
    u = uniform[0].cost.iteration_time_s if uniform else None
    return f"heterogeneous: predicted {h:.4g} s" + (f" < best uniform {u:.4g} s" if u is not None else
                                                      " (no uniform grid fits)")


def _gpus_that_fit(cost: CostModel, start: int, width: int) -> tuple[int | None, int]:
    """(GPUs, the most tried): about the fewest GPUs above this cluster's, in nodes of ``width``,
    on which the uniform search finds a layout that fits: doubling from ``start`` (six tries), then
    bisecting down to the last count that failed or this cluster's (eight more); None when none
    fit. A count the message names is one the planner itself accepted."""
    from .cluster import Cluster, MAX_GPUS
    cl = cost.cluster

    def fits(g: int) -> bool:
        trial = Cluster.from_gpus_per_node([width] * (g // width), gpu_memory_gb=cl.gpu_memory_gb,
                                           intra_node_bandwidth_gbs=cl.intra_node_bandwidth_gbs,
                                           inter_node_bandwidth_gbs=cl.inter_node_bandwidth_gbs)
        try:
            plan(CostModel(cost.model, cost.training, trial, cost.params, cost.profile), layouts="uniform", top_k=1,
                 explain=False)
            return True
        except PlanningError:
            return False
    # in nodes: lo failed (or is at most this cluster's count), g is the next count to try
    lo, g = cl.num_gpus // width, max(-(-start // width), cl.num_gpus // width + 1) * width
    for _ in range(6):
        if g > MAX_GPUS:
            break
        if fits(g):
            hi = g // width
            for _ in range(8):   # bisect between the last failure and the first fit
                if hi - lo <= 1:
                    break
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid * width) else (mid, hi)
            return hi * width, g
        lo, g = g // width, g * 2
    return None, lo * width


def infeasible_message(cost: CostModel) -> str:
    """Why nothing fits, and what would: the memory per GPU, or the GPU count, that would."""
    m, tr, cl = cost.model, cost.training, cost.cluster
    node_max = max(cl.max_gpus_per_node, 1)
    tp = max([t for t in (tr.valid_tps(m) or (1,)) if t <= node_max] or [1])
    n = cl.num_gpus
    per_param = cost.state_bytes_per_param(1)
    total_state = (m.num_layers * m.params_per_layer + 2 * m.embedding_params) * per_param
    limit = cost.memory_limit_bytes
    # best case for memory: one replica, as many stages as layers/groups allow, at the widest TP
    groups = sum(len(nd.gpus) // tp for nd in cl.nodes)
    msg = (f"no layout fits: the model's parameters, gradients and optimizer state need "
           f"{total_state / GiB:.1f} GiB (ZeRO-{tr.zero_stage}, one replica) but the limit is "
           f"{limit / GiB:.1f} GiB per GPU on {n} usable GPU(s)")
    if groups >= 1:
        pp = max(1, min(m.num_layers, groups))
        need = 0.0
        for j in range(pp):
            layers = -(-m.num_layers // pp)
            need = max(need, cost.stage_memory(tp, layers, j, pp, 1))
        need_gb = need / GiB / (1 - cost.params.memory_safety_margin)
        msg += f"; with tp={tp} x pp={pp} a GPU would need about {need_gb:.0f} GB"
        per_gpu = limit - cost.params.memory_overhead_gb * GiB
        if per_gpu > 0:   # a first guess from the state alone, checked by planning for that many GPUs
            est = max(math.ceil(total_state / per_gpu * 1.3), n + 1)
            fits, tried = _gpus_that_fit(cost, est, max(node_max, max(tr.valid_tps(m) or (tp,))))
            msg += (f", or about {fits} GPUs of {cl.gpu_memory_gb:g} GB" if fits is not None else
                    f"; {tried} GPUs of {cl.gpu_memory_gb:g} GB found no layout either")
    msg += ("; or raise --zero-stage, lower --micro-batch-size/--seq-length" +
            ("" if tr.nominal_tp >= 8 else ", raise --tensor-model-parallel-size"))
    return msg
