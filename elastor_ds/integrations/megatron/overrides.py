"""Every megatron-core / Megatron-LM internal elastor_ds patches or reads, pinned to
megatron-core==0.16.1 and Megatron-LM tag core_v0.16.1 (commit 55ac708), torch 2.13.0.

Where the Megatron integration reaches into Megatron:

* :func:`~.parallel.use_stage_tp_group` makes ``parallel_state`` describe one stage of a
  heterogeneous layout: it sets the module globals ``_TENSOR_MODEL_PARALLEL_GROUP`` and
  ``_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS`` (:func:`set_tensor_parallel_group`);
* the Megatron-LM hooks (``training_hooks.py``) read the distributed optimizer's shard bookkeeping
  (``_get_model_param_range_map``: :func:`param_range`) and whether the micro-batch calculator
  exists (``_GLOBAL_NUM_MICROBATCHES_CALCULATOR``: :func:`microbatches_calculator_ready`);
* the CPU shims (:mod:`elastor_ds.testing.megatron_cpu`) replace CUDA-only functions of torch and
  megatron-core's ``tensor_parallel.random`` and the ``torch`` module global of the pipeline
  schedules (:func:`patch`);
* the Megatron-LM source patches (``patches/megatron-lm/``) insert calls into functions of
  Megatron-LM; their parameter names are what the hooks receive;
* the Megatron-LM CPU runner (``examples/megatron_lm/cpu_pretrain_gpt.py``, dev/test only) patches
  ``Tensor.cuda``/``Module.cuda``/``Tensor.type``, the ``torch`` of :data:`CPU_RUNNER_TORCH_MODULES`
  and a few Megatron-LM start-up functions itself (listed; not routed: it is an example script).

:data:`TABLE` is the one list: ``tests/unit/test_overrides.py`` imports every megatron-core row,
compares the parameter names, checks the installed version against :data:`PINS`, and checks the
Megatron-LM rows against the source of a checkout in ``MEGATRON_LM_DIR`` when one is given. To
support a new release: re-check every row against its source, then bump the pin.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..override_table import Kind, Override, Pin
from ..override_table import patch as _patch

PINS = (Pin("megatron-core", "0.16.1", "megatron.core"), Pin("torch", "2.13.0", "torch"),
        # Megatron-LM tag core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6): its tree's
        # megatron/core/package_info.py says 0.16.1; checked only with a checkout in MEGATRON_LM_DIR
        Pin("megatron-lm", "0.16.1", "megatron.training"))

_M = "elastor_ds/integrations/megatron/"
_PAR, _HOOKS, _SHIM = _M + "parallel.py", _M + "training_hooks.py", "elastor_ds/testing/megatron_cpu.py"
_PS = "megatron.core.parallel_state:"
_DOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer."
_F16 = "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params."
_RND = "megatron.core.tensor_parallel.random:"
_P = "patches/megatron-lm/"


def _mc(path: str, kind: Kind, where: tuple[str, ...], why: str, params: Any = None, instance: bool = False,
        direct: tuple[str, ...] = ()) -> Override:
    return Override(path, kind, where, why, params, instance, host="megatron-core", direct=direct)


def _hooks(path: str, kind: Kind, why: str, params: Any = None, instance: bool = False) -> Override:
    """A symbol training_hooks.py (being rewritten) touches directly; the accessors below exist to route it."""
    return _mc(path, kind, (_HOOKS,), why, params, instance, direct=(_HOOKS,))


def _lm(path: str, patch_file: str, why: str, params: str, hooks: str = _HOOKS) -> Override:
    """A Megatron-LM function a source patch calls ``hooks`` from."""
    return Override(path, Kind.PATCH, (_P + patch_file, hooks), why, params, host="megatron-lm",
                    direct=(_P + patch_file,))


_RUNNER = "examples/megatron_lm/cpu_pretrain_gpt.py"
# the modules whose ``torch`` the Megatron-LM CPU runner replaces by a proxy (its TORCH_PROXY_MODULES)
CPU_RUNNER_TORCH_MODULES = (
    "megatron.training.training", "megatron.training.utils", "megatron.training.checkpointing",
    "megatron.training.initialize", "megatron.training.arguments", "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel", "megatron.core.distributed.finalize_model_grads",
    "megatron.core.tensor_parallel.cross_entropy", "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.p2p_communication", "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.rerun_state_machine", "megatron.core.utils", "megatron.core.transformer.utils")


def _run(path: str, kind: Kind, why: str, params: Any = None, *, host: str) -> Override:
    """A symbol the Megatron-LM CPU runner (an example, not the package) patches itself."""
    return Override(path, kind, (_RUNNER,), why, params, host=host, direct=(_RUNNER,))


def _torch(path: str, why: str, params: str) -> Override:
    return Override(path, Kind.PATCH, (_SHIM,), why, params, host="torch")


TABLE: tuple[Override, ...] = (
    # --- parallel_state (parallel.py)
    _mc(_PS + "_TENSOR_MODEL_PARALLEL_GROUP", Kind.PATCH, (_PAR,),
        "a heterogeneous stage's TP group (initialize_model_parallel cannot express per-stage TP degrees)"),
    _mc(_PS + "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", Kind.PATCH, (_PAR,), "the ranks of that TP group"),
    _mc(_PS + "set_tensor_model_parallel_world_size", Kind.CALL, (_PAR,), "the stage's TP degree", "world_size"),
    _mc(_PS + "set_tensor_model_parallel_rank", Kind.CALL, (_PAR,), "this rank's place in the stage's TP group",
        "rank"),
    # --- the Megatron-LM hooks (training_hooks.py)
    _mc("megatron.core.num_microbatches_calculator:_GLOBAL_NUM_MICROBATCHES_CALCULATOR", Kind.READ, (_HOOKS,),
        "update the micro-batch schedule after a load only when Megatron built the calculator "
        "(microbatches_calculator_ready())"),
    _mc(_DOPT + "_get_model_param_range_map", Kind.CALL, (_HOOKS,),
        "each parameter's range in this rank's distributed-optimizer shard (param_range())", "param"),
    _hooks(_DOPT + "model_float16_groups", Kind.READ, "half-precision model params per group", instance=True),
    _hooks(_DOPT + "shard_fp32_from_float16_groups", Kind.READ, "their fp32 main shards", instance=True),
    _hooks(_DOPT + "model_fp32_groups", Kind.READ, "fp32 model params per group", instance=True),
    _hooks(_DOPT + "shard_fp32_groups", Kind.READ, "their shards", instance=True),
    _hooks(_F16 + "float16_groups", Kind.READ, "half-precision params per group", instance=True),
    _hooks(_F16 + "fp32_from_float16_groups", Kind.READ, "their fp32 main params", instance=True),
    # --- CPU shims (testing/megatron_cpu.py)
    _mc(_RND + "_get_cuda_rng_state", Kind.PATCH, (_SHIM,), "the RNG tracker reads the CPU generator",
        "device, clone, graph_safe"),
    _mc(_RND + "_set_cuda_rng_state", Kind.PATCH, (_SHIM,), "the RNG tracker sets the CPU generator",
        "new_state, device, graph_safe"),
    _mc("megatron.core.pipeline_parallel.schedules:torch", Kind.PATCH, (_SHIM,),
        "the schedules allocate with device='cuda' literals: their torch becomes a proxy mapping CUDA to CPU"),
    Override("torch.cuda:current_device", Kind.PATCH, (_SHIM, _M + "convert.py"),
             "megatron allocates on torch.cuda.current_device() (also the torch_dist writer's failure flag, "
             "in a torch_dist export without CUDA: cpu_sync())", "", host="torch"),
    Override("torch.cuda:synchronize", Kind.PATCH, (_SHIM, _M + "convert.py"),
             "p2p communication and the async writer synchronise (also: a torch_dist export on a host "
             "without CUDA, for the duration of dist_checkpointing.save: cpu_sync())", "device", host="torch"),
    _torch("torch.cuda:get_rng_state", "the model-parallel RNG tracker", "device"),
    _torch("torch.cuda:set_rng_state", "the model-parallel RNG tracker", "new_state, device"),
    _torch("torch.cuda:manual_seed", "model_parallel_cuda_manual_seed", "seed"),
    # --- Megatron-LM source patches (patches/megatron-lm/, Megatron-LM tag core_v0.16.1)
    _lm("megatron.training.training:pretrain", "0001-pretrain_gpt-elastor-flags.patch",
        "pretrain_gpt.py passes an extra_args_provider registering the --elastor flags",
        "train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, "
        "process_non_loss_data_func, extra_args_provider, args_defaults, get_embedding_ranks, "
        "get_position_embedding_ranks, non_loss_data_func, store, inprocess_call_wrapper"),
    _lm("megatron.training.arguments:validate_args", "0002-arguments-elastor-plan.patch",
        "applies --elastor-plan before the parallel sizes are derived", "args, defaults"),
    _lm("megatron.training.initialize:_initialize_distributed", "0003-initialize-elastor-check.patch",
        "checks every rank's (tp, dp, pp) against the plan after initialize_model_parallel",
        "get_embedding_ranks, get_position_embedding_ranks, store"),
    _lm("megatron.training.checkpointing:save_checkpoint", "0004-checkpointing-elastor-save-load.patch",
        "returns early into training_hooks.save_checkpoint with the same arguments",
        "iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, "
        "checkpointing_context, pipeline_rank, expert_rank, tensor_rank, pipeline_parallel, expert_parallel, "
        "non_persistent_ckpt, train_data_iterator, preprocess_common_state_dict_fn, release, tp_group, pp_group, "
        "dp_cp_group"),
    _lm("megatron.training.checkpointing:load_checkpoint", "0004-checkpointing-elastor-save-load.patch",
        "returns early into training_hooks.load_checkpoint with the same arguments",
        "ddp_model, optimizer, opt_param_scheduler, load_arg, strict, checkpointing_context, "
        "skip_load_to_model_and_opt, tp_group, pp_group, dp_cp_group"),
    _lm("megatron.training.async_utils:maybe_finalize_async_save", "0005-async_utils-elastor-finalize.patch",
        "a blocking finalize also waits for elastor's async writer", "blocking, terminate"),
    _lm("megatron.training.yaml_arguments:validate_yaml", "0006-yaml_arguments-elastor-plan.patch",
        "the --yaml-cfg path applies --elastor-plan like validate_args", "args, defaults"),
    _lm("megatron.training.training:train", "0007-training-elastor-loop.patch",
        "attach before the loop, iteration_end at every iteration end (its locals: iteration, model, optimizer, "
        "opt_param_scheduler, checkpointing_context, train_data_iterator)",
        "forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator, "
        "process_non_loss_data_func, config, checkpointing_context, non_loss_data_func, inference_model",
        _M + "elastic.py"),
    _lm("megatron.training.training:save_checkpoint_and_time", "0007-training-elastor-loop.patch",
        "an agreed stop saves this iteration through it",
        "iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, "
        "checkpointing_context, non_persistent_ckpt, train_data_iterator", _M + "elastic.py"),
    # --- the Megatron-LM CPU runner (examples/megatron_lm/cpu_pretrain_gpt.py; dev/test only)
    _run("torch:Tensor.cuda", Kind.PATCH, "returns the tensor itself on CPU", host="torch"),
    _run("torch.nn.modules.module:Module.cuda", Kind.PATCH, "returns the module itself on CPU", "device",
         host="torch"),
    _run("torch:Tensor.type", Kind.WRAP, "answers torch.cuda.<X>Tensor for CPU tensors (Megatron's optimizers "
         "assert it)", host="torch"),
    *(_run(f"{m}:torch", Kind.PATCH, "a proxy torch: device='cuda' allocations go to CPU, torch.cuda answers "
           "with CPU stand-ins", host="megatron-lm" if m.startswith("megatron.training") else "megatron-core")
      for m in CPU_RUNNER_TORCH_MODULES),
    _run("megatron.training.initialize:fused_kernels", Kind.PATCH, "no fused-kernel build", host="megatron-lm"),
    _run("megatron.training.initialize:_warmup_jit_function", Kind.PATCH, "no JIT warm-up", "",
         host="megatron-lm"),
    _run("megatron.training.arguments:get_device_arch_version", Kind.PATCH, "answers 0 (no GPU; imported there "
         "from megatron.core.utils)", host="megatron-lm"),
    _run("megatron.training.training:initialize_megatron", Kind.WRAP, "called with allow_no_cuda=True",
         host="megatron-lm"),
    _run("megatron.training.initialize:initialize_megatron", Kind.CALL, "the wrapper sets allow_no_cuda",
         "extra_args_provider, args_defaults, ignore_unknown_args, allow_no_cuda, skip_mpu_initialization, "
         "get_embedding_ranks, get_position_embedding_ranks, parsed_args, store", host="megatron-lm"),
    _run("megatron.training.training:train_step", Kind.WRAP, "fault injection: SIGKILL a rank at iteration N "
         "(reads the iteration keyword)",
         "forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func, "
         "iteration", host="megatron-lm"),
)


# ------------------------------------------------------------------ accessors (the only patching code)
def cpu_sync():
    """A ``with`` block for megatron's torch_dist writer on a host without CUDA: it synchronises
    unconditionally before writing host tensors and puts its failure flag on
    ``torch.cuda.current_device()``; without CUDA both calls can only raise. Here
    ``synchronize`` is a no-op and the current device is the CPU for the block's duration; with
    CUDA nothing changes."""
    import contextlib

    import torch
    stack = contextlib.ExitStack()
    if not torch.cuda.is_available():
        from ..override_table import patched
        stack.enter_context(patched(TABLE, "torch.cuda:synchronize", lambda *a, **k: None))
        stack.enter_context(patched(TABLE, "torch.cuda:current_device", lambda: "cpu"))
    return stack


def patch(path: str, value: Any) -> Any:
    """Set the symbol at ``path`` (a PATCH/WRAP row of :data:`TABLE`) to ``value``; returns the old one."""
    return _patch(TABLE, path, value)


def set_tensor_parallel_group(group: Any, ranks: Sequence[int], rank: int) -> None:
    """Make ``parallel_state``'s tensor-parallel group ``group`` over global ``ranks``, with this
    process at ``rank`` in it (size and rank set through megatron's own setters)."""
    from megatron.core import parallel_state as ps
    patch(_PS + "_TENSOR_MODEL_PARALLEL_GROUP", group)
    patch(_PS + "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", list(ranks))
    ps.set_tensor_model_parallel_world_size(len(ranks))
    ps.set_tensor_model_parallel_rank(rank)


def microbatches_calculator_ready() -> bool:
    """Megatron's global micro-batch calculator has been built (``update_num_microbatches`` may run)."""
    from megatron.core import num_microbatches_calculator as nmc
    return getattr(nmc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None


def param_range(optimizer: Any, param: Any) -> Any:
    """``param``'s range (``.start``/``.end``) in this rank's shard of a ``DistributedOptimizer``."""
    return optimizer._get_model_param_range_map(param)["param"]
