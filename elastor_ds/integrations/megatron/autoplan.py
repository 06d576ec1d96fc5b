"""``--elastor-plan auto|on-change`` for Megatron-LM: the plan this launch runs, from Megatron's args
and the launched world.

* ``auto``: the best plan Megatron-LM can run on the launched world
  (:func:`elastor_ds.plan.best_plan_for_world` with ``homogeneous_only``: one TP x PP for every
  replica, uneven layer splits through ``--pipeline-model-parallel-layout``). The world is
  ``WORLD_SIZE`` processes, per node ``ELASTOR_PROCS_PER_NODE`` under ``elastor run`` (else
  ``LOCAL_WORLD_SIZE``), device memory ``ELASTOR_GPU_MEMORY_GB`` when set. An explicit
  ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` above 1 fixes that size in the
  search, so the plan never contradicts it (no plan with it is an error naming the flag).
* ``on-change``: the parallel-size flags as given while the world is the one ``elastor run`` first
  launched (``ELASTOR_INITIAL_WORLD_SIZE``; always, outside ``elastor run``); ``auto``'s plan once the
  world changed, replacing those flags (they describe the first world).

The model comes from Megatron's args: layers, hidden size, heads, query groups (with
``--group-query-attention``), FFN width (Megatron's default when not given), sequence length,
vocabulary (``--vocab-size``, NullTokenizer's + 1 for EOD, or the GPT-2 ``--vocab-file``), the
precision (bf16/fp16: 2-byte weights and fp32 main params), the distributed optimizer (ZeRO-1),
micro and global batch.

Pure planning plus environment reads: no torch, torch.distributed or megatron.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

from ...errors import ConfigError, ElastorError
from ...plan import Cluster, CostModel, ModelSpec, PlanConstraints, ScoredPlan, TrainingSpec, best_plan_for_world
from ...plan.world import widest_tp

log = logging.getLogger(__name__)

AUTO, ON_CHANGE = "auto", "on-change"
MODES = (AUTO, ON_CHANGE)


def _arg(args: Any, name: str, default: Any = None) -> Any:
    """``args.name``, else ``args.language_model.name`` (--yaml-cfg), else ``default``."""
    v = getattr(args, name, None)
    if v is None:
        v = getattr(getattr(args, "language_model", None), name, None)
    return default if v is None else v


def _parallel(args: Any, name: str) -> int:
    mp = getattr(args, "model_parallel", None)
    src = mp if mp is not None and hasattr(mp, "tensor_model_parallel_size") else args
    return int(getattr(src, name, 1) or 1)


def world_changed(world: int, env: Optional[Mapping[str, str]] = None) -> tuple[bool, int]:
    """(whether ``world`` differs from the world ``elastor run`` first launched, that first world)."""
    from ...elastic.protocol import launched_world
    try:
        lw = launched_world(dict(os.environ if env is None else env))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    initial = lw.initial_world_size if lw is not None and lw.initial_world_size else world
    return world != initial, initial


def launched_cluster(world: int, env: Optional[Mapping[str, str]] = None) -> Cluster:
    """The launched world as the planner's cluster: processes per node, device memory when known."""
    from ...elastic.protocol import launched_world, procs_per_node
    e = dict(os.environ if env is None else env)
    try:
        nodes = procs_per_node(dict(e, WORLD_SIZE=str(world)))
        lw = launched_world(e)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    kw = {"gpu_memory_gb": lw.gpu_memory_gb} if lw is not None and lw.gpu_memory_gb else {}
    return Cluster.from_gpus_per_node(nodes, **kw)


def vocab_size(args: Any) -> int:
    """The tokenizer's vocabulary as Megatron-LM will know it (before padding)."""
    padded = getattr(args, "padded_vocab_size", None)
    if padded:
        return int(padded)
    n = _arg(args, "vocab_size")
    if n:
        return int(n) + (1 if _arg(args, "tokenizer_type") == "NullTokenizer" else 0)  # NullTokenizer adds EOD
    path = _arg(args, "vocab_file")
    if path and str(path).endswith(".json") and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return len(json.load(f))
        except (OSError, ValueError) as e:
            raise ConfigError(f"--elastor-plan auto: --vocab-file {path} is not a JSON vocabulary ({e})") from None
    raise ConfigError("--elastor-plan auto needs the vocabulary size for its cost model: give --vocab-size N "
                      "(the tokenizer's vocabulary), or use a plan file (`elastor plan ... --homogeneous --json`)")


def model_spec(args: Any) -> ModelSpec:
    """The planner's description of the model Megatron's ``args`` build."""
    h = int(_arg(args, "hidden_size", 0))
    ffn = _arg(args, "ffn_hidden_size")
    swiglu = bool(_arg(args, "swiglu", False))
    if ffn is None:  # megatron's validate_args default (applied after this hook runs)
        ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention", False) else None
    half = bool(_arg(args, "bf16", False) or _arg(args, "fp16", False))
    try:
        return ModelSpec(num_layers=int(_arg(args, "num_layers", 0)), hidden_size=h,
                         num_attention_heads=int(_arg(args, "num_attention_heads", 0)),
                         seq_length=int(_arg(args, "seq_length", 0)), vocab_size=vocab_size(args),
                         ffn_hidden_size=int(ffn), num_query_groups=int(groups) if groups else None,
                         dtype_bytes=2 if half else 4, gated_mlp=swiglu,
                         tied_embeddings=not bool(_arg(args, "untie_embeddings_and_output_weights", False)),
                         vocab_divisible_by=int(_arg(args, "make_vocab_size_divisible_by", 128)))
    except ConfigError as e:
        raise ConfigError(f"--elastor-plan auto: the model flags do not describe a GPT model: {e}") from None


def training_spec(args: Any, model: ModelSpec, cluster: Cluster, fixed_tp: Optional[int]) -> TrainingSpec:
    """Micro-batches per iteration from ``--global-batch-size`` / ``--micro-batch-size``; the TP cap
    the widest that fits a node (or the fixed TP)."""
    mbs, gbs = _arg(args, "micro_batch_size"), _arg(args, "global_batch_size")
    if not mbs or not gbs:
        raise ConfigError(f"--elastor-plan auto needs --micro-batch-size and --global-batch-size (got {mbs} and "
                          f"{gbs}): the global batch stays fixed when the plan changes the data-parallel size")
    if int(gbs) % int(mbs):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs}")
    half = model.dtype_bytes == 2
    dist_opt = bool(_arg(args, "use_distributed_optimizer", False))
    return TrainingSpec(micro_batch_size=int(mbs), num_micro_batches=int(gbs) // int(mbs),
                        nominal_tp=max(widest_tp(model, cluster.max_gpus_per_node), fixed_tp or 1),
                        zero_stage=1 if dist_opt else 0, grad_bytes=4,
                        optimizer_bytes=12 if half else 8)  # fp32 main params + 2 moments; fp32: moments only


def auto_plan(args: Any, world: int, env: Optional[Mapping[str, str]] = None,
              honour_flags: bool = True) -> ScoredPlan:
    """The best TP x PP x DP plan for ``world`` launched processes (see the module docstring).
    ``honour_flags``: a TP/PP flag above 1 fixes that size (``auto``); ``on-change`` replaces them."""
    tp = _parallel(args, "tensor_model_parallel_size") if honour_flags else 1
    pp = _parallel(args, "pipeline_model_parallel_size") if honour_flags else 1
    fixed_tp, fixed_pp = (tp if tp > 1 else None), (pp if pp > 1 else None)
    cluster = launched_cluster(world, env)
    model = model_spec(args)
    cost = CostModel(model, training_spec(args, model, cluster, fixed_tp), cluster)
    try:
        best = best_plan_for_world(cost, PlanConstraints(homogeneous_only=True, tp=fixed_tp, pp=fixed_pp))
    except ElastorError as e:
        given = " ".join(f"{f} {v}" for f, v in (("--tensor-model-parallel-size", fixed_tp),
                                                ("--pipeline-model-parallel-size", fixed_pp)) if v)
        hint = f"drop {given} to let the planner choose, " if given else ""
        raise ConfigError(f"--elastor-plan auto: {e}; {hint}launch another process count, or pass a plan file "
                          f"(`elastor plan ... --homogeneous --json > plan.json`)") from None
    log.info("--elastor-plan auto on %d processes (per node %s): %s (%s)", world,
             [len(n.gpus) for n in cluster.nodes], best.layout.describe(), best.describe())
    return best
