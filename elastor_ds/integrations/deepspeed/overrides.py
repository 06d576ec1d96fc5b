"""Every DeepSpeed internal elastor_ds patches or reads, pinned to deepspeed==0.19.8 (torch 2.13.0).

The DeepSpeed adapter reaches into DeepSpeed (and a few torch internals) in these places:

* the heterogeneous runtime (:mod:`.hetero`, :mod:`.pipe`): ``PipelineModule.__init__`` builds its
  grid by the module-global name ``PipelineParallelGrid``, swapped for the duration of the
  constructor (:func:`swapped_grid`); the pipeline p2p ``send``/``recv`` are wrapped to pair stages
  of different TP widths, reading p2p's private ``_grid`` (:func:`wrap_p2p`, :func:`p2p_grid`);
  ``PipelineEngine`` dispatches through its private ``_INSTRUCTION_MAP``, so our gradient reduction
  and optimizer step are re-registered there (:func:`instruction_map`) and call the stock ones
  (:func:`stock_reduce_grads`, :func:`stock_optimizer_step`);
* :func:`~.api.initialize`: the engine's ``__class__`` becomes a subclass of its own class
  (:func:`reclass`);
* the checkpoint state mapping (:mod:`.state`): the ZeRO-1/2 optimizer's flat-partition bookkeeping
  (:func:`zero_flat_groups`) and ``torch.nn.Module``'s own ``_parameters``/``_buffers``
  (:func:`own_tensors`) and ``_non_persistent_buffers_set`` (:func:`non_persistent_buffers`);
* CPU hardening (:mod:`.compat`): DeepSpeed's ``__compatible_ops__`` (:func:`disable_op`) and
  torch c10d's default process-group timeouts (:func:`bound_default_pg_timeouts`).

Subclass overrides of private methods (``PipelineModule._partition_layers``,
``PipelineEngine._exec_reduce_grads``, ...) stay in their subclasses; they are listed here too.
:data:`TABLE` is the one list (``tests/unit/test_overrides.py`` checks it against the installed
versions, and that nothing else in ``elastor_ds/`` touches a private DeepSpeed symbol). To support a
new DeepSpeed release: re-check every row against its source, then bump :data:`PINS`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

from ..override_table import Kind, Override, Pin
from ..override_table import patch as _patch
from ..override_table import patched as _patched

PINS = (Pin("deepspeed", "0.19.8", "deepspeed"), Pin("torch", "2.13.0", "torch"))

_D = "elastor_ds/integrations/deepspeed/"
_PIPE, _HET, _API, _ST, _COMPAT, _RT = (_D + "pipe.py", _D + "hetero.py", _D + "api.py", _D + "state.py",
                                        _D + "compat.py", _D + "runtime.py")
_ZERO = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."


def _ds(path: str, kind: Kind, where: tuple[str, ...], why: str, params: Optional[str] = None,
        instance: bool = False, direct: tuple[str, ...] = ()) -> Override:
    return Override(path, kind, where, why, params, instance, host="deepspeed", direct=direct)


TABLE: tuple[Override, ...] = (
    # --- pipeline module and grid (pipe.py, hetero.py)
    _ds("deepspeed.runtime.pipe.module:PipelineParallelGrid", Kind.PATCH, (_PIPE,),
        "PipelineModule.__init__ constructs its grid by this module-global name; a heterogeneous plan swaps in "
        "a factory returning a HeteroGrid for the constructor's duration", "topology, process_group"),
    _ds("deepspeed.runtime.pipe.module:PipelineModule.__init__", Kind.CALL, (_PIPE,),
        "our PipelineModule passes layers/num_stages/topology/partition_method through",
        "layers, num_stages, topology, loss_fn, seed_layers, seed_fn, base_seed, partition_method, "
        "activation_checkpoint_interval, activation_checkpoint_func, checkpointable_layers, dynamic_shape",
        direct=(_PIPE,)),
    _ds("deepspeed.runtime.pipe.module:PipelineModule._partition_layers", Kind.OVERRIDE, (_PIPE,),
        "explicit (uneven) stage boundaries from a plan; falls back to DeepSpeed's for the stock methods",
        "method", direct=(_PIPE,)),
    _ds("deepspeed.runtime.pipe.module:PipelineModule._set_bounds", Kind.CALL, (_PIPE,),
        "sets this stage's layer range after our partitioning", "start, stop", direct=(_PIPE,)),
    _ds("deepspeed.runtime.pipe.module:PipelineModule._layer_specs", Kind.READ, (_PIPE, _RT),
        "the module's full layer list (the plan's layer index is its index); runtime.py reads it through "
        "layer_specs()", instance=True, direct=(_PIPE,)),
    _ds("deepspeed.runtime.pipe.module:PipelineModule._topo", Kind.READ, (_PIPE,),
        "this rank's pipe coordinate when partitioning", instance=True, direct=(_PIPE,)),
    _ds("deepspeed.runtime.pipe.topology:PipelineParallelGrid._topo", Kind.PATCH, (_HET,),
        "HeteroGrid sets the grid's topology itself (it does not call PipelineParallelGrid.__init__)",
        instance=True, direct=(_HET,)),
    # --- pipeline p2p (hetero.py)
    _ds("deepspeed.runtime.pipe.p2p:send", Kind.WRAP, (_HET,),
        "cross-width stage pairing (TP2 -> TP1 -> TP4) when the grid is a HeteroGrid", "tensor, dest_stage, async_op"),
    _ds("deepspeed.runtime.pipe.p2p:recv", Kind.WRAP, (_HET,),
        "cross-width stage pairing when the grid is a HeteroGrid", "tensor, src_stage, async_op"),
    _ds("deepspeed.runtime.pipe.p2p:_grid", Kind.READ, (_HET,),
        "the grid p2p was initialised with (one pipeline engine per process)"),
    # --- pipeline engine (hetero.py)
    _ds("deepspeed.runtime.pipe.engine:PipelineEngine._INSTRUCTION_MAP", Kind.OVERRIDE, (_HET,),
        "the engine dispatches schedule instructions through this map: an override of the method alone is "
        "ignored, so HeteroPipelineEngine's map re-registers ReduceGrads and OptimizerStep", direct=(_HET,)),
    _ds("deepspeed.runtime.pipe.engine:PipelineEngine._exec_reduce_grads", Kind.OVERRIDE, (_HET,),
        "the split all-reduce across heterogeneous replicas, then the stock reduction", "", direct=(_HET,)),
    _ds("deepspeed.runtime.pipe.engine:PipelineEngine._exec_optimizer_step", Kind.OVERRIDE, (_HET,),
        "the stock step, then the ZeRO-1 all-gather of updated shares", "lr_kwargs", direct=(_HET,)),
    _ds("deepspeed.runtime.pipe.engine:PipelineEngine._aggregate_total_loss", Kind.OVERRIDE, (_HET,),
        "the global loss sum_p M_p loss_p / M on every rank (stock assumes equal replicas)", "", direct=(_HET,)),
    _ds("deepspeed.runtime.pipe.engine:PipelineEngine.train_batch", Kind.CALL, (_HET, _API),
        "wrapped by HeteroPipelineEngine and ElastorEngineMixin (save policy after the step)", "data_iter",
        direct=(_HET, _API)),
    # --- the engine class swap (api.py)
    _ds("deepspeed.runtime.engine:DeepSpeedEngine", Kind.REPLACE_CLASS, (_API,),
        "initialize() re-classes the engine into Elastor<its class> (and HeteroPipelineEngine for a "
        "heterogeneous plan) so train_batch/step/save_checkpoint also run elastor's policy"),
    _ds("deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint", Kind.WRAP, (_API,),
        "ElastorEngineMixin.save_checkpoint mirrors this signature and calls it",
        "save_dir, tag, client_state, save_latest, exclude_frozen_parameters", direct=(_API,)),
    _ds("deepspeed.runtime.engine:DeepSpeedEngine.step", Kind.WRAP, (_API,),
        "ElastorEngineMixin.step saves after an optimizer step (global_steps moved across it)", "lr_kwargs", direct=(_API,)),
    # --- ZeRO-1/2 flat partitions (state.py)
    _ds(_ZERO + "single_partition_of_fp32_groups", Kind.READ, (_ST,), "this rank's fp32 flat partition per group",
        instance=True),
    _ds(_ZERO + "round_robin_bit16_groups", Kind.READ, (_ST,), "the parameters packed into each flat group",
        instance=True),
    _ds(_ZERO + "round_robin_bit16_offsets", Kind.READ, (_ST,), "each parameter's offset in its flat group",
        instance=True),
    _ds(_ZERO + "real_dp_process_group", Kind.READ, (_ST,), "the data-parallel group partitioning each flat group",
        instance=True),
    _ds(_ZERO + "partition_size", Kind.READ, (_ST,), "elements per rank of each flat group", instance=True),
    # --- CPU hardening (compat.py)
    _ds("deepspeed.ops:__compatible_ops__", Kind.PATCH, (_COMPAT,),
        "on CPU, marks deepspeed_shm_comm incompatible so init_distributed skips a 40+ s C++ build"),
    # --- torch internals the DeepSpeed adapter touches
    Override("torch.distributed.distributed_c10d:default_pg_timeout", Kind.PATCH, (_COMPAT,),
             "new_group() ignores the world group's timeout: DeepSpeed's/Megatron's groups would wait 30 min",
             host="torch"),
    Override("torch.distributed.distributed_c10d:default_pg_nccl_timeout", Kind.PATCH, (_COMPAT,),
             "the NCCL default (None on a CPU-only build: left alone then)", host="torch"),
    Override("torch.nn.modules.module:Module._parameters", Kind.READ, (_ST,),
             "state_fingerprint walks each submodule's own parameters without recursion", instance=True,
             host="torch"),
    Override("torch.nn.modules.module:Module._buffers", Kind.READ, (_ST,),
             "state_fingerprint walks each submodule's own buffers without recursion", instance=True, host="torch"),
    Override("torch.nn.modules.module:Module._non_persistent_buffers_set", Kind.READ, (_ST,),
             "buffers registered with persistent=False stay out of checkpoints, as in Module.state_dict()",
             instance=True, host="torch"),
)


# ------------------------------------------------------------------ accessors (the only patching code)
@contextlib.contextmanager
def swapped_grid(grid: Any) -> Iterator[None]:
    """While active, ``PipelineModule.__init__`` gets ``grid`` where it would build a
    ``PipelineParallelGrid``."""
    with _patched(TABLE, "deepspeed.runtime.pipe.module:PipelineParallelGrid", lambda *a, **k: grid):
        yield


def reclass(engine: Any, cls: type) -> None:
    """Make ``engine`` an instance of ``cls``, a subclass of the engine's own class (the state stays;
    only methods are added)."""
    if not issubclass(cls, type(engine)):
        raise TypeError(f"cannot re-class a {type(engine).__name__} as {cls.__name__}: not a subclass of it")
    engine.__class__ = cls


def p2p_grid() -> Any:
    """The grid DeepSpeed's pipeline p2p was initialised with."""
    from deepspeed.runtime.pipe import p2p
    return p2p._grid


def wrap_p2p(wrap_send: Callable[[Callable], Callable], wrap_recv: Callable[[Callable], Callable]) -> bool:
    """Replace the pipeline p2p ``send``/``recv`` with ``wrap_send(original)``/``wrap_recv(original)``,
    once per process; returns False when they are wrapped already."""
    from deepspeed.runtime.pipe import p2p
    if getattr(p2p, "_elastor_hetero", False):
        return False
    _patch(TABLE, "deepspeed.runtime.pipe.p2p:send", wrap_send(p2p.send))
    _patch(TABLE, "deepspeed.runtime.pipe.p2p:recv", wrap_recv(p2p.recv))
    p2p._elastor_hetero = True
    return True


def instruction_map(replacements: dict) -> dict:
    """``PipelineEngine``'s instruction -> method map with ``replacements`` (instruction class ->
    function of the engine) in place of the stock entries."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return {**PipelineEngine._INSTRUCTION_MAP, **replacements}


def stock_reduce_grads(engine: Any) -> None:
    """DeepSpeed's own ``ReduceGrads`` step on ``engine``."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    PipelineEngine._exec_reduce_grads(engine)


def stock_optimizer_step(engine: Any, lr_kwargs: Any = None) -> None:
    """DeepSpeed's own ``OptimizerStep`` step on ``engine``."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    PipelineEngine._exec_optimizer_step(engine, lr_kwargs)


def layer_specs(module: Any) -> list:
    """A ``PipelineModule``'s full layer-spec list (empty for another module)."""
    return list(getattr(module, "_layer_specs", []))


@dataclass(frozen=True)
class ZeroFlatGroup:
    """One flat param group of DeepSpeed's ZeRO-1/2 optimizer as this rank holds it."""

    flat: Any                          # this rank's fp32 partition (a 1-D tensor)
    params: list                       # the parameters packed into the group, in order
    offsets: Optional[list]            # each parameter's offset in the group (None: packed back to back)
    dp_group: Any                      # the data-parallel group the group is partitioned over
    partition_size: int


def is_zero_optimizer(opt: Any) -> bool:
    """DeepSpeed's ZeRO stage 1/2 optimizer (its flat-partition bookkeeping is present)."""
    return hasattr(opt, "single_partition_of_fp32_groups") and hasattr(opt, "round_robin_bit16_groups")


def zero_flat_groups(opt: Any) -> list[ZeroFlatGroup]:
    """The flat groups of a ZeRO-1/2 optimizer (see :func:`is_zero_optimizer`)."""
    offsets = getattr(opt, "round_robin_bit16_offsets", None)
    return [ZeroFlatGroup(flat, opt.round_robin_bit16_groups[i], list(offsets[i]) if offsets is not None else None,
                          opt.real_dp_process_group[i], int(opt.partition_size[i]))
            for i, flat in enumerate(opt.single_partition_of_fp32_groups)]


def own_tensors(module: Any) -> tuple[Any, Any]:
    """(parameters, buffers) registered on ``module`` itself (not its children), as name -> tensor."""
    return module._parameters, module._buffers


def non_persistent_buffers(module: Any) -> Any:
    """Names of the buffers registered on ``module`` itself with ``persistent=False`` (a set)."""
    return module._non_persistent_buffers_set


def disable_op(name: str) -> None:
    """Mark DeepSpeed op ``name`` incompatible (it is then never built just in time)."""
    import deepspeed.ops
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible[name] = False


def bound_default_pg_timeouts(td: timedelta) -> None:
    """Every process group created from now on without a ``timeout`` waits at most ``td``."""
    import torch.distributed.distributed_c10d as c10d
    _patch(TABLE, "torch.distributed.distributed_c10d:default_pg_timeout", td)
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        _patch(TABLE, "torch.distributed.distributed_c10d:default_pg_nccl_timeout", td)
