"""Measured communication costs for the planner: an alpha-beta model per collective kind and group
size (:class:`CommProfile`, the ``collectives`` field of a profile), and the exact list of
collective calls the heterogeneous runtime issues for a plan's gradient sync (:func:`sync_buffers`).

Profile field (``latency_s`` 0 to 1e6 seconds, ``s_per_byte`` 0 to 1; group sizes are integers >= 2;
p2p is measured between 2 ranks)::

    "collectives": {
      "tp_all_reduce":  {"2": {"latency_s": 4e-4, "s_per_byte": 2e-9}, "4": {...}},
      "p2p":            {"2": {...}},
      "dp_all_reduce":  {"2": {...}, "3": {...}},
      "reduce_scatter": {"3": {...}},
      "all_gather":     {"3": {...}}
    }

One call of kind ``k`` over ``g`` ranks moving a buffer of ``n`` bytes (the all-reduce's or
reduce-scatter's input, the all-gather's output, the p2p message) costs ``latency_s + s_per_byte x n``.
A group size that was not measured is scaled from the nearest measured one as a ring: latency by
``(g - 1) / (g0 - 1)``, the per-byte term by ``((g - 1) / g) / ((g0 - 1) / g0)``; a kind that was not
measured falls back to the analytical defaults (:mod:`elastor_ds.plan.cost`).

Which calls a plan makes (what :mod:`elastor_ds.runtime.hetero_comm` does, counted exactly):

* gradient sync: every tensor is cut into the finest TP blocks among the replicas holding it; a
  block's holder set is one rank per replica (TP rank ``q x t / T`` of a width-``t`` stage when the
  finest width is ``T``); the vocabulary-parallel embedding and output layer are cut by rows, and a
  width's row split depends on Megatron's padding (:func:`vocab_rows`), so those blocks need not nest;
  TP-replicated tensors (norms, position embedding) are held by every rank of the holding stages. A rank runs **one call per distinct holder set it belongs to** (all its cells with
  that holder set share one buffer): the split all-reduce is one ``dp_all_reduce`` per set, ZeRO-1
  one ``reduce_scatter`` plus one ``all_gather`` per set. :func:`sync_buffers` lists, per rank, the
  sets with their group size and buffer elements;
* TP: megatron-core issues 4 all-reduces per layer per micro-batch (forward: attention and MLP
  row-parallel outputs; backward: QKV and FC1 column-parallel input gradients), each of the
  activation ``b x s x h``; the first stage 1 more (vocab-parallel embedding), the last 1 (output
  layer input gradient) plus 3 of ``b x s`` fp32 values (vocab-parallel cross-entropy);
* p2p: DeepSpeed's pipeline sends block on gloo, so every micro-batch pays its stage's transfers:
  an activation to the next stage (``ceil(b / a)`` copies from a width-``a`` to a width-``b`` stage)
  and one gradient back, received likewise.

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Sequence

from ..errors import ConfigError


class CollectiveKind(str, Enum):
    TP_ALL_REDUCE = "tp_all_reduce"    # inside a TP stage's forward/backward
    P2P = "p2p"                        # one blocking send -> recv between pipeline stages
    DP_ALL_REDUCE = "dp_all_reduce"    # split all-reduce (one per holder set) / a grid's DP all-reduce
    REDUCE_SCATTER = "reduce_scatter"  # ZeRO-1, per holder set
    ALL_GATHER = "all_gather"          # ZeRO-1, per holder set


@dataclass(frozen=True)
class AlphaBeta:
    """One call costs ``latency_s + s_per_byte x bytes``."""

    latency_s: float
    s_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + self.s_per_byte * nbytes


# what a call's measured cost may be (like the profile's other tables, cost.py): a latency of 0 to
# ~11 days, 0 to 1 second per byte (1 byte/s); beyond these the planner's sums overflow to inf (a
# latency of 1e300 failed an internal assertion) and the answer would mean nothing anyway
COLLECTIVE_RANGES = {"latency_s": (0.0, 1e6, "seconds"), "s_per_byte": (0.0, 1.0, "seconds per byte")}


def _number(v: Any, where: str) -> float:
    lo, hi, unit = COLLECTIVE_RANGES[where.rpartition(".")[2]]
    # comparisons only: NaN and inf fail them, and an int too large for a float compares exactly
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        shown = f"<an integer of {v.bit_length():,} bits>" if isinstance(v, int) and v.bit_length() > 128 else \
            str(v)[:40]
        raise ConfigError(f"profile {where}={shown}: must be a finite number, {unit} from {lo:g} to {hi:g}; "
                          f"measure it again or drop the entry")
    return float(v)


@dataclass(frozen=True)
class CommProfile:
    """Measured alpha-beta costs per collective kind and group size."""

    costs: Mapping[CollectiveKind, Mapping[int, AlphaBeta]]

    def has(self, kind: CollectiveKind) -> bool:
        return bool(self.costs.get(kind))

    def time(self, kind: CollectiveKind, group_size: int, nbytes: float) -> float:
        """Seconds of one call over ``group_size`` ranks moving ``nbytes`` (0 for one rank)."""
        if group_size <= 1:
            return 0.0
        table = self.costs[kind]
        if group_size in table:
            return table[group_size].time(nbytes)
        g0 = min(table, key=lambda k: (abs(k - group_size), k))
        ab = table[g0]
        lat = ab.latency_s * (group_size - 1) / (g0 - 1)
        per_byte = ab.s_per_byte * ((group_size - 1) / group_size) / ((g0 - 1) / g0)
        return lat + per_byte * nbytes

    @staticmethod
    def from_dict(d: Any) -> "CommProfile":
        if not isinstance(d, Mapping):
            raise ConfigError(f"profile collectives: expected a mapping of kind -> group size -> "
                              f"{{latency_s, s_per_byte}}, got {type(d).__name__}")
        known = {k.value: k for k in CollectiveKind}
        costs: dict[CollectiveKind, dict[int, AlphaBeta]] = {}
        for name, table in d.items():
            if name not in known:
                raise ConfigError(f"profile collectives.{name}: unknown collective kind; known: {sorted(known)}")
            if not isinstance(table, Mapping) or not table:
                raise ConfigError(f"profile collectives.{name}: expected a non-empty mapping of group size -> "
                                  f"{{latency_s, s_per_byte}}")
            out: dict[int, AlphaBeta] = {}
            for gs, ab in table.items():
                where = f"collectives.{name}.{gs}"
                try:
                    g = int(gs)
                except (TypeError, ValueError):
                    raise ConfigError(f"profile {where}: group size must be an integer >= 2") from None
                if g < 2 or str(g) != str(gs).strip():
                    raise ConfigError(f"profile {where}: group size must be an integer >= 2")
                if name == CollectiveKind.P2P.value and g != 2:
                    raise ConfigError(f"profile {where}: p2p is measured between 2 ranks (group size 2)")
                if not isinstance(ab, Mapping) or set(ab) != {"latency_s", "s_per_byte"}:
                    raise ConfigError(f"profile {where}: expected exactly the keys latency_s and s_per_byte, got "
                                      f"{sorted(ab) if isinstance(ab, Mapping) else type(ab).__name__}")
                out[g] = AlphaBeta(_number(ab["latency_s"], where + ".latency_s"),
                                   _number(ab["s_per_byte"], where + ".s_per_byte"))
            costs[known[name]] = out
        return CommProfile(costs)

    def to_dict(self) -> dict[str, Any]:
        return {k.value: {str(g): {"latency_s": ab.latency_s, "s_per_byte": ab.s_per_byte}
                          for g, ab in sorted(t.items())}
                for k, t in sorted(self.costs.items(), key=lambda kv: kv[0].value)}


# ---- the gradient sync's calls ----------------------------------------------------------------------
RankKey = tuple[int, int, int]  # (replica, stage, TP rank within the stage)


def vocab_rows(vocab: int, divisible_by: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[first, last)`` of a ``vocab``-row table that TP rank ``rank`` of ``tp`` holds: Megatron
    pads the table to a multiple of ``divisible_by x tp`` and gives each rank an equal slice (the
    padding rows, beyond ``vocab``, are not part of the canonical tensor)."""
    m = divisible_by * tp
    per = -(-vocab // m) * m // tp
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def sync_buffers(stages: Sequence[Sequence[tuple[int, tuple[int, int]]]], params_per_layer: int,
                 replicated_per_layer: int, vocab: int = 0, row_elems: int = 0, divisible_by: int = 1,
                 output_layer: bool = True, first_replicated: int = 0,
                 last_replicated: int = 0) -> dict[RankKey, dict[frozenset, int]]:
    """Per rank, its holder sets (as frozensets of rank keys) -> elements of its buffer for that set.

    ``stages[i]`` lists replica ``i``'s stages as ``(tp, (first_layer, last_layer))``. Each layer has
    ``params_per_layer`` parameters of which ``replicated_per_layer`` are TP-replicated (norms) and the
    rest split ``tp`` ways in nested blocks; the first stage of a replica also holds the word embedding
    (``vocab`` rows of ``row_elems``, split by rows as :func:`vocab_rows`: widths need not nest there)
    and ``first_replicated`` (e.g. position embedding), the last stage the output layer (same rows,
    when ``output_layer``) and ``last_replicated`` (the final norm). Only sets spanning >= 2 replicas
    are listed.
    """
    R = len(stages)
    out: dict[RankKey, dict[frozenset, int]] = {}
    if R < 2:
        return out
    num_layers = max(st[-1][1][1] for st in stages)

    def put(hs: frozenset, n: int) -> None:
        if n <= 0:
            return
        for key in hs:
            d = out.setdefault(key, {})
            d[hs] = d.get(hs, 0) + n

    def add(holding: list[tuple[int, int, int]], split: int, replicated: int) -> None:
        # holding: (replica, stage index, tp) of the stages holding this tensor group
        if len({i for i, _, _ in holding}) < 2:
            return
        T = max(t for _, _, t in holding)
        if split:
            for q in range(T):  # block q of T: a width-t rank holds blocks [r T/t, (r+1) T/t)
                put(frozenset((i, j, q * t // T) for i, j, t in holding), split // T)
        if replicated:
            put(frozenset((i, j, r) for i, j, t in holding for r in range(t)), replicated)

    def add_table(holding: list[tuple[int, int, int]]) -> None:
        if not vocab or len({i for i, _, _ in holding}) < 2:
            return
        ranges = [((i, j, r), vocab_rows(vocab, divisible_by, t, r)) for i, j, t in holding for r in range(t)]
        cuts = sorted({e for _, rg in ranges for e in rg} | {0, vocab})
        for a, b in zip(cuts, cuts[1:]):
            put(frozenset(k for k, (lo, hi) in ranges if lo <= a and b <= hi), (b - a) * row_elems)

    split_layer = params_per_layer - replicated_per_layer
    for layer in range(num_layers):
        holding = [(i, j, t) for i, st in enumerate(stages) for j, (t, (a, b)) in enumerate(st) if a <= layer < b]
        add(holding, split_layer, replicated_per_layer)
    first = [(i, 0, st[0][0]) for i, st in enumerate(stages)]
    last = [(i, len(st) - 1, st[-1][0]) for i, st in enumerate(stages)]
    add_table(first)
    add(first, 0, first_replicated)
    if output_layer:
        add_table(last)
    add(last, 0, last_replicated)
    return out
