"""``"elastor": {"plan": ...}`` -> the :class:`~elastor_ds.layout.Layout` this launch runs.

A path or an inline document is read as is. ``"auto"`` really plans: the cluster is the launch's
world (``WORLD_SIZE`` processes; per node ``ELASTOR_PROCS_PER_NODE`` under ``elastor run``, else
``LOCAL_WORLD_SIZE``, so a TP group never spans nodes),
the model is the section's ``"model"`` (the planner's ``ModelSpec`` fields; ``num_layers`` is the
module's layer-list length, because a plan's layer index is the index in that list), the training
shape comes from the DeepSpeed config (micro-batch size, global batch), and ``"profile"`` (a measured
per-layer profile in ``elastor plan --profile`` format) prices the layers when given. The search
covers heterogeneous plans (grids only when ZeRO >= 2 is configured: heterogeneous plans run ZeRO-1
at most); the best plan that uses exactly the launched processes is returned. Every launched process
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
    from ...plan import Cluster, CostModel, ModelSpec, Profile, TrainingSpec, plan
    if not ecfg.model:
        raise ConfigError('elastor.plan="auto" needs the model description: add "model": {"hidden_size": ..., '
                          '"num_attention_heads": ..., "seq_length": ..., "vocab_size": ...} to the "elastor" section')
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
    cap = 1
    while cap * 2 <= max(nodes) and model.num_attention_heads % (cap * 2) == 0 and \
            model.num_query_groups % (cap * 2) == 0:  # type: ignore[operator]
        cap *= 2  # widest TP that fits a node and divides the heads
    training = TrainingSpec(micro_batch_size=mbs, num_micro_batches=int(gbs) // mbs, nominal_tp=cap, zero_stage=zero)
    profile = Profile.load(ecfg.profile) if ecfg.profile else None
    try:
        # heterogeneous plans run ZeRO-1 at most (see .hetero): with ZeRO >= 2 configured, search grids only
        res = plan(CostModel(model, training, Cluster.from_gpus_per_node(nodes), profile=profile),
                   layouts="uniform" if zero >= 2 else "heterogeneous", top_k=50)
    except ElastorError as e:
        raise ConfigError(f'elastor.plan="auto": {e}') from None
    for cand in list(res.alternatives) or [res.best]:
        layout = cand.plan.to_layout()
        if layout.world_size == world:
            if res.best.plan.num_gpus < world:
                log.warning("elastor.plan=auto: the planner's best plan %s uses %d of the %d launched processes "
                            "(predicted %.4g s/iter vs %.4g for the plan that uses all); processes cannot stay idle "
                            "(every rank joins the runtime's collectives): relaunch with %d processes to run it",
                            res.best.plan.describe(), res.best.plan.num_gpus, world, res.best.cost.iteration_time_s,
                            cand.cost.iteration_time_s, res.best.plan.num_gpus)
            uni = res.uniform
            log.info("elastor.plan=auto on %s processes per node: %s, predicted %.4g s/iter (best uniform %s: %s)",
                     nodes, layout.describe(), cand.cost.iteration_time_s, uni.plan.describe() if uni else "none",
                     f"{uni.cost.iteration_time_s:.4g} s" if uni else "-")
            return layout
    raise ConfigError(f'elastor.plan="auto": none of the planner\'s best plans uses exactly the {world} launched '
                      f"processes (best: {res.best.plan.describe()}); launch {res.best.plan.num_gpus} or pass a plan")
