"""Hooks that route Megatron-LM's own trainer (``pretrain_gpt.py``, ``megatron/training``) through
elastor: the functions the diffs in ``patches/`` call. Off unless ``--elastor`` is given; the
patches import this module only then, so an unflagged run never touches elastor.

The patches call, in order:
1. :func:`add_arguments` (pretrain_gpt.py's ``extra_args_provider``): ``--elastor``,
   ``--elastor-async/--no-elastor-async``, ``--elastor-keep N``, ``--elastor-plan FILE``.
2. :func:`configure` (start of ``validate_args``): check the flags megatron-core must run with, and
   apply a plan: TP, PP and (uneven) stage boundaries as ``--pipeline-model-parallel-layout``.
3. :func:`check_parallel_state` (after ``mpu.initialize_model_parallel``): every rank sits where the
   layout says.
4. :func:`save_checkpoint` / :func:`load_checkpoint` (start of Megatron-LM's functions of the same
   name; same arguments and return value): one partition-agnostic checkpoint through
   :class:`CheckpointEngine`, loadable under any TP x PP x DP.
5. :func:`finalize` (blocking ``maybe_finalize_async_save``): wait for the in-flight async save.

What a checkpoint carries: the weights of every rank's model; Adam state (``exp_avg``,
``exp_avg_sq``, ``step``) when the optimizer is a torch optimizer over the model parameters,
Megatron's ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` (plus its fp32 main
parameters, as ``optimizer.fp32_param.<name>``) or a ``ChainedOptimizer`` of those; the LR
scheduler (``opt_param_scheduler.state_dict()``), iteration, consumed/skipped train samples,
consumed valid samples, FLOPs so far; per-rank RNG (python, numpy, torch, CUDA and megatron's RNG
tracker), restored only when the layout is unchanged.

Not carried (yet): the state of Megatron's ``DistributedOptimizer`` (its shards live in flat
buffers; only the weights are saved and a warning says so), virtual pipeline chunks, context and
expert parallelism (rejected by :func:`configure`).
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from ...checkpoint import commit as commit_mod
from ...checkpoint.engine import CheckpointEngine, SaveStats
from ...checkpoint.shards import shards_from_pieces
from ...checkpoint.state import capture_rng_state, restore_rng_state
from ...errors import CheckpointNotFoundError, ConfigError, LayoutError
from ...layout import Layout
from .model import spec_config_from_model
from .parallel import MEGATRON_ORDER, check_layout
from .specs import GPTSpecConfig
from .state import STEP_NAME, _plan, _set_steps, ensure_adam_state, gpt_shards

log = logging.getLogger(__name__)

FORMAT = "megatron-lm/1"
MAIN_PREFIX = "optimizer.fp32_param."


# ------------------------------------------------------------------ flags and parallel init
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--elastor*`` flags (an ``extra_args_provider`` for Megatron-LM's parse_args)."""
    g = parser.add_argument_group("elastor", "elastic, partition-agnostic checkpoints (off by default)")
    g.add_argument("--elastor", action="store_true", default=False,
                   help="save/load checkpoints through elastor (loadable under any TP x PP x DP)")
    g.add_argument("--elastor-async", dest="elastor_async", action=argparse.BooleanOptionalAction, default=True,
                   help="write checkpoints in a background thread (default on)")
    g.add_argument("--elastor-keep", type=int, default=2, help="committed checkpoints to keep (default 2)")
    g.add_argument("--elastor-plan", default=None, metavar="FILE",
                   help="elastor plan JSON: sets TP, PP and the (uneven) pipeline stage boundaries")
    return parser


def enabled(args: Any) -> bool:
    return bool(getattr(args, "elastor", False))


def plan_layout(args: Any) -> Optional[Layout]:
    """The layout of ``--elastor-plan`` (None without one)."""
    path = getattr(args, "elastor_plan", None)
    if not path:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"--elastor-plan {path}: no such file (write one with `elastor plan ... --json`)")
    with open(path, encoding="utf-8") as f:
        return Layout.from_json(json.load(f), args.num_layers)


def pipeline_layout_string(boundaries: Sequence[int]) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for stage boundaries, e.g. ``Et|tttL``."""
    stages = ["t" * (b - a) for a, b in zip(boundaries, boundaries[1:])]
    return "E" + "|".join(stages) + "L"


def configure(args: Any) -> Optional[Layout]:
    """Check the flags (start of ``validate_args``) and apply ``--elastor-plan``; returns its layout."""
    if args.elastor_keep < 1:
        raise ConfigError(f"--elastor-keep {args.elastor_keep}: must be >= 1")
    bad = [(f, v) for f, v in (("--context-parallel-size", getattr(args, "context_parallel_size", 1)),
                               ("--expert-model-parallel-size", getattr(args, "expert_model_parallel_size", 1)))
           if (v or 1) > 1]
    for f in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        if getattr(args, f, None) is not None:
            bad.append(("--" + f.replace("_", "-"), getattr(args, f)))
    if getattr(args, "use_tp_pp_dp_mapping", False):
        bad.append(("--use-tp-pp-dp-mapping", True))
    if bad:
        raise ConfigError(f"--elastor supports TP x PP x DP grids in megatron-core's {MEGATRON_ORDER} order only; "
                          f"drop {', '.join(f'{f} {v}' for f, v in bad)} or run without --elastor")
    if getattr(args, "use_distributed_optimizer", False):
        log.warning("--elastor with --use-distributed-optimizer: elastor does not yet carry the distributed "
                    "optimizer's state; checkpoints hold the weights, scheduler, iteration and RNG only, and a "
                    "resume starts the optimizer moments from zero")
    layout = plan_layout(args)
    if layout is None:
        return None
    try:
        tp, pp, dp = layout.uniform_dims()
    except LayoutError as e:
        raise ConfigError(f"--elastor-plan: Megatron-LM runs uniform TP x PP x DP grids (uneven stages "
                          f"allowed); this plan is heterogeneous: {e}") from None
    world = int(getattr(args, "world_size", layout.world_size))
    if layout.world_size != world:
        raise ConfigError(f"--elastor-plan needs {layout.world_size} processes (tp({tp}) * pp({pp}) * dp({dp})) "
                          f"but WORLD_SIZE={world}")
    for f in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, f, None) is not None:
            raise ConfigError(f"--elastor-plan sets the stage boundaries; drop --{f.replace('_', '-')}")
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    bounds = layout.boundaries()
    if pp > 1 and check_layout(layout).uneven:
        args.pipeline_model_parallel_layout = pipeline_layout_string(bounds)
    log.info("elastor plan %s: tp %d, pp %d, dp %d, stage boundaries %s", layout.describe(), tp, pp, dp, bounds)
    return layout


def check_parallel_state(args: Any) -> None:
    """After megatron's parallel init: this rank's (tp, dp, pp) is where the plan puts it."""
    from megatron.core import parallel_state as ps

    layout = plan_layout(args)
    if layout is None:
        return
    check_layout(layout)
    rank = torch.distributed.get_rank()
    pos = layout.position(rank)
    got = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    if got != (pos.tp_rank, pos.replica, pos.stage):
        raise LayoutError(f"rank {rank}: megatron-core placed it at (tp, dp, pp) = {got}, the elastor plan at "
                          f"{(pos.tp_rank, pos.replica, pos.stage)}")


# ------------------------------------------------------------------ session (comm + engines)
@dataclass
class _Session:
    comm: Any = None
    engines: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)


_S = _Session()


def _comm(args: Any) -> Any:
    if _S.comm is None:
        from ...comm.collectives import LocalComm, TorchComm

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            _S.comm = TorchComm.create(60.0 * float(getattr(args, "distributed_timeout_minutes", 10) or 10))
        else:
            _S.comm = LocalComm()
    return _S.comm


def _engine(args: Any, root: str) -> CheckpointEngine:
    key = os.path.abspath(root)
    eng = _S.engines.get(key)
    if eng is None:
        eng = CheckpointEngine(key, _comm(args), keep=int(getattr(args, "elastor_keep", 2)),
                               async_save=bool(getattr(args, "elastor_async", True)))
        _S.engines[key] = eng
    return eng


def finalize() -> Optional[SaveStats]:
    """Wait for every in-flight save (raises AsyncSaveError if one failed). Call before exiting."""
    last = None
    for eng in _S.engines.values():
        last = eng.finalize() or last
    return last


def reset() -> None:
    """Forget the engines and comm (after finalize; for tests and in-process restarts)."""
    _S.comm, _S.engines, _S.warned = None, {}, set()


def _warn_once(key: str, msg: str, *a: Any) -> None:
    if key not in _S.warned:
        _S.warned.add(key)
        log.warning(msg, *a)


# ------------------------------------------------------------------ model and optimizer adapters
def unwrap_model(model: Any) -> list[Any]:
    """Megatron-LM's model list (DDP / Float16Module wrapped chunks) -> the GPTModels."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for m in chunks:
        while hasattr(m, "module") and isinstance(getattr(m, "module"), torch.nn.Module):
            m = m.module
        out.append(m)
    return out


def _one_chunk(model: Any) -> Any:
    chunks = unwrap_model(model)
    if len(chunks) != 1:
        raise ConfigError(f"--elastor: {len(chunks)} model chunks (virtual pipeline); elastor carries one chunk "
                          f"per rank, run without virtual pipeline stages")
    return chunks[0]


def _true_vocab(args: Any, chunk: Any) -> int:
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    try:
        from megatron.training.global_vars import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - no tokenizer: the padded size is the best we know
        _warn_once("vocab", "elastor: true vocabulary size unknown (no --vocab-size, no tokenizer); saving the "
                   "padded vocabulary %d, so a resume at another TP degree may fail", int(chunk.vocab_size))
        return int(chunk.vocab_size)


def _layout(args: Any, chunk: Any, cfg: GPTSpecConfig, comm: Any) -> Layout:
    """This run's layout, from what megatron built: the stage boundaries from each rank's layer numbers."""
    from megatron.core import parallel_state as ps

    layers = chunk.decoder.layers
    first = int(layers[0].layer_number) - 1 if len(layers) else -1
    me = (ps.get_pipeline_model_parallel_rank(), first, len(layers))
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    stages = {s: (f, n) for s, f, n in comm.all_gather_object(me)}
    bounds = [stages[s][0] for s in range(pp)] + [stages[pp - 1][0] + stages[pp - 1][1]]
    layout = Layout.uniform(tp, pp, dp, cfg.num_layers, bounds)
    check_layout(layout)
    return layout


@dataclass
class _AdamView:
    """Adam state of the model parameters, wherever the Megatron optimizer keeps it."""

    torch_opts: list                      # the torch optimizers holding the state
    main: dict                            # model param -> fp32 main param (mixed precision)

    @property
    def param_groups(self) -> list[dict]:
        return [{"params": [p for g in o.param_groups for p in g["params"]]} for o in self.torch_opts]

    @property
    def state(self) -> "_ViewState":
        return _ViewState(self)


class _ViewState:
    def __init__(self, view: _AdamView):
        self.view = view

    def __getitem__(self, p: Any) -> Any:
        return self.get(p, {})

    def get(self, p: Any, default: Any = None) -> Any:
        q = self.view.main.get(p, p)
        for o in self.view.torch_opts:
            if q in o.state:
                return o.state[q]
        return default


def adam_view(optimizer: Any) -> Optional[_AdamView]:
    """The Adam state behind ``optimizer`` (None when there is none elastor can carry)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return _AdamView([optimizer], {})
    if "DistributedOptimizer" in type(optimizer).__name__:
        _warn_once("distopt", "elastor: the %s's state is not carried yet; the checkpoint holds weights only "
                   "and a resume starts Adam from zero", type(optimizer).__name__)
        return None
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is not None:
        views = [adam_view(o) for o in subs]
        if any(v is None for v in views):
            return None
        return _AdamView([o for v in views for o in v.torch_opts], {k: m for v in views for k, m in v.main.items()})
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return None  # a stub optimizer (no parameters on this rank) or an unknown wrapper
    main: dict = {}
    for mg, fg in zip(getattr(optimizer, "float16_groups", ()), getattr(optimizer, "fp32_from_float16_groups", ())):
        main.update(zip(mg, fg))
    return _AdamView([inner], main)


def _shards(chunk: Any, cfg: GPTSpecConfig, layout: Layout, rank: int, view: Optional[_AdamView],
            for_load: bool, with_main: bool):
    if view is not None and for_load:
        for o in view.torch_opts:
            ensure_adam_state(o)
    shards = gpt_shards(chunk, cfg, layout, rank, view, for_load=for_load)
    if view is not None and view.main and with_main:
        for spec, h, p in _plan(chunk, cfg, layout, rank):
            m = view.main.get(p)
            if m is not None:
                shards += shards_from_pieces(MAIN_PREFIX + spec.name, spec.shape, m.data, h.pieces)
    return shards


# ------------------------------------------------------------------ RNG
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"rng": capture_rng_state()}
    try:
        from megatron.core import tensor_parallel

        out["tracker"] = {k: _b64(v) for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except Exception as e:  # noqa: BLE001 - a tracker that cannot be read is logged, not fatal
        log.warning("elastor: megatron RNG tracker state not saved: %s", e)
    return out


def _restore_rng(st: Mapping[str, Any]) -> None:
    if "rng" in st:
        restore_rng_state(st["rng"])
    if st.get("tracker"):
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8).clone()
             for k, v in st["tracker"].items()})


# ------------------------------------------------------------------ save / load
def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float, args: Any, **_megatron_kwargs: Any) -> SaveStats:
    """Collective: save checkpoint ``iteration`` under ``args.save`` (Megatron-LM's signature + args)."""
    if not getattr(args, "save", None):
        raise ConfigError("--elastor: saving needs --save DIR")
    chunk = _one_chunk(model)
    cfg = spec_config_from_model(chunk, _true_vocab(args, chunk), int(getattr(args, "make_vocab_size_divisible_by", 128)))
    eng = _engine(args, args.save)
    layout = _layout(args, chunk, cfg, eng.comm)
    view = adam_view(optimizer)
    if view is not None and not all(o.state for o in view.torch_opts):
        _warn_once("nostate", "elastor: optimizer has no state yet (no step taken); saving weights only")
        view = None
    shards = _shards(chunk, cfg, layout, eng.comm.rank, view, for_load=False, with_main=True)
    extra = {
        "format": FORMAT, "iteration": int(iteration),
        "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far or 0),
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
        "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
        "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
        "optimizer_state": view is not None,
        "global_batch_size": getattr(args, "global_batch_size", None),
    }
    stats = eng.save(int(iteration), shards, extra=extra, rank_state=_rng_state(), model=cfg.to_json(),
                     layout=layout.to_json())
    if eng.comm.rank == 0:
        log.info("elastor: saving iteration %d under %s (%s, stall %.3fs%s)", iteration, eng.root,
                 layout.describe(), stats.stall_s, ", async" if eng.async_save else "")
    return stats


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, args: Any, load_arg: str = "load",
                    strict: bool = True, **_megatron_kwargs: Any) -> tuple[int, float]:
    """Collective: load the latest checkpoint under ``args.<load_arg>`` into this layout.

    Returns ``(iteration, num_floating_point_operations_so_far)`` like Megatron-LM; ``(0, 0)`` when
    there is no checkpoint (an error with ``--exit-on-missing-checkpoint``). Sets
    ``args.consumed_train_samples`` and friends, like Megatron-LM."""
    root = getattr(args, load_arg, None)
    if not root:
        return 0, 0
    finalize()  # a save of this process must be committed before it is read
    try:
        step_dir = commit_mod.resolve(root)
    except CheckpointNotFoundError:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise
        log.warning("elastor: no checkpoint under %s; starting from scratch", root)
        return 0, 0
    man = commit_mod.read_manifest(step_dir)
    chunk = _one_chunk(model)
    cfg = spec_config_from_model(chunk, _true_vocab(args, chunk), int(getattr(args, "make_vocab_size_divisible_by", 128)))
    eng = _engine(args, root)
    layout = _layout(args, chunk, cfg, eng.comm)
    finetune = bool(getattr(args, "finetune", False))
    view = None if finetune or getattr(args, "no_load_optim", False) else adam_view(optimizer)
    if view is not None and not man.extra.get("optimizer_state"):
        _warn_once("noopt", "elastor: checkpoint %s has no optimizer state; loading weights only", step_dir)
        view = None
    with_main = any(n.startswith(MAIN_PREFIX) for n in man.tensors)
    shards = _shards(chunk, cfg, layout, eng.comm.rank, view, for_load=True, with_main=with_main)
    step_t = next((s.tensor for s in shards if s.name == STEP_NAME), None)
    res = eng.load(step_dir, shards, strict=strict)
    if view is not None:
        if step_t is not None:
            _set_steps(view, step_t)  # type: ignore[arg-type]
        if view.main and not with_main:  # main params from the (lower precision) weights
            for p, m in view.main.items():
                m.data.copy_(p.data)
    ex = res.extra
    if ex.get("format") not in (None, FORMAT):
        raise ConfigError(f"{step_dir}: format {ex.get('format')!r}; this reader knows {FORMAT}")
    if finetune:
        return 0, 0
    for k in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(args, k, int(ex.get(k, 0)))
    _update_num_microbatches(args.consumed_train_samples)
    if view is not None and opt_param_scheduler is not None and ex.get("opt_param_scheduler") is not None:
        opt_param_scheduler.load_state_dict(ex["opt_param_scheduler"])
    saved = Layout.from_json(man.layout) if man.layout else None
    if saved is not None and saved.fingerprint() == layout.fingerprint() and res.rank_state \
            and not getattr(args, "no_load_rng", False):
        _restore_rng(res.rank_state)
    elif eng.comm.rank == 0:
        log.info("elastor: layout %s -> %s: RNG states start fresh", saved.describe() if saved else "?",
                 layout.describe())
    if eng.comm.rank == 0:
        log.info("elastor: loaded iteration %s from %s into %s", ex.get("iteration", res.step), step_dir,
                 layout.describe())
    return int(ex.get("iteration", res.step)), float(ex.get("num_floating_point_operations_so_far", 0))


def _update_num_microbatches(consumed: int) -> None:
    from megatron.core import num_microbatches_calculator as nmc

    if getattr(nmc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None:
        nmc.update_num_microbatches(consumed_samples=consumed, verbose=True)

