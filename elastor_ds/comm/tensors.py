"""In-place tensor collectives for the runtime's training traffic (gradients, norms, losses).

Thin calls over a group (``None``: the default world) so that the runtime never imports
``torch.distributed``: a sum all-reduce, a sum reduce-scatter and an all-gather into one flat
tensor each. Errors are the backend's own (a training collective that fails ends the step; the
elastic agent restarts the job), unlike the checkpoint :class:`~.collectives.TorchComm`, which
turns every failure into a typed error on every rank.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["all_gather_into", "all_reduce_sum", "reduce_scatter_sum"]


def all_reduce_sum(t: Any, group: Optional[Any] = None) -> None:
    """``t`` becomes the element-wise sum of every member's ``t``."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_sum(out: Any, inp: Any, group: Any) -> None:
    """``out`` (``inp.numel() / group size`` elements) becomes this member's chunk of the sum of
    every member's ``inp`` (chunks in group rank order)."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # renamed in torch 2.13
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def all_gather_into(out: Any, inp: Any, group: Any) -> None:
    """``out`` (group size x ``inp.numel()`` elements) becomes every member's ``inp``, in group rank order."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
    fn(out, inp, group=group)
