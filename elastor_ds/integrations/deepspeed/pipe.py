"""Explicit, uneven pipeline-stage boundaries for DeepSpeed's ``PipelineModule``.

DeepSpeed partitions layers by ``uniform``, ``parameters`` or ``type:``; a plan gives explicit
boundaries instead. :class:`PipelineModule` is DeepSpeed's class with one more way to partition:
``boundaries=[0, 2, 5, 8]`` (stage ``s`` builds layer specs ``[b[s], b[s+1])``) or ``plan=`` (a
:class:`~elastor_ds.layout.Layout`, a plan dict or a plan JSON path, whose first replica's
boundaries are used). A plan's layer index is the index in the module's layer list.

A heterogeneous plan (replicas with different stages, TP degrees or micro-batches) builds the module
on this rank's replica only, with groups from :class:`~.hetero.HeteroRuntime` (see :mod:`.hetero`);
the stage boundaries are those of this rank's replica.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence, Union

from deepspeed.pipe import PipelineModule as _DSPipelineModule

from ...errors import ConfigError, LayoutError
from ...layout import Layout
from . import overrides
from .config import load_plan_document

log = logging.getLogger(__name__)

PlanLike = Union[Layout, Mapping[str, Any], str]


def layout_from_plan(plan: PlanLike, num_layers: Optional[int] = None) -> Layout:
    if isinstance(plan, Layout):
        return plan
    try:
        return Layout.from_json(load_plan_document(plan), num_layers=num_layers)
    except (LayoutError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"elastor.plan: not a valid plan document: {e}") from None


def grid_boundaries(layout: Layout, num_stages: int, world_size: int, rank: int = 0) -> list[int]:
    """The stage boundaries ``rank`` runs under ``layout`` (its replica's), after checking the plan
    against the launch: the plan's devices must equal the world size and the replica's stage count
    the module's."""
    if layout.world_size != world_size:
        raise ConfigError(f"plan {layout.describe()} has {layout.world_size} devices but WORLD_SIZE is {world_size}")
    pos = layout.position(rank)
    stages = layout.replicas[pos.replica].stages
    if len(stages) != num_stages:
        raise ConfigError(f"plan gives replica {pos.replica} {len(stages)} stages but the PipelineModule has "
                          f"num_stages={num_stages}")
    return layout.boundaries(pos.replica)


def check_boundaries(boundaries: Sequence[int], num_stages: int, num_layers: int) -> list[int]:
    b = [int(x) for x in boundaries]
    if len(b) != num_stages + 1 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise ConfigError(f"pipeline boundaries {b} must be {num_stages + 1} strictly increasing layer indices from 0 "
                          f"to {num_layers} (num_stages={num_stages}, {num_layers} layer specs), e.g. "
                          f"{_example(num_stages, num_layers)}")
    return b


def _example(pp: int, n: int) -> list[int]:
    if pp > n:
        return []
    return [(i * n) // pp for i in range(pp)] + [n]


class PipelineModule(_DSPipelineModule):
    """DeepSpeed's PipelineModule plus explicit stage boundaries (``boundaries=`` or ``plan=``)."""

    def __init__(self, layers, num_stages=None, topology=None, *, boundaries: Optional[Sequence[int]] = None,
                 plan: Optional[PlanLike] = None, **kwargs: Any):
        if boundaries is not None and plan is not None:
            raise ConfigError("pass either boundaries= or plan=, not both")
        object.__setattr__(self, "_elastor_boundaries", list(boundaries) if boundaries is not None else None)
        object.__setattr__(self, "_elastor_plan", plan)
        if boundaries is not None or plan is not None:
            kwargs.setdefault("partition_method", "uniform")  # never 'parameters': it builds every layer
        import deepspeed.comm as ds_dist
        if not ds_dist.is_initialized():  # DeepSpeed's module needs its comm backend; skip the CPU JIT build
            from .api import init_distributed
            init_distributed()
        layers = list(layers)
        rt = None
        if plan is not None:
            from .hetero import HeteroRuntime, agreed_plan, needs_hetero

            def load() -> Layout:
                got = layout_from_plan(plan, len(layers))
                if got.num_layers != len(layers):
                    raise ConfigError(f"plan covers {got.num_layers} layers but the PipelineModule has {len(layers)} "
                                      f"layer specs (a plan's layer index is the index in the layer list)")
                return got
            # every rank must hold this plan: a rank building another (uniform or heterogeneous)
            # plan would create other groups, and the ranks hang in the world-collective new_group;
            # a rank whose plan does not load still takes part, and every rank raises its error
            layout = agreed_plan(load, "PipelineModule(plan=...)")
            if needs_hetero(layout):
                rt = HeteroRuntime.create(layout, agreed=True)
        object.__setattr__(self, "_elastor_runtime", rt)
        if rt is None:
            super().__init__(layers, num_stages=num_stages, topology=topology, **kwargs)
            return
        if topology is not None or (num_stages is not None and num_stages != len(rt.stages)):
            raise ConfigError(f"a heterogeneous plan sets each replica's topology: pass plan= without topology/"
                              f"num_stages (this rank's replica has {len(rt.stages)} stages)")
        from deepspeed.pipe import TiedLayerSpec
        if any(isinstance(s, TiedLayerSpec) for s in layers):
            raise ConfigError("heterogeneous plans do not support tied layers (TiedLayerSpec) yet: untie them or use "
                              "a uniform plan")
        with overrides.swapped_grid(rt.make_grid()):  # PipelineModule.__init__ builds its grid by name
            super().__init__(layers, topology=rt.topology, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        b = self._elastor_boundaries
        num_layers = len(self._layer_specs)
        if b is None and self._elastor_plan is not None:
            layout = layout_from_plan(self._elastor_plan, num_layers)
            if layout.num_layers != num_layers:
                raise ConfigError(f"plan covers {layout.num_layers} layers but the PipelineModule has {num_layers} "
                                  f"layer specs (a plan's layer index is the index in the layer list)")
            b = grid_boundaries(layout, self.num_stages, self.world_size, self.global_rank)
        if b is None:
            super()._partition_layers(method=method)
            return
        self.parts = check_boundaries(b, self.num_stages, num_layers)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            log.info("pipeline boundaries from elastor: %s", self.parts)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
