"""Collectives of the heterogeneous runtime: group creation in one order, split gradient all-reduce,
global gradient norm and the global loss.

The plans come from :mod:`elastor_ds.runtime.groups` (pure); this module only moves bytes, through
:mod:`elastor_ds.comm` (it imports no ``torch.distributed`` itself):

* :func:`create_groups` (:func:`elastor_ds.comm.groups.create_groups`) creates every group of the
  plan, in the plan's order, on every rank (group creation is collective over the world);
* :class:`SplitAllReduce` packs this rank's cells of each holder set into one flat buffer (its
  gradient times ``weight`` if it contributes, zeros otherwise), all-reduces it (SUM) within exactly
  the holder set and unpacks: afterwards every holder of every cell has ``sum_p weight_p * g_p`` over
  replicas ``p``. With ``weight_p = M_p / M`` (micro-batches of replica ``p`` over the global batch's)
  and DeepSpeed's per-replica ``g_p = (1/M_p) sum of its micro-batch gradients`` this is the gradient
  one process computes for the global batch;
* :meth:`SplitAllReduce.grad_norm`: the L2 norm of the whole model's gradient, each element counted
  once (by the cell's owner), summed over the world;
* :func:`global_mean` averages per-replica losses weighted by micro-batches;
* :class:`HeteroZero1`: ZeRO-1 across heterogeneous replicas. The optimizer state of every block is
  sharded among exactly the ranks that hold it (:func:`elastor_ds.runtime.zero_partition`): per
  (param group, holder set) buffer, a reduce-scatter of the weighted gradients gives each holder the
  summed gradient of its share only, the optimizer steps the share (an fp32 copy of those weights),
  and an all-gather writes the updated weights back into every holder's parameters. Bytes per rank:
  ``(k-1)/k`` of the buffer for each of the two collectives (the split all-reduce moves ``2 (k-1)/k``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..comm.groups import create_groups, world_rank
from ..comm.tensors import all_gather_into, all_reduce_sum, reduce_scatter_sum
from .groups import Cell, ShardPart, split_reduce_bytes

log = logging.getLogger(__name__)

__all__ = ["HeteroZero1", "SplitAllReduce", "create_groups", "global_mean"]


def _slices(region) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))


def _owned_cells_sq(cells, grad_of: Callable[[str], Optional[torch.Tensor]]) -> torch.Tensor:
    """Sum of squares (fp64) of the gradient cells this rank owns (each element counted once)."""
    sq = torch.zeros(1, dtype=torch.float64)
    for c in cells:
        if c.owner:
            g = grad_of(c.name)
            if g is not None:
                sq += g[_slices(c.local)].double().pow(2).sum().cpu()
    return sq


def _global_norm(sq: torch.Tensor) -> float:
    """L2 norm from every rank's partial sum of squares; collective over the world."""
    all_reduce_sum(sq)
    return float(sq.sqrt())


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
            raise RuntimeError(f"split all-reduce groups {missing[:4]} were not created on rank {world_rank()}")
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
            all_reduce_sum(buf, self.groups[holders])
            pos = 0
            for c, g in zip(cells, grads):
                k = c.region.numel
                if g is not None:
                    g[_slices(c.local)].copy_(buf[pos:pos + k].view(c.region.sizes))
                pos += k

    def grad_norm(self, grad_of: Callable[[str], Optional[torch.Tensor]]) -> float:
        """L2 norm of the full model gradient (call after :meth:`reduce`); collective over the world."""
        return _global_norm(_owned_cells_sq(self.cells, grad_of))


def global_mean(value: Optional[float], weight: float) -> float:
    """``sum over contributing ranks of weight * value`` over the world (``value=None``: contributes 0)."""
    t = torch.tensor([0.0 if value is None else float(value) * weight], dtype=torch.float64)
    all_reduce_sum(t)
    return float(t)


class HeteroZero1:
    """This rank's ZeRO-1 shares (see the module docstring). ``shards[i]`` is an fp32 parameter
    holding elements ``[parts[i].start, parts[i].end)`` of its buffer: give these to the optimizer
    instead of the module's parameters (cells held by one replica only -- a single-replica layout --
    stay with their parameters: :attr:`local_names`)."""

    def __init__(self, parts: Sequence[ShardPart], cells: Sequence[Cell], groups: Mapping[tuple[int, ...], Any],
                 data_of: Callable[[str], torch.Tensor]):
        self.parts = list(parts)
        missing = [p.holders for p in self.parts if p.holders not in groups]
        if missing:
            raise RuntimeError(f"ZeRO-1 groups {missing[:4]} were not created on rank {world_rank()}")
        self.groups = {p.holders: groups[p.holders] for p in self.parts}
        sharded = {c.name for p in self.parts for c in p.cells}
        self.local_cells = [c for c in cells if not c.cross_replica]
        mixed = sharded & {c.name for c in self.local_cells}
        if mixed:
            raise RuntimeError(f"tensors {sorted(mixed)[:4]} are partly held by one replica and partly by several")
        self.local_names = sorted({c.name for c in self.local_cells})
        self.sharded_names = sorted(sharded)
        self.shards: list[torch.nn.Parameter] = []
        with torch.no_grad():
            for p in self.parts:
                buf = self._pack(p, data_of, None)
                self.shards.append(torch.nn.Parameter(buf[p.start:p.end].clone()))
        self.bytes_sent = int(sum(2 * (len(p.holders) - 1) * p.chunk * 4 for p in self.parts))

    @staticmethod
    def _pack(part: ShardPart, tensor_of: Callable[[str], Optional[torch.Tensor]],
              weight: Optional[float]) -> torch.Tensor:
        """The padded buffer of ``part``: every cell's values (``weight``: contributing holders'
        values times weight, zeros elsewhere -- for gradients)."""
        ts = [tensor_of(c.name) for c in part.cells]
        ref = next((t for t in ts if t is not None), None)
        buf = torch.zeros(len(part.holders) * part.chunk, dtype=torch.float32,
                          device=ref.device if ref is not None else torch.device("cpu"))
        pos = 0
        for c, t in zip(part.cells, ts):
            k = c.region.numel
            if t is not None and (weight is None or c.contributes):
                dst = buf[pos:pos + k].view(c.region.sizes)
                dst.copy_(t[_slices(c.local)])
                if weight is not None:
                    dst.mul_(weight)
            pos += k
        return buf

    def reduce_scatter(self, grad_of: Callable[[str], Optional[torch.Tensor]], weight: float) -> None:
        """Each shard's ``.grad`` becomes the summed weighted gradient of its elements over the
        replicas; gradients of local cells (held by one replica) are scaled by ``weight``."""
        for c in self.local_cells:
            g = grad_of(c.name)
            if g is not None and weight != 1.0:
                g[_slices(c.local)].mul_(weight)
        for p, sh in zip(self.parts, self.shards):
            buf = self._pack(p, grad_of, weight)
            out = torch.empty(p.chunk, dtype=buf.dtype, device=buf.device)
            reduce_scatter_sum(out, buf, self.groups[p.holders])
            sh.grad = out[:p.end - p.start].clone()

    def grad_norm(self, grad_of: Callable[[str], Optional[torch.Tensor]]) -> float:
        """L2 norm of the whole model gradient after :meth:`reduce_scatter` (every element once:
        the shards, plus local cells by their owner); collective over the world."""
        sq = _owned_cells_sq(self.local_cells, grad_of)
        for sh in self.shards:
            if sh.grad is not None:
                sq += sh.grad.double().pow(2).sum().cpu()
        return _global_norm(sq)

    def scale_grads(self, coef: float) -> None:
        for sh in self.shards:
            if sh.grad is not None:
                sh.grad.mul_(coef)

    def all_gather(self, data_of: Callable[[str], torch.Tensor]) -> None:
        """Write every holder's updated shares back into the parameters of every holder."""
        with torch.no_grad():
            for p, sh in zip(self.parts, self.shards):
                mine = torch.zeros(p.chunk, dtype=torch.float32, device=sh.device)
                mine[:p.end - p.start].copy_(sh.data)
                out = torch.empty(len(p.holders) * p.chunk, dtype=torch.float32, device=sh.device)
                all_gather_into(out, mine, self.groups[p.holders])
                pos = 0
                for c in p.cells:
                    k = c.region.numel
                    data_of(c.name)[_slices(c.local)].copy_(out[pos:pos + k].view(c.region.sizes))
                    pos += k
                sh.grad = None  # the share's gradient lives from the reduce-scatter to the step only

    def refresh_from_params(self, data_of: Callable[[str], torch.Tensor]) -> None:
        """Copy the parameters' current values into the shards (after weights were loaded)."""
        with torch.no_grad():
            for p, sh in zip(self.parts, self.shards):
                sh.data.copy_(self._pack(p, data_of, None)[p.start:p.end])
