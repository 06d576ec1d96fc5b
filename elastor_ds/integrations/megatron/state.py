"""A megatron-core GPT's weights and torch-optimizer (Adam) state as elastor shards; save/load.

Every local parameter is matched to its :class:`TensorSpec` by global name; the spec's rule gives
the pieces of the canonical tensor the rank holds (:func:`rank_tensors`), and a local shape that
differs from the rule's is an error (it means megatron and the rule disagree). Optimizer state is
saved per parameter under ``optimizer.exp_avg.<name>`` / ``optimizer.exp_avg_sq.<name>`` with the
parameter's pieces (and ``optimizer.max_exp_avg_sq.<name>`` for a group with ``amsgrad``), plus the
scalar ``optimizer.step``; so it reshards exactly like the weights. A parameter outside every
parameter group of the optimizer (a frozen one) is saved as weights only.

Vocabulary padding rows are not saved; on load they are zero-filled (weights and moments).

The optimizer: a torch optimizer (Adam/AdamW), an object with the same ``param_groups`` and ``state``
(megatron-core's ``FP32Optimizer``), or megatron-core's ``ChainedOptimizer`` of those (its own
``state`` is a proxy keyed by ``(index, key)``: the state is read from each of its
``chained_optimizers``). Anything else is a :class:`~elastor_ds.errors.ConfigError`.

A :func:`load_gpt` that raises zeroes no padding row and creates no Adam state (both happen only
once the load succeeded); the bytes a failed read had written (verified checkpoint bytes or zeros)
stay, unless ``restore_on_failure=True`` asked for a host copy taken before it to put them back.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional

import torch

from ...checkpoint.engine import CheckpointEngine, LoadResult
from ...checkpoint.shards import TensorShard, full_shard, shards_from_pieces
from ...comm.collectives import agree
from ...errors import ConfigError, ShardingError
from ...layout import Layout, RuleKind, TensorSpec, rank_tensors
from .specs import GPTSpecConfig, canonical_name, gpt_tensor_specs, local_to_global

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_NAME = "optimizer.step"
WRAPPER_PREFIX = "module."   # megatron-core's DistributedDataParallel / Float16Module hold the model as .module


def named_local_params(model: Any, cfg: GPTSpecConfig, first_layer: int) -> dict[str, torch.nn.Parameter]:
    """The model's parameters under their global spec names (Transformer Engine's fused layer-norm
    names mapped to the canonical ones: :func:`.specs.canonical_name`). A model inside megatron-core's
    wrappers (``DistributedDataParallel``, ``Float16Module``: parameter names ``module.<name>``) is
    the model it wraps."""
    out: dict[str, torch.nn.Parameter] = {}
    for name, p in model.named_parameters():
        while name.startswith(WRAPPER_PREFIX):
            name = name[len(WRAPPER_PREFIX):]
        g = canonical_name(local_to_global(name, first_layer))
        if g in out:
            raise ShardingError(f"parameter {name} maps to {g}, which the model already has (a model with both "
                                f"the local and the Transformer Engine layer norms?)")
        if g == "output_layer.weight" and cfg.share_embeddings_and_output_weights:
            g = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
        out[g] = p
    return out


def _plan(model: Any, cfg: GPTSpecConfig, layout: Layout, rank: int):
    pos = layout.position(rank)
    params = named_local_params(model, cfg, pos.layers[0])
    held = rank_tensors(gpt_tensor_specs(cfg), layout, rank)
    names = {s.name for s, _ in held}
    extra = sorted(set(params) - names)
    if extra:
        raise ShardingError(f"rank {rank}: model parameters {extra[:4]} have no elastor spec; the GPT config "
                            f"{cfg} does not describe this model (check gated_linear_unit, add_bias_linear, "
                            f"normalization, share_embeddings_and_output_weights)")
    out = []
    for spec, h in held:
        p = params.get(spec.name)
        if p is None:
            raise ShardingError(f"rank {rank}: the layout puts {spec.name} on this rank (stage layers "
                                f"{pos.layers}) but the model has no such parameter; was the model built "
                                f"for this layout (build_gpt after initialize_from_layout)?")
        if tuple(p.shape) != tuple(h.local_shape):
            raise ShardingError(f"rank {rank}: {spec.name} has local shape {tuple(p.shape)} but rule "
                                f"{spec.rule.kind.value} at tp={pos.tp} gives {h.local_shape}; megatron's layout "
                                f"and the elastor rule disagree")
        out.append((spec, h, p))
    return out


def _zero_padding(spec: TensorSpec, pieces, t: torch.Tensor) -> None:
    if spec.rule.kind == RuleKind.VOCAB:
        used = sum(pc.local.sizes[0] for pc in pieces)
        t[used:].zero_()


AMSGRAD_MOMENT = "max_exp_avg_sq"   # Adam(amsgrad=True)'s running maximum of exp_avg_sq


def _moments(group: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-element Adam state of a parameter group's parameters."""
    return MOMENTS + ((AMSGRAD_MOMENT,) if group.get("amsgrad") else ())


def state_holders(optimizer: Any) -> list:
    """The optimizers that hold the per-parameter state: ``[optimizer]``, or the ``chained_optimizers``
    of a megatron-core ``ChainedOptimizer`` (recursively); a megatron stub optimizer (no parameters
    on this rank) holds none. Each must have ``param_groups`` and a ``state`` mapping with ``get``."""
    if optimizer is None:
        return []
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is not None:
        return [h for o in subs for h in state_holders(o)]
    if getattr(optimizer, "is_stub_optimizer", False):
        return []
    state = getattr(optimizer, "state", None)
    groups = getattr(optimizer, "param_groups", None)
    if not callable(getattr(state, "get", None)) or not isinstance(groups, (list, tuple)):
        raise ConfigError(f"optimizer {type(optimizer).__module__}.{type(optimizer).__name__} has no param_groups "
                          f"list and state mapping (state is {type(state).__name__}), so elastor cannot find its "
                          f"Adam state; pass a torch optimizer (torch.optim.Adam/AdamW) over the model's parameters, "
                          f"megatron-core's FP32Optimizer or ChainedOptimizer of those, or optimizer=None for the "
                          f"weights alone")
    return [optimizer]


def _state_of(holders: list, p: Any) -> Optional[dict]:
    for h in holders:
        st = h.state.get(p)
        if st:
            return st
    return None


def _zero_state(group: Mapping[str, Any], p: torch.Tensor) -> dict:
    st: dict = {"step": torch.zeros((), dtype=torch.float32)}
    for m in _moments(group):
        st[m] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def ensure_adam_state(optimizer: Any) -> None:
    """Create zero Adam state (step 0) for parameters that have none yet, so it can be loaded into
    (every optimizer of a megatron-core ``ChainedOptimizer``)."""
    for h in state_holders(optimizer):
        for group in h.param_groups:
            for p in group["params"]:
                if not h.state.get(p):
                    h.state[p] = _zero_state(group, p)


class _Staged:
    """What a :func:`load_gpt` changes besides the bytes it reads: applied once the load succeeded
    (:meth:`commit`), dropped when it failed after the read-into tensors were put back (:meth:`undo`)."""

    def __init__(self, backup: bool):
        self.backup = backup
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []   # (destination, host copy before the load)
        self.new_state: list[tuple[Any, Any, dict]] = []            # (optimizer, param, zero state loaded into)
        self.pad: list[tuple[TensorSpec, Any, torch.Tensor]] = []   # vocabulary padding rows to zero

    def keep(self, t: torch.Tensor) -> None:
        if self.backup:
            self.saved.append((t, t.detach().to("cpu", copy=True)))

    def undo(self) -> None:
        with torch.no_grad():
            for t, b in self.saved:
                t.copy_(b)
        self.saved.clear()

    def commit(self) -> None:
        self.saved.clear()
        for h, p, st in self.new_state:
            if not h.state.get(p):
                h.state[p] = st
        with torch.no_grad():
            for spec, pieces, t in self.pad:
                _zero_padding(spec, pieces, t)


def gpt_shards(model: Any, cfg: GPTSpecConfig, layout: Layout, rank: int,
               optimizer: Optional[Any] = None, for_load: bool = False) -> list[TensorShard]:
    """Shards of this rank's weights (and Adam moments + step when ``optimizer`` is given).
    ``for_load``: zero the vocabulary padding rows and create zero Adam state where there is none
    now, in place (:func:`load_gpt` defers both until its load succeeded)."""
    return _gpt_shards(model, cfg, layout, rank, optimizer, for_load, None)


def _gpt_shards(model: Any, cfg: GPTSpecConfig, layout: Layout, rank: int, optimizer: Optional[Any],
                for_load: bool, staged: Optional[_Staged]) -> list[TensorShard]:
    plan = _plan(model, cfg, layout, rank)
    holders = state_holders(optimizer)
    shards: list[TensorShard] = []
    for spec, h, p in plan:
        if staged is not None:
            staged.keep(p.data)
            if spec.rule.kind == RuleKind.VOCAB:
                staged.pad.append((spec, h.pieces, p.data))
        elif for_load:
            _zero_padding(spec, h.pieces, p.data)
        shards += shards_from_pieces(spec.name, spec.shape, p.detach(), h.pieces)   # p's version counter
    if optimizer is None:
        return shards
    if for_load and staged is None:
        ensure_adam_state(optimizer)
    step_t: Optional[torch.Tensor] = None
    group_of = {id(q): (g, o) for o in holders for g in o.param_groups for q in g["params"]}
    skipped = []
    for spec, h, p in plan:
        group, holder = group_of.get(id(p), (None, None))
        st = _state_of(holders, p)
        fresh = False
        if not st and staged is not None and group is not None:
            st, fresh = _zero_state(group, p), True   # loaded into; installed by _Staged.commit
            staged.new_state.append((holder, p, st))
        elif st and staged is not None and torch.is_tensor(st.get("step")):
            staged.keep(st["step"])
        if group is None and not st:
            # outside every parameter group and without state (frozen): its weights only. (A wrapper
            # such as Megatron-LM's mixed-precision view lists its fp32 copies in its groups and maps
            # the model parameter to their state: state, no group.)
            skipped.append((spec.name, p))
            continue
        if not st:
            raise ShardingError(f"optimizer has no state for {spec.name}: take one optimizer step or call "
                                f"ensure_adam_state(optimizer) before saving")
        moments = _moments(group) if group is not None else \
            MOMENTS + ((AMSGRAD_MOMENT,) if AMSGRAD_MOMENT in st else ())
        for m in moments:
            if m not in st:
                raise ShardingError(f"optimizer state of {spec.name} has no {m!r} (keys {sorted(st)}); only "
                                    f"Adam/AdamW state is supported")
            if staged is not None:
                if not fresh:
                    staged.keep(st[m])
                if spec.rule.kind == RuleKind.VOCAB:
                    staged.pad.append((spec, h.pieces, st[m]))
            elif for_load:
                _zero_padding(spec, h.pieces, st[m])
            shards += shards_from_pieces(f"optimizer.{m}.{spec.name}", spec.shape, st[m], h.pieces)
        if step_t is None:
            step_t = st["step"] if torch.is_tensor(st["step"]) else torch.tensor(float(st["step"]))
            if step_t.dtype != torch.float32:
                step_t = step_t.float()
    trainable = [name for name, p in skipped if p.requires_grad]
    if len(skipped) == len(plan) and trainable:
        # not one parameter known to the optimizer: its state lives elsewhere (megatron-core's
        # mixed-precision / distributed optimizers keep it on fp32 copies); saving the weights alone
        # would drop it silently
        raise ShardingError(f"rank {rank}: the optimizer ({type(optimizer).__name__}) holds none of this rank's "
                            f"{len(trainable)} trainable parameters (e.g. {trainable[0]}) in its groups or state, "
                            f"so its Adam state would not be saved; pass the torch optimizer over the model's own "
                            f"parameters (megatron-core's mixed-precision and distributed optimizers keep the state "
                            f"on fp32 copies: Megatron-LM with --elastor maps those), or optimizer=None for the "
                            f"weights alone")
    if step_t is not None:
        shards.append(full_shard(STEP_NAME, step_t.reshape(())))
    return shards


def _set_steps(optimizer: Any, step: torch.Tensor) -> None:
    for h in state_holders(optimizer):
        for group in h.param_groups:
            for p in group["params"]:
                st = h.state.get(p)
                if st and "step" in st:
                    if torch.is_tensor(st["step"]):
                        st["step"].copy_(step.to(st["step"].dtype))
                    else:
                        st["step"] = float(step)


def _agreed_shards(what: str, engine: CheckpointEngine, model: Any, cfg: GPTSpecConfig, layout: Layout,
                   optimizer: Optional[Any], for_load: bool,
                   staged: Optional[_Staged] = None) -> list[TensorShard]:
    """This rank's shards, or one error on every rank when the layout's world is not the engine's or
    any rank's model does not fit (one rank raising alone left the others in the engine's collectives
    until the peer timeout)."""
    comm = engine.comm
    if layout.world_size != comm.world_size:   # the same on every rank: every rank raises it
        raise ShardingError(f"{what}: the layout {layout.describe()} has {layout.world_size} ranks but the "
                            f"checkpoint engine's comm has {comm.world_size}; pass the layout this world runs "
                            f"(the one given to initialize_from_layout)")
    build = lambda: _gpt_shards(model, cfg, layout, comm.rank, optimizer, for_load, staged)  # noqa: E731
    if comm.world_size == 1:
        return build()
    return agree(comm, build, what=f"{what}: matching the model to the config and layout")


def save_gpt(engine: CheckpointEngine, step: int, model: Any, cfg: GPTSpecConfig, layout: Layout,
             optimizer: Optional[Any] = None, extra: Optional[Mapping[str, Any]] = None,
             rank_state: Optional[Mapping[str, Any]] = None):
    """Collective: save this rank's part of the GPT (and Adam state) as checkpoint ``step``.

    A model, config or layout that does not fit on any rank raises one error on every rank (a
    :class:`~elastor_ds.errors.RanksFailedError` that is also a :class:`ShardingError`), before the
    engine's collectives: the ranks that fit do not wait for the ones that failed."""
    shards = _agreed_shards("save_gpt", engine, model, cfg, layout, optimizer, for_load=False)
    return engine.save(step, shards, extra=extra, rank_state=rank_state, model=cfg.to_json(),
                       layout=layout.to_json())


def load_gpt(engine: CheckpointEngine, path: Optional[str], model: Any, cfg: GPTSpecConfig, layout: Layout,
             optimizer: Optional[Any] = None, *, restore_on_failure: bool = False, **kw: Any) -> LoadResult:
    """Collective: fill the GPT (and Adam state) from a checkpoint saved under any layout. A model,
    config or layout that does not fit on any rank: one error on every rank, as in :func:`save_gpt`.
    ``kw``: :meth:`CheckpointEngine.load`'s options (``fallback``, ``verify_checksums``, ...).

    When it raises, the vocabulary padding rows are not zeroed, no Adam state is created and the
    step is not set (all three happen only after the load succeeded); a failure while reading (a
    corrupt or truncated checkpoint fails part-way, :meth:`CheckpointEngine.load`) leaves the bytes
    the engine wrote (verified checkpoint bytes or zeros) in the weights and existing Adam state.
    ``restore_on_failure=True``: the model and optimizer are bit for bit as before the call, the
    weights and existing Adam state copied back from a host copy taken first (host memory for one
    copy of this rank's weights and Adam state for the duration of the call; off by default, as a
    resume that fails usually ends the job)."""
    staged = _Staged(backup=restore_on_failure)
    shards = _agreed_shards("load_gpt", engine, model, cfg, layout, optimizer, for_load=True, staged=staged)
    step_t = next((s.tensor for s in shards if s.name == STEP_NAME), None)
    try:
        res = engine.load(path, shards, **kw)
    except BaseException:
        staged.undo()
        raise
    staged.commit()
    if optimizer is not None and step_t is not None:
        _set_steps(optimizer, step_t)
    return res


def consolidated_names(cfg: GPTSpecConfig, with_optimizer: bool) -> list[str]:
    names = [s.name for s in gpt_tensor_specs(cfg)]
    if with_optimizer:
        names += [f"optimizer.{m}.{n}" for m in MOMENTS for n in names] + [STEP_NAME]
    return names


def iter_specs(cfg: GPTSpecConfig) -> Iterable[TensorSpec]:
    return gpt_tensor_specs(cfg)
