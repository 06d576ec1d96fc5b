"""Strategy planner (pure): which layout to train with on the GPUs that are left.

Glossary: a **group** is a TP group (power-of-two GPUs of one node); a **replica** is a pipeline
(one data-parallel copy of the model); a **stage** is one group holding a contiguous layer range
of a replica; **micro-batches** are given per replica, their total per iteration is fixed.

Modules: ``cluster`` (usable GPUs), ``model`` (model and training description), ``cost`` (cost
model and profiles), ``search`` (the search), ``plan_doc`` (the plan value and its JSON document),
``scored`` (the one scored plan type), ``world`` (the best plan for exactly the launched world, the
picker every trainer uses), ``profile`` (measures a profile with torch; imported only on demand),
``cli`` (``elastor plan``).
"""
from .cluster import Cluster, Device, Node
from .cost import CostBreakdown, CostModel, CostParams, Profile
from .model import ModelSpec, TrainingSpec
from .plan_doc import Plan, PlanReplica, PlanStage, plan_document
from .scored import PlanProvenance, ScoredPlan
from .search import PlanResult, Planner, assign_micro_batches, plan, split_layers
from .world import PlanConstraints, PreviousPlan, best_plan_for_world

__all__ = ["Cluster", "Device", "Node", "CostBreakdown", "CostModel", "CostParams", "Profile", "ModelSpec",
           "TrainingSpec", "Plan", "PlanReplica", "PlanStage", "plan_document", "PlanResult", "Planner",
           "assign_micro_batches", "plan", "split_layers", "PlanProvenance", "ScoredPlan", "PlanConstraints",
           "PreviousPlan", "best_plan_for_world"]
