"""The one scored plan type: a :class:`~.plan_doc.Plan` (replicas -> stages -> TP degree, layer
range, devices) with its price (:class:`~.cost.CostBreakdown`) and, when it was chosen for a
launched world, how it was found (:class:`PlanProvenance`).

Every search result (:func:`~.search.plan`, :func:`~.replan.replan`) and every trainer's choice
(:func:`~.world.best_plan_for_world`) is a :class:`ScoredPlan`; its :attr:`ScoredPlan.layout` is the
:class:`~elastor_ds.layout.Layout` a trainer runs (rank ``i`` on the ``i``-th used device in the
cluster's canonical order).

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Optional

from .cluster import Device
from .plan_doc import Plan

if TYPE_CHECKING:
    from ..layout import Layout
    from .cost import CostBreakdown


@dataclass(frozen=True)
class PlanProvenance:
    """How :func:`~.world.best_plan_for_world` found its plan.

    ``search``: the search that ran, in words (``"grids over every device"``, ``"full search (no
    previous plan)"``, ``"re-plan from ...: ..."``). ``candidates``: plans that use exactly the world
    and were compared. ``best_overall``: the search's best plan when it leaves devices idle (a
    trainer cannot run it on this world; relaunching with its device count would). ``uniform``: the
    best TP x PP x DP grid for the world under the same cost model (:func:`~.world.best_uniform`:
    the grids over every device and the search's best grid, which may leave devices idle).
    """

    search: str
    candidates: int
    best_overall: Optional["ScoredPlan"] = None
    uniform: Optional["ScoredPlan"] = None


@dataclass(frozen=True)
class ScoredPlan:
    """A plan on concrete devices and its predicted cost."""

    plan: Plan
    cost: "CostBreakdown"
    provenance: Optional[PlanProvenance] = None

    @property
    def predicted_iteration_s(self) -> float:
        return self.cost.iteration_time_s

    @property
    def devices(self) -> list[Device]:
        """The used devices in rank order (rank ``i`` runs on ``devices[i]``)."""
        return self.plan.used_devices()

    @cached_property
    def layout(self) -> "Layout":
        """The :class:`~elastor_ds.layout.Layout` a trainer runs (made once)."""
        return self.plan.to_layout()

    def describe(self) -> str:
        return f"{self.plan.describe()}, predicted {self.cost.iteration_time_s:.4g} s/iter"
