"""``"elastor": {"plan": ...}`` -> the :class:`~elastor_ds.layout.Layout` this launch runs.

A path or an inline document is read as is. ``"auto"`` really plans: the cluster is the launch's
world (``WORLD_SIZE`` processes; per node ``ELASTOR_PROCS_PER_NODE`` under ``elastor run``, else
``LOCAL_WORLD_SIZE``, so a TP group never spans nodes),
the model is the section's ``"model"`` (the planner's ``ModelSpec`` fields; ``num_layers`` is the
module's layer-list length, because a plan's layer index is the index in that list), the training
shape comes from the DeepSpeed config (micro-batch size, global batch), and ``"profile"`` (a measured
per-layer profile in ``elastor plan --profile`` format) prices the layers when given. The search
covers heterogeneous plans (grids only when ZeRO >= 2 is configured: heterogeneous plans run ZeRO-1
at most); the best plan that uses exactly the launched processes is returned
(:func:`elastor_ds.plan.best_plan_for_world`, the picker every trainer shares). Every launched process
must have a place in the plan (each joins the runtime's collectives): when the planner's best plan
overall leaves processes idle, that is logged with its prediction and the process count to relaunch
with, and the best plan using every process runs.

Pure planning plus environment reads: no torch.distributed.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

from ...errors import ConfigError, ElastorError
from ...layout import Layout
from .config import ElastorConfig, split_ds_config

log = logging.getLogger(__name__)


def launch_world(env: Optional[Mapping[str, str]] = None) -> list[int]:
    """Processes per node of this launch, from the launcher's environment: ``ELASTOR_PROCS_PER_NODE``
    under ``elastor run`` (nodes may differ), else ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``."""
    from ...elastic.protocol import procs_per_node
    try:
        return procs_per_node(dict(os.environ if env is None else env))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resolve_plan(config: Any, num_layers: int, env: Optional[Mapping[str, str]] = None) -> Optional[Layout]:
    """The layout named by the config's ``elastor.plan`` (None when there is none)."""
    ds, ecfg = split_ds_config(config)
    if ecfg.plan is None:
        return None
    if ecfg.plan != "auto":
        from .pipe import layout_from_plan
        return layout_from_plan(ecfg.plan, num_layers)
    return auto_layout(ds, ecfg, num_layers, env)


def auto_layout(ds: Mapping[str, Any], ecfg: ElastorConfig, num_layers: int,
                env: Optional[Mapping[str, str]] = None) -> Layout:
    from ...plan import Cluster, CostModel, ModelSpec, PlanConstraints, Profile, TrainingSpec, best_plan_for_world
    from ...plan.world import widest_tp
    if not ecfg.model:
        raise ConfigError('elastor.plan="auto" needs the model description: add "model": {"hidden_size": ..., '
                          '"num_attention_heads": ..., "seq_length": ..., "vocab_size": ...} to the "elastor" section')
    given = ecfg.model.get("num_layers")
    if given is not None and given != num_layers:
        # a plan's layer index is the index in the module's layer list: a plan over another count
        # would be refused by the PipelineModule (or, were it built from it, cut the wrong layers)
        raise ConfigError(f"elastor.model.num_layers is {given!r} but the PipelineModule has {num_layers} layer specs "
                          f"(a plan's layer index is the index in the layer list, embedding and head included): "
                          f"leave num_layers out of \"model\" (the layer list's length is used) or set it to "
                          f"{num_layers}")
    nodes = launch_world(env)
    world = sum(nodes)
    mbs = int(ds.get("train_micro_batch_size_per_gpu") or 0)
    gbs = ds.get("train_batch_size")
    if mbs < 1 or gbs is None:
        raise ConfigError('elastor.plan="auto" needs "train_micro_batch_size_per_gpu" and "train_batch_size" (the '
                          'global batch) in the DeepSpeed config')
    if int(gbs) % mbs:
        raise ConfigError(f"train_batch_size {gbs} is not a multiple of train_micro_batch_size_per_gpu {mbs}")
    try:
        model = ModelSpec(**{"num_layers": num_layers, **dict(ecfg.model)})
    except TypeError as e:
        raise ConfigError(f"elastor.model: {e}; use the planner's ModelSpec fields") from None
    zero = int((ds.get("zero_optimization") or {}).get("stage", 0))
    training = TrainingSpec(micro_batch_size=mbs, num_micro_batches=int(gbs) // mbs,
                            nominal_tp=widest_tp(model, max(nodes)), zero_stage=zero)
    profile = Profile.load(ecfg.profile, "elastor.profile") if ecfg.profile else None
    # heterogeneous plans run ZeRO-1 at most (see .hetero), and DeepSpeed's PipelineEngine refuses ZeRO-2/3
    # with more than one stage: with ZeRO >= 2 configured, one-stage grids only
    cons = PlanConstraints(layouts="uniform", pp=1) if zero >= 2 else PlanConstraints(layouts="heterogeneous")
    try:
        best = best_plan_for_world(CostModel(model, training, Cluster.from_gpus_per_node(nodes), profile=profile),
                                   cons)
    except ElastorError as e:
        raise ConfigError(f'elastor.plan="auto": {e}') from None
    prov = best.provenance
    idle = prov.best_overall if prov is not None else None
    if idle is not None:
        log.warning("elastor.plan=auto: the planner's best plan %s uses %d of the %d launched processes "
                    "(predicted %.4g s/iter vs %.4g for the plan that uses all); processes cannot stay idle "
                    "(every rank joins the runtime's collectives): relaunch with %d processes to run it",
                    idle.plan.describe(), idle.plan.num_gpus, world, idle.cost.iteration_time_s,
                    best.cost.iteration_time_s, idle.plan.num_gpus)
    uni = prov.uniform if prov is not None else None
    log.info("elastor.plan=auto on %s processes per node: %s, predicted %.4g s/iter (best uniform %s: %s)",
             nodes, best.layout.describe(), best.cost.iteration_time_s, uni.plan.describe() if uni else "none",
             f"{uni.cost.iteration_time_s:.4g} s" if uni else "-")
    return best.layout

