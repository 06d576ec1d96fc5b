"""Hooks that route Megatron-LM's own trainer (``pretrain_gpt.py``, ``megatron/training``) through
elastor: the functions the diffs in ``patches/`` call. Off unless ``--elastor`` is given; the
patches import this module only then, so an unflagged run never touches elastor.

The patches call, in order:
1. :func:`add_arguments` (pretrain_gpt.py's ``extra_args_provider``): ``--elastor``,
   ``--elastor-async/--no-elastor-async``, ``--elastor-keep N``, ``--elastor-plan auto|on-change|FILE``.
2. :func:`configure` (start of ``validate_args``): check the flags megatron-core must run with, and
   apply a plan (a FILE, or planned for the launched world by :mod:`.autoplan`): TP, PP and (uneven)
   stage boundaries as ``--pipeline-model-parallel-layout``.
3. :func:`check_parallel_state` (after ``mpu.initialize_model_parallel``): every rank sits where the
   layout says.
4. :func:`save_checkpoint` / :func:`load_checkpoint` (start of Megatron-LM's functions of the same
   name; same arguments and return value): one partition-agnostic checkpoint through
   :class:`CheckpointEngine`, loadable under any TP x PP x DP.
5. :func:`finalize` (blocking ``maybe_finalize_async_save``): wait for the in-flight async save.

What a checkpoint carries: the weights of every rank's model (true vocabulary rows: the tokenizer's
size); Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) when the optimizer is a torch optimizer
over the model parameters, Megatron's ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``
(plus its fp32 main parameters, as ``optimizer.fp32_param.<name>``), the ``DistributedOptimizer``
(each DP rank's contiguous range of every flattened parameter mapped to regions of the global
tensor, :func:`elastor_ds.layout.zero.flat_partition_pieces`) or a ``ChainedOptimizer`` of those;
the fp16 loss scaler; the LR scheduler (``opt_param_scheduler.state_dict()``), iteration,
consumed/skipped train samples, consumed valid samples, FLOPs so far; per-rank RNG (python, numpy,
torch, CUDA and megatron's RNG tracker), restored only when the layout is unchanged.

Loading follows Megatron-LM's own loader: ``--ckpt-step``, a newer non-persistent checkpoint,
``--pretrained-checkpoint`` as a fallback (fine-tuning), ``--finetune`` / ``--no-load-optim``
(weights only, then ``optimizer.reload_model_params()``), the scheduler unless those two, and a
warning when this run pads the vocabulary differently (:func:`check_padded_vocab`). A stock
Megatron checkpoint under ``--load`` is refused with the conversion command.

Not carried: virtual pipeline chunks, context and expert parallelism (rejected by
:func:`configure`), the precision-aware distributed optimizer.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import torch

from ...checkpoint import commit as commit_mod
from ...checkpoint.engine import LoadResult, SaveStats
from ...checkpoint.session import Collected, CheckpointSession
from ...checkpoint.settings import MAX_KEEP, MAX_STEPS, CheckpointConfig, MemorySnapshotConfig, parse_memory_snapshot
from ...checkpoint.shards import full_shard, shards_from_flat, shards_from_pieces
from ...checkpoint.state import capture_rng_state, restore_rng_state, scalar
from ... import errors
from ...errors import CheckpointError, CheckpointNotFoundError, ConfigError, LayoutError
from ...layout import Layout
from . import autoplan, overrides
from .model import spec_config_from_model
from .parallel import MEGATRON_ORDER, check_layout
from .specs import GPTSpecConfig
from .state import MOMENTS, STEP_NAME, _plan, _set_steps, ensure_adam_state, gpt_shards

log = logging.getLogger(__name__)

FORMAT = "megatron-lm/1"
MAIN_PREFIX = "optimizer.fp32_param."


# ------------------------------------------------------------------ flags and parallel init
# what a user must act on (errors.USER_ERRORS): exit 2 for a flag, plan or folder to change (as `elastor`'s CLI: the
# same on every relaunch), exit 1 for a checkpoint whose contents cannot be used; the message names the
# checkpoint and the fix
USER_ERRORS = errors.USER_ERRORS


def user_error_line(value: BaseException) -> Optional[tuple[str, int]]:
    """The one line (no newline) and exit code for a user error from :data:`USER_ERRORS`, else None
    (reads ``RANK`` only). A checkpoint error names its class (``CorruptCheckpointError: ...``)."""
    if not isinstance(value, USER_ERRORS):
        return None
    from ...checkpoint.paths import printable
    text = printable(" | ".join(x.strip() for x in str(value).splitlines() if x.strip()) or type(value).__name__)
    usage = isinstance(value, (ConfigError, CheckpointNotFoundError))
    kind = f"{type(value).__name__}: " if isinstance(value, CheckpointError) else ""   # gathered: the same name
    rank = os.environ.get("RANK")
    return f"elastor: error{f' (rank {rank})' if rank else ''}: {kind}{text}", 2 if usage else 1


def _one_line_user_errors() -> None:
    """Outside ``elastor run`` (torchrun, as docs/megatron-lm.md launches it): an uncaught user error
    (:data:`USER_ERRORS`: a flag, plan or folder the user must change, or a checkpoint whose contents
    cannot be used, e.g. a corrupt newest one under ``--no-elastor-fallback``) ends the process with
    one line on stderr (:func:`user_error_line`) and exit 2 (usage) or 1 (checkpoint), as ``elastor``'s
    CLI does, instead of a traceback through Megatron-LM's frames on every rank (torchrun still prints
    its own summary). Other exceptions keep the interpreter's hook. Installed once, by
    :func:`add_arguments` (the first hook Megatron-LM's patched code calls)."""
    from ...elastic.protocol import launch_context
    if launch_context().under_elastor_run or getattr(sys.excepthook, "_elastor", False):
        return
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        line = user_error_line(value)
        if line is not None:
            try:
                sys.stdout.flush()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
            # straight to fd 2: through sys.stderr the line was lost under Megatron-LM (QA round 7, Q7-2)
            os.write(2, f"{line[0]}\n".encode("utf-8", "replace"))
            os._exit(line[1])   # no teardown: a failed rank's peers may be gone (as worker_main's _exit_now)
        previous(kind, value, tb)
    hook._elastor = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _int_flag(flag: str, lo: int, hi: int, example: str) -> Any:
    """An argparse ``type`` for an integer flag in [lo, hi]: a value out of range is Megatron-LM's own
    usage error (``pretrain_gpt.py: error: argument FLAG: ...``, exit 2) naming the bound and a value
    to pass, on every rank before any process group exists."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; e.g. {flag} {example}") from None
        if v < lo or v > hi:
            raise argparse.ArgumentTypeError(f"{v}: must be {f'at least {lo}' if v < lo else f'at most {hi}'}; "
                                             f"e.g. {flag} {example}")
        return v
    parse.__name__ = "int"   # argparse names the type in its own messages
    return parse


def _plan_flag(text: str) -> str:
    """``--elastor-plan``: a mode or a path, never empty (``--elastor-plan "$PLAN"`` with PLAN unset
    would otherwise run without the plan the user meant)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: empty; pass auto, on-change or a plan file "
                                         f"(`elastor plan ... --homogeneous --json > plan.json`), or drop the flag")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--elastor*`` flags (an ``extra_args_provider`` for Megatron-LM's parse_args). Integer
    values are range-checked by argparse itself (Megatron-LM's usage error, exit 2); :func:`configure`
    checks them again for namespaces argparse did not make (``--yaml-cfg``)."""
    mem = {name: _int_flag(_mem_flag(name), lo, hi, example) for name, _key, lo, hi, example in _MEM_FLAGS
           if lo is not None}
    _one_line_user_errors()
    g = parser.add_argument_group("elastor", "elastic, partition-agnostic checkpoints (off by default)")
    g.add_argument("--elastor", action="store_true", default=False,
                   help="save/load checkpoints through elastor (loadable under any TP x PP x DP)")
    g.add_argument("--elastor-async", dest="elastor_async", action=argparse.BooleanOptionalAction,
                   default=CheckpointConfig.async_save,
                   help="write checkpoints in a background thread (default on)")
    g.add_argument("--elastor-keep", type=_int_flag("--elastor-keep", 1, MAX_KEEP, "2"),
                   default=CheckpointConfig.keep, metavar="N",
                   help=f"committed checkpoints to keep (default {CheckpointConfig.keep})")
    g.add_argument("--elastor-fallback", dest="elastor_fallback", action=argparse.BooleanOptionalAction,
                   default=CheckpointConfig.fallback_to_previous,
                   help="when the newest checkpoint is corrupt or incomplete, load the previous "
                        "committed one (default on)")
    g.add_argument("--elastor-plan", type=_plan_flag, default=None, metavar="auto|on-change|FILE",
                   help="sets TP, PP and the (uneven) pipeline stage boundaries: 'auto' plans the best TP x PP x DP "
                        "for the launched world; 'on-change' keeps the parallel-size flags on the world `elastor "
                        "run` first launched and plans (as auto) once it changed; FILE: a plan JSON "
                        "(`elastor plan ... --homogeneous --json`)")
    g.add_argument("--elastor-memory-snapshot-interval", type=mem["interval"], default=None, metavar="N",
                   help="also snapshot every N iterations into this node's memory (tmpfs: --elastor-memory-"
                        "snapshot-dir, default $ELASTOR_SNAPSHOT_DIR, which `elastor run` makes); a restart "
                        "restores from memory first, storage only for what no memory holds (needs --save)")
    g.add_argument("--elastor-memory-snapshot-peer-copies", type=mem["peer_copies"], default=None, metavar="K",
                   help="copies of each snapshot on other nodes (0 or 1; default 1)")
    g.add_argument("--elastor-memory-snapshot-peer-copy-interval", type=mem["peer_copy_interval"], default=None, metavar="N",
                   help="copy only every N-th iteration's snapshot to the next node (a multiple of the snapshot "
                        "interval; default: every snapshot)")
    g.add_argument("--elastor-memory-snapshot-keep", type=mem["keep"], default=None, metavar="K",
                   help="memory snapshots kept per node (default 1)")
    g.add_argument("--elastor-memory-snapshot-dir", default=None, metavar="DIR",
                   help="this node's snapshot directory, in memory (e.g. /dev/shm/<job>; one per node, private to "
                        "you); default $ELASTOR_SNAPSHOT_DIR (`elastor run` makes and exports one: leave this unset "
                        "under it)")
    return parser


def enabled(args: Any) -> bool:
    return bool(getattr(args, "elastor", False))


def plan_layout(args: Any) -> Optional[Layout]:
    """The layout of ``--elastor-plan`` (None without one, and under ``on-change`` while the world is
    the first one launched): the one :func:`configure` chose (``args.elastor_plan_layout``), else a
    FILE as written or ``auto`` / ``on-change`` planned (:mod:`.autoplan`)."""
    chosen = getattr(args, "elastor_plan_layout", None)
    if chosen is not None:
        return chosen
    path = getattr(args, "elastor_plan", None)
    if not path:
        return None
    if path in autoplan.MODES:
        world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
        if path == autoplan.ON_CHANGE and not autoplan.world_changed(world)[0]:
            return None
        return autoplan.auto_plan(args, world, honour_flags=path == autoplan.AUTO).layout
    if not os.path.isfile(path):
        raise ConfigError(f"--elastor-plan {path}: no such file; pass auto, on-change or a plan file (write one "
                          f"with `elastor plan ... --homogeneous --json > plan.json`)")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--elastor-plan {path}: not a readable plan JSON ({e})") from None
    lm = getattr(args, "language_model", None)  # --yaml-cfg keeps num_layers there
    try:
        return Layout.from_json(doc, getattr(args, "num_layers", None) or getattr(lm, "num_layers", None))
    except LayoutError as e:
        raise ConfigError(f"--elastor-plan {path}: {e}") from None


def pipeline_layout_string(boundaries: Sequence[int]) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for stage boundaries, e.g. ``Et|tttL``."""
    stages = ["t" * (b - a) for a, b in zip(boundaries, boundaries[1:])]
    return "E" + "|".join(stages) + "L"


def _parallel_ns(args: Any) -> Any:
    """Where the parallel sizes live: ``args`` (argparse) or ``args.model_parallel`` (--yaml-cfg)."""
    mp = getattr(args, "model_parallel", None)
    return mp if mp is not None and hasattr(mp, "tensor_model_parallel_size") else args


def configure(args: Any) -> Optional[Layout]:
    """Check the flags (start of ``validate_args`` / ``validate_yaml``) and apply ``--elastor-plan``;
    returns its layout (also kept as ``args.elastor_plan_layout``). A plan that contradicts an explicit
    ``--tensor/--pipeline-model-parallel-size`` or ``--pipeline-model-parallel-layout`` is an error,
    never silently overridden; the one exception is ``on-change`` after the world changed, whose
    flags describe the first world and are replaced (logged). A heterogeneous plan is refused."""
    keep = getattr(args, "elastor_keep", None)
    keep = CheckpointConfig.keep if keep is None else keep
    if not 1 <= keep <= MAX_KEEP:
        raise ConfigError(f"--elastor-keep {keep}: must be {'at least 1' if keep < 1 else f'at most {MAX_KEEP}'}; "
                          f"e.g. --elastor-keep 2")
    plan = getattr(args, "elastor_plan", None)
    if plan is not None and not str(plan).strip():
        raise ConfigError(f"--elastor-plan {plan!r}: empty; pass auto, on-change or a plan file "
                          f"(`elastor plan ... --homogeneous --json > plan.json`), or drop the flag")
    mem = memory_config(args)
    if mem is not None:
        if not getattr(args, "save", None):
            raise ConfigError("--elastor-memory-snapshot-interval needs --save DIR too (storage stays the durable "
                              "tier; --save-interval can be large)")
        _check_memory_dir(mem)
    mp = _parallel_ns(args)
    bad = [(f, v) for f, v in (("--context-parallel-size", getattr(mp, "context_parallel_size", 1)),
                               ("--expert-model-parallel-size", getattr(mp, "expert_model_parallel_size", 1)))
           if (v or 1) > 1]
    for f in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        if getattr(args, f, None) is not None or getattr(mp, f, None) is not None:
            bad.append(("--" + f.replace("_", "-"), getattr(args, f, None) or getattr(mp, f, None)))
    if getattr(args, "use_tp_pp_dp_mapping", False):
        bad.append(("--use-tp-pp-dp-mapping", True))
    if bad:
        raise ConfigError(f"--elastor supports TP x PP x DP grids in megatron-core's {MEGATRON_ORDER} order only; "
                          f"drop {', '.join(f'{f} {v}' for f, v in bad)} or run without --elastor")
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        raise ConfigError("--elastor with --non-persistent-ckpt-type local: elastor writes non-persistent "
                          "checkpoints globally; use --non-persistent-ckpt-type global or run without --elastor")
    layout = plan_layout(args)
    if layout is None:
        if getattr(args, "elastor_plan", None) == autoplan.ON_CHANGE:
            log.info("--elastor-plan on-change: the world is the one first launched; the parallel-size flags run")
        return None
    try:
        tp, pp, dp = layout.uniform_dims()
    except LayoutError as e:
        raise ConfigError(f"--elastor-plan {args.elastor_plan}: Megatron-LM runs one TP x PP for every replica "
                          f"(uneven layer splits allowed, through --pipeline-model-parallel-layout); this plan "
                          f"is heterogeneous ({e}). Write a homogeneous plan with `elastor plan ... --homogeneous "
                          f"--json > plan.json`, or use --elastor-plan auto") from None
    if len({r.micro_batches for r in layout.replicas}) > 1:
        raise ConfigError(f"--elastor-plan {args.elastor_plan}: its replicas run different micro-batch counts "
                          f"{[r.micro_batches for r in layout.replicas]}; Megatron-LM runs the same in every "
                          f"replica. Write a homogeneous plan with `elastor plan ... --homogeneous --json > "
                          f"plan.json`, or use --elastor-plan auto")
    replaces_flags = args.elastor_plan == autoplan.ON_CHANGE  # the flags describe the first world
    world = int(getattr(args, "world_size", layout.world_size))
    if layout.world_size != world:
        raise ConfigError(f"--elastor-plan needs {layout.world_size} processes (tp({tp}) * pp({pp}) * dp({dp})) "
                          f"but WORLD_SIZE={world}")
    for f in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, f, None) is None and getattr(mp, f, None) is None:
            continue
        if not replaces_flags:
            raise ConfigError(f"--elastor-plan sets the stage boundaries; drop --{f.replace('_', '-')}")
        log.info("--elastor-plan on-change: the world changed; the plan's stage boundaries replace --%s",
                 f.replace("_", "-"))
        for ns in {id(args): args, id(mp): mp}.values():
            if hasattr(ns, f):
                setattr(ns, f, None)
    for flag, attr, dim, want in (("--tensor-model-parallel-size", "tensor_model_parallel_size", "TP", tp),
                                  ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", "PP", pp)):
        have = int(getattr(mp, attr, 1) or 1)
        if have not in (1, want) and replaces_flags:
            log.info("--elastor-plan on-change: the world changed; the plan's %s=%d replaces %s %d", dim, want,
                     flag, have)
        elif have not in (1, want):
            raise ConfigError(f"--elastor-plan {args.elastor_plan} says {dim}={want} but "
                              f"{flag} {have} was given: drop {flag} (the plan sets it) or use a plan for it")
    bounds = layout.boundaries()
    want_layout = pipeline_layout_string(bounds) if pp > 1 and check_layout(layout).uneven else None
    have_layout = getattr(mp, "pipeline_model_parallel_layout", None) or getattr(args, "pipeline_model_parallel_layout", None)
    if have_layout is not None and str(have_layout) != str(want_layout) and not replaces_flags:
        raise ConfigError(f"--elastor-plan {args.elastor_plan} places the layers at stage boundaries {bounds} but "
                          f"--pipeline-model-parallel-layout {have_layout} was given: drop one of them")
    mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size = tp, pp
    if want_layout is not None or replaces_flags:
        mp.pipeline_model_parallel_layout = want_layout
    args.elastor_plan_layout = layout  # what check_parallel_state and the checkpoint hooks run under
    log.info("elastor plan %s: tp %d, pp %d, dp %d, stage boundaries %s", layout.describe(), tp, pp, dp, bounds)
    return layout


def check_parallel_state(args: Any) -> None:
    """After megatron's parallel init: this rank's (tp, dp, pp) is where the plan puts it."""
    from megatron.core import parallel_state as ps

    from ...elastic.protocol import expect_worker_hooks
    expect_worker_hooks()   # train() attaches them after the set-up: a stop request waits for it
    layout = plan_layout(args)
    if layout is None:
        return
    if not ps.model_parallel_is_initialized():
        raise LayoutError("--elastor-plan: megatron-core's model parallel state was not initialised (Megatron-LM "
                          "skips it when torch.cuda.device_count() is 0); cannot check the plan's placement")
    check_layout(layout)
    rank = torch.distributed.get_rank()
    pos = layout.position(rank)
    got = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    if got != (pos.tp_rank, pos.replica, pos.stage):
        raise LayoutError(f"rank {rank}: megatron-core placed it at (tp, dp, pp) = {got}, the elastor plan at "
                          f"{(pos.tp_rank, pos.replica, pos.stage)}")


# ------------------------------------------------------------------ session (comm + checkpoint sessions)
@dataclass
class _Registry:
    """This process's checkpoint sessions, one per storage root (``--save``, the non-persistent
    directory, a ``--load`` elsewhere); the one of ``--save`` carries the memory tier."""
    comm: Any = None
    policy_comm: Any = None
    sessions: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)


_S = _Registry()


def _timeout_s(args: Any) -> float:
    return 60.0 * float(getattr(args, "distributed_timeout_minutes", 10) or 10)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _comm(args: Any) -> Any:
    if _S.comm is None:
        from ...comm.collectives import LocalComm, TorchComm

        if _distributed():
            _S.comm = TorchComm.create(_timeout_s(args))
            _S.policy_comm = TorchComm.create(_timeout_s(args))
        else:
            _S.comm = _S.policy_comm = LocalComm()
    return _S.comm


# --elastor-memory-snapshot-NAME -> (MemorySnapshotConfig field, smallest, largest, an example value)
_MEM_FLAGS = (("interval", "interval_steps", 1, MAX_STEPS, "1 (a snapshot after every iteration)"),
              ("keep", "keep", 1, MAX_KEEP, "2"),
              ("peer_copies", "peer_copies", 0, 1, "1 (0: no copy on another node)"),
              ("peer_copy_interval", "peer_copy_interval_steps", 1, MAX_STEPS, "10 (every 10th iteration's snapshot)"),
              ("dir", "dir", None, None, "/dev/shm/<job>"))
_MEM_WHERE = "--elastor-memory-snapshot-*"


def _mem_flag(name: str) -> str:
    return "--elastor-memory-snapshot-" + name.replace("_", "-")


def memory_config(args: Any) -> Optional[MemorySnapshotConfig]:
    """``--elastor-memory-snapshot-*`` as the memory tier's settings (None: no snapshots). Errors
    name the flags: each value, then the flags together; the other flags without ``-interval`` are
    an error (they would be ignored: no snapshot is taken)."""
    given = {}
    for name, key, lo, hi, example in _MEM_FLAGS:
        v = getattr(args, "elastor_memory_snapshot_" + name, None)
        if v is not None:
            given[key] = _mem_value(_mem_flag(name), v, lo, hi, example)
    if "interval_steps" not in given:
        if given:
            shown = " ".join(f"{_mem_flag(n)} {getattr(args, 'elastor_memory_snapshot_' + n)}"
                             for n, k, *_ in _MEM_FLAGS if k in given)
            raise ConfigError(f"{shown} without --elastor-memory-snapshot-interval N: no memory snapshot is taken, so "
                              f"this does nothing; add --elastor-memory-snapshot-interval 1 (a snapshot after every "
                              f"iteration) or drop {'it' if len(given) == 1 else 'them'}")
        return None
    _check_mem_together(given)
    try:
        return parse_memory_snapshot(given, where=_MEM_WHERE)
    except ConfigError as e:   # a check of the settings' own not mirrored here: its keys as the flags
        msg = str(e)
        for name, key, *_ in _MEM_FLAGS:
            msg = msg.replace(f"{_MEM_WHERE}.{key}", _mem_flag(name))
        raise ConfigError(msg) from None


def _mem_value(flag: str, v: Any, lo: Optional[int], hi: Optional[int], example: str) -> Any:
    """One ``--elastor-memory-snapshot-*`` value, checked: an integer in [lo, hi], or a directory."""
    if lo is None:   # the directory: as the settings check it (a path alone, not the root), named by its flag
        p = os.path.expanduser(str(v))
        if not p or p != p.strip() or any(ord(c) < 32 or ord(c) == 127 for c in p):
            raise ConfigError(f"{flag} {v!r}: empty, or surrounding spaces or control characters; write the path "
                              f"alone, e.g. {flag} {example}")
        if os.path.normpath(os.path.abspath(p)) == os.sep:
            raise ConfigError(f"{flag} {v}: the root directory; name a directory of its own, e.g. {flag} {example}")
        return p
    if v < lo or v > hi:   # type=int: argparse refused what is not an integer
        bound = f"at least {lo}" if v < lo else f"at most {hi}"
        raise ConfigError(f"{flag} {v}: must be {bound}; e.g. {flag} {example}")
    return v


def _check_mem_together(given: Mapping[str, Any]) -> None:
    """The flags against each other: the copy interval is a multiple of the snapshot interval, and with
    peer copies ``keep`` holds every snapshot between two copies (the default follows by itself)."""
    snap, every, keep = given["interval_steps"], given.get("peer_copy_interval_steps"), given.get("keep")
    if every is not None and every % snap:
        raise ConfigError(f"--elastor-memory-snapshot-peer-copy-interval {every}: not a multiple of "
                          f"--elastor-memory-snapshot-interval {snap} (only snapshots are copied); use e.g. "
                          f"{snap * max(1, round(every / snap))}")
    if keep is None or given.get("peer_copies", MemorySnapshotConfig.peer_copies) == 0:
        return
    need = MemorySnapshotConfig(interval_steps=snap, peer_copy_interval_steps=every).keep_for_copies()
    if keep < need:
        raise ConfigError(f"--elastor-memory-snapshot-keep {keep}: with a peer copy every {every} iterations and a "
                          f"snapshot every {snap}, a node must keep {need} so that the newest copied step is still in "
                          f"its own memory when another node is lost; pass --elastor-memory-snapshot-keep {need}, or "
                          f"drop it (the default follows the copy interval)")


def _check_memory_dir(mem: MemorySnapshotConfig) -> None:
    """The node directory of the snapshots, at start-up: ``--elastor-memory-snapshot-dir`` checked (and
    made, 0700) as ``elastor run`` checks its own, else one ``elastor run`` (or the user) exported."""
    from ...checkpoint.private_dir import ensure_private_dir
    from ...elastic.protocol import ENV_SNAPSHOT_DIR, launch_context
    if mem.dir:
        ensure_private_dir(mem.dir, "--elastor-memory-snapshot-dir")
    elif not launch_context().snapshot_dir:
        raise ConfigError(f"--elastor-memory-snapshot-interval {mem.interval_steps}: no node directory for the "
                          f"snapshots; launch with `elastor run` (it makes one on /dev/shm), or pass "
                          f"--elastor-memory-snapshot-dir /dev/shm/<job> (or export "
                          f"{ENV_SNAPSHOT_DIR}=/dev/shm/<job>): one directory per node, in memory")


def session(args: Any, root: str, keep: Optional[int] = None, model: Any = None, optimizer: Any = None,
            scheduler: Any = None) -> CheckpointSession:
    """Collective on first use of ``root``: the checkpoint session writing under ``root`` (its state
    bound to ``model``/``optimizer``/``scheduler`` when given: the memory tier sizes its budget from them)."""
    key = os.path.abspath(root)
    sess = _S.sessions.get(key)
    if sess is None:
        comm = _comm(args)
        keep = int(keep or getattr(args, "elastor_keep", None) or CheckpointConfig.keep)
        cfg = CheckpointConfig(dir=key, keep=keep,
                               async_save=bool(getattr(args, "elastor_async", CheckpointConfig.async_save)),
                               fallback_to_previous=bool(getattr(args, "elastor_fallback",
                                                                 CheckpointConfig.fallback_to_previous)),
                               timeout_s=_timeout_s(args))
        mem = None
        if getattr(args, "save", None) and key == os.path.abspath(args.save):
            mem = memory_config(args)
        memory_comm = None
        if mem is not None and _distributed():
            from ...comm.collectives import TorchComm
            memory_comm = TorchComm.create(_timeout_s(args))
        state = MegatronState(args, comm)
        if model is not None:
            state.bind(args, model, optimizer, scheduler)
        sess = CheckpointSession(state, cfg, mem, comm=comm, policy_comm=_S.policy_comm,
                                 memory_comm=memory_comm, cross_node=_distributed(),
                                 dir_setting="--save" if key == os.path.abspath(getattr(args, "save", None) or "//") else "--load")
        _S.sessions[key] = sess
    return sess


def restore_record(args: Any) -> Optional[dict]:
    """The restore record (tier, step, bytes per source, seconds) of this launch's load, from the
    session of ``--load`` (else ``--save``); None when nothing was loaded."""
    for root in (getattr(args, "load", None), getattr(args, "save", None)):
        sess = _S.sessions.get(os.path.abspath(root)) if root else None
        if sess is not None and sess.restore:
            return dict(sess.restore)
    return None


def finalize() -> Optional[SaveStats]:
    """Wait for every in-flight save and snapshot (raises AsyncSaveError if one failed). Call before exiting."""
    last = None
    for sess in _S.sessions.values():
        last = sess.finalize() or last
    return last


def reset() -> None:
    """Forget the sessions and comm (after finalize; for tests and in-process restarts)."""
    _S.comm, _S.policy_comm, _S.sessions, _S.warned = None, None, {}, set()


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
    """The unpadded vocabulary: what Megatron pads from, i.e. the tokenizer's ``vocab_size``
    (NullTokenizer: ``--vocab-size`` + 1 for EOD). ``--vocab-size`` only when there is no tokenizer."""
    try:
        from megatron.training.global_vars import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - no tokenizer built (tests, tools): fall back below
        pass
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    _warn_once("vocab", "elastor: true vocabulary size unknown (no tokenizer, no --vocab-size); saving the "
               "padded vocabulary %d, so a resume at another TP degree may fail", int(chunk.vocab_size))
    return int(chunk.vocab_size)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: a multiple of ``divisible_by * tp``."""
    m = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-int(vocab) // m) * m


def vocab_divisor_fix(vocab: int, padded: int, tps: Sequence[int]) -> Optional[int]:
    """The largest ``--make-vocab-size-divisible-by`` that pads ``vocab`` to ``padded`` under every TP
    degree in ``tps`` (None if there is none)."""
    for d in range(padded, 0, -1):
        if padded % d == 0 and all(padded_vocab(vocab, d, t) == padded for t in tps):
            return d
    return None


def check_padded_vocab(saved_model: Mapping[str, Any], saved_tp: int, vocab: int, divisible_by: int,
                       tp: int) -> Optional[str]:
    """A warning when this run pads the vocabulary differently from the run that saved (None if same).

    The checkpoint holds the true rows only; extra padding rows are zero-filled here and enter the
    softmax, so the loss of a resumed run differs. The fix is a divisor giving the same padded size."""
    old_div = int(saved_model.get("make_vocab_size_divisible_by", divisible_by) or divisible_by)
    old = padded_vocab(vocab, old_div, saved_tp)
    new = padded_vocab(vocab, divisible_by, tp)
    if old == new:
        return None
    fix = vocab_divisor_fix(vocab, old, sorted({saved_tp, tp, 1}))
    how = (f"relaunch with --make-vocab-size-divisible-by {fix} (pads {vocab} to {old} under TP "
           f"{sorted({saved_tp, tp, 1})}; choose it so that divisor x TP divides {old} for every TP you will use)"
           if fix else f"no divisor gives {old} rows at TP {tp}; keep TP {saved_tp} or accept a changed loss")
    return (f"elastor: the checkpoint was trained with a padded vocabulary of {old} rows (vocab {vocab}, "
            f"--make-vocab-size-divisible-by {old_div} x TP {saved_tp}); this run pads to {new} (divisible-by "
            f"{divisible_by} x TP {tp}): the {abs(new - old)} extra zero rows change the softmax and the loss. "
            f"Fix: {how}")


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
class _Flat:
    """A DistributedOptimizer's part of one model parameter: elements ``[start, end)`` of the
    flattened (TP-local) parameter; ``key`` is the tensor Adam keeps state for (the fp32 main shard
    of a 16-bit parameter, else a view of the fp32 parameter); ``main`` is that fp32 main shard."""

    key: Any
    main: Optional[Any]
    start: int
    end: int


@dataclass
class _AdamView:
    """Adam state of the model parameters, wherever the Megatron optimizer keeps it."""

    torch_opts: list                      # the torch optimizers holding the state
    main: dict                            # model param -> fp32 main param (mixed precision)
    flat: dict = field(default_factory=dict)  # model param -> _Flat (distributed optimizer)

    @property
    def param_groups(self) -> list[dict]:
        return [{"params": [p for g in o.param_groups for p in g["params"]]} for o in self.torch_opts]

    @property
    def state(self) -> "_ViewState":
        return _ViewState(self)

    def has_state(self) -> bool:
        return all(o.state for o in self.torch_opts if any(g["params"] for g in o.param_groups))


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


def sub_optimizers(optimizer: Any) -> list:
    """The optimizers inside a Megatron ChainedOptimizer (or ``[optimizer]``)."""
    if optimizer is None:
        return []
    subs = getattr(optimizer, "chained_optimizers", None)
    return list(subs) if subs is not None else [optimizer]


def _distributed_view(optimizer: Any) -> Optional[_AdamView]:
    inner = getattr(optimizer, "optimizer", None)
    need = ("model_float16_groups", "shard_fp32_from_float16_groups", "model_fp32_groups", "shard_fp32_groups",
            "_get_model_param_range_map")
    missing = [n for n in need if not hasattr(optimizer, n)]
    if missing or not isinstance(inner, torch.optim.Optimizer):
        _warn_once("distopt", "elastor: %s has no %s (a Megatron version this integration does not know); its "
                   "state is not carried", type(optimizer).__name__, missing or "torch optimizer")
        return None
    flat: dict = {}
    for groups, mains, is16 in ((optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups, True),
                                (optimizer.model_fp32_groups, optimizer.shard_fp32_groups, False)):
        for mg, sg in zip(groups, mains):
            for p, shard in zip(mg, sg):
                if shard is None:
                    _warn_once("distopt-prec", "elastor: precision-aware distributed optimizer keeps its main "
                               "params inside the fused optimizer; its state is not carried")
                    return None
                r = overrides.param_range(optimizer, p)
                flat[p] = _Flat(shard, shard if is16 else None, int(r.start), int(r.end))
    return _AdamView([inner], {}, flat)


def adam_view(optimizer: Any) -> Optional[_AdamView]:
    """The Adam state behind ``optimizer`` (None when there is none elastor can carry)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return _AdamView([optimizer], {})
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is not None:
        views = [adam_view(o) for o in subs]
        views = [v for v, o in zip(views, subs) if not (v is None and getattr(o, "is_stub_optimizer", False))]
        if not views or any(v is None for v in views):
            return None
        return _AdamView([o for v in views for o in v.torch_opts], {k: m for v in views for k, m in v.main.items()},
                         {k: f for v in views for k, f in v.flat.items()})
    if "DistributedOptimizer" in type(optimizer).__name__:
        return _distributed_view(optimizer)
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return None  # a stub optimizer (no parameters on this rank) or an unknown wrapper
    main: dict = {}
    for mg, fg in zip(getattr(optimizer, "float16_groups", ()), getattr(optimizer, "fp32_from_float16_groups", ())):
        main.update(zip(mg, fg))
    return _AdamView([inner], main)


def _flat_state_shards(plan: list, view: _AdamView, for_load: bool, with_main: bool) -> list:
    """Adam moments (and fp32 main shards) of a distributed optimizer: each rank's contiguous range
    of each flattened parameter mapped to regions of the global tensors (elastor_ds.layout.zero)."""
    shards: list = []
    step_t = None
    for spec, h, p in plan:
        f = view.flat.get(p)
        if f is None or f.end <= f.start:
            continue
        st = view.state.get(f.key)
        if not st:
            raise ConfigError(f"distributed optimizer has no state for {spec.name}: take one step first")
        for m in MOMENTS:
            if for_load:
                st[m].zero_()
            shards += shards_from_flat([f"optimizer.{m}.{spec.name}"], [spec.shape], [tuple(p.shape)], [h.pieces],
                                       st[m].view(-1), f.start, f.end)
        if f.main is not None and with_main:
            shards += shards_from_flat([MAIN_PREFIX + spec.name], [spec.shape], [tuple(p.shape)], [h.pieces],
                                       f.main.data.view(-1), f.start, f.end)
        if step_t is None and "step" in st:
            step_t = st["step"] if torch.is_tensor(st["step"]) else torch.tensor(float(st["step"]))
    if step_t is not None:
        shards.append(full_shard(STEP_NAME, step_t.float().reshape(()) if step_t.dtype != torch.float32
                                 else step_t.reshape(())))
    return shards


def _shards(chunk: Any, cfg: GPTSpecConfig, layout: Layout, rank: int, view: Optional[_AdamView],
            for_load: bool, with_main: bool):
    if view is not None and for_load:
        for o in view.torch_opts:
            ensure_adam_state(o)
    if view is not None and view.flat:
        shards = gpt_shards(chunk, cfg, layout, rank, None, for_load=for_load)
        return shards + _flat_state_shards(_plan(chunk, cfg, layout, rank), view, for_load, with_main)
    shards = gpt_shards(chunk, cfg, layout, rank, view, for_load=for_load)
    if view is not None and view.main and with_main:
        for spec, h, p in _plan(chunk, cfg, layout, rank):
            m = view.main.get(p)
            if m is not None:
                shards += shards_from_pieces(MAIN_PREFIX + spec.name, spec.shape, m.data, h.pieces)
    return shards


def _adam_hparams(view: Optional[_AdamView]) -> Optional[dict]:
    """Adam's betas / eps / amsgrad (a legacy export writes them: torch's Adam takes them from the state)."""
    for o in (view.torch_opts if view is not None else []):
        for g in o.param_groups:
            if "betas" in g and "eps" in g:
                return {"betas": [float(b) for b in g["betas"]], "eps": float(g["eps"]),
                        "amsgrad": bool(g.get("amsgrad", False))}
    return None


def _scaler_states(optimizer: Any) -> Optional[list]:
    """fp16 loss scaler state of every (chained) optimizer, JSON-safe (None when no scaler)."""
    out = []
    for o in sub_optimizers(optimizer):
        sc = getattr(o, "grad_scaler", None)
        if sc is None or not hasattr(sc, "state_dict"):
            out.append(None)
            continue
        # a CUDA scale stays a tensor here: the engine reads it off the training thread (no sync per snapshot)
        out.append({k: (scalar(v) if torch.is_tensor(v) else v) for k, v in sc.state_dict().items()})
    return out if any(x is not None for x in out) else None


def _load_scalers(optimizer: Any, states: Optional[list]) -> None:
    if not states:
        return
    subs = sub_optimizers(optimizer)
    for o, st in zip(subs, states):
        sc = getattr(o, "grad_scaler", None)
        if sc is None or st is None:
            continue
        sc.load_state_dict({k: (torch.tensor(v, dtype=torch.float32) if k == "scale" else v) for k, v in st.items()})


def _reload_main_params(optimizer: Any) -> None:
    """fp32 main params from the (just loaded) model weights, like Megatron-LM when it does not load
    optimizer state; without it the first step writes the fresh-init main params back."""
    fn = getattr(optimizer, "reload_model_params", None)
    if fn is not None:
        fn()


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
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's default place for non-persistent global saves


def _non_persistent_root(args: Any, base: Optional[str]) -> Optional[str]:
    if getattr(args, "non_persistent_ckpt_type", None) != "global":
        return None
    d = getattr(args, "non_persistent_global_ckpt_dir", None)
    return d or (os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None)


def _cfg(args: Any, chunk: Any) -> GPTSpecConfig:
    return spec_config_from_model(chunk, _true_vocab(args, chunk), int(getattr(args, "make_vocab_size_divisible_by", 128)))


class MegatronState:
    """The :class:`~elastor_ds.checkpoint.session.TrainerState` of Megatron-LM's own trainer. Megatron
    passes its model, optimizer and scheduler to every hook call; :meth:`bind` keeps the current ones
    (and the iteration) for the session's next save, snapshot or load."""

    def __init__(self, args: Any, comm: Any):
        self.args = args
        self.comm = comm
        self.model = self.optimizer = self.scheduler = None
        self.iteration = 0
        self.flops = 0.0
        self.non_persistent = False
        self._layout: Optional[Layout] = None
        self.loaded: dict[str, Any] = {}   # what the last load found (see restore)
        self.load_opts: dict[str, Any] = {}   # per load: no_optim, strict
        self._chosen: dict[str, Any] = {}
        self._state_everywhere: Any = None   # the optimizer every rank was seen to hold Adam state for

    def bind(self, args: Any, model: Any, optimizer: Any, scheduler: Any, iteration: Optional[int] = None,
             flops: Optional[float] = None, non_persistent: bool = False) -> "MegatronState":
        if model is not self.model or args is not self.args:
            self._layout = None
        self.args = args
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        if iteration is not None:
            self.iteration = int(iteration)
        if flops is not None:
            self.flops = float(flops or 0)
        self.non_persistent = bool(non_persistent)
        return self

    # -------------------------------------------------------------- TrainerState
    def step(self) -> int:
        return self.iteration

    def _chunk_cfg(self) -> tuple[Any, GPTSpecConfig]:
        chunk = _one_chunk(self.model)
        return chunk, _cfg(self.args, chunk)

    def layout(self) -> Layout:
        if self._layout is None:
            chunk, cfg = self._chunk_cfg()
            self._layout = _layout(self.args, chunk, cfg, self.comm)
        return self._layout

    def fence_optimizer(self) -> Any:
        return None   # Megatron's optimizers have no step pre-hooks: snapshots wait for their copies

    def snapshot_bytes(self, comm: Any) -> int:
        """Bytes this rank writes per snapshot, before the optimizer has state: its model shards
        (fp32 Adam adds two moments, a separate fp32 main copy a third, per element)."""
        chunk, cfg = self._chunk_cfg()
        shards = _shards(chunk, cfg, self.layout(), comm.rank, None, for_load=False, with_main=False)
        model_bytes = sum(sh.tensor.numel() * sh.tensor.element_size() for sh in shards)
        elems = sum(sh.tensor.numel() for sh in shards)
        extra = (3 if any(sh.tensor.element_size() < 4 for sh in shards) else 2) * 4 * elems
        return model_bytes + (extra if self.optimizer is not None else 0)

    def collect(self) -> Collected:
        args, optimizer = self.args, self.optimizer
        chunk, cfg = self._chunk_cfg()
        view = adam_view(optimizer)
        if view is not None and not view.has_state():
            _warn_once("nostate", "elastor: optimizer has no state yet (no step taken); saving weights only")
            view = None
        # every rank must agree (a DistributedOptimizer rank may own no element of a parameter); asked
        # until every rank has state: Adam state, once there, stays (no collective per snapshot after that)
        if self._state_everywhere is not optimizer:   # the same answer on every rank: all ask, or none does
            if all(self.comm.all_gather_object(view is not None)):
                self._state_everywhere = optimizer
            else:
                view = None
        shards = _shards(chunk, cfg, self.layout(), self.comm.rank, view, for_load=False, with_main=True)
        sched = self.scheduler
        extra = {
            "format": FORMAT, "iteration": int(self.iteration),
            "num_floating_point_operations_so_far": float(self.flops or 0),
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
            "opt_param_scheduler": sched.state_dict() if sched is not None else None,
            "optimizer_state": view is not None,
            "grad_scaler": _scaler_states(optimizer),
            "adam": _adam_hparams(view),
            "global_batch_size": getattr(args, "global_batch_size", None),
            "non_persistent": bool(self.non_persistent),
        }
        return Collected(shards=shards, extra=extra, rank_state=_rng_state(), model=cfg.to_json())

    def for_storage(self, got: Collected) -> Collected:
        """Megatron-LM's ``--no-save-optim`` (no optimizer state, no scheduler) and ``--no-save-rng``
        (no RNG states) for the checkpoints under ``--save``; memory snapshots keep everything, since a
        recovery resumes training."""
        args = self.args
        no_optim, no_rng = bool(getattr(args, "no_save_optim", False)), bool(getattr(args, "no_save_rng", False))
        if not (no_optim or no_rng):
            return got
        shards, extra = got.shards, got.extra
        if no_optim:
            shards = [sh for sh in shards if not sh.name.startswith("optimizer.")]
            extra = dict(extra, optimizer_state=False, opt_param_scheduler=None, grad_scaler=None)
        return replace(got, shards=shards, extra=extra, rank_state={} if no_rng else got.rank_state)

    def shards_for(self, m: Any) -> list:
        """This rank's shards for the checkpoint the engine loads (no collectives: runs per candidate)."""
        chunk, cfg = self._chunk_cfg()
        v = self.load_opts.get("view")
        if v is not None and not m.extra.get("optimizer_state"):
            _warn_once("noopt", "elastor: checkpoint of step %s has no optimizer state; loading weights only", m.step)
            v = None
        wm = any(n.startswith(MAIN_PREFIX) for n in m.tensors)
        shards = _shards(chunk, cfg, self.layout(), self.comm.rank, v, for_load=True, with_main=wm)
        self._chosen = dict(view=v, with_main=wm, step_t=next((s.tensor for s in shards if s.name == STEP_NAME), None))
        return shards

    def restore(self, res: LoadResult, same_layout: bool) -> None:
        """Megatron-LM's loader's bookkeeping after the tensors are in: Adam steps, main params,
        loss scalers; then (unless fine-tuning) consumed samples, the scheduler, RNG."""
        ex, man = res.extra, res.manifest
        if ex.get("format") not in (None, FORMAT):
            raise ConfigError(f"{res.step_dir}: format {ex.get('format')!r}; this reader knows {FORMAT}")
        optimizer = self.optimizer
        view, with_main, step_t = (self._chosen.get(k) for k in ("view", "with_main", "step_t"))
        if view is not None:
            if step_t is not None:
                _set_steps(view, step_t)  # type: ignore[arg-type]
            if not with_main:  # main params from the (lower precision) weights
                _reload_main_params(optimizer)
            _load_scalers(optimizer, ex.get("grad_scaler"))
        elif optimizer is not None:
            _reload_main_params(optimizer)
        self._restore_counters(ex, res.rank_state, same_layout)
        self.iteration = int(ex.get("iteration", man.step))
        self.flops = float(ex.get("num_floating_point_operations_so_far", 0))

    def _restore_counters(self, ex: Mapping[str, Any], rank_state: Any, same_layout: bool) -> None:
        args = self.args
        if self.load_opts.get("finetune"):
            return
        for k in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
            setattr(args, k, int(ex.get(k, 0)))
        _update_num_microbatches(args.consumed_train_samples)
        # like Megatron-LM: the scheduler comes back unless --finetune / --no-load-optim, whether or not
        # the optimizer state itself could be loaded
        if not self.load_opts.get("no_optim") and self.scheduler is not None and \
                ex.get("opt_param_scheduler") is not None:
            self.scheduler.load_state_dict(ex["opt_param_scheduler"])
        if same_layout and rank_state and not getattr(args, "no_load_rng", False):
            _restore_rng(rank_state)


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float, args: Any, non_persistent_ckpt: bool = False,
                    **_megatron_kwargs: Any) -> SaveStats:
    """Collective: save checkpoint ``iteration`` under ``args.save`` (Megatron-LM's signature + args).

    ``non_persistent_ckpt`` (Megatron's ``--non-persistent-save-interval``) goes to
    ``--non-persistent-global-ckpt-dir`` (default ``SAVE/non_persistent``), keeping only the newest
    one, so it never pushes persistent checkpoints out of ``--elastor-keep``."""
    if not getattr(args, "save", None):
        raise ConfigError("--elastor: saving needs --save DIR")
    root = args.save
    keep = None
    if non_persistent_ckpt:
        root = _non_persistent_root(args, args.save)
        if root is None:
            raise ConfigError("--elastor: a non-persistent save needs --non-persistent-ckpt-type global "
                              "(elastor does not write 'local' non-persistent checkpoints)")
        keep = 1
    sess = session(args, root, keep, model, optimizer, opt_param_scheduler)
    sess.state.bind(args, model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
                    non_persistent=non_persistent_ckpt)
    stats = sess.save()
    if sess.comm.rank == 0:
        log.info("elastor: saving %siteration %d under %s (%s, stall %.3fs%s)",
                 "non-persistent " if non_persistent_ckpt else "", iteration, sess.ckpt.root,
                 sess.layout.describe(), stats.stall_s, ", async" if sess.ckpt.async_save else "")
    return stats


def after_iteration(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float, args: Any) -> Optional[SaveStats]:
    """End of iteration ``iteration`` (collective, every rank): a memory snapshot when one is due
    (``--elastor-memory-snapshot-interval``). Storage saves stay Megatron-LM's (``--save-interval``)."""
    if memory_config(args) is None or not getattr(args, "save", None):
        return None
    sess = session(args, args.save, None, model, optimizer, opt_param_scheduler)
    sess.state.bind(args, model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far)
    return sess.maybe_save()


def stock_megatron_checkpoint(root: str) -> Optional[str]:
    """What marks ``root`` as a stock Megatron-LM checkpoint directory (None if it is not one)."""
    if not root or not os.path.isdir(root):
        return None
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        return os.path.basename(tracker)
    iters = sorted(n for n in os.listdir(root) if n.startswith("iter_") or n == "release")
    return iters[-1] if iters else None


def _stock_error(root: str, mark: str, load_arg: str) -> ConfigError:
    return ConfigError(
        f"--{load_arg.replace('_', '-')} {root} holds a stock Megatron checkpoint ({mark}), not an elastor one; "
        f"elastor will not silently start over from scratch. Convert it once with `elastor convert {root} "
        f"NEW_DIR --from megatron` and pass --{load_arg.replace('_', '-')} NEW_DIR (use --no-load-optim "
        f"--no-load-rng if the conversion reports weights only), or drop --elastor to resume with "
        f"Megatron-LM's own loader")


def _step_of(step_dir: str) -> int:
    """The step of a committed step dir, from its name (the manifest is read once, by the engine)."""
    name = os.path.basename(step_dir.rstrip("/"))
    return int(name[len("step_"):]) if name.startswith("step_") and name[len("step_"):].isdigit() else -1


def _find_step(root: str, args: Any, load_arg: str) -> Optional[str]:
    """The committed step dir to load from ``root`` (None: nothing there). Honours ``--ckpt-step``
    and a newer non-persistent checkpoint; refuses a stock Megatron checkpoint directory."""
    step = getattr(args, "ckpt_step", None)
    if step is not None:
        dirs = dict(commit_mod.list_committed(root))
        if int(step) not in dirs:
            mark = stock_megatron_checkpoint(root)
            if mark and not dirs:
                raise _stock_error(root, mark, load_arg)
            raise ConfigError(f"--ckpt-step {step}: {root} has no committed elastor checkpoint of that iteration "
                              f"(it has {sorted(dirs) or 'none'})")
        return dirs[int(step)]
    found = []
    for r in (root, _non_persistent_root(args, root) if load_arg == "load" else None):
        if not r:
            continue
        try:
            d = commit_mod.resolve(r)
        except CheckpointNotFoundError:
            continue
        found.append((_step_of(d), r != root, d))
    if found:
        return max(found)[2]
    mark = stock_megatron_checkpoint(root)
    if mark:
        raise _stock_error(root, mark, load_arg)
    return None


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, args: Any, load_arg: str = "load",
                    strict: bool = True, skip_load_to_model_and_opt: bool = False,
                    **_megatron_kwargs: Any) -> tuple[int, float]:
    """Collective: load the latest checkpoint under ``args.<load_arg>`` into this layout.

    Returns ``(iteration, num_floating_point_operations_so_far)`` like Megatron-LM; ``(0, 0)`` when
    there is no checkpoint (an error with ``--exit-on-missing-checkpoint``). Sets
    ``args.consumed_train_samples`` and friends, like Megatron-LM. Like Megatron-LM it falls back to
    ``--pretrained-checkpoint`` (as ``--finetune``) when ``--load`` holds nothing, honours
    ``--ckpt-step``, ``--finetune``, ``--no-load-optim``, ``--no-load-rng`` and
    ``skip_load_to_model_and_opt`` (read the metadata only).

    With memory snapshots (``--elastor-memory-snapshot-interval``, ``--load`` = ``--save``): the
    newest committed step across this node's memory and storage wins (memory on a tie; see
    :class:`~elastor_ds.checkpoint.session.CheckpointSession`), and a step restored from memory that
    storage lacks is saved to storage right away (in the background)."""
    root = getattr(args, load_arg, None)
    finalize()  # a save of this process must be committed before it is read
    finetune = bool(getattr(args, "finetune", False))
    no_optim = finetune or bool(getattr(args, "no_load_optim", False))
    mem_res = _load_memory(model, optimizer, opt_param_scheduler, args, load_arg, root, strict, no_optim,
                           skip_load_to_model_and_opt)
    if mem_res is not None:
        return mem_res
    step_dir = _find_step(root, args, load_arg) if root else None
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if step_dir is None and pretrained and load_arg == "load":
        step_dir = _find_step(pretrained, args, "pretrained_checkpoint")
        if step_dir is None:
            raise CheckpointNotFoundError(f"no checkpoint under --load {root} nor --pretrained-checkpoint "
                                          f"{pretrained}")
        log.info("elastor: nothing under --load %s; fine-tuning from --pretrained-checkpoint %s", root, step_dir)
        args.finetune = True
        finetune = no_optim = True
    if step_dir is None:
        if not root:
            return 0, 0
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise CheckpointNotFoundError(f"--exit-on-missing-checkpoint: no elastor checkpoint under {root}")
        log.warning("elastor: no checkpoint under %s; starting from scratch", root)
        return 0, 0
    np_root = _non_persistent_root(args, root)
    from_np = bool(np_root) and os.path.abspath(os.path.dirname(step_dir)) == os.path.abspath(np_root)
    sess = session(args, os.path.dirname(step_dir), 1 if from_np else None, model, optimizer,
                   opt_param_scheduler)  # the same session later saves there
    state: MegatronState = sess.state
    state.bind(args, model, optimizer, opt_param_scheduler)
    # the engine resolves and reads the manifest once (past unusable ones with --elastor-fallback);
    # --ckpt-step pins one step: no fallback then
    fallback = bool(getattr(args, "elastor_fallback", CheckpointConfig.fallback_to_previous)) and getattr(args, "ckpt_step", None) is None
    opened = sess.ckpt.open(step_dir, fallback=fallback)
    man = opened.manifest
    if man.extra.get("format") not in (None, FORMAT):
        raise ConfigError(f"{opened.step_dir}: format {man.extra.get('format')!r}; this reader knows {FORMAT}")
    layout = state.layout()
    saved = Layout.from_json(man.layout) if man.layout else None
    if skip_load_to_model_and_opt:
        state.load_opts = {"finetune": finetune, "no_optim": no_optim}
        if finetune:
            return 0, 0
        state._restore_counters(man.extra, None, same_layout=False)
        return int(man.extra.get("iteration", man.step)), float(man.extra.get("num_floating_point_operations_so_far", 0))
    if man.model and saved is not None and sess.comm.rank == 0:
        c = _cfg(args, _one_chunk(model))
        msg = check_padded_vocab(man.model, saved.uniform_dims()[0] if _uniform(saved) else 1, c.vocab_size,
                                 c.make_vocab_size_divisible_by, layout.uniform_dims()[0])
        if msg:
            log.warning(msg)
    _prepare_load(state, sess, optimizer, finetune, no_optim)
    res = sess.ckpt.load(opened, state.shards_for, strict=strict)
    sess.resumed(res, "storage", durable_step=res.step)
    if finetune:
        return 0, 0
    if sess.comm.rank == 0:
        log.info("elastor: loaded iteration %s from %s into %s", state.iteration, res.step_dir, layout.describe())
    return state.iteration, state.flops


def _prepare_load(state: "MegatronState", sess: CheckpointSession, optimizer: Any, finetune: bool,
                  no_optim: bool) -> None:
    want = None if no_optim else adam_view(optimizer)
    if not all(sess.comm.all_gather_object(want is not None)):
        want = None
    state.load_opts = {"view": want, "finetune": finetune, "no_optim": no_optim}


def _load_memory(model: Any, optimizer: Any, opt_param_scheduler: Any, args: Any, load_arg: str,
                 root: Optional[str], strict: bool, no_optim: bool, skip: bool) -> Optional[tuple[int, float]]:
    """The memory tier's half of a load: only for a plain resume of ``--save`` (``--load`` = ``--save``,
    no ``--ckpt-step``, no fine-tuning, tensors wanted). None: load from storage as usual."""
    if (memory_config(args) is None or load_arg != "load" or skip or not root or not getattr(args, "save", None)
            or os.path.abspath(root) != os.path.abspath(args.save) or getattr(args, "ckpt_step", None) is not None
            or getattr(args, "finetune", False)):
        return None
    sess = session(args, args.save, None, model, optimizer, opt_param_scheduler)
    state: MegatronState = sess.state
    state.bind(args, model, optimizer, opt_param_scheduler)
    _prepare_load(state, sess, optimizer, False, no_optim)
    storage_root = sess.resolve("latest")
    res = sess.load_memory(storage_root)
    if res is None:
        return None
    if sess.last_save_step != res.step:   # storage lacks the restored step: make it durable (background)
        sess.save()
    if sess.comm.rank == 0:
        log.info("elastor: restored iteration %s from memory (%s) into %s", state.iteration, res.step_dir,
                 sess.layout.describe())
    return state.iteration, state.flops


def _uniform(layout: Layout) -> bool:
    try:
        layout.uniform_dims()
        return True
    except LayoutError:
        return False


def _update_num_microbatches(consumed: int) -> None:
    from megatron.core import num_microbatches_calculator as nmc

    if overrides.microbatches_calculator_ready():
        nmc.update_num_microbatches(consumed_samples=consumed, verbose=True)

