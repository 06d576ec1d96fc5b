"""Per-tensor sharding rules: which part of the global tensor each TP rank of a stage holds.

A :class:`TensorSpec` names a tensor, its *global* (canonical) shape and dtype, where it lives in
the model (``pre`` = embeddings on the first stage, ``post`` = final norm / output layer on the
last stage, ``tied`` = both, or a transformer layer index) and its :class:`ShardRule`.

The canonical global form of every tensor is what megatron-core holds at TP=1:

* column-parallel (``split(dim=0)``), row-parallel (``split(dim=1)``);
* vocab-parallel rows with padding: the global tensor has the *unpadded* rows; at TP ``t`` the
  padded size is ``ceil(rows / (pad_multiple * t)) * pad_multiple * t`` and the padding rows a rank
  holds map to nothing (they are not saved and are zero-filled on load);
* fused tensors whose TP shard interleaves parts: ``parts`` lists the sizes of the parts along the
  split dim (gated MLP ``linear_fc1`` = ``[gate; up]`` -> ``parts=(ffn, ffn)``), each part is
  split across TP ranks separately and the local shard is the concatenation of the part slices;
* fused QKV with grouped query heads (megatron-core's layout: per query group ``[q..., k, v]``)
  needs no parts: a TP shard is a contiguous run of whole groups, so ``unit`` = rows per group.

:func:`local_pieces` turns a rule into the rank's local shape and its :class:`Piece` list.
Uneven splits (a part not divisible by the TP degree) are allowed: rank ``r`` of ``t`` takes units
``[r*n//t, (r+1)*n//t)``, which equals Megatron's split whenever Megatron's divisibility holds.

Pure: no torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

from ..errors import ShardingError
from .layout import Layout
from .region import Piece, Region


class RuleKind(str, enum.Enum):
    REPLICATED = "replicated"
    SPLIT = "split"
    VOCAB = "vocab"


@dataclass(frozen=True)
class ShardRule:
    kind: RuleKind = RuleKind.REPLICATED
    dim: int = 0
    parts: tuple[int, ...] = ()
    unit: int = 1
    pad_multiple: int = 1

    # ---- constructors ----
    @staticmethod
    def replicated() -> "ShardRule":
        return ShardRule(RuleKind.REPLICATED)

    @staticmethod
    def column_parallel(unit: int = 1) -> "ShardRule":
        return ShardRule(RuleKind.SPLIT, dim=0, unit=unit)

    @staticmethod
    def row_parallel() -> "ShardRule":
        return ShardRule(RuleKind.SPLIT, dim=1)

    @staticmethod
    def split(dim: int, parts: Sequence[int] = (), unit: int = 1) -> "ShardRule":
        return ShardRule(RuleKind.SPLIT, dim=dim, parts=tuple(int(p) for p in parts), unit=unit)

    @staticmethod
    def vocab_parallel(pad_multiple: int = 1) -> "ShardRule":
        return ShardRule(RuleKind.VOCAB, dim=0, pad_multiple=pad_multiple)

    @staticmethod
    def gated_mlp(ffn_hidden_size: int) -> "ShardRule":
        """megatron-core ``linear_fc1`` with a gated activation: global rows ``[gate; up]``."""
        return ShardRule(RuleKind.SPLIT, dim=0, parts=(ffn_hidden_size, ffn_hidden_size))

    @staticmethod
    def fused_qkv(num_heads: int, num_query_groups: int, head_dim: int) -> "ShardRule":
        """megatron-core ``linear_qkv``: rows grouped per query group as ``[q * (heads/groups), k, v]``."""
        if num_heads % num_query_groups:
            raise ShardingError(f"num_attention_heads={num_heads} is not divisible by "
                                f"num_query_groups={num_query_groups}")
        return ShardRule(RuleKind.SPLIT, dim=0, unit=(num_heads // num_query_groups + 2) * head_dim)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value}
        if self.kind != RuleKind.REPLICATED:
            d["dim"] = self.dim
        if self.parts:
            d["parts"] = list(self.parts)
        if self.unit != 1:
            d["unit"] = self.unit
        if self.pad_multiple != 1:
            d["pad_multiple"] = self.pad_multiple
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "ShardRule":
        return ShardRule(RuleKind(d["kind"]), int(d.get("dim", 0)), tuple(d.get("parts", ())),
                         int(d.get("unit", 1)), int(d.get("pad_multiple", 1)))


Placement = Union[int, str]  # layer index, or "pre" | "post" | "tied"
_NAMED_PLACEMENTS = ("pre", "post", "tied")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    rule: ShardRule = field(default_factory=ShardRule.replicated)
    placement: Placement = "pre"

    def __post_init__(self) -> None:
        if isinstance(self.placement, str) and self.placement not in _NAMED_PLACEMENTS:
            raise ShardingError(f"tensor {self.name}: placement {self.placement!r} must be a layer index "
                                f"or one of {_NAMED_PLACEMENTS}")
        r = self.rule
        if r.kind != RuleKind.REPLICATED and not 0 <= r.dim < len(self.shape):
            raise ShardingError(f"tensor {self.name} of shape {self.shape}: split dim {r.dim} out of range")
        if r.parts and sum(r.parts) != self.shape[r.dim]:
            raise ShardingError(f"tensor {self.name}: parts {r.parts} sum to {sum(r.parts)} but dim {r.dim} "
                                f"has size {self.shape[r.dim]}")
        sizes = r.parts or ((self.shape[r.dim],) if r.kind != RuleKind.REPLICATED else ())
        for p in sizes:
            if p % r.unit:
                raise ShardingError(f"tensor {self.name}: part of size {p} is not a multiple of unit {r.unit}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "rule": self.rule.to_json(), "placement": self.placement}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "TensorSpec":
        return TensorSpec(d["name"], tuple(d["shape"]), d.get("dtype", "float32"),
                          ShardRule.from_json(d["rule"]), d["placement"])


def _split_range(n: int, t: int, r: int) -> tuple[int, int]:
    return (r * n) // t, ((r + 1) * n) // t


def local_pieces(spec: TensorSpec, tp: int, tp_rank: int) -> tuple[tuple[int, ...], list[Piece]]:
    """Local shape of ``spec`` on TP rank ``tp_rank`` of ``tp`` and the pieces it holds."""
    if not 0 <= tp_rank < tp:
        raise ShardingError(f"tp_rank={tp_rank} outside tp={tp}")
    shape = spec.shape
    rule = spec.rule
    if rule.kind == RuleKind.REPLICATED or tp == 1 and rule.kind != RuleKind.VOCAB:
        return shape, ([Piece(Region.full(shape), Region.full(shape))] if _numel(shape) else [])
    d = rule.dim
    if rule.kind == RuleKind.VOCAB:
        rows = shape[d]
        m = rule.pad_multiple * tp
        padded = -(-rows // m) * m
        local_rows = padded // tp
        lo = min(tp_rank * local_rows, rows)
        hi = min(lo + local_rows, rows) if lo < rows else lo
        local_shape = _with(shape, d, local_rows)
        if hi <= lo:
            return local_shape, []
        return local_shape, [Piece(_box(shape, d, 0, hi - lo), _box(shape, d, lo, hi - lo))]
    parts = rule.parts or (shape[d],)
    pieces: list[Piece] = []
    local_off = 0
    global_off = 0
    for p in parts:
        n_units = p // rule.unit
        u0, u1 = _split_range(n_units, tp, tp_rank)
        lo, n = u0 * rule.unit, (u1 - u0) * rule.unit
        if n:
            pieces.append(Piece(_box(shape, d, local_off, n), _box(shape, d, global_off + lo, n)))
        local_off += n
        global_off += p
    return _with(shape, d, local_off), pieces


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _with(shape: Sequence[int], d: int, v: int) -> tuple[int, ...]:
    s = list(shape)
    s[d] = v
    return tuple(s)


def _box(shape: Sequence[int], d: int, off: int, n: int) -> Region:
    offs = [0] * len(shape)
    offs[d] = off
    return Region(tuple(offs), _with(shape, d, n))


def stages_holding(spec: TensorSpec, layout: Layout) -> list[tuple[int, int]]:
    """(replica, stage) pairs that hold ``spec`` under ``layout``."""
    out = []
    for ri, rep in enumerate(layout.replicas):
        last = len(rep.stages) - 1
        p = spec.placement
        if p == "pre":
            idx = [0]
        elif p == "post":
            idx = [last]
        elif p == "tied":
            idx = sorted({0, last})
        else:
            idx = [si for si, s in enumerate(rep.stages) if s.layers[0] <= int(p) < s.layers[1]]
            if not idx:
                raise ShardingError(f"tensor {spec.name}: layer {p} is not held by replica {ri}")
        out.extend((ri, si) for si in idx)
    return out


@dataclass(frozen=True)
class Holding:
    """What one rank holds of one tensor."""

    rank: int
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def holdings(spec: TensorSpec, layout: Layout) -> list[Holding]:
    """Every rank's holding of ``spec`` (ranks in ascending order)."""
    out = []
    for ri, si in stages_holding(spec, layout):
        st = layout.replicas[ri].stages[si]
        for t, rank in enumerate(st.ranks):
            shape, pieces = local_pieces(spec, st.tp, t)
            out.append(Holding(rank, shape, tuple(pieces)))
    return sorted(out, key=lambda h: h.rank)


def rank_tensors(specs: Iterable[TensorSpec], layout: Layout, rank: int) -> list[tuple[TensorSpec, Holding]]:
    """The tensors ``rank`` holds under ``layout``, in spec order."""
    pos = layout.position(rank)
    out = []
    for spec in specs:
        for ri, si in stages_holding(spec, layout):
            if ri == pos.replica and si == pos.stage:
                shape, pieces = local_pieces(spec, pos.tp, pos.tp_rank)
                out.append((spec, Holding(rank, shape, tuple(pieces))))
                break
    return out
