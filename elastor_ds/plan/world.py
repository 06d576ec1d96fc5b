"""The best plan for exactly the launched world: the one picker every trainer uses.

A launched world is a :class:`~.cluster.Cluster` whose every device runs one process; a trainer can
only run a plan that gives each of them a place (each process joins the trainer's collectives).
:func:`best_plan_for_world` returns that plan as a :class:`~.scored.ScoredPlan`:

1. **Grids** (:func:`world_grids`): every TP x PP x DP grid over all devices, in the rank order
   megatron-core and DeepSpeed use (``rank = pp_rank * dp * tp + dp_rank * tp + tp_rank``, rank
   ``i`` on the cluster's ``i``-th device), TP groups inside one node, DP dividing the
   micro-batches, the layers split by the search's exact min-max split under each stage's memory
   limit (uneven stages allowed). Each is priced exactly (:meth:`~.cost.CostModel.evaluate`).
2. **Search** (skipped with ``PlanConstraints(homogeneous_only=True)``): a re-plan from the
   previous launch's plan when one is given (:func:`~.replan.replan`), else the full search
   (:func:`~.search.plan`); its plans that use exactly the world join the grids.
3. **Choose** the fastest prediction; ties go to grids, then fewer replicas, then the plan's text.
   The provenance's ``uniform`` is the best uniform alternative on the same world and cost model
   (:func:`best_uniform`), idle devices allowed; a trainer reports it with ``world - num_gpus``.

``homogeneous_only`` is what Megatron-LM can run: one TP x PP for every replica (uneven layer
splits through ``--pipeline-model-parallel-layout``). Every TP degree divides the attention heads,
the query groups and the FFN width.

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import PlanningError
from .cluster import Cluster, Device
from .cost import CostModel
from .model import ModelSpec
from .plan_doc import Plan, PlanReplica, PlanStage
from .scored import PlanProvenance, ScoredPlan
from .search import PlanResult, _plan_tie, _split, plan

log = logging.getLogger(__name__)

SEARCH_TOP_K = 50  # the search's runners-up kept: the best ones that use exactly the world are among them


@dataclass(frozen=True)
class PlanConstraints:
    """What a trainer can run. ``homogeneous_only``: TP x PP x DP grids with the same stage
    boundaries and micro-batches in every replica (Megatron-LM). ``layouts``: the search space of
    step 2 (``"heterogeneous"`` or ``"uniform"``). ``tp`` / ``pp``: a fixed TP degree or stage count
    (grids only when either is set)."""

    homogeneous_only: bool = False
    layouts: str = "heterogeneous"
    tp: Optional[int] = None
    pp: Optional[int] = None

    def __post_init__(self) -> None:
        if self.layouts not in ("heterogeneous", "uniform"):
            raise PlanningError(f"layouts={self.layouts!r}: choose 'heterogeneous' or 'uniform'")
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise PlanningError(f"{name}={v!r}: a fixed {name.upper()} must be an integer >= 1 (or None)")

    @property
    def grids_only(self) -> bool:
        return self.homogeneous_only or self.tp is not None or self.pp is not None

    def describe(self) -> str:
        parts = ["TP x PP x DP grids only" if self.homogeneous_only else f"{self.layouts} layouts"]
        parts += [f"{k}={v}" for k, v in (("TP", self.tp), ("PP", self.pp)) if v is not None]
        return ", ".join(parts)


@dataclass(frozen=True)
class PreviousPlan:
    """The previous launch's plan, numbered like the cluster now (:func:`~.plan_doc.plan_from_document`),
    and where it came from (a path, for the provenance text)."""

    plan: Plan
    cluster: Cluster
    source: str = "the previous plan"


def best_plan_for_world(cost: CostModel, constraints: PlanConstraints = PlanConstraints(),
                        previous: Optional[PreviousPlan] = None) -> ScoredPlan:
    """The fastest plan, by ``cost``'s prediction, that uses every device of ``cost.cluster`` (the
    launched world) under ``constraints``; see the module docstring. Raises
    :class:`~elastor_ds.errors.PlanningError` with the numbers when none fits."""
    world = cost.cluster.num_gpus
    grids = world_grids(cost, constraints)
    if constraints.grids_only:
        pool, res, how = grids, None, "grids over every device"
    else:
        res, how = _search(cost, constraints, previous)
        pool = grids + [s for s in [res.best, *res.alternatives] if _fits(s, cost)]
    if not pool:
        raise PlanningError(_none_fits(cost, constraints, res))
    best = min(pool, key=lambda s: (s.cost.iteration_time_s, _plan_tie(s.plan)))
    searched = pool[len(grids):]
    if searched and best.cost.iteration_time_s < min(s.cost.iteration_time_s for s in searched):
        how += "; chosen: a TP x PP x DP grid over every device (faster than the search's plans)"
    idle = res.best if res is not None and res.best.plan.num_gpus < world else None
    prov = PlanProvenance(how, len(pool), idle, best_uniform(cost, grids, res))
    log.debug("best plan for %d devices (%s): %s", world, constraints.describe(), best.describe())
    return ScoredPlan(best.plan, best.cost, prov)


def best_uniform(cost: CostModel, grids: Sequence[ScoredPlan], res: Optional[PlanResult]) -> Optional[ScoredPlan]:
    """The best uniform plan for the launched world, priced by the same ``cost`` as the chosen
    plan: the fastest of the grids over every device (``grids``, :func:`world_grids`) and the
    search's best grid (``res.uniform``, which may leave devices idle: ``world - plan.num_gpus``);
    ties go to the plan using more devices. None when neither exists."""
    pool = list(grids) + ([res.uniform] if res is not None and res.uniform is not None else [])
    if not pool:
        return None
    return min(pool, key=lambda s: (s.cost.iteration_time_s, -s.plan.num_gpus, _plan_tie(s.plan)))


def world_grids(cost: CostModel, constraints: PlanConstraints = PlanConstraints()) -> list[ScoredPlan]:
    """Every feasible TP x PP x DP grid over all devices of ``cost.cluster`` (step 1), priced."""
    model, training = cost.model, cost.training
    devs = cost.cluster.device_tuple()
    n, L, M = len(devs), model.num_layers, training.num_micro_batches
    out: list[ScoredPlan] = []
    for tp in allowed_tps(cost, constraints):
        if n % tp or not _groups_in_nodes(devs, tp):
            continue
        groups = [devs[k * tp:(k + 1) * tp] for k in range(n // tp)]
        for pp in range(1, min(L, len(groups)) + 1):
            if len(groups) % pp or (constraints.pp is not None and pp != constraints.pp):
                continue
            dp = len(groups) // pp
            if M % dp:
                continue
            p = _grid(cost, tp, pp, dp, groups)
            if p is None:
                continue
            cb = cost.evaluate(p)
            if cb.feasible:
                out.append(ScoredPlan(p, cb))
    return out


def allowed_tps(cost: CostModel, constraints: PlanConstraints = PlanConstraints()) -> list[int]:
    """TP degrees the training setup allows (:meth:`~.model.TrainingSpec.valid_tps`: they divide the
    heads, query groups and FFN width), restricted to ``constraints.tp``."""
    ffn = int(cost.model.ffn_hidden_size or 0)
    return [t for t in cost.training.valid_tps(cost.model)
            if ffn % t == 0 and constraints.tp in (None, t)]


def widest_tp(model: ModelSpec, node_procs: int) -> int:
    """The widest power-of-two TP that fits ``node_procs`` processes (one node) and divides the
    heads, query groups and FFN width: the TP cap (``TrainingSpec.nominal_tp``) for planning a
    launched world (``TrainingSpec.check_against`` refuses a cap that does not split them)."""
    cap = 1
    while cap * 2 <= node_procs and model.num_attention_heads % (cap * 2) == 0 and \
            int(model.num_query_groups or model.num_attention_heads) % (cap * 2) == 0 and \
            int(model.ffn_hidden_size or 0) % (cap * 2) == 0:
        cap *= 2
    return cap


def _groups_in_nodes(devs: Sequence[Device], tp: int) -> bool:
    """Every block of ``tp`` consecutive devices (a TP group in rank order) sits on one node."""
    return all(len({d.node for d in devs[k:k + tp]}) == 1 for k in range(0, len(devs), tp))


def _grid(cost: CostModel, tp: int, pp: int, dp: int, groups: Sequence[tuple[Device, ...]]) -> Optional[Plan]:
    """The grid with stage ``j`` of replica ``d`` on group ``j * dp + d`` and the exact min-max
    layer split under the memory limit (None when no split fits)."""
    L = cost.model.num_layers
    speeds = [min(x.speed for g in groups[j * dp:(j + 1) * dp] for x in g) for j in range(pp)]
    held = dp if cost.training.zero_stage > 0 else 1  # replicas that share a block's optimizer state
    mx = [min(m, L) for m in cost.max_layers_all(tp, pp, held, cost.grid_zero_stage(pp))]
    per = [cost.layer_time(tp) / sp for sp in speeds]
    extra = [cost.stage_extra_time((tp,) * pp, j) for j in range(pp)]
    extra[-1] += cost.head_time(tp) / speeds[-1]
    split = _split(per, extra, mx, L)
    if split is None:
        return None
    counts = split[1]
    mb = cost.training.num_micro_batches // dp
    reps = []
    for d in range(dp):
        stages, first = [], 0
        for j, c in enumerate(counts):
            stages.append(PlanStage(tp, (first, first + c), tuple(groups[j * dp + d])))
            first += c
        reps.append(PlanReplica(tuple(stages), mb))
    return Plan(L, tuple(reps), (), "uniform")


def _search(cost: CostModel, constraints: PlanConstraints,
            previous: Optional[PreviousPlan]) -> tuple[PlanResult, str]:
    """Step 2: the re-plan when it fits the world, else the full search; and which ran, in words."""
    if previous is None:
        why = "no previous plan"
    elif constraints.layouts != "heterogeneous":
        why = "uniform layouts only"
    else:
        from .replan import replan
        res = replan(cost, previous.plan, previous.cluster, top_k=SEARCH_TOP_K)
        if _fits(res.best, cost):
            return res, f"re-plan from {previous.source}: {res.search_stats.get('replan', 'from the previous plan')}"
        why = (f"the re-plan from {previous.source} uses {res.best.plan.num_gpus} of the {cost.cluster.num_gpus} "
               f"processes or TP widths the model cannot split")
    return plan(cost, layouts=constraints.layouts, top_k=SEARCH_TOP_K), f"full search ({why})"


def _fits(s: ScoredPlan, cost: CostModel) -> bool:
    """Uses every device, and every TP degree splits the heads, query groups and FFN width."""
    if s.plan.num_gpus != cost.cluster.num_gpus:
        return False
    ok = set(allowed_tps(cost))
    return all(st.tp in ok for r in s.plan.replicas for st in r.stages)


def _none_fits(cost: CostModel, constraints: PlanConstraints, res: Optional[PlanResult]) -> str:
    world = cost.cluster.num_gpus
    tps = allowed_tps(cost, constraints)
    msg = (f"no plan uses exactly the {world} launched processes ({constraints.describe()}; TP degrees {tps}, "
           f"{cost.model.num_layers} layers, {cost.training.num_micro_batches} micro-batches: DP must divide them)")
    if res is not None:
        b = res.best
        return msg + (f"; the search's best plan {b.plan.describe()} uses {b.plan.num_gpus}: launch "
                      f"{b.plan.num_gpus} processes or pass a plan")
    return msg + "; launch a process count that TP x PP x DP fits (and that fits in memory), or pass a plan"
