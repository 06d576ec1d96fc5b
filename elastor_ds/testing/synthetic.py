"""Synthetic model state for tests, the demo and benchmarks.

A GPT-like tensor inventory (vocab-parallel tied embedding with padding, fused QKV with grouped
query heads, gated MLP ``linear_fc1``, row-parallel projections, replicated norms), global
tensors generated from a seed, and per-rank shards of weights and Adam moments under any layout,
with optimizer state either replicated per stage or ZeRO-1 partitioned across a uniform layout's
data-parallel group. ``check_rank_state`` compares what a rank loaded with the global tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from ..checkpoint.shards import TensorShard, full_shard, shards_from_flat, shards_from_pieces
from ..layout import Layout, ShardRule, TensorSpec, local_pieces, partition_bounds, rank_tensors


@dataclass(frozen=True)
class GPTShape:
    num_layers: int = 4
    hidden: int = 16
    ffn: int = 24
    heads: int = 4
    groups: int = 2
    vocab: int = 50
    pad_multiple: int = 4
    dtype: str = "float32"


def gpt_specs(c: GPTShape) -> list[TensorSpec]:
    hd = c.hidden // c.heads
    qkv_rows = (c.heads + 2 * c.groups) * hd
    specs = [TensorSpec("embedding.word_embeddings.weight", (c.vocab, c.hidden), c.dtype,
                        ShardRule.vocab_parallel(c.pad_multiple), "tied")]
    for i in range(c.num_layers):
        p = f"decoder.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (c.hidden,), c.dtype, ShardRule.replicated(), i),
            TensorSpec(p + "self_attention.linear_qkv.weight", (qkv_rows, c.hidden), c.dtype,
                       ShardRule.fused_qkv(c.heads, c.groups, hd), i),
            TensorSpec(p + "self_attention.linear_qkv.bias", (qkv_rows,), c.dtype,
                       ShardRule.fused_qkv(c.heads, c.groups, hd), i),
            TensorSpec(p + "self_attention.linear_proj.weight", (c.hidden, c.heads * hd), c.dtype,
                       ShardRule.row_parallel(), i),
            TensorSpec(p + "mlp.linear_fc1.weight", (2 * c.ffn, c.hidden), c.dtype, ShardRule.gated_mlp(c.ffn), i),
            TensorSpec(p + "mlp.linear_fc2.weight", (c.hidden, c.ffn), c.dtype, ShardRule.row_parallel(), i),
        ]
    specs.append(TensorSpec("decoder.final_layernorm.weight", (c.hidden,), c.dtype, ShardRule.replicated(), "post"))
    return specs


def optimizer_specs(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    out = []
    for s in specs:
        for k in ("exp_avg", "exp_avg_sq"):
            out.append(TensorSpec(f"optimizer.{k}.{s.name}", s.shape, "float32", s.rule, s.placement))
    return out


def global_tensors(specs: Iterable[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in specs}


def build_local(spec: TensorSpec, tp: int, tp_rank: int, glob: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    shape, pieces = local_pieces(spec, tp, tp_rank)
    t = torch.full(shape, fill, dtype=glob.dtype)
    for p in pieces:
        t[tuple(slice(o, o + s) for o, s in zip(p.local.offsets, p.local.sizes))] = \
            glob[tuple(slice(o, o + s) for o, s in zip(p.global_.offsets, p.global_.sizes))]
    return t


@dataclass
class RankState:
    """A rank's local tensors (to save from or load into) and their shards."""

    weights: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]   # name -> local tensor, or "__flat__" -> ZeRO flat partition
    shards: list[TensorShard]
    zero: bool
    flat_range: tuple[int, int] = (0, 0)


def rank_state(layout: Layout, rank: int, specs: list[TensorSpec], globs: dict[str, torch.Tensor] | None,
               zero: bool, fill: float = float("nan"), with_optimizer: bool = True) -> RankState:
    """Local state of ``rank``: copied from ``globs`` (to save) or filled with ``fill`` (to load into).

    ``zero``: optimizer moments ZeRO-1 partitioned across the replicas (uniform layouts only)."""
    pos = layout.position(rank)
    held = rank_tensors(specs, layout, rank)
    weights, optim, shards = {}, {}, []
    for spec, h in held:
        g = globs[spec.name] if globs is not None else torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype))
        t = build_local(spec, pos.tp, pos.tp_rank, g, fill) if globs is not None else \
            torch.full(h.local_shape, fill, dtype=g.dtype)
        weights[spec.name] = t
        shards += shards_from_pieces(spec.name, spec.shape, t, h.pieces)
    if not with_optimizer:
        return RankState(weights, optim, shards, zero)
    ospecs = optimizer_specs([s for s, _ in held])
    if zero and layout.dp > 1:
        if not layout.is_uniform():
            raise ValueError("ZeRO partitioning in this helper needs a uniform layout")
        names, shapes, lshapes, pieces, flats = [], [], [], [], []
        for os_ in ospecs:
            lshape, pcs = local_pieces(os_, pos.tp, pos.tp_rank)
            names.append(os_.name), shapes.append(os_.shape), lshapes.append(lshape), pieces.append(pcs)
            if globs is not None:
                flats.append(build_local(os_, pos.tp, pos.tp_rank, globs[os_.name], fill).reshape(-1))
        total = sum(int(torch.tensor(s).prod()) if s else 1 for s in lshapes)
        lo, hi = partition_bounds(total, layout.dp, pos.replica, alignment=2)
        flat = torch.cat(flats)[lo:hi].clone() if globs is not None else torch.full((hi - lo,), fill)
        optim["__flat__"] = flat
        shards += shards_from_flat(names, shapes, lshapes, pieces, flat, lo, hi)
        st = RankState(weights, optim, shards, True, (lo, hi))
    else:
        for os_ in ospecs:
            g = globs[os_.name] if globs is not None else None
            lshape, pcs = local_pieces(os_, pos.tp, pos.tp_rank)
            t = build_local(os_, pos.tp, pos.tp_rank, g, fill) if g is not None else torch.full(lshape, fill)
            optim[os_.name] = t
            shards += shards_from_pieces(os_.name, os_.shape, t, pcs)
        st = RankState(weights, optim, shards, False)
    step = torch.tensor(7, dtype=torch.int64) if globs is not None else torch.tensor(-1, dtype=torch.int64)
    optim["__step__"] = step
    shards.append(full_shard("optimizer.step", step))
    return st


def check_rank_state(layout: Layout, rank: int, specs: list[TensorSpec], globs: dict[str, torch.Tensor],
                     loaded: RankState) -> list[str]:
    """Differences between what ``rank`` loaded and what it should hold (empty list = bit-identical)."""
    expect = rank_state(layout, rank, specs, globs, loaded.zero, fill=float("nan"),
                        with_optimizer=bool(loaded.optim))
    errs = []
    for name, t in expect.weights.items():
        got = loaded.weights[name]
        if not _same(got, t):
            errs.append(f"rank {rank}: weight {name} differs ({_diff(got, t)})")
    for name, t in expect.optim.items():
        got = loaded.optim[name]
        if name == "__step__":
            t = torch.tensor(7, dtype=torch.int64)
        if not _same(got, t):
            errs.append(f"rank {rank}: optimizer {name} differs ({_diff(got, t)})")
    return errs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = (a != b) & ~(torch.isnan(a.float()) & torch.isnan(b.float()))
    return f"{int(bad.sum())} of {a.numel()} elements"


def all_specs(c: GPTShape) -> list[TensorSpec]:
    s = gpt_specs(c)
    return s + optimizer_specs(s)


__all__ = ["GPTShape", "gpt_specs", "optimizer_specs", "global_tensors", "rank_state", "check_rank_state",
           "all_specs"]
