"""The plan as a value (:class:`Plan`: replicas -> stages -> TP degree, layer range, devices, plus
micro-batches per replica) and its versioned JSON document, which ``Layout.from_json`` loads.

Document (version 1)::

    {"version": 1, "num_gpus": N, "num_layers": L, "predicted_iteration_time_s": t,
     "uniform_baseline": {...}, "replicas": [{"micro_batches": m, "stages": [
         {"tp": k, "layers": [first, last_exclusive], "devices": ["node0:0", ...], "ranks": [...],
          "memory_gb": g, "time_per_micro_batch_s": s}]}],
     "unused_devices": [...], "cost_breakdown": {...}}

Ranks number the used devices in canonical device order (node by node, GPU id ascending), so a
launcher that starts one process per used device in that order gets rank ``i`` on ``ranks[i]``.

Pure: no torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layout.layout import PLAN_FORMAT_VERSION, Layout
from .cluster import Device


@dataclass(frozen=True)
class PlanStage:
    tp: int
    layers: tuple[int, int]  # [first, last)
    devices: tuple[Device, ...]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def speed(self) -> float:
        """A TP group runs at the pace of its slowest GPU."""
        return min(d.speed for d in self.devices)


@dataclass(frozen=True)
class PlanReplica:
    stages: tuple[PlanStage, ...]
    micro_batches: int

    @property
    def num_gpus(self) -> int:
        return sum(s.tp for s in self.stages)


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

    def rank_of(self) -> dict[Device, int]:
        return {d: i for i, d in enumerate(self.used_devices())}

    def describe(self) -> str:
        """Short text, e.g. ``R0(mb16)[tp1:0-6|tp4:6-32] R1(mb16)[tp2:0-32]``; identical replicas are
        folded (``12x R0(...)``)."""
        parts: list[str] = []
        prev, n = None, 0
        for r in self.replicas:
            txt = f"(mb{r.micro_batches})[" + "|".join(
                f"tp{s.tp}:{s.layers[0]}-{s.layers[1]}" for s in r.stages) + "]"
            if txt == prev:
                n += 1
                continue
            if prev is not None:
                parts.append((f"{n}x" if n > 1 else "") + prev)
            prev, n = txt, 1
        parts.append((f"{n}x" if n > 1 else "") + str(prev))
        return " ".join(parts)

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

    def to_layout(self) -> Layout:
        return Layout.from_json({"version": PLAN_FORMAT_VERSION, "num_layers": self.num_layers,
                                 "replicas": self.replicas_json()})

    def uniform_dims(self) -> tuple[int, int, int] | None:
        """(tp, pp, dp) when this is a TP x PP x DP grid (same boundaries everywhere), else None."""
        shape0 = [(s.tp, s.layers) for s in self.replicas[0].stages]
        if len({s.tp for s in self.replicas[0].stages}) != 1:
            return None
        if any([(s.tp, s.layers) for s in r.stages] != shape0 for r in self.replicas):
            return None
        return shape0[0][0], len(shape0), len(self.replicas)


def _scored_json(plan: Plan, cost: Any, num_micro_batches: int, micro_batch_size: int) -> dict[str, Any]:
    """Plan + cost as the version-1 document (``cost`` is a :class:`~.cost.CostBreakdown`)."""
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
        "replicas": plan.replicas_json(extra),
        "unused_devices": [d.name for d in plan.unused],
        "cost_breakdown": cost.to_dict(),
    }
    dims = plan.uniform_dims()
    if dims is not None:
        doc["tp"], doc["pp"], doc["dp"] = dims
        doc["boundaries"] = [s.layers[0] for s in plan.replicas[0].stages] + [plan.num_layers]
    return doc


def plan_document(result: Any, num_micro_batches: int, micro_batch_size: int,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full plan document of a :class:`~.search.PlanResult`: the chosen plan at top level,
    the best uniform plan under ``uniform_baseline`` and the runners-up under ``alternatives``."""
    best = result.best
    doc = _scored_json(best.plan, best.cost, num_micro_batches, micro_batch_size)
    doc["num_usable_gpus"] = len(result.usable)
    if result.uniform is not None:
        u = _scored_json(result.uniform.plan, result.uniform.cost, num_micro_batches, micro_batch_size)
        doc["uniform_baseline"] = u
        doc["speedup_vs_uniform"] = u["predicted_iteration_time_s"] / doc["predicted_iteration_time_s"]
    else:
        doc["uniform_baseline"] = None
        doc["speedup_vs_uniform"] = None
    doc["alternatives"] = [{"kind": a.plan.kind, "description": a.plan.describe(), "num_gpus": a.plan.num_gpus,
                            "predicted_iteration_time_s": a.cost.iteration_time_s} for a in result.alternatives]
    if inputs is not None:
        doc["inputs"] = inputs
    doc["fingerprint"] = best.plan.to_layout().fingerprint()
    return doc
