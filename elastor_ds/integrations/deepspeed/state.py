"""What a DeepSpeed engine's training state looks like to the checkpoint engine.

Maps an engine's memory to :class:`~elastor_ds.checkpoint.shards.TensorShard` s with global,
partition-independent names, and its scalar state to JSON:

* module weights and persistent buffers (those ``state_dict()`` holds): ``<name>``, the module's own parameter name (a ``PipelineModule``
  names layer ``i``'s parameters ``"<i>.<param>"`` for the *global* layer index ``i``, and tied
  weights ``"tied_modules.<key>.<param>"``), so it does not depend on the stage boundaries. When
  the module has an ``elastor_geometry`` callable (``(name, local_shape) -> (canonical name, global
  shape, TP pieces)``), tensor-parallel parameters are saved as regions of their canonical global
  tensors under canonical names instead (e.g. megatron-core layers inside the pipeline), so TP can
  change between save and load;
* optimizer tensors: ``optimizer.<state key>.<name>`` (``master`` = fp32 master weights, then every
  per-element state of the optimizer, e.g. Adam's ``exp_avg``/``exp_avg_sq``). Under ZeRO-1 a rank
  holds one contiguous run of each param group's flat buffer; each parameter's part of that run is
  mapped to boxes of the parameter (:func:`shards_from_flat`), so any DP size or ZeRO stage can
  read it back. Under ZeRO-0 every rank holds whole tensors. Under ZeRO-1 across heterogeneous
  replicas (``engine.elastor_zero``, :class:`elastor_ds.runtime.hetero_comm.HeteroZero1`) a rank holds a
  run of each buffer of finest common blocks (cells, regions of the global tensors): its part of
  that run is mapped to boxes of each cell the same way.
* scalars (Adam's ``step``, param-group hyper-parameters), the LR scheduler and engine counters go
  into the manifest's ``extra``.

Supported optimizers: a plain torch optimizer (ZeRO-0, fp32, and the heterogeneous runtime's ZeRO-1)
and DeepSpeed's ZeRO stage 1/2 optimizer (``DeepSpeedZeroOptimizer``). Others raise :class:`ConfigError` naming the class.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from ...checkpoint.shards import TensorShard, full_shard, shards_from_flat, shards_from_pieces
from ...checkpoint.state import scalar
from ...errors import ConfigError
from ...layout.region import Piece, Region
from . import overrides

log = logging.getLogger(__name__)

MODEL = ""              # model tensors keep their (canonical) names: a consolidated checkpoint is usable as is
OPTIM = "optimizer."    # the repo-wide prefix of optimizer state (see elastor_ds.checkpoint.convert)
MASTER = "master"


def model_name(name: str) -> str:
    return MODEL + name


def optim_name(key: str, name: str) -> str:
    return f"{OPTIM}{key}.{name}"


def is_optim(name: str) -> bool:
    return name.startswith(OPTIM)


def is_model(name: str) -> bool:
    return not is_optim(name)


def _geometry(engine: Any):
    return getattr(engine.module, "elastor_geometry", None)


def _place(engine: Any, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], list[Piece]]:
    """(checkpoint name, global shape, TP pieces) of the local parameter ``name``."""
    geo = _geometry(engine)
    if geo is None:
        full = Region.full(shape)
        return name, tuple(shape), [Piece(full, full)]
    cname, gshape, pieces = geo(name, tuple(shape))
    return cname, tuple(gshape), list(pieces)


@dataclass
class _Group:
    """One optimizer param group as this rank holds it."""

    base_group: dict                      # the torch optimizer's param_group
    state_params: list[torch.Tensor]      # tensors keyed in optimizer.state (ZeRO: the flat partition)
    # per state param: list of (param name, param shape, start, end, flat offset) -- the flat range
    # [start, end) of the param held at ``flat offset`` of the state tensor
    spans: list[list[tuple[str, tuple[int, ...], int, int, int]]] = field(default_factory=list)
    # per state param, when not described by spans: (state key, tensor) -> its shards (ZeRO-1 shares of cells)
    views: list[Optional[Callable[[str, torch.Tensor], list[TensorShard]]]] = field(default_factory=list)
    # checkpoint (canonical) names of the group's parameters on this rank, whole ones included: what
    # identifies the group under another layout (a pipeline stage holds groups of its own)
    names: list[str] = field(default_factory=list)


def _cell_views(part: Any, shapes: dict, key: str, t: torch.Tensor) -> list[TensorShard]:
    """Shards of a ZeRO-1 share: ``t`` holds elements ``[part.start, part.end)`` of the concatenation
    of the flattened cells of ``part`` (each a region of its global tensor)."""
    cells = part.cells
    return shards_from_flat([optim_name(key, c.name) for c in cells], [shapes[c.name] for c in cells],
                            [c.region.sizes for c in cells], [[Piece(Region.full(c.region.sizes), c.region)] for c in cells],
                            t.reshape(-1), part.start, part.end)


def _is_zero(opt: Any) -> bool:
    return overrides.is_zero_optimizer(opt)


def base_optimizer(engine: Any) -> torch.optim.Optimizer:
    opt = engine.optimizer
    if opt is None:
        raise ConfigError("the DeepSpeed engine has no optimizer; elastor checkpoints need one (pass optimizer= or "
                          "an \"optimizer\" config section)")
    if _is_zero(opt):
        return opt.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        return opt
    raise ConfigError(f"optimizer wrapper {type(opt).__name__} is not supported by elastor_ds yet (supported: a torch "
                      f"optimizer with fp32 and ZeRO stage 0, or ZeRO stage 1/2 in any precision); "
                      f"{_wrapper_fix(engine)}")


def _wrapper_fix(engine: Any) -> str:
    """What to configure instead of an unsupported optimizer wrapper, for this engine's precision."""
    def on(name: str) -> bool:
        try:
            return bool(getattr(engine, name)())
        except Exception:  # noqa: BLE001 - an engine without the query: not that precision
            return False
    try:
        stage = int(engine.zero_optimization_stage())
    except Exception:  # noqa: BLE001
        stage = -1
    prec = "bf16" if on("bfloat16_enabled") else "fp16" if on("fp16_enabled") else "fp32"
    if stage >= 3:
        return (f"use ZeRO stage 1 or 2 (\"zero_optimization\": {{\"stage\": 1}}; {prec} + ZeRO-1 is supported), "
                f"ZeRO-3's partitioned parameters are not")
    if prec != "fp32":
        return (f"{prec} with ZeRO-{max(stage, 0)} runs DeepSpeed's {type(engine.optimizer).__name__}: use ZeRO stage 1 "
                f"(\"zero_optimization\": {{\"stage\": 1}}; {prec} + ZeRO-1 is supported)")
    return "use a torch optimizer (fp32, ZeRO stage 0) or ZeRO stage 1/2"


def check_optimizer(engine: Any) -> None:
    """Raise :class:`ConfigError` (at ``initialize``, not at the first save hours later) when the
    engine's optimizer is one elastor checkpoints cannot hold."""
    base_optimizer(engine)


def _param_names(engine: Any) -> dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


def _groups(engine: Any) -> list[_Group]:
    opt = engine.optimizer
    names = _param_names(engine)
    out = []
    zero = getattr(engine, "elastor_zero", None)
    if zero is not None:  # ZeRO-1 across heterogeneous replicas: shares of cells, and local params whole
        rt = engine.elastor_runtime
        for gi, g in enumerate(base_optimizer(engine).param_groups):
            grp = _Group(g, [], [], [])
            for part, sh in zip(zero.parts, zero.shards):
                if part.group == gi:
                    grp.state_params.append(sh)
                    grp.spans.append([])
                    grp.views.append(lambda key, t, part=part: _cell_views(part, rt.shapes, key, t))
                    grp.names.extend(c.name for c in part.cells)
            ids = {id(p) for p in g["params"]}
            for n in zero.local_names:
                p = rt.params[n]
                if id(p) in ids:
                    grp.state_params.append(p)
                    grp.spans.append([(names[id(p)], tuple(p.shape), 0, p.numel(), 0)])
                    grp.views.append(None)
                    grp.names.append(_place(engine, names[id(p)], tuple(p.shape))[0])
            grp.names = list(dict.fromkeys(grp.names))
            out.append(grp)
    elif _is_zero(opt):
        import deepspeed.comm as dist
        for i, zg in enumerate(overrides.zero_flat_groups(opt)):
            flat, params = zg.flat, zg.params
            if zg.offsets is not None:
                offsets = zg.offsets
            else:  # older DeepSpeed: params packed back to back
                offsets, pos = [], 0
                for p in params:
                    offsets.append(pos)
                    pos += p.numel()
            pid = dist.get_rank(group=zg.dp_group)
            psize = zg.partition_size
            if flat.numel() != psize:
                raise ConfigError(f"ZeRO group {i}: fp32 partition has {flat.numel()} elements but partition_size is "
                                  f"{psize}; this DeepSpeed version's ZeRO layout is not supported")
            p0, p1 = pid * psize, (pid + 1) * psize
            spans = []
            for p, off in zip(params, offsets):
                n = p.numel()
                lo, hi = max(off, p0), min(off + n, p1)
                if lo < hi:
                    spans.append((names[id(p)], tuple(p.shape), lo - off, hi - off, lo - p0))
            out.append(_Group(opt.optimizer.param_groups[i], [flat], [spans],
                              names=_canonical(engine, names, params)))
    else:
        for g in base_optimizer(engine).param_groups:
            ps = [p for p in g["params"] if p.requires_grad]
            out.append(_Group(g, ps, [[(names[id(p)], tuple(p.shape), 0, p.numel(), 0)] for p in ps],
                              names=_canonical(engine, names, g["params"])))
    return out


def _canonical(engine: Any, names: dict[int, str], params: Iterable[torch.Tensor]) -> list[str]:
    """Checkpoint names of ``params`` (those of the module; in order, once each)."""
    out = [_place(engine, names[id(p)], tuple(p.shape))[0] for p in params if id(p) in names]
    return list(dict.fromkeys(out))


def model_shards(engine: Any) -> list[TensorShard]:
    out = []
    for n, p in engine.module.named_parameters():
        cname, gshape, pieces = _place(engine, n, tuple(p.shape))
        # detach(), not .data: the same memory and the same version counter, so an in-place change
        # of the parameter is seen by a live write's guard (a .data alias has a counter of its own)
        out.extend(shards_from_pieces(model_name(cname), gshape, p.detach(), pieces))
    for n, b in persistent_buffers(engine.module):
        out.append(full_shard(model_name(n), b))
    return out


def _non_persistent(module: torch.nn.Module) -> Any:
    return overrides.non_persistent_buffers(module)


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds, as ``named_buffers()`` names them: every dtype
    (batch norm's integer ``num_batches_tracked`` too), without those registered with
    ``persistent=False`` (derived from the config at construction, e.g. a rotary ``inv_freq``:
    torch and DeepSpeed leave them out of checkpoints, a resume keeps the value the module built)."""
    out = []
    seen: set[int] = set()
    for prefix, m in module.named_modules():
        skip = _non_persistent(m)
        for n, b in overrides.own_tensors(m)[1].items():
            if b is None or n in skip or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{prefix}.{n}" if prefix else n, b))
    return out


def per_element(v: Any, sp: torch.Tensor) -> bool:
    """Whether the optimizer state value ``v`` of the state tensor ``sp`` holds one value per element
    of it (Adam's moments): decided by shape, not size (a one-element parameter's moments are
    per-element, a 0-dim ``step`` is not, whatever their sizes)."""
    return isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(sp.shape)


def is_state_scalar(v: Any, sp: torch.Tensor) -> bool:
    """Whether ``v`` is a scalar optimizer state of ``sp`` (Adam's ``step``): a one-element tensor
    that is not per-element (0-dim in torch's optimizers), or a python number (or flag)."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not per_element(v, sp)
    return isinstance(v, (int, float))


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


_SUBMODULES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _submodules(module: torch.nn.Module) -> tuple:
    """``module.modules()``, listed once per module (a snapshot every step walked the tree twice
    per step; the tree of a model being trained does not change, its parameters may and are read
    live from each submodule)."""
    got = _SUBMODULES.get(module)
    if got is None:
        got = _SUBMODULES[module] = tuple(module.modules())
    return got


def state_fingerprint(engine: Any) -> tuple:
    """Everything :func:`model_shards` and :func:`optimizer_shards` depend on that can change while
    training: each module parameter and persistent buffer (identity, memory address, shape, stride,
    dtype), each optimizer param's and per-parameter state tensor's (by state key), the ZeRO
    partition objects. Equal fingerprints mean the previously built shards still view the right
    memory (a shard's view keeps its storage alive, so a replaced tensor cannot reuse its address)."""
    key: list = [id(engine.module), id(engine.optimizer), id(getattr(engine, "elastor_zero", None))]
    seen: set[int] = set()
    own = [overrides.own_tensors(m) for m in _submodules(engine.module)]
    for params, _ in own:   # what module.parameters()/buffers() visit, without their recursion
        for p in params.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                key.append((id(p), _tensor_key(p.data)))
    for m, (_, buffers) in zip(_submodules(engine.module), own):
        skip = _non_persistent(m)
        for n, b in buffers.items():
            if b is not None and n not in skip and id(b) not in seen:
                seen.add(id(b))
                key.append((id(b), _tensor_key(b)))
    opt = base_optimizer(engine)
    for g in opt.param_groups:
        for p in g["params"]:
            key.append((id(p), _tensor_key(p.data)))
            for k, v in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                key.append((k, _tensor_key(v) if per_element(v, p) else None))
    return tuple(key)


def _views(engine: Any, name_key: str, t: torch.Tensor, spans) -> list[TensorShard]:
    flat = t.view(-1)
    out = []
    for name, shape, start, end, foff in spans:
        cname, gshape, pieces = _place(engine, name, tuple(shape))
        out.extend(shards_from_flat([optim_name(name_key, cname)], [gshape], [shape], [pieces],
                                    flat[foff:foff + (end - start)], start, end))
    return out


def master_is_weight(engine: Any) -> bool:
    """fp32 training: the fp32 master copy equals the module's weights after every step, so a
    checkpoint need not store it twice (loads fill the master from the weights)."""
    return all(p.dtype == torch.float32 for p in engine.module.parameters())


def master_from_weight_name(name: str) -> Optional[str]:
    """``optimizer.master.<x>`` -> ``<x>`` (the model tensor that holds the same fp32 values)."""
    prefix = optim_name(MASTER, "")
    return MODEL + name[len(prefix):] if name.startswith(prefix) else None


def optimizer_shards(engine: Any, state_keys: Optional[Iterable[str]] = None,
                     include_master: bool = True) -> list[TensorShard]:
    """Shards of the fp32 master weights (unless ``include_master`` is False) and every
    per-element optimizer state.

    ``state_keys``: when given (load), missing state tensors are created as zeros first (a fresh
    optimizer has no state before its first step)."""
    opt = base_optimizer(engine)
    out: list[TensorShard] = []
    for g in _groups(engine):
        for i, (sp, spans) in enumerate(zip(g.state_params, g.spans)):
            view = g.views[i] if g.views and g.views[i] is not None else None

            def mk(key: str, t: torch.Tensor, view=view, spans=spans) -> list[TensorShard]:
                return view(key, t) if view is not None else _views(engine, key, t, spans)
            if include_master:
                out.extend(mk(MASTER, sp.detach()))   # detach: the parameter's version counter
            st = opt.state[sp]
            if state_keys is not None:
                for k in state_keys:
                    if k not in st:
                        st[k] = torch.zeros_like(sp.data, memory_format=torch.preserve_format)
            for k in sorted(st):
                if per_element(st[k], sp):
                    out.extend(mk(k, st[k]))
    return out


def optimizer_groups(engine: Any) -> list:
    """The optimizer's param groups as :func:`optimizer_scalars` reads them (reusable while
    :func:`state_fingerprint` is unchanged: the values are read live from them each time)."""
    return _groups(engine)


def optimizer_scalars(engine: Any, groups: Optional[list] = None) -> list[dict[str, Any]]:
    """Per param group: hyper-parameters and scalar states (e.g. Adam's ``step``). ``groups``:
    :func:`optimizer_groups` of an unchanged state (it walks the module's parameters)."""
    opt = base_optimizer(engine)
    out = []
    for g in (_groups(engine) if groups is None else groups):
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.base_group.items()
                 if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))}
        scalars: dict[str, Any] = {}
        # the first state param with state (one that never had a gradient has none)
        for sp in [sp for sp in g.state_params if opt.state.get(sp)][:1]:
            for k, v in opt.state[sp].items():
                if not is_state_scalar(v, sp):
                    continue
                if isinstance(v, torch.Tensor):
                    # a CUDA step count is read by the engine's writer, not here (no device sync per snapshot)
                    scalars[k] = {"value": scalar(v), "tensor": True, "dtype": str(v.dtype).replace("torch.", "")}
                    if v.dim():
                        scalars[k]["shape"] = list(v.shape)
                else:
                    scalars[k] = {"value": v, "tensor": False}
        out.append({"params": list(g.names), "hyper": hyper, "scalars": scalars})
    return out


def merge_scalars(own: list[dict[str, Any]], everyone: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The job's param groups: this rank's (in order; on rank 0 they lead, as a reader by index
    expects), then every other rank's group not seen yet (by its parameter names: data-parallel
    replicas hold the same groups, pipeline stages groups of their own)."""
    out = list(own)
    seen = {tuple(e.get("params", ())) for e in own}
    for entries in everyone:
        for e in entries:
            key = tuple(e.get("params", ()))
            if key not in seen:
                seen.add(key)
                out.append(e)
    return out


def restore_optimizer_scalars(engine: Any, saved: list[dict[str, Any]]) -> Optional[str]:
    """Put the saved param groups' hyper-parameters and scalar states back. Groups saved with their
    parameters' names (``"params"``) are found by membership: each group of this rank takes the
    saved group sharing most of its parameters, whatever the stage or index it had. Returns what
    could not be matched (a group of this rank with parameters that no saved group holds), else
    None; the caller agrees on it across ranks. Checkpoints of older versions (groups without names:
    rank 0's, in order) are restored by index."""
    opt = base_optimizer(engine)
    groups = _groups(engine)
    if not all(isinstance(s, dict) and "params" in s for s in saved):
        if len(saved) != len(groups):
            log.warning("checkpoint has %d optimizer param groups, this optimizer %d: restoring hyper-parameters and "
                        "step counters from group 0 into every group", len(saved), len(groups))
        for i, g in enumerate(groups):
            _restore_group(opt, g, saved[i] if i < len(saved) else saved[0])
        return None
    members = [set(s["params"]) for s in saved]
    missing = []
    for i, g in enumerate(groups):
        if not g.names:
            continue   # a group without parameters of the module (empty on this stage)
        mine = set(g.names)
        overlap = [len(mine & m) for m in members]
        best = max(range(len(saved)), key=lambda j: overlap[j]) if saved else None
        if best is None or overlap[best] == 0:
            if not g.state_params:
                continue   # frozen parameters only: no state, and no step they would take
            missing.append(f"param group {i} ({', '.join(g.names[:3])}{' ...' if len(g.names) > 3 else ''})")
            continue
        # a group made of several saved ones (PP2 -> PP1: one group per stage, now one) is fine while
        # they agree; a tied weight is in a group of each stage holding it
        others = [j for j, o in enumerate(overlap) if o and saved[j]["hyper"] != saved[best]["hyper"]]
        if overlap[best] < len(mine) and others:
            log.warning("param group %d (%d parameters) holds parameters of saved groups with other hyper-parameters: "
                        "it takes those of the saved group holding %d of its parameters", i, len(mine), overlap[best])
        _restore_group(opt, g, saved[best])
    return "; ".join(missing) or None


def _restore_group(opt: Any, g: _Group, s: dict[str, Any]) -> None:
    for k, v in s["hyper"].items():
        if k in g.base_group:
            g.base_group[k] = tuple(v) if isinstance(g.base_group[k], tuple) else v
    for sp in g.state_params:
        st = opt.state[sp]
        for k, d in s["scalars"].items():
            if d["tensor"]:
                st[k] = torch.tensor(d["value"], dtype=getattr(torch, d.get("dtype", "float32")),
                                     device=sp.device if k != "step" else "cpu").reshape(d.get("shape", ()))
            else:
                st[k] = d["value"]


#: the loss scaler's state (what changes while training); its settings (window, minimum, hysteresis)
#: come from the resumed run's config
_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(engine: Any) -> Optional[dict[str, Any]]:
    """The ZeRO optimizer's loss scaler state (fp16's dynamic scale: its current scale, iteration,
    last overflow and hysteresis), None when the optimizer has no loss scaler."""
    ls = getattr(engine.optimizer, "loss_scaler", None)
    if ls is None or not hasattr(ls, "cur_scale"):
        return None
    out: dict[str, Any] = {"dynamic": bool(getattr(ls, "dynamic", False))}
    for k in _SCALER_STATE:
        v = getattr(ls, k, None)
        if isinstance(v, torch.Tensor):
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    return out


def restore_loss_scaler(engine: Any, saved: dict[str, Any]) -> None:
    """Put :func:`loss_scaler_state` back (as DeepSpeed's own load does) into a scaler of the same
    kind; a static scale now where a dynamic one was saved (or the other way round) keeps the
    configured scaler, with a warning."""
    ls = getattr(engine.optimizer, "loss_scaler", None)
    if ls is None or not hasattr(ls, "cur_scale"):
        if saved.get("dynamic"):
            log.warning("checkpoint has a dynamic loss scale (%s) but this optimizer has no loss scaler: ignored",
                        saved.get("cur_scale"))
        return
    if bool(getattr(ls, "dynamic", False)) != bool(saved.get("dynamic")):
        log.warning("checkpoint's loss scaling is %s, this run's is %s: the configured scaler starts afresh",
                    "dynamic" if saved.get("dynamic") else "static", "dynamic" if getattr(ls, "dynamic", False)
                    else "static")
        return
    if not saved.get("dynamic"):
        return   # a static scale is the config's
    for k in _SCALER_STATE:
        if k in saved and hasattr(ls, k):
            setattr(ls, k, type(getattr(ls, k))(saved[k]) if isinstance(getattr(ls, k), (int, float)) else saved[k])


def state_keys_in(tensor_names: Iterable[str]) -> set[str]:
    """Optimizer state keys present in a checkpoint's tensor names (``optimizer.<key>.<name>``)."""
    keys = set()
    for n in tensor_names:
        if n.startswith(OPTIM):
            k = n[len(OPTIM):].split(".", 1)[0]
            if k != MASTER:
                keys.add(k)
    return keys
