"""Collectives of the heterogeneous runtime: group creation in one order, split gradient all-reduce,
global gradient norm and the global loss.

The plans come from :mod:`elastor_ds.runtime.groups` (pure); this module only moves bytes:

* :func:`create_groups` calls ``torch.distributed.new_group`` for every group of the plan, in the
  plan's order, on every rank (``new_group`` is collective over the world);
* :class:`SplitAllReduce` packs this rank's cells of each holder set into one flat buffer (its
  gradient times ``weight`` if it contributes, zeros otherwise), all-reduces it (SUM) within exactly
  the holder set and unpacks: afterwards every holder of every cell has ``sum_p weight_p * g_p`` over
  replicas ``p``. With ``weight_p = M_p / M`` (micro-batches of replica ``p`` over the global batch's)
  and DeepSpeed's per-replica ``g_p = (1/M_p) sum of its micro-batch gradients`` this is the gradient
  one process computes for the global batch;
* :meth:`SplitAllReduce.grad_norm`: the L2 norm of the whole model's gradient, each element counted
  once (by the cell's owner), summed over the world;
* :func:`global_mean` averages per-replica losses weighted by micro-batches.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..runtime.groups import Cell, split_reduce_bytes

log = logging.getLogger(__name__)


def create_groups(order: Sequence[Sequence[int]], backend: Optional[str] = None) -> dict[tuple[int, ...], Any]:
    """Create every group of ``order`` (same order on every rank). Returns rank tuple -> group for
    the groups this rank belongs to (others are created but not kept)."""
    me = dist.get_rank()
    out: dict[tuple[int, ...], Any] = {}
    for ranks in order:
        g = dist.new_group(ranks=list(ranks), backend=backend)
        if me in ranks:
            out[tuple(ranks)] = g
    return out


def _slices(region) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))


class SplitAllReduce:
    """This rank's part of the split gradient all-reduce (see the module docstring)."""

    def __init__(self, cells: Sequence[Cell], groups: Mapping[tuple[int, ...], Any]):
        self.cells = list(cells)
        self.by_group: dict[tuple[int, ...], list[Cell]] = {}
        for c in self.cells:
            if c.cross_replica:
                self.by_group.setdefault(c.holders, []).append(c)
        missing = [g for g in self.by_group if g not in groups]
        if missing:
            raise RuntimeError(f"split all-reduce groups {missing[:4]} were not created on rank {dist.get_rank()}")
        self.groups = {g: groups[g] for g in self.by_group}
        self.bytes_sent = split_reduce_bytes(self.cells)

    def reduce(self, grad_of: Callable[[str], Optional[torch.Tensor]], weight: float) -> None:
        """All-reduce the gradients ``grad_of(name)`` in place: afterwards every holder has the
        weighted sum over replicas. Cells of tensors held by one replica only are scaled by ``weight``."""
        for c in self.cells:
            if not c.cross_replica and weight != 1.0:
                g = grad_of(c.name)
                if g is not None:
                    g[_slices(c.local)].mul_(weight)
        for holders in sorted(self.by_group):
            cells = self.by_group[holders]
            grads = [grad_of(c.name) for c in cells]
            dtype = next((g.dtype for g in grads if g is not None), torch.float32)
            device = next((g.device for g in grads if g is not None), torch.device("cpu"))
            n = sum(c.region.numel for c in cells)
            buf = torch.zeros(n, dtype=dtype, device=device)
            pos = 0
            for c, g in zip(cells, grads):
                k = c.region.numel
                if c.contributes and g is not None:
                    buf[pos:pos + k].view(c.region.sizes).copy_(g[_slices(c.local)]).mul_(weight)
                pos += k
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.groups[holders])
            pos = 0
            for c, g in zip(cells, grads):
                k = c.region.numel
                if g is not None:
                    g[_slices(c.local)].copy_(buf[pos:pos + k].view(c.region.sizes))
                pos += k

    def grad_norm(self, grad_of: Callable[[str], Optional[torch.Tensor]]) -> float:
        """L2 norm of the full model gradient (call after :meth:`reduce`); collective over the world."""
        sq = torch.zeros(1, dtype=torch.float64)
        for c in self.cells:
            if c.owner:
                g = grad_of(c.name)
                if g is not None:
                    sq += g[_slices(c.local)].double().pow(2).sum().cpu()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        return float(sq.sqrt())


def global_mean(value: Optional[float], weight: float) -> float:
    """``sum over contributing ranks of weight * value`` over the world (``value=None``: contributes 0)."""
    t = torch.tensor([0.0 if value is None else float(value) * weight], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t)
