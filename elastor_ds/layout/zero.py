"""ZeRO flat partitions mapped to regions of global tensors.

ZeRO-1/2 optimizers flatten a group of (TP-local) parameters into one buffer and give each DP rank
a contiguous element range of it. To reshard optimizer state like weights, each range is mapped
back to per-parameter boxes (:func:`flat_range_to_regions`), then through the parameter's TP pieces
to boxes of the global tensor. Every box produced is a contiguous run of the flat buffer, so the
caller can view it without copying.

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .region import Piece, Region, contiguous_strides, flat_range_to_regions


@dataclass(frozen=True)
class FlatPiece:
    """``numel`` elements at ``flat_offset`` of a rank's flat partition tensor hold ``global_`` of
    parameter ``param_index`` (row-major, shape ``global_.sizes``)."""

    param_index: int
    flat_offset: int
    global_: Region


def partition_bounds(total: int, dp: int, dp_rank: int, alignment: int = 1) -> tuple[int, int]:
    """DeepSpeed-style equal partition of a flat buffer padded to a multiple of ``dp * alignment``."""
    m = dp * alignment
    padded = -(-total // m) * m
    size = padded // dp
    lo = dp_rank * size
    return min(lo, total), min(lo + size, total)


def flat_partition_pieces(param_shapes: Sequence[Sequence[int]], param_pieces: Sequence[Sequence[Piece]],
                          start: int, end: int) -> list[FlatPiece]:
    """Map the element range ``[start, end)`` of the concatenation of flattened local params to
    global regions. ``param_pieces[i]`` are param ``i``'s TP pieces (local -> global). Elements of
    the range that hold padding (no piece) map to nothing. Flat offsets are relative to ``start``."""
    out: list[FlatPiece] = []
    base = 0
    for i, shape in enumerate(param_shapes):
        n = 1
        for s in shape:
            n *= s
        lo, hi = max(start, base), min(end, base + n)
        if lo < hi:
            strides = contiguous_strides(shape)
            for box in flat_range_to_regions(shape, lo - base, hi - base):
                for pc in param_pieces[i]:
                    inter = box.intersect(pc.local)
                    if inter is None:
                        continue
                    # inter is a contiguous run inside box (pieces split whole rows or whole boxes)
                    inter_flat = sum(o * st for o, st in zip(inter.offsets, strides))
                    glob = inter.relative_to(pc.local).shift(pc.global_.offsets)
                    out.append(FlatPiece(i, base + inter_flat - start, glob))
        base += n
        if base >= end:
            break
    return out
