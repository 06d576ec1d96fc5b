"""The cost model: predicted iteration time and per-stage memory of a plan.

Terms (all per iteration, seconds unless said otherwise):

* **stage time** ``c`` (forward+backward of one micro-batch on one stage):
  ``(layers x layer_time(tp) + [last stage] head_time(tp)) / speed``; ``speed`` is the slowest GPU
  of the TP group (1.0 nominal). ``layer_time`` is analytical by default (matmul FLOPs / achieved
  FLOP/s / tp, plus four TP all-reduces of the layer's activations over the intra-node link) or
  comes from a measured :class:`Profile`.
* **pipeline time** of replica ``i`` under 1F1B: ``(m_i + S_i - 1) x max_j c_j`` (``m_i``
  micro-batches, ``S_i`` stages: the ``S_i - 1`` extra slots are the fill/drain bubble) plus the
  stage-to-stage transfer on the fill/drain path: ``2 x sum over boundaries of
  activation_bytes / bandwidth`` (forward activations and backward gradients; steady-state
  transfers overlap with compute). Intra-node bandwidth when both stages share a node.
* **gradient sync** across replicas: every gradient is cut into the finest TP blocks among the
  replicas holding it and each block is all-reduced by the ranks that own it (one per replica).
  A rank of TP degree ``t`` owns ``params/t`` of the layer whatever the block size, so its volume
  is ``params/t x bytes``; ring factor ``2 (R-1)/R`` for an all-reduce (ZeRO 0) or
  ``(R-1)/R x (grad_bytes + dtype_bytes)`` for reduce-scatter + all-gather (ZeRO >= 1). A layer
  whose holders all sit on one node uses intra-node bandwidth, otherwise inter-node. Stages sync in
  parallel; the sync time is the slowest stage's.
* **iteration time** = ``max_i pipeline_i + sync`` (sync after the last backward, not overlapped),
  plus a measured profile's ``step_time_s`` (below).
* **memory** per GPU of a stage: parameters, gradients and optimizer state of its layers
  (ZeRO-sharded over the ``R`` replicas; a heterogeneous plan runs ZeRO-1 at most -- the optimizer
  state of every block sharded among its ``R`` holders, gradients and weights whole -- and so does a
  grid of more than one stage, DeepSpeed's PipelineEngine refusing ZeRO-2/3: both are priced at
  ``min(zero_stage, 1)``, :meth:`CostModel.plan_zero_stage`), activations of ``S - j`` in-flight micro-batches for the
  ``j``-th stage (1F1B; an upper bound that does not depend on ``m``), embedding on the first stage,
  output layer and fp32 logits on the last, plus a constant overhead; it must fit in
  ``gpu_memory x (1 - safety_margin)``.

**Measured communication** (a profile's ``collectives``, :mod:`elastor_ds.plan.comm_cost`): when a
kind is measured it replaces the bandwidth model above for that kind, counted per call as the
runtime issues them: ``tp_all_reduce`` -- 4 per layer per micro-batch, plus the embedding's (first
stage) and the output layer's and cross-entropy's (last stage) -- added to the layer and stage times
when the profile's layer times exclude them (``layer_time_includes_tp_comm: false``; the trainer's own
profile times whole layers and includes them); ``p2p`` -- every micro-batch's blocking sends and
receives of a stage, added to its time per micro-batch (the fill/drain transfer term is then 0);
``dp_all_reduce`` / ``reduce_scatter`` + ``all_gather`` -- one call per holder set a rank belongs to
(ZeRO 0 / ZeRO-1), the sync time being the slowest rank's sum. A uniform grid's DeepSpeed DP sync is
one call over the DP group.

**Measured per-iteration terms** (a running trainer's profile, ``examples/megatron_gpt/layer_profile.py``):
``embedding_time_s`` -- the first stage's work per micro-batch outside its layers (embedding, loading
the micro-batch), added to its stage time; ``step_time_s`` -- the iteration's wall time outside the
pipeline passes and transfers (gradient reduce, optimizer step, loss aggregation, checkpoint hooks),
added once per iteration. A profile without them prices them at 0 (the analytical GPU defaults).

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import math

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..cli_types import has_control_chars
from ..errors import ConfigError
from ..user_json import read_json_file
from .cluster import Cluster
from .comm_cost import CollectiveKind, CommProfile, sync_buffers
from .model import ModelSpec, TrainingSpec
from .plan_doc import Plan

MAX_PROFILE_FILE_BYTES = 16 << 20    # a measured profile is a few KB

log = logging.getLogger(__name__)

GiB = float(1 << 30)
HETERO_MAX_ZERO = 1  # the heterogeneous runtime shards optimizer state (ZeRO-1), not gradients or weights
PIPELINE_MAX_ZERO = 1  # DeepSpeed's PipelineEngine asserts ZeRO < 2: a grid of more than one stage runs ZeRO-1 at most
GB = 1e9  # bandwidths are in GB/s
# what a profile table's numbers may be: a time between a nanosecond and ~11 days per layer, bytes
# from 0 to 1 EB (a negative or denormal value planned a model onto 2 GPUs with negative memory, or
# overflowed the planner: QA round 5, Q5-4 and Q5-6)
_PROFILE_RANGES = {"activation_bytes_per_layer": (0.0, 1e18, "bytes"),
                   "head_time_s": (0.0, 1e6, "0 or seconds"), "embedding_time_s": (0.0, 1e6, "0 or seconds")}
_MAX_TP = 1 << 20
_TP_KEY = re.compile(r"^[1-9][0-9]{0,6}$")
PROFILE_TABLES = ("layer_time_s", "head_time_s", "activation_bytes_per_layer", "collectives", "embedding_time_s",
                  "step_time_s", "cores_per_node")


GPU_TFLOPS_RANGE = (0.001, 1e9)   # achieved TFLOP/s per GPU that the cost model accepts


@dataclass(frozen=True)
class CostParams:
    """Hardware and safety constants of the analytical model."""

    gpu_tflops: float = 200.0           # achieved dense TFLOP/s of one nominal-speed GPU
    memory_overhead_gb: float = 3.0     # CUDA context, NCCL buffers, allocator slack (GiB)
    memory_safety_margin: float = 0.05  # fraction of GPU memory never planned for
    tp_collective_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        if not (GPU_TFLOPS_RANGE[0] <= self.gpu_tflops <= GPU_TFLOPS_RANGE[1]):
            raise ConfigError(f"gpu_tflops={self.gpu_tflops!r}: out of range, give {GPU_TFLOPS_RANGE[0]:g} to "
                              f"{GPU_TFLOPS_RANGE[1]:,g}")
        if not (0 <= self.memory_safety_margin < 1) or self.memory_overhead_gb < 0:
            raise ConfigError(f"invalid cost parameters {self}")


@dataclass(frozen=True)
class Profile:
    """Measured per-layer forward+backward time (seconds per micro-batch) at each TP width, and
    optionally the output layer's time, per-layer activation bytes per micro-batch and measured
    collective costs (:class:`~elastor_ds.plan.comm_cost.CommProfile`).

    JSON: ``{"version": 1, "micro_batch_size": 1, "seq_length": 4096, "device": "...",
    "layer_time_s": {"1": 0.0377, "2": 0.0191, "4": 0.01}, "head_time_s": {...},
    "activation_bytes_per_layer": {"1": ..., ...}, "layer_time_includes_tp_comm": true,
    "collectives": {"tp_all_reduce": {"2": {"latency_s": ..., "s_per_byte": ...}}, ...},
    "sources": {"layer_time_s": "measured: ...", "head_time_s": "assumed: ..."}}``.
    ``layer_time_includes_tp_comm`` (default true: the trainer times whole layers, TP all-reduces
    included) says whether the TP collectives must be added to ``layer_time_s``/``head_time_s``.
    ``sources`` says, per table (:data:`PROFILE_TABLES`), how its numbers were obtained: a text
    starting with ``"measured"`` or ``"assumed"``; a table present without an entry counts as
    measured (older profiles). :meth:`CostModel.sources` names, for every term of the cost model,
    whether it comes from a measured number, an assumed one, or the analytical model.
    """

    layer_time_s: Mapping[int, float]
    head_time_s: Mapping[int, float] = field(default_factory=dict)
    activation_bytes_per_layer: Mapping[int, float] = field(default_factory=dict)
    micro_batch_size: int | None = None
    seq_length: int | None = None
    device: str = ""
    collectives: CommProfile | None = None
    layer_time_includes_tp_comm: bool = True
    sources: Mapping[str, str] = field(default_factory=dict)
    # measured by a running trainer (absent: 0, the analytical model's GPU-default behaviour):
    embedding_time_s: Mapping[int, float] = field(default_factory=dict)  # first stage's non-layer s per micro-batch
    step_time_s: float | None = None  # per iteration: optimizer step, gradient reduce, schedule bookkeeping
    # CPU runs: the cores a node's processes share (absent: a device per process, as with GPUs)
    cores_per_node: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_time_s:
            raise ConfigError("profile has no layer_time_s entries")
        for t, v in self.layer_time_s.items():
            if t < 1 or not (v > 0) or not math.isfinite(v):
                raise ConfigError(f"profile layer_time_s[{t}]={v}: TP width >= 1 and time > 0 required")
        for t, v in self.embedding_time_s.items():
            if t < 1 or not (v >= 0) or not math.isfinite(v):
                raise ConfigError(f"profile embedding_time_s[{t}]={v}: TP width >= 1 and time >= 0 required")
        if self.step_time_s is not None and (not isinstance(self.step_time_s, (int, float)) or
                                             not (self.step_time_s >= 0) or not math.isfinite(self.step_time_s)):
            raise ConfigError(f"profile step_time_s={self.step_time_s!r}: seconds per iteration >= 0 required")
        if self.cores_per_node is not None and (isinstance(self.cores_per_node, bool) or
                                                not isinstance(self.cores_per_node, int) or self.cores_per_node < 1):
            raise ConfigError(f"profile cores_per_node={self.cores_per_node!r}: a whole number of cores >= 1 required")
        if not isinstance(self.layer_time_includes_tp_comm, bool):
            raise ConfigError(f"profile layer_time_includes_tp_comm={self.layer_time_includes_tp_comm!r}: must be "
                              f"true or false")
        for k, v in self.sources.items():
            if k not in PROFILE_TABLES or not isinstance(v, str) or len(v) > 300 or \
                    not v.startswith(("measured", "assumed")) or has_control_chars(v):
                raise ConfigError(f"profile sources[{str(k)[:40]!r}]={str(v)[:60]!r}: keys are {list(PROFILE_TABLES)}, "
                                  f"values a text of at most 300 characters starting with 'measured' or 'assumed', "
                                  f"without control or invisible formatting characters (the text is printed)")

    def source(self, table: str) -> str | None:
        """How ``table`` was obtained (None when the profile does not have it)."""
        present = {"layer_time_s": bool(self.layer_time_s), "head_time_s": bool(self.head_time_s),
                   "activation_bytes_per_layer": bool(self.activation_bytes_per_layer),
                   "collectives": self.collectives is not None, "embedding_time_s": bool(self.embedding_time_s),
                   "step_time_s": self.step_time_s is not None, "cores_per_node": self.cores_per_node is not None}
        if not present.get(table):
            return None
        return self.sources.get(table, "measured (the profile does not say how)")

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Profile":
        if not isinstance(d, Mapping):
            raise ConfigError(f"profile: expected a JSON object, got {type(d).__name__}")
        if d.get("version", 1) != 1:
            raise ConfigError(f"profile version {d.get('version')} is not supported (this build reads 1)")

        def tbl(key: str) -> dict[int, float]:
            raw = d.get(key) or {}
            if not isinstance(raw, Mapping):
                raise ConfigError(f"profile {key}: expected a mapping of TP width -> number, got {type(raw).__name__}")
            lo, hi, unit = _PROFILE_RANGES.get(key, (1e-9, 1e6, "seconds"))
            out = {}
            for k, v in raw.items():
                if not (isinstance(k, str) and _TP_KEY.match(k)):
                    raise ConfigError(f"profile {key}: key {str(k)[:40]!r} is not a TP width (a whole number 1 to "
                                      f"{_MAX_TP:,} in ASCII digits)")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or 0 < v < 1e-9:
                    raise ConfigError(f"profile {key}.{k}={str(v)[:40]}: expected {unit} from {max(lo, 1e-9):g} to "
                                      f"{hi:g}{' (or 0)' if lo == 0 else ''}; measure it again or drop the entry")
                if int(k) > _MAX_TP:
                    raise ConfigError(f"profile {key}: TP width {k} is above {_MAX_TP:,}")
                out[int(k)] = float(v)
            return out

        coll = d.get("collectives")
        src = d.get("sources") or {}
        if not isinstance(src, Mapping):
            raise ConfigError(f"profile sources: expected a mapping of table -> text, got {type(src).__name__}")
        step = d.get("step_time_s")
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))):
            raise ConfigError(f"profile step_time_s={step!r}: expected seconds per iteration (a number)")
        return Profile(tbl("layer_time_s"), tbl("head_time_s"), tbl("activation_bytes_per_layer"),
                       d.get("micro_batch_size"), d.get("seq_length"), str(d.get("device", "")),
                       CommProfile.from_dict(coll) if coll is not None else None,
                       d.get("layer_time_includes_tp_comm", True), dict(src), tbl("embedding_time_s"),
                       None if step is None else float(step), d.get("cores_per_node"))

    @staticmethod
    def load(path: str | Path, flag: str = "profile") -> "Profile":
        """The profile file at ``path`` (``flag``: what named it, for errors), read as untrusted
        input: no symlink, at most :data:`MAX_PROFILE_FILE_BYTES`, every field checked."""
        doc = read_json_file(str(path), flag, MAX_PROFILE_FILE_BYTES, "a JSON profile",
                             "give a profile the trainer wrote (profile.json) or one docs/planner.md describes",
                             strict=False)
        try:
            return Profile.from_dict(doc)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{flag} {path}: {type(e).__name__}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        out = {"version": 1, "micro_batch_size": self.micro_batch_size, "seq_length": self.seq_length,
               "device": self.device,
               "layer_time_s": {str(k): v for k, v in sorted(self.layer_time_s.items())},
               "head_time_s": {str(k): v for k, v in sorted(self.head_time_s.items())},
               "activation_bytes_per_layer": {str(k): v for k, v in sorted(self.activation_bytes_per_layer.items())},
               "layer_time_includes_tp_comm": self.layer_time_includes_tp_comm}
        if self.collectives is not None:
            out["collectives"] = self.collectives.to_dict()
        if self.embedding_time_s:
            out["embedding_time_s"] = {str(k): v for k, v in sorted(self.embedding_time_s.items())}
        if self.step_time_s is not None:
            out["step_time_s"] = self.step_time_s
        if self.cores_per_node is not None:
            out["cores_per_node"] = self.cores_per_node
        if self.sources:
            out["sources"] = dict(self.sources)
        return out


@dataclass(frozen=True)
class ReplicaCost:
    micro_batches: int
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    slowest_stage_s: float
    compute_s: float      # m x slowest stage
    bubble_s: float       # (S - 1) x slowest stage
    p2p_s: float          # stage-to-stage transfer on the fill/drain path
    time_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batches": self.micro_batches, "slowest_stage_s": self.slowest_stage_s,
                "compute_s": self.compute_s, "bubble_s": self.bubble_s, "p2p_s": self.p2p_s,
                "time_s": self.time_s}


@dataclass(frozen=True)
class CostBreakdown:
    iteration_time_s: float
    pipeline_time_s: float
    sync_time_s: float
    replicas: tuple[ReplicaCost, ...]
    memory_limit_bytes: float
    feasible: bool
    step_time_s: float = 0.0  # the profile's measured per-iteration step time (0 without one)

    @property
    def peak_memory_bytes(self) -> float:
        return max(m for r in self.replicas for m in r.stage_memory_bytes)

    def to_dict(self) -> dict[str, Any]:
        slow = max(range(len(self.replicas)), key=lambda i: (self.replicas[i].time_s, -i))
        return {"iteration_s": self.iteration_time_s, "pipeline_s": self.pipeline_time_s,
                "gradient_sync_s": self.sync_time_s, **({"step_s": self.step_time_s} if self.step_time_s else {}),
                "bottleneck_replica": slow,
                "peak_memory_gb": self.peak_memory_bytes / GiB,
                "memory_limit_gb": self.memory_limit_bytes / GiB,
                "replicas": [r.to_dict() for r in self.replicas]}


class _Shaped(NamedTuple):
    """A replica as :meth:`CostModel._replica_cost` reads it: stages as (tp, layers, pace)."""

    stages: tuple
    micro_batches: int


class CostModel:
    """Prices stages, replicas and whole plans for one model, training setup and cluster."""

    def __init__(self, model: ModelSpec, training: TrainingSpec, cluster: Cluster,
                 params: CostParams | None = None, profile: Profile | None = None) -> None:
        self.model, self.training, self.cluster = model, training, cluster
        self.params = params or CostParams()
        self.profile = profile
        self._procs_per_node: int | None = None   # made on first use (bubble_share)
        self._lt: dict[int, float] = {}
        self._ht: dict[int, float] = {}
        if profile is not None:
            if profile.micro_batch_size not in (None, training.micro_batch_size) or \
                    profile.seq_length not in (None, model.seq_length):
                log.warning("profile was measured at micro_batch_size=%s seq_length=%s, the plan uses %s/%s",
                            profile.micro_batch_size, profile.seq_length, training.micro_batch_size,
                            model.seq_length)

    # ---- provenance ---------------------------------------------------------------------------
    def sources(self) -> dict[str, str]:
        """For every term of the cost model: where its numbers come from -- a measured profile
        table (and which TP widths), an assumed profile entry, or the analytical model with the
        constants it assumes. What `elastor plan` and the plan document show."""
        prof, cl, par = self.profile, self.cluster, self.params
        analytic = f"assumed: analytical ({par.gpu_tflops:g} TFLOP/s per GPU)"
        out: dict[str, str] = {}
        if prof is None:
            out["layer_time"] = analytic
            out["head_time"] = analytic
        else:
            widths = ",".join(str(t) for t in sorted(prof.layer_time_s))
            other = [t for t in self.training.valid_tps(self.model) if t not in prof.layer_time_s]
            out["layer_time"] = f"{prof.source('layer_time_s')} (TP {widths})" + (
                f"; TP {','.join(map(str, other))} scaled from the nearest measured width" if other else "")
            out["head_time"] = (prof.source("head_time_s") if prof.head_time_s else
                                "assumed: analytical, scaled by the measured/analytical layer-time ratio")
        nv = f"assumed: {cl.intra_node_bandwidth_gbs:g} GB/s within a node + {par.tp_collective_latency_s * 1e6:g} us"
        if prof is not None and prof.layer_time_includes_tp_comm:
            out["tp_all_reduce"] = "inside the measured layer times"
        elif self.measured(CollectiveKind.TP_ALL_REDUCE) is not None:
            out["tp_all_reduce"] = prof.source("collectives")  # type: ignore[union-attr]
        else:
            out["tp_all_reduce"] = nv
        bw = (f"assumed: {cl.intra_node_bandwidth_gbs:g} GB/s within a node, {cl.inter_node_bandwidth_gbs:g} GB/s "
              f"across nodes")
        p2p_measured = self.measured(CollectiveKind.P2P) is not None
        out["p2p"] = prof.source("collectives") if p2p_measured else bw  # type: ignore[union-attr]
        z = min(self.training.zero_stage, HETERO_MAX_ZERO)
        sync_measured = all(self.measured(k) is not None for k in self._sync_kinds(z))
        out["gradient_sync"] = prof.source("collectives") if sync_measured else bw  # type: ignore[union-attr]
        if prof is not None and prof.embedding_time_s:
            out["embedding_time"] = f"{prof.source('embedding_time_s')} (per micro-batch, first stage)"
        if prof is not None and prof.step_time_s is not None:
            out["step_time"] = f"{prof.source('step_time_s')} (per iteration)"
        if prof is not None and prof.cores_per_node is not None:
            out["bubble"] = (f"{prof.source('cores_per_node')}: {prof.cores_per_node} cores per node; where a node's "
                             f"processes outnumber them, a stage idle in the fill/drain bubble yields its core")
        out["memory"] = ((prof.source("activation_bytes_per_layer") + " (activations); ")  # type: ignore[union-attr]
                         if prof is not None and prof.activation_bytes_per_layer else "") + \
            (f"assumed: analytical (weights, gradients, optimizer state, activations with flash attention, "
             f"{par.memory_overhead_gb:g} GiB overhead, {par.memory_safety_margin:.0%} margin)")
        return out

    # ---- time ---------------------------------------------------------------------------------
    def _analytic_compute(self, tp: int) -> float:
        m, b = self.model, self.training.micro_batch_size
        return 3.0 * m.layer_fwd_flops(b) / tp / (self.params.gpu_tflops * 1e12)

    def _analytic_tp_comm(self, tp: int) -> float:
        """Four TP all-reduces of one layer's activation over the intra-node link (NVLink defaults)."""
        if tp <= 1:
            return 0.0
        ar = 2.0 * (tp - 1) / tp * self.activation_bytes / (self.cluster.intra_node_bandwidth_gbs * GB)
        return 4 * (ar + self.params.tp_collective_latency_s)

    def _analytic_layer_time(self, tp: int) -> float:
        return self._analytic_compute(tp) + self._analytic_tp_comm(tp)

    def _analytic_head_time(self, tp: int) -> float:
        return 3.0 * self.model.head_fwd_flops(self.training.micro_batch_size) / tp / (self.params.gpu_tflops * 1e12)

    @property
    def activation_bytes(self) -> float:
        """One micro-batch's hidden state ``b x s x h`` (what TP all-reduces and p2p move)."""
        m = self.model
        return float(self.training.micro_batch_size * m.seq_length * m.hidden_size * m.dtype_bytes)

    def measured(self, kind: CollectiveKind) -> CommProfile | None:
        """The profile's measured costs when ``kind`` was measured, else None (analytical model)."""
        prof = self.profile
        c = prof.collectives if prof is not None else None
        return c if c is not None and c.has(kind) else None

    def _tp_comm_added(self) -> bool:
        """TP collectives are priced on top of the profile's layer times (or analytically)."""
        return self.profile is None or not self.profile.layer_time_includes_tp_comm

    def tp_comm_per_layer(self, tp: int) -> float:
        """Seconds of one layer's TP all-reduces per micro-batch (4 calls): measured or analytical."""
        if tp <= 1:
            return 0.0
        c = self.measured(CollectiveKind.TP_ALL_REDUCE)
        if c is None:
            return self._analytic_tp_comm(tp)
        return 4 * c.time(CollectiveKind.TP_ALL_REDUCE, tp, self.activation_bytes)

    def layer_time(self, tp: int) -> float:
        """Forward+backward seconds of one layer for one micro-batch at TP ``tp`` (nominal speed),
        TP all-reduces included."""
        v = self._lt.get(tp)
        if v is None:
            prof = self.profile
            if prof is None:
                v = self._compute_layer_time(tp)
            elif prof.layer_time_includes_tp_comm:
                lt = prof.layer_time_s
                if tp in lt:
                    v = lt[tp]
                else:  # scale the analytical value by the nearest measured width
                    near = min(lt, key=lambda k: (abs(k - tp), k))
                    v = lt[near] * self._analytic_layer_time(tp) / self._analytic_layer_time(near)
            else:
                v = self._compute_layer_time(tp) + self.tp_comm_per_layer(tp)
            self._lt[tp] = v
        return v

    def _compute_layer_time(self, tp: int) -> float:
        """Without a profile: the analytical layer (compute + TP collectives, measured ones if given).
        With a profile whose times exclude TP collectives: its compute, scaled from the nearest width."""
        prof = self.profile
        if prof is None:
            return self._analytic_compute(tp) + self.tp_comm_per_layer(tp)
        lt = prof.layer_time_s
        if tp in lt:
            return lt[tp]
        near = min(lt, key=lambda k: (abs(k - tp), k))
        return lt[near] * self._analytic_compute(tp) / self._analytic_compute(near)

    def head_time(self, tp: int) -> float:
        v = self._ht.get(tp)
        if v is None:
            prof = self.profile
            if prof is not None and tp in prof.head_time_s:
                v = prof.head_time_s[tp]
            elif prof is not None:  # same measured/analytical ratio as the layers
                v = self._analytic_head_time(tp) * self.layer_time(tp) / self._analytic_layer_time(tp)
            else:
                v = self._analytic_head_time(tp)
            c = self.measured(CollectiveKind.TP_ALL_REDUCE)
            if c is not None and tp > 1 and self._tp_comm_added():
                # output layer's input gradient + vocab-parallel cross-entropy's three fp32 [s, b] reductions
                small = 4.0 * self.training.micro_batch_size * self.model.seq_length
                v += (c.time(CollectiveKind.TP_ALL_REDUCE, tp, self.activation_bytes)
                      + 3 * c.time(CollectiveKind.TP_ALL_REDUCE, tp, small))
            self._ht[tp] = v
        return v

    def embedding_time(self, tp: int) -> float:
        """The first stage's measured per-micro-batch work outside its layers (embedding, loading the
        micro-batch; the profile's ``embedding_time_s``, nearest measured width); 0 when not measured."""
        et = self.profile.embedding_time_s if self.profile is not None else None
        if not et:
            return 0.0
        return et[tp] if tp in et else et[min(et, key=lambda k: (abs(k - tp), k))]

    def step_time(self) -> float:
        """The measured per-iteration time outside the pipeline schedule's passes (optimizer step,
        gradient reduce, bookkeeping; the profile's ``step_time_s``); 0 when not measured."""
        st = self.profile.step_time_s if self.profile is not None else None
        return st or 0.0

    def stage_time(self, tp: int, num_layers: int, is_last: bool, speed: float = 1.0) -> float:
        return (num_layers * self.layer_time(tp) + (self.head_time(tp) if is_last else 0.0)) / speed

    def stage_extra_time(self, tps: tuple[int, ...], j: int) -> float:
        """Per micro-batch seconds of stage ``j`` of a replica whose stages have TP ``tps`` that do
        not scale with its layers or speed: the embedding's TP all-reduce (first stage) and the
        blocking p2p transfers (every micro-batch), when those are measured; 0 otherwise."""
        t = 0.0
        tp = tps[j]
        if j == 0:
            t += self.embedding_time(tp)
        c = self.measured(CollectiveKind.TP_ALL_REDUCE)
        if c is not None and j == 0 and tp > 1 and self._tp_comm_added():
            t += c.time(CollectiveKind.TP_ALL_REDUCE, tp, self.activation_bytes)
        p = self.measured(CollectiveKind.P2P)
        if p is not None:
            msgs = 0
            if j > 0:  # receive the activation, send the input gradient to every rank that needs it
                msgs += 1 + -(-tps[j - 1] // tp)
            if j < len(tps) - 1:  # send the activation to every rank of the next stage that needs it, receive its gradient
                msgs += -(-tps[j + 1] // tp) + 1
            t += msgs * p.time(CollectiveKind.P2P, 2, self.activation_bytes)
        return t

    def p2p_time(self, same_node: bool) -> float:
        """One activation (or its gradient) between neighbouring stages, seconds (bandwidth model)."""
        return self.activation_bytes / (self.bandwidth(same_node) * GB)

    def fill_drain_p2p(self, same_node: bool) -> float:
        """Transfer time of one stage boundary on the pipeline's fill/drain path (forward and
        backward); 0 when p2p is measured (then every micro-batch's transfers are in the stage times)."""
        return 0.0 if self.measured(CollectiveKind.P2P) is not None else 2.0 * self.p2p_time(same_node)

    def bandwidth(self, same_node: bool) -> float:
        c = self.cluster
        return c.intra_node_bandwidth_gbs if same_node else c.inter_node_bandwidth_gbs

    def sync_bytes_factor(self, num_replicas: int, zero_stage: int | None = None) -> float:
        """Bytes moved per parameter a rank owns, for the cross-replica gradient sync."""
        r = num_replicas
        if r <= 1:
            return 0.0
        tr = self.training
        if (tr.zero_stage if zero_stage is None else zero_stage) == 0:
            return 2.0 * (r - 1) / r * tr.grad_bytes
        return (r - 1) / r * (tr.grad_bytes + self.model.dtype_bytes)

    # ---- memory -------------------------------------------------------------------------------
    @property
    def memory_limit_bytes(self) -> float:
        return self.cluster.gpu_memory_gb * GiB * (1.0 - self.params.memory_safety_margin)

    def plan_zero_stage(self, plan: Plan) -> int:
        """The ZeRO stage ``plan`` runs with: the configured one on a grid of one stage; at most
        :data:`PIPELINE_MAX_ZERO` (1) on a grid of more (DeepSpeed's PipelineEngine refuses ZeRO-2/3)
        and :data:`HETERO_MAX_ZERO` (1) on the heterogeneous runtime."""
        z = self.training.zero_stage
        if not self.is_grid(plan):
            return min(z, HETERO_MAX_ZERO)
        return self.grid_zero_stage(plan.uniform_dims()[1])  # type: ignore[index]

    def grid_zero_stage(self, num_stages: int) -> int:
        """The ZeRO stage a TP x PP x DP grid of ``num_stages`` stages runs with: the configured one
        for one stage, at most :data:`PIPELINE_MAX_ZERO` for more (a pipeline)."""
        z = self.training.zero_stage
        return z if num_stages <= 1 else min(z, PIPELINE_MAX_ZERO)

    def state_bytes_per_param(self, num_replicas: int, zero_stage: int | None = None) -> float:
        tr, r = self.training, max(1, num_replicas)
        z = tr.zero_stage if zero_stage is None else zero_stage
        return (self.model.dtype_bytes / (r if z >= 3 else 1) + tr.grad_bytes / (r if z >= 2 else 1)
                + tr.optimizer_bytes / (r if z >= 1 else 1))

    def activation_bytes_per_layer(self, tp: int) -> float:
        """Stored activations of one layer for one micro-batch (Korthikanti et al. with flash
        attention: ``s b (10 h + (8 h + 2 f k) / tp)`` bytes at 2-byte dtype, k = 2 or 3 FFN mats)."""
        prof = self.profile
        if prof is not None and tp in prof.activation_bytes_per_layer:
            return prof.activation_bytes_per_layer[tp]
        m = self.model
        s, b, h, f = m.seq_length, self.training.micro_batch_size, m.hidden_size, m.ffn_hidden_size
        k = 3 if m.gated_mlp else 2
        return s * b * (10.0 * h + (8.0 * h + 2.0 * f * k) / tp) * m.dtype_bytes / 2.0  # type: ignore[operator]

    def stage_memory_parts(self, tp: int, pos: int, num_stages: int, num_replicas: int,
                           zero_stage: int | None = None) -> tuple[float, float]:
        """(fixed bytes, bytes per layer) of stage ``pos`` of ``num_stages``: memory = fixed + n x per_layer."""
        m, tr = self.model, self.training
        in_flight = num_stages - pos
        per_param = self.state_bytes_per_param(num_replicas, zero_stage)
        per_layer = m.params_per_layer / tp * per_param + in_flight * self.activation_bytes_per_layer(tp)
        fixed = self.params.memory_overhead_gb * GiB
        tokens = tr.micro_batch_size * m.seq_length
        if pos == 0:
            fixed += m.embedding_params / tp * per_param + in_flight * tokens * m.hidden_size * m.dtype_bytes
        if pos == num_stages - 1:
            if not (m.tied_embeddings and num_stages == 1):
                fixed += m.embedding_params / tp * per_param
            fixed += tokens * m.vocab_size / tp * 4.0 * 2  # fp32 logits and their gradient
        return fixed, per_layer

    def stage_params(self, tp: int, num_layers: int, pos: int, num_stages: int) -> float:
        """Parameters one GPU of stage ``pos`` holds: its layers, the embedding on the first stage,
        the output layer on the last (unless tied on a single stage), each split ``tp`` ways."""
        m = self.model
        n = num_layers * m.params_per_layer
        if pos == 0:
            n += m.embedding_params
        if pos == num_stages - 1 and not (m.tied_embeddings and num_stages == 1):
            n += m.embedding_params
        return n / tp

    def stage_state_bytes(self, tp: int, num_layers: int, pos: int, num_stages: int, num_replicas: int,
                          zero_stage: int | None = None) -> float:
        """The training-state part of :meth:`stage_memory` (weights, gradients, optimizer state;
        no activations or overhead): what ``elastor_ds.testing.state_memory`` measures on a rank."""
        return self.stage_params(tp, num_layers, pos, num_stages) * self.state_bytes_per_param(num_replicas, zero_stage)

    def stage_memory(self, tp: int, num_layers: int, pos: int, num_stages: int, num_replicas: int,
                     zero_stage: int | None = None) -> float:
        fixed, per_layer = self.stage_memory_parts(tp, pos, num_stages, num_replicas, zero_stage)
        return fixed + num_layers * per_layer

    def max_layers_all(self, tp: int, num_stages: int, num_replicas: int,
                       zero_stage: int | None = None) -> tuple[int, ...]:
        """:meth:`max_layers` of every position of a ``num_stages``-stage pipeline of TP ``tp``
        (the same arithmetic as :meth:`stage_memory_parts`, once per position; cached)."""
        key = (tp, num_stages, num_replicas, zero_stage)
        cache = self.__dict__.setdefault("_mx_all", {})
        v = cache.get(key)
        if v is not None:
            return v
        m, tr, S = self.model, self.training, num_stages
        per_param = self.state_bytes_per_param(num_replicas, zero_stage)
        w = m.params_per_layer / tp * per_param
        act = self.activation_bytes_per_layer(tp)
        base = self.params.memory_overhead_gb * GiB
        tokens = tr.micro_batch_size * m.seq_length
        emb = m.embedding_params / tp * per_param
        head = (0.0 if (m.tied_embeddings and S == 1) else emb) + tokens * m.vocab_size / tp * 4.0 * 2
        limit = self.memory_limit_bytes
        out = []
        for j in range(S):
            fixed = base
            if j == 0:
                fixed += emb + (S - j) * tokens * m.hidden_size * m.dtype_bytes
            if j == S - 1:
                fixed += head
            room = limit - fixed
            per_layer = w + (S - j) * act
            out.append(-1 if room < 0 else (int(room // per_layer) if per_layer > 0 else m.num_layers))
        v = cache[key] = tuple(out)
        return v

    def max_layers(self, tp: int, pos: int, num_stages: int, num_replicas: int, zero_stage: int | None = None) -> int:
        """Most layers stage ``pos`` can hold within the memory limit (may be <= 0)."""
        fixed, per_layer = self.stage_memory_parts(tp, pos, num_stages, num_replicas, zero_stage)
        room = self.memory_limit_bytes - fixed
        if room < 0:
            return -1
        return int(room // per_layer) if per_layer > 0 else self.model.num_layers

    # ---- whole plans --------------------------------------------------------------------------
    def evaluate(self, plan: Plan) -> CostBreakdown:
        """Price a placed plan exactly (the function every search result and test is judged by).
        Replicas of the same shape on the same kind of placement are priced once
        (:meth:`~.plan_doc.Plan.priced_replicas`: a plan placed lazily is priced without its devices)."""
        priced = plan.priced_replicas()
        R = len(priced)
        # a grid runs DeepSpeed's ZeRO at the configured stage over its DP group; the heterogeneous
        # runtime runs ZeRO-1 at most, sharding each block's optimizer state among its R holders
        z = self.plan_zero_stage(plan)
        limit = self.memory_limit_bytes
        feasible = True
        reps: list[ReplicaCost] = []
        memo: dict[tuple, ReplicaCost] = {}
        by_id: dict[tuple[int, int], ReplicaCost] = {}  # (micro-batches, id of the shape key): no hashing of the key
        for m, shape in priced:
            # what the price depends on: TP, layers, speed of every stage, and which neighbouring
            # stages share a node (PlanReplica.shape_key), and the micro-batches
            k = (m, id(shape))
            rc = by_id.get(k)
            if rc is None:
                key = (m, shape)
                rc = memo.get(key)
                if rc is None:
                    rc = memo[key] = self._replica_cost(_Shaped(shape[0], m), shape[1], R, z)
                    if any(mm > limit for mm in rc.stage_memory_bytes):
                        feasible = False
                by_id[k] = rc
            reps.append(rc)
        sync = self.sync_time(plan)
        step = self.step_time()
        pipe = max(r.time_s for r in reps)
        return CostBreakdown(pipe + sync + step, pipe, sync, tuple(reps), limit, feasible, step)

    def _replica_cost(self, rep, same_node: tuple[bool, ...], R: int, z: int) -> ReplicaCost:  # noqa: ANN001
        """``rep``: a :class:`~.plan_doc.PlanReplica` or a :class:`_Shaped` (stages as (tp, layers, pace))."""
        st = rep.stages
        S = len(st)
        if S and isinstance(st[0], tuple):
            shape = st
        else:
            shape = tuple((s.tp, s.layers, s.speed) for s in st)
        tps = tuple(t for t, _, _ in shape)
        times = tuple(self.stage_time(t, b - a, j == S - 1, sp) + self.stage_extra_time(tps, j)
                      for j, (t, (a, b), sp) in enumerate(shape))
        mems = tuple(self.stage_memory(t, b - a, j, S, R, z) for j, (t, (a, b), _) in enumerate(shape))
        slow = max(times)
        p2p = sum(self.fill_drain_p2p(same) for same in same_node)
        compute, bubble = rep.micro_batches * slow, (S - 1) * slow * self.bubble_share(sum(tps))
        return ReplicaCost(rep.micro_batches, times, mems, slow, compute, bubble, p2p, compute + bubble + p2p)

    def bubble_share(self, procs: int) -> float:
        """The part of the fill/drain bubble a replica of ``procs`` processes pays for.

        1 with a device per process. Where a node's processes share fewer cores (a CPU run whose
        profile says ``cores_per_node``), the measured stage times are those of P processes on C
        cores, each running at C/P of a core. During the bubble the idle half of this replica's
        processes (on average over fill and drain) leave their cores to the busy ones, which then
        run at min(1, C / busy) of a core. The bubble then costs max(C/P, busy/P) of a steady
        slot, with busy = P - procs/2."""
        cores = self.profile.cores_per_node if self.profile is not None else None
        if cores is None:
            return 1.0
        per_node = self._procs_per_node
        if per_node is None:
            per_node = self._procs_per_node = max((len(n.gpus) for n in self.cluster.nodes), default=1)
        if per_node <= cores:
            return 1.0
        busy = per_node - min(procs, per_node) / 2.0
        return max(cores / per_node, busy / per_node)

    @staticmethod
    def is_grid(plan: Plan) -> bool:
        """A TP x PP x DP grid with equal micro-batches: runs as DeepSpeed's own grid (any ZeRO
        stage with one stage, ZeRO-1 at most with more); other plans run on the heterogeneous
        runtime (ZeRO-1 at most)."""
        return plan.uniform_dims() is not None and len({m for m, _ in plan.priced_replicas()}) == 1

    def sync_time(self, plan: Plan) -> float:
        """Cross-replica gradient sync (see module docstring): slowest stage over all replicas."""
        priced = plan.priced_replicas()
        R = len(priced)
        factor = self.sync_bytes_factor(R, self.plan_zero_stage(plan))
        if factor == 0.0:
            return 0.0
        measured = self.measured_sync_time(plan)
        if measured is not None:
            return measured
        m = self.model
        # The node holding each layer over all replicas (-1: more than one), by segments between
        # all stage boundaries; stages of the same layer range are taken together.
        by_range, first_node, last_node = plan.holder_nodes()
        cuts = sorted({b for lay in by_range for b in lay})
        seg_index = {c: i for i, c in enumerate(cuts)}
        seg_node: list[int | None] = [None] * (len(cuts) - 1)
        for (a, b), n in by_range.items():
            for i in range(seg_index[a], seg_index[b]):
                seg_node[i] = n if seg_node[i] in (None, n) else -1
        seg_time = [(cuts[i + 1] - cuts[i]) * m.params_per_layer * factor / (self.bandwidth(seg_node[i] != -1) * GB)
                    for i in range(len(cuts) - 1)]
        emb_first = m.embedding_params * factor / (self.bandwidth(first_node != -1) * GB)
        emb_last = m.embedding_params * factor / (self.bandwidth(last_node != -1) * GB)
        worst = 0.0
        seen: set = set()
        shapes: set = set()
        ids: set[int] = set()
        for _, sk in priced:
            shape = sk[0]  # (tp, layers, speed) per stage: its stages' keys below
            if id(shape) in ids:
                continue
            ids.add(id(shape))
            if shape in shapes:
                continue
            shapes.add(shape)
            S = len(shape)
            for j, (tp, lay, _) in enumerate(shape):
                key = (tp, lay, j == 0, j == S - 1 and not (m.tied_embeddings and S == 1))
                if key in seen:
                    continue
                seen.add(key)
                t = sum(seg_time[seg_index[lay[0]]:seg_index[lay[1]]])
                if key[2]:
                    t += emb_first
                if key[3]:
                    t += emb_last
                worst = max(worst, t / tp)
        return worst

    def _sync_kinds(self, zero_stage: int) -> tuple[CollectiveKind, ...]:
        return (CollectiveKind.DP_ALL_REDUCE,) if zero_stage == 0 else (CollectiveKind.REDUCE_SCATTER,
                                                                         CollectiveKind.ALL_GATHER)

    def sync_call_time(self, group_size: int, nbytes: float, zero_stage: int) -> float:
        """One holder set's sync over ``group_size`` ranks with a buffer of ``nbytes``: an all-reduce
        (ZeRO 0) or a reduce-scatter + all-gather (ZeRO >= 1), from the measured costs."""
        c = self.profile.collectives  # type: ignore[union-attr]
        return sum(c.time(k, group_size, nbytes) for k in self._sync_kinds(zero_stage))  # type: ignore[union-attr]

    def measured_sync_time(self, plan: Plan) -> float | None:
        """The gradient sync from measured collective costs, one call per holder set a rank belongs
        to (:func:`~elastor_ds.plan.comm_cost.sync_buffers`; a grid: one call over its DP group); the
        slowest rank's sum. None when the needed kinds were not measured."""
        z = self.plan_zero_stage(plan)
        if any(self.measured(k) is None for k in self._sync_kinds(z)):
            return None
        R = len(plan.replicas)
        gb = self.training.grad_bytes
        if self.is_grid(plan):
            S = len(plan.replicas[0].stages)
            return max(self.sync_call_time(R, self.stage_params(s.tp, s.num_layers, j, S) * gb, z)
                       for j, s in enumerate(plan.replicas[0].stages))
        return max(sum(self.sync_call_time(len(hs), n * gb, z) for hs, n in sets.items())
                   for sets in self.sync_buffers(plan).values())

    def sync_buffers(self, plan: Plan) -> dict:
        """Per rank (replica, stage, TP rank): holder set -> buffer elements (see ``comm_cost``)."""
        m = self.model
        h = m.hidden_size
        return sync_buffers([[(s.tp, s.layers) for s in r.stages] for r in plan.replicas], m.params_per_layer,
                            2 * h, vocab=m.vocab_size, row_elems=h, divisible_by=m.vocab_divisible_by,
                            output_layer=not m.tied_embeddings, last_replicated=h)
