"""Megatron-LM's legacy (``--ckpt-format torch``) optimizer state <-> elastor's per-parameter names.

Megatron-LM's non-distributed optimizers store ``optimizer.state_dict()`` under ``'optimizer'`` in
each ``mp_rank_*/model_optim_rng.pt``:

* ``FP32Optimizer`` (fp32 runs): the torch Adam state dict, ``{'state': {index: {'step', 'exp_avg',
  'exp_avg_sq'}}, 'param_groups': [{'params': [index, ...], 'wd_mult', 'lr_mult', ...}, ...]}``;
* ``Float16OptimizerWithFloat16Params`` (``--bf16`` / ``--fp16``): ``{'optimizer': <that dict>,
  'fp32_from_fp16_params': [[fp32 main param of each parameter of a group] per group],
  'grad_scaler': {...}}`` (the scaler for fp16 only).

Indices number the parameters group after group. Megatron-core builds the groups from the model's
``named_parameters()``: a parameter whose name ends in ``.bias`` or that is 1-D goes to the group with
``wd_mult`` 0, every other one to the default group (``wd_mult`` 1, listed first), each in
``named_parameters()`` order. :func:`param_order` gives that order for the names of one rank, and
:func:`parse` / :func:`build` map between the state dict and per-name tensors; anything that does
not fit (another grouping, a missing state, a shape that differs) raises :class:`CheckpointError`
naming it, so a caller can fall back to weights only instead of mis-assigning moments.

The distributed optimizer (``--use-distributed-optimizer``) keeps its state in ``distrib_optim.pt``
in its own flat layout; it is not read or written here.

Pure: torch tensors only, no torch.distributed, no megatron.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from ...errors import CheckpointError

GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# Megatron-LM's --adam-beta1/--adam-beta2/--adam-eps defaults
DEFAULT_ADAM = {"betas": [0.9, 0.999], "eps": 1e-8, "amsgrad": False}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# named_parameters() order inside one transformer layer (module registration order of megatron-core's
# TransformerLayer / SelfAttention / MLP; the Transformer Engine spec fuses the norms into the linears,
# where TE registers the norm parameters first)
_IN_LAYER = ("input_layernorm.weight", "input_layernorm.bias",
             "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
             "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
             "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
             "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
             "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
             "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
             "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


def param_order(local_names: Sequence[str]) -> list[str]:
    """``local_names`` (one rank's parameters) in megatron-core's ``named_parameters()`` order."""
    def key(n: str) -> tuple:
        if n in _BEFORE:
            return (0, _BEFORE.index(n), 0)
        m = _LAYER.match(n)
        if m:
            if m.group(2) not in _IN_LAYER:
                raise CheckpointError(f"parameter {n}: not a GPT layer parameter elastor knows the order of")
            return (1, int(m.group(1)), _IN_LAYER.index(m.group(2)))
        if n in _AFTER:
            return (2, _AFTER.index(n), 0)
        raise CheckpointError(f"parameter {n}: not a GPT parameter elastor knows the order of")
    return sorted(local_names, key=key)


def no_weight_decay(name: str, ndim: int) -> bool:
    """Megatron-core's standard rule: biases and 1-D parameters get ``wd_mult`` 0."""
    return name.endswith(".bias") or ndim == 1


def groups_of(ordered: Sequence[tuple[str, Sequence[int]]]) -> list[tuple[float, list[str]]]:
    """(wd_mult, names) per optimizer group, in Megatron's group order (default group first)."""
    wd = [n for n, s in ordered if not no_weight_decay(n, len(s))]
    nwd = [n for n, s in ordered if no_weight_decay(n, len(s))]
    return [(1.0, wd), (0.0, nwd)]


@dataclass
class LegacyOptimizerState:
    """One rank's Adam state by local parameter name."""

    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    main: dict[str, torch.Tensor] = field(default_factory=dict)     # fp32 main params (bf16 / fp16)
    step: Optional[float] = None
    grad_scaler: Optional[dict] = None                              # JSON-safe numbers
    adam: dict = field(default_factory=dict)                        # betas, eps, amsgrad


def _num(v: Any, what: str) -> float:
    if torch.is_tensor(v) and v.numel() == 1:
        return float(v.reshape(()).item())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise CheckpointError(f"{what}: expected a number, found {type(v).__name__}")


def parse(opt: Any, params: Mapping[str, Sequence[int]], where: str) -> LegacyOptimizerState:
    """Per-name state from Megatron's ``'optimizer'`` entry. ``params``: this rank's parameters
    (local name -> shape) in ``named_parameters()`` order."""
    if not isinstance(opt, dict):
        raise CheckpointError(f"{where}: 'optimizer' is a {type(opt).__name__}, expected a dict")
    out = LegacyOptimizerState()
    inner = opt
    if "fp32_from_fp16_params" in opt or "optimizer" in opt:
        inner = opt.get("optimizer")
        sc = opt.get("grad_scaler")
        if isinstance(sc, dict) and sc:
            out.grad_scaler = {str(k): _num(v, f"{where}: grad_scaler.{k}") for k, v in sc.items()}
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
            or not isinstance(inner.get("param_groups"), list):
        keys = sorted(str(k) for k in (inner or {})) if isinstance(inner, dict) else type(inner).__name__
        raise CheckpointError(f"{where}: not a torch optimizer state dict (keys {keys}); a distributed "
                              f"optimizer keeps its state in distrib_optim.pt")
    groups = inner["param_groups"]
    expected = groups_of(list(params.items()))
    by_wd = {wd: names for wd, names in expected}
    index: dict[int, str] = {}
    used: set = set()
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise CheckpointError(f"{where}: param_groups[{gi}] has no 'params' list")
        wd = _num(g.get("wd_mult", 1.0), f"{where}: param_groups[{gi}].wd_mult")
        if _num(g.get("lr_mult", 1.0), "lr_mult") != 1.0 or g.get("is_expert_parallel") or g.get("is_decoupled_lr"):
            raise CheckpointError(f"{where}: param_groups[{gi}] is not one of Megatron's two standard groups "
                                  f"(lr_mult/expert/decoupled lr): elastor cannot tell which parameters it holds")
        names = by_wd.get(wd)
        if names is None or wd in used or len(names) != len(g["params"]):
            raise CheckpointError(f"{where}: param_groups[{gi}] (wd_mult {wd}) holds {len(g['params'])} parameters; "
                                  f"the model's parameters give {[(w, len(n)) for w, n in expected]}: another "
                                  f"grouping than Megatron's standard one")
        used.add(wd)
        for i, n in zip(g["params"], names):
            if not isinstance(i, int) or i in index:
                raise CheckpointError(f"{where}: param_groups[{gi}] has a bad or repeated index {i!r}")
            index[i] = n
        if gi == 0:
            betas = g.get("betas")
            if isinstance(betas, (list, tuple)) and len(betas) == 2:
                out.adam["betas"] = [_num(b, "betas") for b in betas]
            if "eps" in g:
                out.adam["eps"] = _num(g["eps"], "eps")
            out.adam["amsgrad"] = bool(g.get("amsgrad", False))
    if set(index.values()) != set(params):
        missing = sorted(set(params) - set(index.values()))[:4]
        raise CheckpointError(f"{where}: the optimizer's groups do not cover parameters {missing}")
    steps = set()
    for i, n in index.items():
        st = inner["state"].get(i)
        if not isinstance(st, dict):
            raise CheckpointError(f"{where}: no optimizer state for parameter {n} (index {i}): no step taken?")
        for m, dst in (("exp_avg", out.exp_avg), ("exp_avg_sq", out.exp_avg_sq)):
            t = st.get(m)
            if not torch.is_tensor(t) or tuple(t.shape) != tuple(params[n]):
                raise CheckpointError(f"{where}: state[{i}].{m} of {n}: expected a tensor of shape "
                                      f"{tuple(params[n])}, found {tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}")
            dst[n] = t
        steps.add(_num(st.get("step"), f"{where}: state[{i}].step"))
    if len(steps) > 1:
        raise CheckpointError(f"{where}: parameters have different Adam steps {sorted(steps)[:4]}; elastor keeps one")
    out.step = steps.pop() if steps else None
    if "fp32_from_fp16_params" in opt:
        mains = opt["fp32_from_fp16_params"]
        if not isinstance(mains, list) or len(mains) != len(groups):
            raise CheckpointError(f"{where}: fp32_from_fp16_params does not have one list per group")
        for gi, (g, ms) in enumerate(zip(groups, mains)):
            if not isinstance(ms, list) or len(ms) != len(g["params"]):
                raise CheckpointError(f"{where}: fp32_from_fp16_params[{gi}] has {len(ms) if isinstance(ms, list) else '?'} "
                                      f"tensors for {len(g['params'])} parameters (some fp32 parameters in a "
                                      f"half-precision model: not supported)")
            for i, t in zip(g["params"], ms):
                n = index[i]
                if not torch.is_tensor(t) or tuple(t.shape) != tuple(params[n]):
                    raise CheckpointError(f"{where}: fp32_from_fp16_params for {n}: bad tensor")
                out.main[n] = t
    return out


def build(params: Mapping[str, Sequence[int]], st: LegacyOptimizerState, scheduler: Optional[Mapping[str, Any]],
          mixed: bool) -> dict:
    """Megatron's ``'optimizer'`` entry for one rank (``params`` in ``named_parameters()`` order):
    FP32Optimizer's form, or Float16OptimizerWithFloat16Params' when ``mixed`` (``st.main`` filled)."""
    adam = dict(DEFAULT_ADAM, **st.adam)
    sched = dict(scheduler or {})
    step = torch.tensor(float(st.step or 0.0), dtype=torch.float32)
    state: dict[int, dict] = {}
    groups, mains = [], []
    i = 0
    for wd, names in groups_of(list(params.items())):
        idx = list(range(i, i + len(names)))
        i += len(names)
        for k, n in zip(idx, names):
            state[k] = {"step": step.clone(), "exp_avg": st.exp_avg[n], "exp_avg_sq": st.exp_avg_sq[n]}
        groups.append({"params": idx, "wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": False,
                       "is_decoupled_lr": False, "default_config": True,
                       "max_lr": sched.get("max_lr", 0.0), "min_lr": sched.get("min_lr", 0.0),
                       "lr": 0.0, "weight_decay": 0.0,  # both set by Megatron's scheduler on load
                       "betas": tuple(adam["betas"]), "eps": adam["eps"], "amsgrad": adam["amsgrad"],
                       "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                       "fused": None})
        if mixed:
            mains.append([st.main[n] for n in names])
    inner = {"state": state, "param_groups": groups}
    if not mixed:
        return inner
    out: dict = {"optimizer": inner, "fp32_from_fp16_params": mains}
    if st.grad_scaler:
        out["grad_scaler"] = {k: (torch.tensor([v], dtype=torch.float32) if k == "scale" else
                                  int(v) if float(v).is_integer() else v) for k, v in st.grad_scaler.items()}
    return out
