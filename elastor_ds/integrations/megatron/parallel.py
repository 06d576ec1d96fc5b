"""Megatron-core ``parallel_state`` from an elastor :class:`Layout`: rank order, init, teardown.

The mapping from an elastor plan to Megatron's rank order is explicit here:
megatron-core's default order ``tp-cp-ep-dp-pp`` (context and expert parallel = 1) places a rank at
``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`` -- TP fastest, then DP, then PP. That is
exactly the order of :meth:`Layout.uniform` (replica = dp_rank, stage = pp_rank, TP rank =
tp_rank). :func:`check_layout` proves a layout follows it (and raises otherwise), and
:func:`initialize_from_layout` re-checks what ``parallel_state`` reports after initialisation.

Uneven pipeline stages use megatron-core's ``pipeline_model_parallel_layout`` (one list of layer
types per stage), built by :func:`pipeline_layer_layout` from the layout's stage boundaries, so any
boundaries work, not only "first/last stage differs".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from ...errors import ConfigError, LayoutError
from ...layout import Layout
from . import overrides

log = logging.getLogger(__name__)

MEGATRON_ORDER = "tp-cp-ep-dp-pp"


def megatron_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """Global rank of a (tp, dp, pp) coordinate in megatron-core's default ``tp-cp-ep-dp-pp`` order."""
    return pp_rank * (dp * tp) + dp_rank * tp + tp_rank


@dataclass(frozen=True)
class MegatronGrid:
    """The uniform grid megatron-core is initialised with, derived from a layout."""

    tp: int
    pp: int
    dp: int
    boundaries: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def uneven(self) -> bool:
        sizes = {b - a for a, b in zip(self.boundaries, self.boundaries[1:])}
        return len(sizes) > 1


def check_layout(layout: Layout) -> MegatronGrid:
    """Return the grid of ``layout``; raise LayoutError when megatron-core cannot run it as is
    (heterogeneous replicas, mixed TP, or ranks not in megatron's order)."""
    try:
        tp, pp, dp = layout.uniform_dims()
    except LayoutError as e:
        raise LayoutError(f"megatron-core's parallel_state needs a uniform TP x PP x DP grid: {e}. Use the "
                          f"elastor runtime for heterogeneous plans, or pass Layout.uniform(tp, pp, dp, ...)") from None
    for r in range(layout.world_size):
        pos = layout.position(r)
        want = megatron_rank(pos.tp_rank, pos.replica, pos.stage, tp, dp)
        if want != r:
            raise LayoutError(f"rank {r} is (replica {pos.replica}, stage {pos.stage}, tp_rank {pos.tp_rank}) "
                              f"in the layout but megatron-core's {MEGATRON_ORDER} order puts that place at "
                              f"rank {want}; build the layout with Layout.uniform(tp={tp}, pp={pp}, dp={dp}, ...)")
    return MegatronGrid(tp, pp, dp, tuple(layout.boundaries()))


def pipeline_layer_layout(grid: MegatronGrid) -> Optional[list[list[str]]]:
    """megatron-core ``pipeline_model_parallel_layout`` for the grid's stage boundaries (None if pp == 1)."""
    if grid.pp == 1:
        return None
    out = []
    for s in range(grid.pp):
        n = grid.boundaries[s + 1] - grid.boundaries[s]
        stage = (["embedding"] if s == 0 else []) + ["decoder"] * n + (["loss"] if s == grid.pp - 1 else [])
        out.append(stage)
    return out


def initialize_from_layout(layout: Layout, seed: int = 1234, timeout_minutes: int = 2) -> MegatronGrid:
    """Initialise megatron-core's parallel_state (and its RNG tracker) for ``layout``.

    Needs torch.distributed initialised with world size == layout.world_size. Collective. A
    parallel_state already initialised (by this function or by megatron's own
    ``initialize_model_parallel``, any sizes) is torn down first and replaced (logged); models built
    for it must be rebuilt."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    grid = check_layout(layout)
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"initialize_from_layout: torch.distributed is not initialised; call "
                          f"torch.distributed.init_process_group(...) on {grid.world_size} ranks first "
                          f"(the layout {layout.describe()} needs tp({grid.tp}) * pp({grid.pp}) * dp({grid.dp}))")
    world = dist.get_world_size()
    if world != grid.world_size:
        raise LayoutError(f"layout {layout.describe()} needs {grid.world_size} ranks "
                          f"(tp({grid.tp}) * pp({grid.pp}) * dp({grid.dp})) but WORLD_SIZE={world}")
    if ps.model_parallel_is_initialized():
        log.info("megatron parallel_state (tp %d x pp %d x dp %d) replaced by %s",
                 ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                 ps.get_data_parallel_world_size(), layout.describe())
        teardown()
    ps.initialize_model_parallel(tensor_model_parallel_size=grid.tp, pipeline_model_parallel_size=grid.pp,
                                 order=MEGATRON_ORDER, distributed_timeout_minutes=timeout_minutes)
    rank = dist.get_rank()
    pos = layout.position(rank)
    got = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    if got != (pos.tp_rank, pos.replica, pos.stage):
        raise LayoutError(f"rank {rank}: megatron-core placed it at (tp, dp, pp) = {got}, the layout at "
                          f"{(pos.tp_rank, pos.replica, pos.stage)}; megatron-core's rank order changed")
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    log.info("megatron parallel_state initialised for %s (rank %d: tp %d, dp %d, pp %d)",
             layout.describe(), rank, *got)
    return grid


def teardown() -> None:
    """Destroy megatron-core's groups and globals so the process can initialise another layout."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def apply_to_config(config: Any, grid: MegatronGrid) -> Any:
    """Set the parallel sizes and the (possibly uneven) pipeline layout on a TransformerConfig's kwargs dict."""
    config["tensor_model_parallel_size"] = grid.tp
    config["pipeline_model_parallel_size"] = grid.pp
    lay = pipeline_layer_layout(grid)
    if lay is not None and grid.uneven:
        config["pipeline_model_parallel_layout"] = lay
    return config


def use_stage_tp_group(group: Any, ranks: Any, seed: Optional[int] = None) -> None:
    """Make megatron-core's parallel_state describe *this rank's stage* of a heterogeneous layout:
    its tensor-parallel group, ranks, size and rank become the stage's TP group (replicas and even
    stages of one replica may have different TP degrees, which ``initialize_model_parallel`` cannot
    express). Call after ``initialize_model_parallel(1, 1)`` (which creates megatron's other groups
    collectively on every rank) and before building TP layers. ``seed``: re-seed the RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ranks = [int(r) for r in ranks]
    me = dist.get_rank()
    if me not in ranks:
        raise LayoutError(f"rank {me} is not in the stage TP group {ranks}")
    if not ps.model_parallel_is_initialized():
        raise LayoutError("call megatron's parallel_state.initialize_model_parallel(1, 1) before use_stage_tp_group")
    overrides.set_tensor_parallel_group(group, ranks, ranks.index(me))
    if seed is not None:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
