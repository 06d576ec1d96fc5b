"""Who sends to whom between adjacent pipeline stages of different TP widths (pure).

Between stages, the activation is the full hidden state, identical on every TP rank of the sending
stage (megatron-core's row-parallel output is all-reduced), and the gradient of a stage's input is
identical on every TP rank of the receiving stage (the column-parallel input's backward all-reduces
it). So with a sending stage of width ``a`` and a receiving stage of width ``b``:

* activations: rank ``j`` of the receiving stage receives from rank ``j % a`` of the sender; sender
  ``i`` sends to every ``j < b`` with ``j % a == i`` (none when ``i >= b``);
* gradients back: rank ``i`` of the earlier stage receives from rank ``i % b`` of the later stage;
  later rank ``j`` sends to every ``i < a`` with ``i % b == j`` -- every rank of the earlier stage
  gets the gradient it needs.

With ``a == b`` this is DeepSpeed's own pairing (same TP rank). Bytes: each receiver gets one copy
of the activation; no sender sends more than ``ceil(b / a)`` copies.

Pure: no torch.
"""
from __future__ import annotations

from ..errors import LayoutError
from ..layout import Layout


def _stages(layout: Layout, rank: int):
    pos = layout.position(rank)
    return pos, layout.replicas[pos.replica].stages


def send_targets(layout: Layout, rank: int, dest_stage: int) -> list[int]:
    """Global ranks ``rank`` sends to when sending to ``dest_stage`` of its replica (activations
    forward to ``stage + 1``, gradients back to ``stage - 1``)."""
    pos, stages = _stages(layout, rank)
    if abs(dest_stage - pos.stage) != 1 or not 0 <= dest_stage < len(stages):
        raise LayoutError(f"rank {rank} (stage {pos.stage}) cannot send to stage {dest_stage}: adjacent stages only")
    dest = stages[dest_stage]
    return [dest.ranks[j] for j in range(dest.tp) if j % pos.tp == pos.tp_rank]


def recv_source(layout: Layout, rank: int, src_stage: int) -> int:
    """The global rank ``rank`` receives from when receiving from ``src_stage`` of its replica."""
    pos, stages = _stages(layout, rank)
    if abs(src_stage - pos.stage) != 1 or not 0 <= src_stage < len(stages):
        raise LayoutError(f"rank {rank} (stage {pos.stage}) cannot receive from stage {src_stage}: adjacent stages only")
    src = stages[src_stage]
    return src.ranks[pos.tp_rank % src.tp]
