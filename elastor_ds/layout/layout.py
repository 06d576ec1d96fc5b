"""Parallel layouts: replicas -> stages -> (TP degree, layer range, ranks), plus micro-batches.

One value type describes every layout elastor_ds handles, uniform or heterogeneous:

* a :class:`Layout` is a tuple of :class:`Replica` (pipelines, i.e. data-parallel replicas);
* a replica has its own stages and its own number of micro-batches per iteration;
* a :class:`Stage` has its own TP degree, its own contiguous layer range ``[first, last)`` and the
  global ranks of its TP group (TP rank ``i`` is ``ranks[i]``).

The first stage of each replica also holds the "pre" tensors (embeddings) and the last stage the
"post" tensors (final norm, output layer). ``Layout.uniform`` builds the TP x PP x DP grid in the
rank order that DeepSpeed's ``PipeModelDataParallelTopology`` and Megatron's default ``tp-dp-pp``
order both use: ``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``.

The JSON form is the planner's plan document (``{"version": 1, "replicas": [...]}``); extra keys
written by the planner are ignored here.

Pure: no torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..errors import LayoutError
from .compact_plan import COMPACT_FORMAT_VERSION, MAX_DEVICES, MAX_MICRO_BATCHES, decode, to_replicas_json

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Stage:
    tp: int
    layers: tuple[int, int]  # [first, last)
    ranks: tuple[int, ...]
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise LayoutError(f"stage tp={self.tp}: the TP degree must be >= 1")
        if len(self.ranks) != self.tp:
            raise LayoutError(f"stage with tp={self.tp} lists {len(self.ranks)} ranks {list(self.ranks)}:"
                              f" give exactly tp ranks")
        first, last = self.layers
        if first < 0 or last <= first:
            raise LayoutError(f"stage layer range [{first}, {last}) is invalid: need 0 <= first < last (every "
                              f"stage holds at least one layer)")
        if self.devices and len(self.devices) != self.tp:
            raise LayoutError(f"stage with tp={self.tp} lists {len(self.devices)} devices; give tp or none")

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class Replica:
    stages: tuple[Stage, ...]
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if not self.stages:
            raise LayoutError("a replica needs at least one stage")
        if self.micro_batches < 1:
            raise LayoutError(f"replica micro_batches={self.micro_batches}: must be >= 1")

    @property
    def num_gpus(self) -> int:
        return sum(s.tp for s in self.stages)


@dataclass(frozen=True)
class RankPosition:
    """Where one global rank sits in a layout."""

    rank: int
    replica: int
    stage: int
    tp_rank: int
    tp: int
    num_stages: int
    layers: tuple[int, int]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class Layout:
    num_layers: int
    replicas: tuple[Replica, ...]
    _positions: Mapping[int, RankPosition] = field(default=None, compare=False, repr=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise LayoutError(f"num_layers={self.num_layers}: must be >= 1")
        if not self.replicas:
            raise LayoutError("a layout needs at least one replica")
        seen: dict[int, tuple[int, int]] = {}
        positions: dict[int, RankPosition] = {}
        for ri, rep in enumerate(self.replicas):
            expect = 0
            for si, st in enumerate(rep.stages):
                if st.layers[0] != expect:
                    raise LayoutError(
                        f"replica {ri} stage {si} starts at layer {st.layers[0]} but the previous stage ends at "
                        f"{expect}: stages must cover [0, {self.num_layers}) contiguously")
                expect = st.layers[1]
                for ti, r in enumerate(st.ranks):
                    if r < 0:
                        raise LayoutError(f"rank {r} in replica {ri} stage {si} is negative")
                    if r in seen:
                        raise LayoutError(f"rank {r} appears twice (replica/stage {seen[r]} and {(ri, si)}): "
                                          f"every rank holds one place")
                    seen[r] = (ri, si)
                    positions[r] = RankPosition(r, ri, si, ti, st.tp, len(rep.stages), st.layers)
            if expect != self.num_layers:
                raise LayoutError(f"replica {ri} covers layers [0, {expect}) but the model has {self.num_layers}")
        n = len(seen)
        if sorted(seen) != list(range(n)):
            raise LayoutError(f"ranks must be 0..{n - 1} without gaps; {gap_report(seen, n)}")
        object.__setattr__(self, "_positions", positions)

    # ---- constructors -------------------------------------------------------------------------
    @staticmethod
    def uniform(tp: int, pp: int, dp: int, num_layers: int,
                boundaries: Sequence[int] | None = None, micro_batches: int | Sequence[int] = 1) -> "Layout":
        """A TP x PP x DP grid; ``boundaries`` (pp+1 layer indices) allows uneven stages."""
        for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
            if v < 1:
                raise LayoutError(f"{name}={v}: must be >= 1")
        if boundaries is None:
            boundaries = balanced_boundaries(num_layers, pp)
        boundaries = [int(b) for b in boundaries]
        if len(boundaries) != pp + 1 or boundaries[0] != 0 or boundaries[-1] != num_layers:
            raise LayoutError(f"boundaries {boundaries} must have pp+1={pp + 1} entries from 0 to {num_layers}")
        mbs = [micro_batches] * dp if isinstance(micro_batches, int) else list(micro_batches)
        if len(mbs) != dp:
            raise LayoutError(f"micro_batches lists {len(mbs)} replicas but dp={dp}")
        reps = []
        for d in range(dp):
            stages = []
            for p in range(pp):
                ranks = tuple(p * dp * tp + d * tp + t for t in range(tp))
                stages.append(Stage(tp, (boundaries[p], boundaries[p + 1]), ranks))
            reps.append(Replica(tuple(stages), mbs[d]))
        return Layout(num_layers, tuple(reps))

    @staticmethod
    def from_json(obj: Mapping[str, Any] | str, num_layers: int | None = None) -> "Layout":
        """Build from a plan document (dict or JSON text). Ranks are assigned in order of appearance
        (replica, stage, TP rank) unless a stage lists ``"ranks"``."""
        if num_layers is not None:
            num_layers = _plan_int("num_layers", num_layers, "num_layers=8 (the model's layer count)", lo=1)
        try:
            if isinstance(obj, str):
                obj = json.loads(obj)
            if not isinstance(obj, Mapping):
                raise LayoutError(f"a plan document is a JSON object, got {type(obj).__name__}")
            return Layout._from_json(obj, num_layers)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"malformed plan document ({type(e).__name__}: {e}); write one with "
                              f"`elastor plan ... --json`") from None

    @staticmethod
    def _from_json(obj: Mapping[str, Any], num_layers: int | None = None) -> "Layout":
        version = obj.get("version", PLAN_FORMAT_VERSION)
        if version == COMPACT_FORMAT_VERSION:  # replica groups and device ranges: expanded, checked
            cp = decode(obj)
            obj = {"num_layers": cp.num_layers, "replicas": to_replicas_json(cp)}
        elif version != PLAN_FORMAT_VERSION:
            raise LayoutError(f"plan version {version} is not supported (this build reads {PLAN_FORMAT_VERSION} and "
                              f"{COMPACT_FORMAT_VERSION})")
        if "replicas" not in obj:
            raise LayoutError("plan JSON has no 'replicas' list")
        next_rank = 0
        total_mb = 0
        reps = []
        for ri, rj in enumerate(obj["replicas"]):
            stages = []
            for si, sj in enumerate(rj["stages"]):
                where = f"replicas[{ri}].stages[{si}]"
                tp = _plan_int(f"{where}.tp", sj["tp"], '"tp": 2', lo=1)
                if next_rank + tp > MAX_DEVICES:
                    # a plan may come from anyone: bounded before anything of that size is built
                    raise LayoutError(f"plan document: a stage of tp {tp:,} brings the plan to {next_rank + tp:,} "
                                      f"ranks; a plan has at most {MAX_DEVICES:,}")
                if "ranks" in sj:
                    ranks = tuple(_plan_int(f"{where}.ranks[{i}]", r, '"ranks": [0, 1]', lo=0)
                                  for i, r in enumerate(_plan_list(f"{where}.ranks", sj["ranks"], '"ranks": [0, 1]')))
                else:
                    ranks = tuple(range(next_rank, next_rank + tp))
                next_rank += tp
                raw = _plan_list(f"{where}.layers", sj["layers"], '"layers": [0, 4]')
                if len(raw) != 2:
                    raise LayoutError(f"stage 'layers' must be [first, last_exclusive], got {sj['layers']}")
                layers = tuple(_plan_int(f"{where}.layers[{i}]", x, '"layers": [0, 4]', lo=0)
                               for i, x in enumerate(raw))
                stages.append(Stage(tp, layers, ranks, tuple(sj.get("devices", ()))))  # type: ignore[arg-type]
            mb = _plan_int(f"replicas[{ri}].micro_batches", rj.get("micro_batches", 1), '"micro_batches": 4', lo=1,
                           hi=MAX_MICRO_BATCHES)
            total_mb += mb
            if total_mb > MAX_MICRO_BATCHES:   # the planner's bound on one step's micro-batches
                raise LayoutError(f"plan document: replicas[{ri}].micro_batches {mb:,} brings the plan to {total_mb:,} "
                                  f"micro-batches per optimizer step, all replicas together; a plan has at most "
                                  f"{MAX_MICRO_BATCHES:,} (global batch / micro-batch size)")
            reps.append(Replica(tuple(stages), mb))
        doc_layers = obj.get("num_layers")
        if doc_layers is not None:
            doc_layers = _plan_int("num_layers", doc_layers, '"num_layers": 32', lo=1)
        if num_layers is None:
            num_layers = doc_layers or max(s.layers[1] for r in reps for s in r.stages)
        return Layout(num_layers, tuple(reps))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PLAN_FORMAT_VERSION,
            "num_layers": self.num_layers,
            "num_gpus": self.world_size,
            "replicas": [
                {"micro_batches": r.micro_batches,
                 "stages": [dict({"tp": s.tp, "layers": list(s.layers), "ranks": list(s.ranks)},
                                 **({"devices": list(s.devices)} if s.devices else {}))
                            for s in r.stages]}
                for r in self.replicas],
        }

    # ---- queries ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._positions)

    @property
    def dp(self) -> int:
        return len(self.replicas)

    def position(self, rank: int) -> RankPosition:
        try:
            return self._positions[rank]
        except KeyError:
            raise LayoutError(f"rank {rank} is not in this layout (world size {self.world_size})") from None

    def stage_of(self, rank: int) -> Stage:
        p = self.position(rank)
        return self.replicas[p.replica].stages[p.stage]

    def is_uniform(self) -> bool:
        """True when every replica has the same stage boundaries and TP degrees (a TP x PP x DP grid)."""
        shape0 = [(s.tp, s.layers) for s in self.replicas[0].stages]
        return all([(s.tp, s.layers) for s in r.stages] == shape0 for r in self.replicas)

    def uniform_dims(self) -> tuple[int, int, int]:
        """(tp, pp, dp) of a uniform layout with one TP degree; raises otherwise."""
        if not self.is_uniform() or len({s.tp for s in self.replicas[0].stages}) != 1:
            raise LayoutError(f"layout is heterogeneous ({self._describe_hetero()}); no single tp x pp x dp")
        return self.replicas[0].stages[0].tp, len(self.replicas[0].stages), self.dp

    def boundaries(self, replica: int = 0) -> list[int]:
        st = self.replicas[replica].stages
        return [s.layers[0] for s in st] + [st[-1].layers[1]]

    def holders_of_layer(self, layer: int) -> list[Stage]:
        """The stage of each replica that holds ``layer`` (one per replica)."""
        out = []
        for r in self.replicas:
            for s in r.stages:
                if s.layers[0] <= layer < s.layers[1]:
                    out.append(s)
                    break
        return out

    def describe(self) -> str:
        """Short human text, e.g. ``tp2.pp2.dp1`` or ``R0[tp1:0-6|tp4:6-32] R1[tp2:0-32]``."""
        try:
            tp, pp, dp = self.uniform_dims()
            b = self.boundaries()
            even = b == balanced_boundaries(self.num_layers, pp)
            return f"tp{tp}.pp{pp}.dp{dp}" + ("" if even else f"(layers {b})")
        except LayoutError:
            return self._describe_hetero()

    def _describe_hetero(self) -> str:
        return " ".join(
                f"R{i}(mb{r.micro_batches})[" + "|".join(f"tp{s.tp}:{s.layers[0]}-{s.layers[1]}" for s in r.stages) + "]"
                for i, r in enumerate(self.replicas))

    def fingerprint(self) -> str:
        """A short hash of :meth:`to_json`: equal for equal layouts (ranks and devices included)."""
        return json_fingerprint(self.to_json())


def _plan_int(where: str, v: Any, example: str, lo: int = 0, hi: int | None = None) -> int:
    """A plan document's integer field: a real int (not a bool, not a float such as 2.0 or 2.9, not
    a string) of at least ``lo`` (and at most ``hi``); else a LayoutError naming the field, the value
    and an example."""
    if isinstance(v, bool) or isinstance(v, float) or isinstance(v, str):
        ok = False
    else:
        try:
            v = operator.index(v)   # int, numpy integers
            ok = True
        except TypeError:
            ok = False
    if not ok:
        raise LayoutError(f"plan document: {where} must be an integer, got {v!r} ({type(v).__name__}); e.g. {example}")
    if v < lo:
        raise LayoutError(f"plan document: {where} must be at least {lo}, got {v}; e.g. {example}")
    if hi is not None and v > hi:
        raise LayoutError(f"plan document: {where} must be at most {hi:,}, got {v:,}; e.g. {example}")
    return v


def _plan_list(where: str, v: Any, example: str) -> list:
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Sequence):
        raise LayoutError(f"plan document: {where} must be a list, got {v!r}; e.g. {example}")
    return list(v)


def json_fingerprint(layout_json: Mapping[str, Any]) -> str:
    """The fingerprint of a layout given as :meth:`Layout.to_json` writes it (key order free);
    ``Plan.layout_fingerprint`` hashes a plan's layout this way without building the Layout."""
    return hashlib.sha1(json.dumps(layout_json, sort_keys=True).encode()).hexdigest()[:16]


def balanced_boundaries(num_layers: int, pp: int) -> list[int]:
    """Stage boundaries that split ``num_layers`` as evenly as possible, earlier stages smaller
    (they keep more activations under 1F1B)."""
    if pp < 1 or pp > num_layers:
        raise LayoutError(f"cannot split {num_layers} layers into pp={pp} stages: need 1 <= pp <= num_layers")
    base, extra = divmod(num_layers, pp)
    sizes = [base + (1 if i >= pp - extra else 0) for i in range(pp)]
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def iter_ranks(layout: Layout) -> Iterable[int]:
    return range(layout.world_size)


def first_missing(present: "Iterable[int] | Mapping[int, object]", n: int, k: int = 8) -> list[int]:
    """The first ``k`` of ``0..n-1`` not in ``present``, in time and memory bounded by ``n`` (a
    crafted document's rank of 10**15 must not make a set of that size)."""
    have = present if isinstance(present, (set, frozenset, dict)) else set(present)
    out: list[int] = []
    for i in range(n):
        if i not in have:
            out.append(i)
            if len(out) == k:
                break
    return out


def gap_report(present: "Iterable[int] | Mapping[int, object]", n: int) -> str:
    """"missing [...]; out of range [...]" for ranks that should be ``0..n-1`` (bounded by ``n``)."""
    import heapq
    have = present if isinstance(present, (set, frozenset, dict)) else set(present)
    beyond = heapq.nsmallest(8, (r for r in have if r >= n))
    return f"missing {first_missing(have, n)}" + (f"; out of range {beyond}" if beyond else "")
