"""Megatron checkpoints in and out of the elastor format (``elastor convert --from/--to megatron``).

Sources understood by :func:`import_megatron` (auto-detected):

* **torch_dist** (written by ``megatron.core.dist_checkpointing.save``): a directory with
  ``metadata.json`` (``sharded_backend: torch_dist``) and PyTorch DCP files, or a Megatron-LM
  checkpoint root whose ``latest_checkpointed_iteration.txt`` points at such an ``iter_*`` dir.
  Tensors are global already; per-layer tensors are stacked on a leading layer axis under
  layer-free keys (:func:`torch_dist_key`). Vocabulary padding rows are dropped.
* **legacy**: ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` plus
  ``latest_checkpointed_iteration.txt``. Each rank's local tensors are put back together with the
  same sharding rules the live integration uses (the inverse of :func:`export_legacy`).

Optimizer state: carried from torch_dist when it holds ``optimizer.state.exp_avg[_sq].*`` tensors,
and from a legacy checkpoint (below); otherwise the importer says so (log + the returned summary).

Optimizer state from a legacy checkpoint: the non-distributed optimizers' state dicts (FP32Optimizer,
Float16OptimizerWithFloat16Params with its fp32 main params and fp16 loss scaler) are mapped to
parameter names through Megatron's parameter groups (:mod:`.legacy_optim`); a checkpoint of the
distributed optimizer (``distrib_optim.pt``) or one whose groups do not map imports weights only,
saying why.

Exports: ``legacy`` (:func:`export_legacy`: per TP/PP rank files, local layer indices, vocab padded
for the target TP; with the Adam state, fp32 main params, loss scaler and LR scheduler in the form
Megatron-LM's non-distributed optimizers load, when the elastor checkpoint has them; start Megatron
with ``--no-load-rng``) or ``torch_dist`` (:func:`export_torch_dist`, through megatron's own
``dist_checkpointing.save``, vocab padded for the target TP; weights only, and the CLI says so).

The model configuration (heads, query groups, gated MLP, true vocabulary) comes from the
checkpoint's ``args`` when it has them, else from ``--model-config FILE.json`` (a
:class:`GPTSpecConfig` as JSON; an elastor checkpoint written by this integration carries it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
from typing import Any, Callable, Optional

import torch

from ...checkpoint.state import from_jsonable
from ...checkpoint import commit as commit_mod
from ...checkpoint.convert import check_import_step, write_single_writer_checkpoint
from ...checkpoint.reader import read_shards
from ...checkpoint.paths import read_regular_text, safe_join
from ...checkpoint.shards import dtype_name, full_shard
from ...errors import CheckpointError, CheckpointNotFoundError, ConfigError, ElastorError
from ...user_json import strict_json
from ...layout import Layout, local_pieces
from ...layout.region import Region
from ..safe_load import dcp_failure, load_pt, raise_dcp_failure, safe_dcp_reader
from ..pt_save import save_pt
from . import overrides
from .specs import TE_FUSED_NORMS, GPTSpecConfig, canonical_name, gpt_tensor_specs
from . import legacy_optim
from .state import MOMENTS, STEP_NAME

_MAIN = "optimizer.fp32_param."  # training_hooks.MAIN_PREFIX (fp32 main params of bf16/fp16 runs)

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_SIDECAR = "elastor_model_config.json"   # beside TRACKER in a torch_dist export: the GPTSpecConfig
_MP_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
_LAYER_KEY_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LN_KEYS = {local: te for te, local in TE_FUSED_NORMS.items()}  # torch_dist keys use TE's names
_LINEARS_WITH_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                             "mlp.linear_fc2")


# ---------------------------------------------------------------------------------- names
def torch_dist_key(name: str) -> tuple[str, Optional[int]]:
    """(megatron sharded key, layer index on the stacked axis or None) of an elastor GPT name."""
    m = _LAYER_KEY_RE.match(name)
    if not m:
        return name, None
    rest = m.group(2)
    for prefix, repl in _LN_KEYS.items():
        if rest.startswith(prefix):
            rest = repl + rest[len(prefix):]
    return f"decoder.layers.{rest}", int(m.group(1))


def _resolve_iter_dir(src: str) -> tuple[str, int]:
    """The iteration directory of a Megatron checkpoint root (or the dir itself) and its iteration."""
    tracker = os.path.join(src, TRACKER)
    if os.path.lexists(tracker):
        try:   # never through a link out of the checkpoint (QA round 7, Q7-6)
            text = read_regular_text(tracker, 4096, nofollow=True).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{tracker}: cannot read it ({e}; a symlink is not followed); give the iter_* "
                                  f"dir itself") from None
        if text == "release":
            return safe_join(src, "release", what=TRACKER), 0
        if not (text.isascii() and text.isdigit()):
            raise CheckpointError(f"{tracker} holds {text[:80]!r}: expected an iteration number or 'release'")
        it = check_import_step(int(text), tracker)
        return safe_join(src, f"iter_{it:07d}", what=TRACKER), it
    m = re.search(r"iter_(\d+)$", src.rstrip("/"))
    return src, check_import_step(int(m.group(1)), src) if m else 0


def detect_format(src: str) -> str:
    d, _ = _resolve_iter_dir(src)
    if os.path.isfile(os.path.join(d, "metadata.json")):
        return "torch_dist"
    if os.path.isdir(d) and any(_MP_RE.match(x) for x in os.listdir(d)):
        return "legacy"
    raise CheckpointNotFoundError(f"{src}: neither a torch_dist checkpoint (metadata.json) nor a legacy one "
                          f"(mp_rank_* dirs) in {d}; point at a Megatron checkpoint root with {TRACKER} "
                          f"or at an iter_* directory")


def config_from_args(args: Any, vocab_size: Optional[int] = None) -> GPTSpecConfig:
    """A spec config from Megatron-LM's saved ``args`` namespace."""
    g = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    vocab = vocab_size or g("vocab_size") or g("padded_vocab_size")
    if not vocab_size and g("tokenizer_type") == "NullTokenizer" and g("vocab_size"):
        vocab = int(g("vocab_size")) + 1  # Megatron's NullTokenizer adds an EOD token to --vocab-size
    return GPTSpecConfig(
        num_layers=g("num_layers"), hidden_size=g("hidden_size"), num_attention_heads=g("num_attention_heads"),
        vocab_size=int(vocab), ffn_hidden_size=g("ffn_hidden_size") or 4 * g("hidden_size"),
        num_query_groups=g("num_query_groups") if g("group_query_attention", False) else None,
        kv_channels=g("kv_channels"), gated_linear_unit=bool(g("swiglu", False)),
        add_bias_linear=bool(g("add_bias_linear", True)), add_qkv_bias=bool(g("add_qkv_bias", False)),
        normalization=g("normalization", "LayerNorm"),
        make_vocab_size_divisible_by=int(g("make_vocab_size_divisible_by", 128)),
        max_sequence_length=int(g("max_position_embeddings", 1024)),
        position_embedding_type=g("position_embedding_type", "learned_absolute"),
        share_embeddings_and_output_weights=not g("untie_embeddings_and_output_weights", False))


def _load_config(path: Optional[str]) -> Optional[GPTSpecConfig]:
    if not path:
        return None
    from ...user_json import read_json_file
    d = read_json_file(path, "--model-config", 1 << 20, "a model config (JSON)",
                       "name a JSON file of GPTSpecConfig fields (the export writes elastor_model_config.json)")
    if not isinstance(d, dict):
        raise ConfigError(f"--model-config {path}: holds a {type(d).__name__}, expected a JSON object of "
                          f"GPTSpecConfig fields")
    try:
        return GPTSpecConfig.from_json(d)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"--model-config {path}: {e}") from None


def _check_stored_shape(d: str, key: str, stored: tuple, want: tuple, layer: Optional[int], cfg: GPTSpecConfig,
                        cfg_from: str) -> None:
    """The checkpoint's tensor ``key`` has the shape the model config gives (a layer's tensors are
    stacked along a first axis of ``num_layers``; embedding rows may be padded for TP). A config that
    does not describe the checkpoint would otherwise cut or reinterpret tensors without a word."""
    if layer is not None:
        ok = len(stored) == len(want) + 1 and stored[1:] == tuple(want) and stored[0] == cfg.num_layers
        expect = f"({cfg.num_layers}, {', '.join(map(str, want))})"
    elif not want:   # a scalar
        ok, expect = stored == (), "a scalar"
    else:
        ok = len(stored) == len(want) and stored[1:] == tuple(want[1:]) and stored[0] >= want[0]
        expect = f"{tuple(want)} (rows may be padded)"
    if not ok:
        raise CheckpointError(f"{d}: tensor {key} is {stored} in the checkpoint, but the model config from {cfg_from} "
                              f"gives {expect}: the config does not describe this checkpoint; pass the right "
                              f"--model-config FILE.json")


def _sidecar_config(root: str) -> Optional[GPTSpecConfig]:
    """The model config ``export_torch_dist`` left beside the tracker file (:data:`MODEL_SIDECAR`),
    read as untrusted input (no symlink, bounded, strict JSON), or None when there is none."""
    path = os.path.join(root, MODEL_SIDECAR)
    if not os.path.lexists(path):
        return None
    try:
        d = strict_json(read_regular_text(path, 1 << 20, nofollow=True))
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, expected an object")
        return GPTSpecConfig.from_json(d)
    except Exception as e:  # noqa: BLE001 - crafted input: any failure is "not ours" (duplicate keys raised IndexError)
        raise CheckpointError(f"{path}: not a model config elastor wrote ({type(e).__name__}: {e}); pass "
                              f"--model-config FILE.json") from None


# ---------------------------------------------------------------------------------- import
def import_megatron(src: str, dst: str, cfg: Optional[GPTSpecConfig] = None, progress: bool = False,
                    force: bool = False, trust: bool = False) -> dict:
    """Convert a Megatron checkpoint (torch_dist or legacy) to a committed elastor checkpoint at ``dst``.

    ``dst`` must be absent or empty unless ``force`` (see :func:`~elastor_ds.checkpoint.commit.
    check_import_destination`); pickled files load through :mod:`..safe_load` unless ``trust``.
    Returns a summary: format, step, tensors, ``optimizer`` (True/False) and the step dir."""
    fmt = detect_format(src)
    it_dir, it = _resolve_iter_dir(src)
    commit_mod.check_import_destination(dst, it, force)
    if fmt == "torch_dist":
        return _import_torch_dist(it_dir, it, dst, cfg, progress, force, trust)
    return _import_legacy(it_dir, it, dst, cfg, progress, force, trust)


def _no_optimizer(src: str, why: str) -> None:
    log.warning("%s has no optimizer state that elastor can carry (%s): importing weights only; resume "
                "with a fresh optimizer", src, why)


def _import_torch_dist(d: str, it: int, dst: str, cfg: Optional[GPTSpecConfig], progress: bool,
                       force: bool = False, trust: bool = False) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = safe_dcp_reader(d, trust).read_metadata().state_dict_metadata
    common: dict = {}
    cp = safe_join(d, "common.pt", what="torch_dist common state")
    if os.path.isfile(cp):
        common = load_pt(cp, trust)
        if not isinstance(common, dict):
            raise CheckpointError(f"{cp} holds a {type(common).__name__}, expected a dict")
    cfg_from = "--model-config" if cfg is not None else MODEL_SIDECAR
    if cfg is None:   # an elastor export's exact config first (its args, read by Megatron-LM, hold less)
        cfg = _sidecar_config(os.path.dirname(os.path.abspath(d)))
    if cfg is None and common.get("args") is not None:
        cfg = config_from_args(common["args"])
        cfg_from = "the checkpoint's Megatron args"
    if cfg is None:
        raise ConfigError(f"{d} carries no Megatron args: pass --model-config FILE.json (GPTSpecConfig fields: "
                          f"num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size, "
                          f"gated_linear_unit, vocab_size, ...)")
    specs = gpt_tensor_specs(cfg)
    names, shapes, dtypes = [], {}, {}
    source: dict[str, tuple[str, Optional[int]]] = {}
    for s in specs:
        key, layer = torch_dist_key(s.name)
        if key not in meta:
            raise CheckpointError(f"{d}: tensor {key} (for {s.name}) is missing; the checkpoint does not match "
                                  f"the model config {cfg}")
        if type(meta[key]) is not TensorStorageMetadata:
            raise CheckpointError(f"{d}: {key} (for {s.name}) is stored as {type(meta[key]).__name__}, not a tensor")
        _check_stored_shape(d, key, tuple(meta[key].size), s.shape, layer, cfg, cfg_from)
        names.append(s.name)
        shapes[s.name] = s.shape
        dtypes[s.name] = dtype_name(meta[key].properties.dtype)
        source[s.name] = (key, layer)
    have_opt = all(f"optimizer.state.{m}.{source[n][0]}" in meta for m in MOMENTS for n in list(names))
    if have_opt:
        for m in MOMENTS:
            for n in list(names[:len(specs)]):
                on = f"optimizer.{m}.{n}"
                names.append(on)
                shapes[on] = shapes[n]
                dtypes[on] = "float32"
                source[on] = (f"optimizer.state.{m}.{source[n][0]}", source[n][1])
    else:
        _no_optimizer(d, "no optimizer.state.exp_avg.* tensors")
    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        key, layer = source[name]
        if key not in cache:
            cache.clear()  # one stacked key in memory at a time (names are grouped by key order below)
            md = meta[key]
            t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            try:
                dcp.load({key: t}, storage_reader=safe_dcp_reader(d, trust), no_dist=True)
            except CheckpointException as e:   # torch's: a BaseException, with the reader's error inside
                raise_dcp_failure(e, f"{d}: reading {key}")
            cache[key] = t
        t = cache[key]
        if layer is not None:
            t = t[layer]
        rows = shapes[name][0] if shapes[name] else 0
        if layer is None and ("word_embeddings" in name or "output_layer" in name) and t.shape[0] > rows:
            t = t[:rows]  # drop the vocabulary padding rows
        return t.contiguous()
    names.sort(key=lambda n: (source[n][0], source[n][1] or 0))
    step_dir = write_single_writer_checkpoint(dst, it, names, shapes, dtypes, get,
                                              extra={"source": "megatron-torch_dist", "iteration": it,
                                                     **legacy_counters(common)},
                                              model=cfg.to_json(), layout=None, progress=progress, force=force)
    return {"format": "torch_dist", "step": it, "tensors": len(names), "optimizer": have_opt, "step_dir": step_dir}


def _import_legacy(d: str, it: int, dst: str, cfg: Optional[GPTSpecConfig], progress: bool,
                   force: bool = False, trust: bool = False) -> dict:
    ranks: dict[tuple[int, int], str] = {}
    for x in os.listdir(d):
        m = _MP_RE.match(x)
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = safe_join(d, f"{x}/model_optim_rng.pt",
                                                                      what="Megatron rank file", allow_subdirs=True)
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    if len(ranks) != tp * pp:
        raise CheckpointError(f"{d}: found {len(ranks)} mp_rank dirs but tp={tp} x pp={pp} needs {tp * pp}")
    sds = {k: load_pt(p, trust, mmap=True) for k, p in ranks.items()}
    for k, sd in sds.items():
        if not isinstance(sd, dict) or not isinstance(sd.get("model"), dict):
            raise CheckpointError(f"{ranks[k]} holds no 'model' state dict: not a Megatron legacy checkpoint")
    first = sds[(0, 0)]
    cfg_from = "--model-config"
    if cfg is None and first.get("args") is not None:
        cfg = config_from_args(first["args"])
        cfg_from = "the checkpoint's args"
    if cfg is None:
        raise ConfigError(f"{d}: the checkpoint carries no args; pass --model-config FILE.json")
    counts = []
    for p in range(pp):
        idx = {int(m.group(1)) for k in sds[(0, p)]["model"] for m in [_LAYER_KEY_RE.match(k)] if m}
        counts.append(len(idx))
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    layout = Layout.uniform(tp, pp, 1, cfg.num_layers, boundaries=bounds)
    specs = gpt_tensor_specs(cfg)
    by_name = {s.name: s for s in specs}
    opt = _legacy_optimizer(d, ranks, sds, specs, bounds, cfg, tp, pp)
    for sd in sds.values():  # Transformer Engine's fused layer-norm names -> the canonical ones
        sd["model"] = {canonical_name(k): v for k, v in sd["model"].items()}
    _check_legacy_shapes(ranks, sds, specs, bounds, cfg, tp, pp, cfg_from)

    def local_of(spec, stage: int, t: int, kind: str) -> torch.Tensor:
        local_name = _local_name(spec.name, bounds[stage], cfg, stage == pp - 1 and stage != 0)
        if kind == "model":
            return sds[(t, stage)]["model"][local_name]
        st = opt[(t, stage)]  # type: ignore[index]
        return {"exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq, "fp32_param": st.main}[kind][local_name]

    def get(name: str) -> torch.Tensor:
        if name == STEP_NAME:
            return torch.tensor(float(opt[(0, 0)].step or 0.0), dtype=torch.float32)  # type: ignore[index]
        kind, base = "model", name
        if name.startswith("optimizer."):
            kind, base = name.split(".", 2)[1], name.split(".", 2)[2]
        spec = by_name[base]
        stage = _stage_of(spec, bounds)
        dtype = local_of(spec, stage, 0, kind).dtype
        full = torch.empty(spec.shape, dtype=dtype)
        for t in range(tp):
            local = local_of(spec, stage, t, kind)
            _, pieces = local_pieces(spec, tp, t)
            for pc in pieces:
                _view(full, pc.global_).copy_(_view(local, pc.local))
        return full
    names = [s.name for s in specs]
    shapes: dict[str, tuple] = {s.name: s.shape for s in specs}
    dtypes = {s.name: dtype_name(local_of(s, _stage_of(s, bounds), 0, "model").dtype) for s in specs}
    extra = {"source": "megatron-legacy", "iteration": it, **legacy_counters(first)}
    if opt is not None:
        st0 = opt[(0, 0)]
        kinds = list(MOMENTS) + (["fp32_param"] if st0.main else [])
        for k in kinds:
            for s in specs:
                names.append(f"optimizer.{k}.{s.name}")
                shapes[names[-1]] = s.shape
                dtypes[names[-1]] = dtype_name(local_of(s, _stage_of(s, bounds), 0, k).dtype)
        names.append(STEP_NAME)
        shapes[STEP_NAME], dtypes[STEP_NAME] = (), "float32"
        extra.update(optimizer_state=True, adam=dict(st0.adam))
        if st0.grad_scaler:
            extra["grad_scaler"] = [dict(st0.grad_scaler)]
    step_dir = write_single_writer_checkpoint(dst, it, names, shapes, dtypes, get, extra=extra,
                                              model=cfg.to_json(), layout=layout.to_json(), progress=progress,
                                              force=force)
    return {"format": "legacy", "step": it, "tensors": len(names), "optimizer": opt is not None, "step_dir": step_dir}


def _check_legacy_shapes(ranks: dict, sds: dict, specs: list, bounds: list[int], cfg: GPTSpecConfig, tp: int,
                         pp: int, cfg_from: str) -> None:
    """Every rank file holds each tensor of its stage, of the local shape the model config gives
    (vocabulary rows may be padded more): a config that does not describe the checkpoint ended as
    "unexpected RuntimeError: The size of tensor a (64) must match ..." half way through the import."""
    for spec in specs:
        stage = _stage_of(spec, bounds)
        for t in range(tp):
            name = _local_name(spec.name, bounds[stage], cfg, stage == pp - 1 and stage != 0)
            local = sds[(t, stage)]["model"].get(name)
            where = ranks[(t, stage)]
            if not isinstance(local, torch.Tensor):
                raise CheckpointError(f"{where}: tensor {name} (for {spec.name}) is "
                                      f"{'missing' if local is None else 'a ' + type(local).__name__}; the model "
                                      f"config from {cfg_from} does not describe this checkpoint (pass the right "
                                      f"--model-config FILE.json)")
            want, pieces = local_pieces(spec, tp, t)
            got = tuple(local.shape)
            vocab = getattr(getattr(spec.rule, "kind", None), "name", "") == "VOCAB"
            ok = got == tuple(want) or (vocab and len(got) == len(want) and got[1:] == tuple(want[1:]) and all(
                o + n <= g for pc in pieces for o, n, g in zip(pc.local.offsets, pc.local.sizes, got)))
            if not ok:
                raise CheckpointError(f"{where}: tensor {name} is {got}, but the model config from {cfg_from} gives "
                                      f"{tuple(want)} at tp={tp}: the config does not describe this checkpoint; pass "
                                      f"the right --model-config FILE.json")


def _legacy_optimizer(d: str, ranks: dict, sds: dict, specs: list, bounds: list[int], cfg: GPTSpecConfig,
                      tp: int, pp: int) -> Optional[dict]:
    """Every rank's legacy optimizer state by local name (:mod:`.legacy_optim`), or None (logged:
    weights only) when the checkpoint has none or elastor cannot map it."""
    if not all("optimizer" in sd and sd["optimizer"] is not None for sd in sds.values()):
        _no_optimizer(d, "the checkpoint has no 'optimizer' entry (saved with --no-save-optim?)")
        return None
    dist_files = [k for k, p in ranks.items() if os.path.exists(os.path.join(os.path.dirname(p), "distrib_optim.pt"))]
    if dist_files:
        _no_optimizer(d, "it was saved by the distributed optimizer (distrib_optim.pt, Megatron's flat DP "
                         "layout): convert from a torch_dist checkpoint instead, or resume with --no-load-optim")
        return None
    out = {}
    try:
        for (t, p), sd in sds.items():
            first_layer = bounds[p]
            local_to_spec = {}
            for s in specs:
                stages = sorted({0, pp - 1}) if s.placement == "tied" else [_stage_of(s, bounds)]
                if p in stages:
                    local_to_spec[_local_name(s.name, first_layer, cfg, p == pp - 1 and p != 0)] = s.name
            model = sd["model"]  # names as saved (local or Transformer Engine spec): their order is Megatron's
            params = {n: tuple(model[n].shape) for n in legacy_optim.param_order(
                [k for k in model if canonical_name(k) in local_to_spec and torch.is_tensor(model[k])])}
            if len(params) != len(local_to_spec):
                raise CheckpointError(f"{ranks[(t, p)]}: the model holds {len(params)} of the {len(local_to_spec)} "
                                      f"parameters the config gives")
            st = legacy_optim.parse(sd["optimizer"], params, ranks[(t, p)])
            for d_ in (st.exp_avg, st.exp_avg_sq, st.main):
                for k in list(d_):
                    d_[canonical_name(k)] = d_.pop(k)
            out[(t, p)] = st
        steps = {st.step for st in out.values()}
        if len(steps) > 1:
            raise CheckpointError(f"ranks hold different Adam steps {sorted(steps)}")
        mixed = {bool(st.main) for st in out.values()}
        if len(mixed) > 1:
            raise CheckpointError("some ranks hold fp32 main params and others do not")
    except CheckpointError as e:
        _no_optimizer(d, f"its optimizer state does not map to parameters: {e}")
        return None
    log.info("%s: carrying the legacy optimizer state (Adam moments%s, step %s)", d,
             ", fp32 main params" if out[(0, 0)].main else "", out[(0, 0)].step)
    return out


def legacy_counters(sd: dict) -> dict:
    """What the Megatron-LM hooks restore besides tensors, from a legacy rank file: sample counters,
    FLOPs so far and the LR scheduler (JSON-safe numbers only; anything else is left out)."""
    out: dict = {}
    a = sd.get("args")
    for k in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        v = getattr(a, k, None)
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
    flops = sd.get("num_floating_point_operations_so_far")
    if isinstance(flops, (int, float)) and not isinstance(flops, bool):
        out["num_floating_point_operations_so_far"] = float(flops)
    sched = sd.get("opt_param_scheduler", sd.get("lr_scheduler"))
    if isinstance(sched, dict) and all(isinstance(k, str) and (v is None or isinstance(v, (int, float, str, bool)))
                                       for k, v in sched.items()):
        out["opt_param_scheduler"] = dict(sched)
    return out


def _stage_of(spec, bounds: list[int]) -> int:
    if spec.placement in ("pre", "tied"):
        return 0
    if spec.placement == "post":
        return len(bounds) - 2
    return next(i for i in range(len(bounds) - 1) if bounds[i] <= int(spec.placement) < bounds[i + 1])


def _local_name(name: str, first_layer: int, cfg: GPTSpecConfig, last_not_first: bool) -> str:
    m = _LAYER_KEY_RE.match(name)
    if m:
        return f"decoder.layers.{int(m.group(1)) - first_layer}.{m.group(2)}"
    if name == "embedding.word_embeddings.weight" and last_not_first and cfg.share_embeddings_and_output_weights:
        return "output_layer.weight"
    return name


def _view(t: torch.Tensor, r: Region) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(r.offsets, r.sizes))] if r.ndim else t


# ---------------------------------------------------------------------------------- export
class _Canonical:
    """Read canonical tensors of an elastor checkpoint one at a time."""

    def __init__(self, src: str, cfg: Optional[GPTSpecConfig]):
        self.step_dir = commit_mod.resolve(src)
        self.man = commit_mod.read_manifest(self.step_dir)
        if cfg is None:
            model = self.man.model or {}
            if model.get("kind") != "megatron-core-gpt":
                raise ConfigError(f"{self.step_dir} was not written by the megatron integration (model "
                                  f"{str(model)[:80]}); pass --model-config FILE.json")
            try:
                cfg = GPTSpecConfig.from_json(model)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{self.step_dir}: its manifest's model record is not a GPT config ({e}); "
                                      f"pass --model-config FILE.json") from None
        self.cfg = cfg

    def get(self, name: str) -> torch.Tensor:
        e = self.man.tensors.get(name)
        if e is None:
            raise CheckpointError(f"{self.step_dir}: tensor {name} is missing (has {len(self.man.tensors)})")
        t = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        read_shards(self.step_dir, self.man, [full_shard(name, t)])
        return t


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
    out[:t.shape[0]] = t
    return out


def megatron_common_state(cfg: GPTSpecConfig, tp: int, pp: int, it: int, extra: dict) -> dict[str, Any]:
    """What Megatron-LM's loader reads besides tensors, in every rank file of a legacy checkpoint and
    in a torch_dist checkpoint's common state: the iteration (without it a resume exits at once,
    "unable to load iteration"), the checkpoint version, and the args with the sample counters
    (without them a resume reads the data from sample 0 again) and the FLOPs so far."""
    args = legacy_args(cfg, tp, pp, it)
    for k in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        if isinstance(extra.get(k), int) and not isinstance(extra.get(k), bool):
            setattr(args, k, extra[k])
    out: dict[str, Any] = {"iteration": it, "checkpoint_version": 3.0, "args": args}
    flops = extra.get("num_floating_point_operations_so_far")
    if isinstance(flops, (int, float)) and not isinstance(flops, bool):
        out["num_floating_point_operations_so_far"] = flops
    return out


def legacy_args(cfg: GPTSpecConfig, tp: int, pp: int, it: int) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=cfg.num_query_groups is not None,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.head_dim, swiglu=cfg.gated_linear_unit,
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias, normalization=cfg.normalization,
        vocab_size=cfg.vocab_size, padded_vocab_size=cfg.padded_vocab(tp),
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        max_position_embeddings=cfg.max_sequence_length, position_embedding_type=cfg.position_embedding_type,
        untie_embeddings_and_output_weights=not cfg.share_embeddings_and_output_weights,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, iteration=it)


def _deepspeed_adam_step(extra: dict) -> Optional[float]:
    """Adam's step count of a checkpoint the DeepSpeed adapter wrote (a megatron-core GPT inside
    DeepSpeed's engine: the step is a scalar of ``extra["optimizer"]``, not a tensor); None when
    it records none. Exporting without it wrote step 0 beside moments of step N, so Adam's bias
    correction was wrong on the first update after a resume."""
    steps = set()
    for group in extra.get("optimizer") or []:
        sc = ((group or {}).get("scalars") or {}).get("step") if isinstance(group, dict) else None
        if isinstance(sc, dict) and isinstance(sc.get("value"), (int, float)):
            steps.add(float(sc["value"]))
    if len(steps) > 1:
        raise CheckpointError(f"the checkpoint's optimizer groups hold different Adam steps {sorted(steps)}; "
                              f"Megatron-LM's optimizer keeps one")
    return steps.pop() if steps else None


def _recorded_adam(ex: dict, where: str) -> dict:
    """Adam's betas/eps/amsgrad a checkpoint records: ``extra["adam"]`` (the megatron integration),
    else the optimizer groups' hyperparameters ``extra["optimizer"][i]["hyper"]`` (the DeepSpeed
    integration); {} when neither does. Megatron-LM's optimizer keeps one set: groups that record
    different ones are refused rather than one of them written for all."""
    if ex.get("adam"):
        return dict(ex["adam"])
    found: list[tuple[int, dict]] = []
    for i, group in enumerate(ex.get("optimizer") or []):
        hyper = group.get("hyper") if isinstance(group, dict) else None
        if not isinstance(hyper, dict) or not any(k in hyper for k in ("betas", "eps")):
            continue
        rec: dict = {}
        betas = hyper.get("betas")
        if betas is not None:
            if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and
                    all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
                raise CheckpointError(f"{where}: extra.optimizer[{i}].hyper.betas is {str(betas)[:80]}, not two "
                                      f"numbers in [0, 1)")
            rec["betas"] = [float(b) for b in betas]
        eps = hyper.get("eps")
        if eps is not None:
            if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < float("inf"):
                raise CheckpointError(f"{where}: extra.optimizer[{i}].hyper.eps is {str(eps)[:80]}, not a "
                                      f"non-negative number")
            rec["eps"] = float(eps)
        if "amsgrad" in hyper:
            rec["amsgrad"] = bool(hyper["amsgrad"])
        found.append((i, rec))
    if not found:
        return {}
    if any(rec != found[0][1] for _, rec in found[1:]):
        raise CheckpointError(f"{where}: the optimizer groups record different Adam hyperparameters "
                              f"({'; '.join(f'group {i}: {rec}' for i, rec in found[:4])}); Megatron-LM's optimizer "
                              f"keeps one set, so no export would resume as saved. Nothing was written")
    return found[0][1]


def export_legacy(src: str, dst: str, tp: int, pp: int, cfg: Optional[GPTSpecConfig] = None,
                  optimizer: bool = True, progress: bool = False) -> str:
    """Write a Megatron-LM legacy checkpoint for TP ``tp`` x PP ``pp`` under ``dst``: weights, and
    (``optimizer`` and the checkpoint has Adam state) the optimizer state in the form Megatron-LM's
    non-distributed optimizers load (:mod:`.legacy_optim`) plus the LR scheduler and counters."""
    can = _Canonical(src, cfg)
    cfg = can.cfg
    cfg.check_tp(tp)
    it = can.man.step
    if not 1 <= pp <= cfg.num_layers:   # a flag value, as check_tp's: a usage error (exit 2)
        raise ConfigError(f"--pipeline-model-parallel-size {pp}: the model has {cfg.num_layers} layers; give 1 to "
                          f"{cfg.num_layers} stages")
    layout = Layout.uniform(tp, pp, 1, cfg.num_layers)
    bounds = layout.boundaries()
    if pp > 1 and len({b - a for a, b in zip(bounds, bounds[1:])}) > 1:
        log.warning("num_layers=%d is not divisible by pp=%d: stages hold %s layers; start Megatron with "
                    "matching --decoder-first/last-pipeline-num-layers", cfg.num_layers, pp,
                    [b - a for a, b in zip(bounds, bounds[1:])])
    specs = gpt_tensor_specs(cfg)
    padded = cfg.padded_vocab(tp)
    kinds = ["model"]
    has_opt = optimizer and all(f"optimizer.{m}.{s.name}" in can.man.tensors for m in MOMENTS for s in specs)
    has_main = has_opt and all(f"{_MAIN}{s.name}" in can.man.tensors for s in specs)
    if has_opt:
        kinds += list(MOMENTS) + (["fp32_param"] if has_main else [])
    ex = from_jsonable(dict(can.man.extra or {}))
    adam = _recorded_adam(ex, can.step_dir) if has_opt else {}   # refused before any tensor is read
    per_rank: dict[tuple[int, int], dict[str, dict[str, Any]]] = {
        (t, p): {k: {} for k in kinds} for t in range(tp) for p in range(pp)}
    from tqdm import tqdm
    # one canonical tensor in memory at a time (+ its local slices); a bar on a terminal only
    for spec in tqdm(specs, unit="tensor", desc="read", disable=None if progress else True):
        for kind in kinds:
            full = can.get(spec.name if kind == "model" else f"optimizer.{kind}.{spec.name}")
            stages = sorted({0, pp - 1}) if spec.placement == "tied" else [_stage_of(spec, bounds)]
            for stage in stages:
                lname = _local_name(spec.name, bounds[stage], cfg, stage == pp - 1 and stage != 0)
                for t in range(tp):
                    shape, pieces = local_pieces(spec, tp, t)
                    local = torch.zeros(shape, dtype=full.dtype)
                    for pc in pieces:
                        _view(local, pc.local).copy_(_view(full, pc.global_))
                    per_rank[(t, stage)][kind][lname] = local
    optim: dict[tuple[int, int], Any] = {}
    if has_opt:
        half = any(per_rank[(0, 0)]["model"][n].dtype in (torch.bfloat16, torch.float16)
                   for n in per_rank[(0, 0)]["model"])
        step = float(can.get(STEP_NAME).item()) if STEP_NAME in can.man.tensors else _deepspeed_adam_step(ex)
        scaler = next((x for x in (ex.get("grad_scaler") or []) if x), None)
        for key, kd in per_rank.items():
            params = {n: tuple(kd["model"][n].shape) for n in legacy_optim.param_order(list(kd["model"]))}
            main = kd.get("fp32_param") or ({n: v.float() for n, v in kd["model"].items()} if half else {})
            st = legacy_optim.LegacyOptimizerState(exp_avg=kd["exp_avg"], exp_avg_sq=kd["exp_avg_sq"], main=main,
                                                   step=step, grad_scaler=scaler, adam=dict(adam))
            optim[key] = legacy_optim.build(params, st, ex.get("opt_param_scheduler"), mixed=half)
        if not adam:
            log.warning("%s does not record Adam's betas/eps: wrote Megatron-LM's defaults %s (torch's Adam "
                        "takes them from the loaded state)", can.step_dir, legacy_optim.DEFAULT_ADAM)
    elif optimizer:
        log.warning("%s has no (complete) optimizer state: exporting weights only", can.step_dir)
    with commit_mod.DirCommit.create(dst) as out:
        _write_legacy(out.path, {k: v["model"] for k, v in per_rank.items()}, cfg, tp, pp, it, optim, ex)
        out.finalize()
    it_dir = os.path.join(dst, f"iter_{it:07d}")
    log.info("wrote Megatron legacy checkpoint (tp=%d, pp=%d, padded vocab %d, %s) to %s", tp, pp, padded,
             "with optimizer state" if optim else "weights only: start Megatron with --no-load-optim --no-load-rng",
             it_dir)
    return it_dir


def _write_legacy(dst: str, per_rank: dict, cfg: GPTSpecConfig, tp: int, pp: int, it: int,
                  optim: Optional[dict] = None, extra: Optional[dict] = None) -> None:
    optim, extra = optim or {}, extra or {}
    it_dir = os.path.join(dst, f"iter_{it:07d}")
    for (t, p), sd in per_rank.items():
        for k in list(sd):
            for lin in _LINEARS_WITH_EXTRA_STATE:
                if k.endswith(f".{lin}.weight"):
                    sd[k[:-len("weight")] + "_extra_state"] = None
        if "output_layer.weight" in sd:
            sd["output_layer._extra_state"] = None
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
        os.makedirs(os.path.join(it_dir, name), exist_ok=True)
        rank_sd: dict[str, Any] = {"model": sd, **megatron_common_state(cfg, tp, pp, it, extra)}
        if (t, p) in optim:
            rank_sd["optimizer"] = optim[(t, p)]
            if isinstance(extra.get("opt_param_scheduler"), dict):
                rank_sd["opt_param_scheduler"] = dict(extra["opt_param_scheduler"])
        save_pt(rank_sd, os.path.join(it_dir, name, "model_optim_rng.pt"))
    with open(os.path.join(dst, TRACKER), "w", encoding="utf-8") as f:
        f.write(str(it))


def export_torch_dist(src: str, dst: str, tp: int, cfg: Optional[GPTSpecConfig] = None) -> str:
    """Write a torch_dist checkpoint with megatron's ``dist_checkpointing.save`` (vocab padded for TP
    ``tp``; loadable at any PP and at any TP with the same padded vocab). Collective over the default
    group when torch.distributed is initialised (rank 0 writes); else runs in-process.

    Callers that are scripts must guard their entry point with ``if __name__ == "__main__":``
    (megatron's writer may start processes)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.api import CheckpointException

    can = _Canonical(src, cfg)
    cfg = can.cfg
    cfg.check_tp(tp)
    it = can.man.step
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    padded = cfg.padded_vocab(tp)
    sd: dict[str, Any] = {}
    for spec in gpt_tensor_specs(cfg):
        key, layer = torch_dist_key(spec.name)
        # every rank holds the full tensor; replica ids make rank 0 the only writer
        full = can.get(spec.name)
        if "word_embeddings" in spec.name or spec.name == "output_layer.weight":
            full = _padded(full, padded)
        if layer is None:
            sd[spec.name] = ShardedTensor.from_rank_offsets(key, full, replica_id=rank)
        else:  # one slice of the stacked layer axis, like TransformerBlock.sharded_state_dict
            sd[spec.name] = ShardedTensor.from_rank_offsets(key, full, (0, layer, cfg.num_layers),
                                                            replica_id=rank, prepend_axis_num=1)
    for lin in _LINEARS_WITH_EXTRA_STATE:  # megatron's loader expects the linears' (empty) extra state
        for layer in range(cfg.num_layers):
            sd[f"decoder.layers.{layer}.{lin}._extra_state"] = ShardedObject(
                f"decoder.layers.{lin}._extra_state", None, (cfg.num_layers,), (layer,), replica_id=rank)
    # the common state (common.pt): a resume without --finetune needs the iteration and the counters
    sd.update(megatron_common_state(cfg, tp, 1, it, from_jsonable(dict(can.man.extra or {}))))
    # rank 0 creates the temporary directory and tells the others its name; rank 0 renames it
    out = commit_mod.DirCommit.create(dst) if rank == 0 else None
    tmp = [out.path if out else None]
    if world > 1:   # plain data, never pickled
        from ...comm.objects import broadcast_object
        tmp = [broadcast_object(tmp[0], 0, what="the temporary directory's name")]
    try:
        tmp_it = os.path.join(tmp[0], f"iter_{it:07d}")
        if rank == 0:
            os.makedirs(tmp_it, exist_ok=True)
        if world > 1:
            dist.barrier()
        # megatron's writer logs its worker's failure as an ERROR of its own: the failure is raised below
        mlog = logging.getLogger("megatron.core.dist_checkpointing")
        level = mlog.level
        mlog.setLevel(logging.CRITICAL)
        try:
            with overrides.cpu_sync():   # megatron's writer calls torch.cuda.synchronize() even for host tensors
                dist_checkpointing.save(sd, tmp_it)
        except CheckpointException as e:   # torch's: a BaseException (a traceback, not one line), error inside
            os_err = _os_error_in(dcp_failure(e))   # megatron wraps a worker's OSError in a RuntimeError
            if os_err is not None:   # a full disk, a permission: as the other exports say it (the CLI names dst)
                raise OSError(os_err.errno, os_err.strerror or str(os_err)) from None
            raise_dcp_failure(e, f"writing the torch_dist checkpoint {dst}")
        finally:
            mlog.setLevel(level)
        if rank == 0:
            with open(os.path.join(tmp[0], TRACKER), "w", encoding="utf-8") as f:
                f.write(str(it))
            with open(os.path.join(tmp[0], MODEL_SIDECAR), "w", encoding="utf-8") as f:
                json.dump(cfg.to_json(), f, indent=1)   # what `--from megatron` needs back (Megatron's args are pickled)
        if world > 1:
            dist.barrier()
        if out is not None:
            out.finalize()
    finally:
        if out is not None:
            out.abort()  # no-op once finalized
    it_dir = os.path.join(dst, f"iter_{it:07d}")
    log.info("wrote torch_dist checkpoint (padded vocab %d for tp=%d) to %s", padded, tp, it_dir)
    return it_dir


def _os_error_in(exc: Optional[BaseException]) -> Optional[OSError]:
    """The OSError ``exc`` is or was caused by (a few links of ``__cause__``), else None. Megatron's
    writer process sends its error back pickled, which drops the cause: there the message
    ("Worker failure: [Errno 28] No space left on device") says which it was."""
    first = exc
    for _ in range(8):
        if exc is None or isinstance(exc, ElastorError):
            break
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__
    if first is None or isinstance(first, ElastorError) or not isinstance(first, Exception):
        return None
    m = re.search(r"\[Errno (\d{1,4})\]", str(first))
    return OSError(int(m.group(1)), os.strerror(int(m.group(1)))) if m else None


# ---------------------------------------------------------------------------------- CLI glue
def _ensure_single_process_group() -> None:
    import datetime

    import torch.distributed as dist
    if dist.is_initialized():
        return
    # an in-process store: one process needs no file (a FileStore left a folder in the temp dir per run)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))


def _require_dist_checkpointing() -> None:
    """``--megatron-format torch_dist`` writes through megatron-core's ``dist_checkpointing``: without
    megatron-core (a plain ``pip install elastor_ds``) a one-line usage error naming the extra."""
    try:
        import megatron.core.dist_checkpointing  # noqa: F401
    except ImportError as e:
        from ...checkpoint.cli import missing_extra_error
        what, hint = "--to megatron --megatron-format torch_dist", "; --megatron-format legacy needs no megatron-core"
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "megatron":
            raise missing_extra_error(what, "megatron", f"No module named {e.name!r}", hint) from None
        raise ConfigError(f"{what}: megatron.core.dist_checkpointing cannot be imported ({type(e).__name__}: {e}); "
                          f"reinstall it with pip install 'elastor_ds[megatron]'{hint}") from None


def cli_import(src: str, dst: str, args: Any) -> str:
    res = import_megatron(src, dst, _load_config(getattr(args, "model_config", None)),
                          progress=not getattr(args, "no_progress", False), force=bool(getattr(args, "force", False)),
                          trust=bool(getattr(args, "trust_checkpoint", False)))
    if not res["optimizer"]:
        log.warning("%s has no optimizer state elastor can carry; imported weights only", src)
    return res["step_dir"]


def cli_export(src: str, dst: str, args: Any) -> str:
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    fmt = getattr(args, "megatron_format", "legacy")
    cfg = _load_config(getattr(args, "model_config", None))
    weights_only = bool(getattr(args, "megatron_weights_only", False))
    man = commit_mod.read_manifest(commit_mod.resolve(src))
    has_opt = any(n.startswith("optimizer.exp_avg.") for n in man.tensors)
    if fmt == "legacy":
        out = export_legacy(src, dst, tp, pp, cfg, optimizer=not weights_only,
                            progress=not getattr(args, "no_progress", False))
        if has_opt and not weights_only:
            log.info("optimizer state exported in the form Megatron-LM's non-distributed optimizers load "
                  "(FP32Optimizer, or Float16OptimizerWithFloat16Params for --bf16/--fp16) with the LR scheduler; "
                  "start Megatron with --ckpt-format torch --no-load-rng. A --use-distributed-optimizer run reads "
                  "distrib_optim.pt, which elastor does not write: add --no-load-optim there (or resume with --elastor)")
            return out
    elif fmt == "torch_dist":
        _require_dist_checkpointing()   # before anything is written
        _ensure_single_process_group()
        out = export_torch_dist(src, dst, tp, cfg)
        if has_opt and not weights_only:
            log.warning("--megatron-format torch_dist exports weights only: the optimizer state in the elastor "
                  "checkpoint is not written (its torch_dist layout depends on Megatron's optimizer wrapper); use "
                  "--megatron-format legacy to carry it, or resume with --elastor")
    else:
        raise ConfigError(f"--megatron-format {fmt!r}: choose legacy or torch_dist")
    log.warning("weights only; start Megatron with --no-load-optim --no-load-rng (it resumes at iteration %d with "
                "the saved sample counters; --finetune starts from iteration 0)", man.step)
    return out


EXPORT_FORMATS: dict[str, Callable] = {"legacy": export_legacy, "torch_dist": export_torch_dist}
