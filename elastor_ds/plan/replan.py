"""Re-planning after a small change of the cluster, starting from the previous plan: cheap enough
for the recovery path at 131,072 GPUs (a few passes over the stages, no search over the cluster).

Steps (:func:`replan`):

1. **Diff.** The nodes whose usable GPUs or speeds differ between the previous cluster and this
   one (lost, slowed, added or returned). Nodes are matched by name.
2. **Keep** every previous replica with no stage on a changed node: same devices, same layers.
3. **Free pool.** The stages of the other (damaged) replicas whose GPUs all survive, kept as TP
   groups, plus every usable GPU of the changed nodes that no kept replica holds, cut into TP
   groups (power-of-two sizes, largest first, one cut per TP cap).
4. **Rebuild.** For each cut and each count of new replicas (0 up to the damaged count + 2), the
   search's own tools build the new replicas: LPT over the free groups' classes, the exact stage
   order and layer split per replica (:meth:`~.search.Planner.solve_replica`), then the exact
   micro-batch assignment over kept and new replicas together (:func:`~.search.assign_micro_batches`).
   Candidates are ranked by the search's estimate (exact pipeline, estimated gradient sync).
5. **Re-shape.** Keeping replicas can cost a whole micro-batch per replica (128 replicas of 8
   micro-batches that lose two: 16 replicas run 9). So the search's own candidates for the cuts
   that keep full nodes in the previous plan's TP are priced too (up to
   :data:`RESHAPE_SEARCH_MAX` GPUs as the search does it; above, one cut and one ladder of replica
   counts, refined once): class counts only, no placement.
6. **Price** the best few exactly (:meth:`~.cost.CostModel.evaluate`); the best feasible one wins.
   A re-shaped candidate is placed (every group made: O(GPUs)) only when its estimate beats the
   best kept-replica one by :data:`RESHAPE_MARGIN`.

When the previous plan does not fit the new inputs (a different layer count, a change on more
than :data:`MAX_CHANGED_NODES` nodes, a replica with a TP degree the model and flags do not allow
or with a TP group across nodes, or no feasible candidate), :func:`replan` runs the full search and
says why in ``search_stats["replan"]``.

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import logging
import math
import operator
import time
from typing import Sequence

from .cluster import Cluster, Device
from .cost import CostModel
from .plan_doc import Plan, PlanReplica, PlanStage
from .search import (Candidate, ClassKey, Group, Planner, PlanResult, ReplicaSolution, ScoredPlan, _bulk_lpt,
                     _geometric, assign_micro_batches, carve, distinct_plans, gc_paused, greedy_parts, plan)

log = logging.getLogger(__name__)
_NAME = operator.attrgetter("name")

MAX_CHANGED_NODES = 64      # a larger change is planned from scratch
EXACT = 3                   # candidates priced exactly (1 above Planner.LARGE_GPUS GPUs)
FULL_SEARCH_BELOW = 4096    # GPUs: up to this many, the full search runs as well
RESHAPE_MARGIN = 0.002      # a re-shaped plan must be estimated this much faster to be placed
RESHAPE_SEARCH_MAX = 16384  # GPUs: up to this many the re-shape runs the search's candidates for the
                            # previous cut in full; above, one ladder of replica counts (bounded time)


def replan(cost: CostModel, previous: Plan, previous_cluster: Cluster, top_k: int = 3,
           full_search_below: int = FULL_SEARCH_BELOW) -> PlanResult:
    """The best plan for ``cost.cluster`` built from ``previous`` (made for ``previous_cluster``);
    the full search (:func:`~.search.plan`) when the previous plan does not apply. On clusters of at
    most ``full_search_below`` GPUs the full search runs too (well under a second there) and the
    faster plan wins: few replicas make the micro-batch granularity coarse, and keeping replicas
    can then cost more than 1 %. The result has no uniform baseline (``uniform`` is None) unless the
    full search ran."""
    with gc_paused():
        return _replan(cost, previous, previous_cluster, top_k, full_search_below)


def _replan(cost: CostModel, previous: Plan, previous_cluster: Cluster, top_k: int,
            full_search_below: int) -> PlanResult:
    t0 = time.perf_counter()
    changed = changed_nodes(previous_cluster, cost.cluster)
    why = _not_applicable(cost, previous, changed)
    if why is None:
        res = _Replanner(cost, previous, previous_cluster, changed).run()
        if res is not None:
            res.search_stats["replan_s"] = time.perf_counter() - t0
            if cost.cluster.num_gpus <= full_search_below:
                full = plan(cost, top_k=top_k)
                if full.best.cost.iteration_time_s < res.best.cost.iteration_time_s:
                    full.search_stats["replan"] = (f"full search: {full.best.cost.iteration_time_s:.4g} s beats the "
                                                   f"re-plan's {res.best.cost.iteration_time_s:.4g} s")
                    return full
                res.uniform = full.uniform
                res.alternatives = distinct_plans(sorted(res.alternatives + full.alternatives,
                                                    key=lambda x: x.cost.iteration_time_s))
            res.alternatives = res.alternatives[:top_k]
            return res
        why = "no feasible plan keeps the undamaged replicas"
    log.info("re-plan: full search (%s)", why)
    res = plan(cost, top_k=top_k)
    res.search_stats["replan"] = f"full search: {why}"
    return res


def _not_applicable(cost: CostModel, previous: Plan, changed: set[str]) -> str | None:
    if previous.num_layers != cost.model.num_layers:
        return f"the previous plan covers {previous.num_layers} layers, the model has {cost.model.num_layers}"
    if not previous.replicas:
        return "the previous plan has no replicas"
    if len(changed) > MAX_CHANGED_NODES:
        return f"{len(changed)} nodes changed (more than {MAX_CHANGED_NODES})"
    # every replica, not only the first: a kept replica runs as it is (a TP degree that does not
    # split the heads, the query groups or the FFN width, or a TP group across nodes, cannot run or
    # is not what the cost model prices); by shape key (one per replica shape), then the index of
    # stages by node that the split into kept and damaged replicas builds anyway
    tps = set(cost.training.valid_tps(cost.model))
    seen: set[int] = set()
    for i, (_, key) in enumerate(previous.priced_replicas()):
        shape = key[0]
        if id(shape) in seen:
            continue
        seen.add(id(shape))
        bad = next((t for t, _, _ in shape if t not in tps), None)
        if bad is not None:
            return (f"replica {i} of the previous plan uses TP {bad}, which the model and flags do not allow "
                    f"(TP degrees {sorted(tps)})")
    across = previous.replicas_on((-1,))
    if across:
        return f"replica {across[0]} of the previous plan has a TP group across nodes (TP groups stay within a node)"
    return None


def changed_nodes(before: Cluster, after: Cluster) -> set[str]:
    """Names of the nodes whose usable GPUs or speeds differ (present in only one counts too)."""
    out: set[str] = set()
    a, b = before.nodes, after.nodes
    k = min(len(a), len(b))
    if [n.name for n in a[:k]] == [n.name for n in b[:k]]:  # same order: compare position by position
        for x, y in zip(a, b):
            if x.gpus != y.gpus or x.speeds != y.speeds:
                out.add(x.name)
        out.update(n.name for n in a[k:])
        out.update(n.name for n in b[k:])
        return out
    da = {n.name: (n.gpus, n.speeds) for n in a}
    db = {n.name: (n.gpus, n.speeds) for n in b}
    out.update(k_ for k_, v in da.items() if db.get(k_) != v)
    out.update(k_ for k_ in db if k_ not in da)
    return out


class _Replanner:
    def __init__(self, cost: CostModel, previous: Plan, previous_cluster: Cluster, changed: set[str]) -> None:
        self.cost, self.prev, self.old, self.changed = cost, previous, previous_cluster, changed
        self.cluster = cost.cluster
        self.planner = Planner(cost)
        self.M = cost.training.num_micro_batches

    # 1-3: diff, keep, free pool
    def _split_replicas(self) -> tuple[list[PlanReplica], list[PlanReplica], set[str]]:
        changed = self.changed
        new_index = self.cluster.node_index()
        old_names = list(map(_NAME, self.old.nodes))
        new_names = list(map(_NAME, self.cluster.nodes))
        k = min(len(old_names), len(new_names))  # nodes keep their index unless one before them went
        same_numbering = old_names[:k] == new_names[:k] and not any(n in new_index for n in old_names[k:])
        # previous plans number nodes like the previous cluster; changed ones by their index
        if same_numbering:  # a name's index is the same in both (the previous cluster's extra nodes follow)
            tail = {n: k + j for j, n in enumerate(old_names[k:])}
            hit_nodes = set()
            for n in changed:
                i = new_index.get(n)
                if i is not None and i < k:
                    hit_nodes.add(i)
                elif n in tail:
                    hit_nodes.add(tail[n])
        else:
            old_index = self.old.node_index()
            hit_nodes = {old_index[n] for n in changed if n in old_index}
        reps = self.prev.replicas
        hit = set(self.prev.replicas_on(hit_nodes))
        for i in self.prev.replicas_on((-1,)):  # a stage across nodes: its devices' nodes by name
            if any(d.node_name in changed for s in reps[i].stages for d in s.devices):
                hit.add(i)
        damaged = [reps[i] for i in sorted(hit)]
        if not hit:
            kept = list(reps)
        else:
            kept = [r for i, r in enumerate(reps) if i not in hit]
        if not same_numbering:
            kept = [_renumber(r, new_index) for r in kept]
        return kept, damaged, changed

    def _free_groups(self, damaged: list[PlanReplica], changed: set[str], cap: int) -> list[Group]:
        """Surviving stages of damaged replicas (as groups) + the changed nodes' other GPUs, cut
        into groups of at most ``cap`` GPUs."""
        index = self.cluster.node_index()
        alive: dict[str, dict[int, float]] = {}
        for name in changed:
            i = index.get(name)
            if i is not None:
                nd = self.cluster.nodes[i]
                alive[name] = dict(zip(nd.gpus, nd.speeds))
        groups: list[Group] = []
        for r in damaged:
            for s in r.stages:
                if any(d.node_name in changed for d in s.devices):
                    continue  # re-cut with its node below
                if s.node == -1:  # a group across nodes (not the planner's): its GPUs one by one
                    groups.extend(Group.of((self._current(d, index),)) for d in s.devices)
                    continue
                groups.append(Group.of(tuple(self._current(d, index) for d in s.devices)))
        for name, gpus in sorted(alive.items(), key=lambda kv: index[kv[0]]):
            i = index[name]
            devs = [Device(i, name, g, sp) for g, sp in sorted(gpus.items())]
            if devs:
                groups.extend(carve(devs, greedy_parts(len(devs), cap)))
        return groups

    def _current(self, d: Device, index: dict[str, int]) -> Device:
        i = index[d.node_name]
        return d if i == d.node else Device(i, d.node_name, d.local_id, d.speed)

    # 4: candidates
    def run(self) -> PlanResult | None:
        kept, damaged, changed = self._split_replicas()
        pl, c = self.planner, self.cost
        kinds_kept = self._kept_kinds(kept)
        R_kept = len(kept)
        best: list[tuple[float, tuple, list, list[tuple[ReplicaSolution, int, int]], list[Group]]] = []
        caps = sorted(self.planner.tps, reverse=True)
        seen: set = set()
        for cap in caps:
            free = self._free_groups(damaged, changed, cap)
            key = tuple(sorted(g.key for g in free))
            if key in seen:
                continue
            seen.add(key)
            tally: dict[ClassKey, int] = {}
            for g in free:
                tally[g.key] = tally.get(g.key, 0) + 1
            classes = sorted(tally, key=lambda k: (-k[1] / c.layer_time(k[0]), -k[0], -k[1]))
            counts = [tally[k] for k in classes]
            capacity = {k: k[1] / c.layer_time(k[0]) for k in classes}
            for r_new in range(0, min(len(free), len(damaged) + 2) + 1):
                reps = _bulk_lpt(classes, counts, capacity, r_new) if r_new else []
                R = R_kept + sum(n for _, n in reps)
                if R < 1 or R > self.M:
                    continue
                sols = []
                for sig, n in reps:
                    s = pl.solve_replica(sig, R)
                    if s is None:
                        break
                    sols.append((s, n))
                else:
                    est = self._estimate(kinds_kept, sols, R)
                    if est is not None:
                        best.append((est[0], (cap, r_new), est[1], sols, free))
        best.sort(key=lambda x: (x[0], x[1]))
        scored: list[ScoredPlan] = []
        n_exact = 1 if pl.large else EXACT
        reshaped = self._reshape(kept, damaged)
        placed, early, shortcut = 0, None, False
        if n_exact == 1 and reshaped:
            # Large clusters: when the re-shaped candidate is certainly placed (its estimate beats,
            # by the margin, a lower bound of the kept-replica plan's exact price and of its
            # estimate, the two bars below) and its exact price beats that bound, it wins whatever
            # the kept-replica plan costs: that plan is then neither built nor priced (both
            # O(GPUs)). Same result as the steps below.
            bound = min(self._kept_bound(kept, kinds_kept, best[0][2]), best[0][0] * (1 - 1e-9)) \
                if best else math.inf
            cd = reshaped[0]
            if cd.estimate < bound * (1 - RESHAPE_MARGIN):
                placed = 1
                p = pl.place_lazy(cd)
                cb = c.evaluate(p)
                early = ScoredPlan(p, cb) if cb.feasible else None
                shortcut = early is not None and cb.iteration_time_s < bound
        if not shortcut:
            for _, _, mbs, sols, free in best[:n_exact]:
                p = self._build(kept, kinds_kept, mbs, sols, free, changed)
                cb = c.evaluate(p)
                if cb.feasible:
                    scored.append(ScoredPlan(p, cb))
        n_kept = len(scored)
        if placed:  # placed above: below the bar whatever the kept-replica plan costs
            if early is not None:
                scored.append(early)
        else:
            # the kept-replica plan's exact price when there is one (the estimate's gradient sync
            # assumes transfers across nodes, which kept replicas may not need)
            kept_time = min((x.cost.iteration_time_s for x in scored), default=best[0][0] if best else math.inf)
            bar = kept_time * (1 - RESHAPE_MARGIN)
            for cd in reshaped[:n_exact]:
                if cd.estimate >= bar:
                    break
                placed += 1
                p = pl.place_lazy(cd)
                cb = c.evaluate(p)
                if cb.feasible:
                    scored.append(ScoredPlan(p, cb))
        if not scored:
            return None
        kept_ids = {id(x) for x in scored[:n_kept]}
        scored.sort(key=lambda s: s.cost.iteration_time_s)
        top = scored[0]
        path = "kept replicas" if id(top) in kept_ids else "re-shaped"
        stats = {"replan": "from the previous plan", "path": path, "kept_replicas": R_kept if path == "kept replicas"
                 else 0, "damaged_replicas": len(damaged), "changed_nodes": len(changed), "candidates": len(best),
                 "reshaped_placed": placed, "estimate_kept": best[0][0] if best else None,
                 "estimate_reshaped": reshaped[0].estimate if reshaped else None}
        return PlanResult(top, None, top if top.plan.kind != "uniform" else None, distinct_plans(scored), (), stats,
                          self.cluster)

    def _kept_bound(self, kept: Sequence[PlanReplica], kinds_kept: dict, mbs: list) -> float:
        """A lower bound of the exact price (:meth:`~.cost.CostModel.evaluate`) of a plan holding the
        kept replicas with micro-batches ``mbs``: its slowest kept replica, priced as ``evaluate``
        prices it, plus the gradient sync of the kept replicas alone (fewer replicas move fewer
        bytes; the new replicas can only cut the layers finer and span more nodes) when it is
        priced from bandwidths, plus the step time; a hair lower for rounding."""
        c = self.cost
        worst = 0.0
        for (_, idx), lst in zip(kinds_kept.values(), mbs):
            r = kept[idx[0]]
            rc = c._replica_cost(PlanReplica(r.stages, lst[0][0]), r.shape_key()[1], len(kept), 1)
            worst = max(worst, rc.time_s)
        sync = 0.0
        if kept and (c.profile is None or c.profile.collectives is None):
            alone = Plan(self.prev.num_layers, tuple(kept), (), "heterogeneous")
            # priced as a heterogeneous plan (no pass to find out whether it is a grid): ZeRO
            # min(z, 1) moves the same bytes as z (the sync factor only tells ZeRO 0 from >= 1)
            object.__setattr__(alone, "_dims", None)
            sync = c.sync_time(alone)
        return (worst + sync + c.step_time()) * (1 - 1e-9)

    def _reshape(self, kept: Sequence[PlanReplica], damaged: Sequence[PlanReplica]) -> list[Candidate]:
        """The search's own candidates (:meth:`~.search.Planner.heterogeneous_candidates`) for the
        cuts that keep full nodes in groups of the previous plan's widest TP (see step 5), best first."""
        pl = self.planner
        tp = max(s.tp for r in list(kept[:1]) + list(damaged[:1]) for s in r.stages)
        full = self.cluster.max_gpus_per_node
        want = tuple(greedy_parts(full, tp))

        def same_cut(pool) -> bool:  # noqa: ANN001
            # a heuristic grouping's key: ((node type, its groups' classes), ...) (Planner.groupings)
            cuts = [tuple(tp_ for tp_, _ in classes) for t, classes in pool.key
                    if isinstance(t, tuple) and len(t) == full]
            return bool(cuts) and all(c == want for c in cuts)

        if self.cluster.num_gpus <= RESHAPE_SEARCH_MAX:
            out = pl.heterogeneous_candidates(keep=same_cut)
        else:  # one cut, the previous TP's ladder of replica counts, refined once
            pools = [p for p in pl.groupings() if p.num_groups > pl.SMALL_GROUPS and same_cut(p)]
            if not pools:
                return []
            pool = min(pools, key=lambda p: (len(p.classes), p.key))
            tried: set[int] = set()
            done = self._bounded_lpt(pool, self._ladder(pool, tp), {}, tried)
            lo, hi = pl._replica_bounds(pool)
            top = sorted((cd.estimate, R) for R, cd in done.items() if cd is not None)[:2]
            done.update(self._bounded_lpt(pool, sorted({R + d for _, R in top for d in (-1, 1)
                                                        if lo <= R + d <= hi and R + d not in tried}), done, tried))
            out = [cd for cd in done.values() if cd is not None]
        out.sort(key=lambda cd: (cd.estimate, cd.num_replicas))
        return out

    def _bounded_lpt(self, pool, Rs: Sequence[int], done: dict, tried: set[int]) -> dict:  # noqa: ANN001
        """:meth:`~.search.Planner._lpt_replicas` of ``pool`` for the replica counts ``Rs`` (in that
        order in the result), skipping a count whose candidate cannot be among the two best estimates
        (with ``done``'s): its lower bound (:meth:`~.search.Planner.lpt_bound`, from the replica
        signatures LPT makes, before their stage orders and layer splits) is above the second best.
        Each count tried is added to ``tried``; a skipped candidate is estimated above the second
        best, so the best, the two best and the order of the rest are as without the bound."""
        pl = self.planner
        classes, counts, cap = pl._lpt_order(pool)
        best = sorted(cd.estimate for cd in done.values() if cd is not None)[:2]
        got: dict[int, Candidate | None] = {}
        near = len(self.prev.replicas)  # the previous plan's count first: a good second best early
        for R in sorted(Rs, key=lambda R: (abs(R - near), R)):
            tried.add(R)
            reps = _bulk_lpt(classes, counts, cap, R)
            if len(best) == 2 and pl.lpt_bound(reps) * (1 - 1e-9) > best[1]:
                continue
            cd = pl._candidate(reps, pool, (0, R))
            got[R] = cd
            if cd is not None:
                best = sorted(best + [cd.estimate])[:2]
        return {R: got[R] for R in Rs if R in got}

    def _ladder(self, pool, tp: int) -> list[int]:  # noqa: ANN001
        """Replica counts: the pool's GPUs over ``tp`` x stages, for the search's geometric ladder
        of stage counts."""
        lo, hi = self.planner._replica_bounds(pool)
        out = set()
        for p in _geometric(self.cost.model.num_layers):
            for R in (pool.num_gpus // (tp * p), -(-pool.num_gpus // (tp * p))):
                if lo <= R <= hi:
                    out.add(R)
        return sorted(out)

    def _kept_kinds(self, kept: Sequence[PlanReplica]) -> dict[tuple, list]:
        """Kept replicas by shape: key -> [solution, indices of the replicas]."""
        by_id: dict[int, list] = {}  # replicas sharing a shape key object (a loaded plan interns them)
        for i, r in enumerate(kept):
            key = r.shape_key()
            e = by_id.get(id(key))
            if e is None:
                by_id[id(key)] = [key, [i]]
            else:
                e[1].append(i)
        out: dict[tuple, list] = {}
        same_fd = self.cost.fill_drain_p2p
        for key, idx in by_id.values():  # in order of first appearance
            e = out.get(key)
            if e is None:
                st = kept[idx[0]].stages
                order = tuple((s.tp, s.speed) for s in st)
                slow = self._slowest(st)
                p2p = sum(same_fd(x) for x in key[1])
                out[key] = [ReplicaSolution(order, tuple(s.num_layers for s in st), slow, p2p), idx]
            else:
                e[1] = sorted(e[1] + idx)
        return out

    def _slowest(self, stages: Sequence[PlanStage]) -> float:
        c = self.cost
        S = len(stages)
        tps = tuple(s.tp for s in stages)
        return max(c.stage_time(s.tp, s.num_layers, j == S - 1, s.speed) + c.stage_extra_time(tps, j)
                   for j, s in enumerate(stages))

    def _estimate(self, kinds_kept: dict, sols: list[tuple[ReplicaSolution, int]],
                  R: int) -> tuple[float, list] | None:
        all_sols = [(e[0], len(e[1])) for e in kinds_kept.values()] + sols
        kinds = [(s.slowest, (s.num_stages - 1) * s.slowest + s.p2p, n) for s, n in all_sols]
        mbs = assign_micro_batches(kinds, self.M)
        if mbs is None:
            return None
        pipe = max(o * lst[0][0] + b for (o, b, _), lst in zip(kinds, mbs))
        used = sum(n * max(tp for tp, _ in s.order) for s, n in all_sols)
        sync = self.planner._sync_estimate([s for s, _ in all_sols], R, used)
        return pipe + sync, mbs

    # 5: the plan
    def _build(self, kept: list[PlanReplica], kinds_kept: dict, mbs: list, sols: list,
               free: list[Group], changed: set[str]) -> Plan:
        out: list[PlanReplica | None] = [None] * len(kept)
        kk = list(kinds_kept.values())
        for (sol, idx), lst in zip(kk, mbs[:len(kk)]):
            pos = 0
            for m, n in lst:  # larger m first, to the first replicas of the kind
                for i in idx[pos:pos + n]:
                    r = kept[i]
                    out[i] = r if r.micro_batches == m else r.with_micro_batches(m)
                pos += n
        pools: dict[ClassKey, list[Group]] = {}
        for g in sorted(free, key=lambda g: g.sort_key):
            pools.setdefault(g.key, []).append(g)
        taken = {k: 0 for k in pools}
        new: list[PlanReplica] = []
        for (sol, _), lst in zip(sols, mbs[len(kk):]):
            for m, n in lst:
                for _ in range(n):
                    stages, first = [], 0
                    for k, cnt in zip(sol.order, sol.counts):
                        g = pools[k][taken[k]]
                        taken[k] += 1
                        stages.append(PlanStage.of_group(g.tp, (first, first + cnt), g.devices, g.speed, g.node))
                        first += cnt
                    new.append(PlanReplica(tuple(stages), m))
        leftover = [d for k, gs in pools.items() for g in gs[taken[k]:] for d in g.devices]
        index = self.cluster.node_index()
        unused = [self._current(d, index) for d in self.prev.unused
                  if d.node_name not in changed and self._exists(d, index)]
        reps = tuple(r for r in out if r is not None) + tuple(new)
        unused_all = tuple(sorted(set(unused) | set(leftover), key=lambda d: (d.node, d.local_id)))
        plan_ = Plan(self.prev.num_layers, reps, unused_all, "heterogeneous")
        if CostModel.is_grid(plan_):
            plan_ = Plan(plan_.num_layers, reps, unused_all, "uniform")
        return plan_

    def _exists(self, d: Device, index: dict[str, int]) -> bool:
        i = index.get(d.node_name)
        if i is None:
            return False
        nd = self.cluster.nodes[i]
        return d.local_id in nd.gpus


def _renumber(r: PlanReplica, index: dict[str, int]) -> PlanReplica:
    """``r`` with its devices numbered like the new cluster (node indices by name)."""
    stages = []
    changed = False
    for s in r.stages:
        devs = tuple(d if index[d.node_name] == d.node else Device(index[d.node_name], d.node_name, d.local_id, d.speed)
                     for d in s.devices)
        if devs != s.devices or any(a.node != b.node for a, b in zip(devs, s.devices)):
            changed = True
            stages.append(PlanStage(s.tp, s.layers, devs))
        else:
            stages.append(s)
    return PlanReplica(tuple(stages), r.micro_batches) if changed else r
