"""The trainer's side of ``elastor run``: heartbeat, graceful stop, start-up marks, the launched world.

A trainer launched by ``elastor run`` (through :mod:`worker_main`) does, per iteration::

    ctl = ElasticWorker.from_env()          # None when not launched by ``elastor run``
    ...
    ctl.heartbeat(iteration, last=iteration == train_iters)   # cheap: rewrites one small file
    code = ctl.agree_stop()                 # one all-reduce (MAX) of the local stop request
    if code: save this iteration, wait until durable, return code.exit_code()

Signals (installed by :mod:`worker_main` before the trainer's imports, so a stop requested during
start-up is not lost): SIGTERM and SIGINT request ``PREEMPT``, SIGUSR1 requests ``RESIZE``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import time

from .events import EventKind, append_line
from .protocol import (STARTED_BEAT, LaunchContext, StopCode, expect_worker_hooks, heartbeat_path, launch_context,
                       resize_marker, worker_hooks_expected)

log = logging.getLogger(__name__)

_requested = StopCode.NONE
_agreed = StopCode.NONE      # what the ranks agreed on (set by ElasticWorker.agree_stop)
_PR_SET_PDEATHSIG = 1


NO_HOOKS_RESIZE = "elastor worker: no hooks: relaunching without a checkpoint\n"


def _on_signal(signum: int, _frame) -> None:
    global _requested
    if not worker_hooks_expected() and signum in (signal.SIGTERM, signal.SIGINT):
        # a script without elastor's hooks (or before it attaches them) never reads the request: end
        # it as the signal would, as torchrun's workers end, instead of waiting for --shutdown-timeout
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not worker_hooks_expected() and signum == signal.SIGUSR1:
        # a resize (scale-up, another node joining) of a script that cannot checkpoint on request:
        # leave now with the resize code (the relaunch is not a failure) instead of running on until
        # --shutdown-timeout's SIGKILL; it resumes from its own newest checkpoint, if it keeps any
        from .protocol import EXIT_RESIZE
        try:
            os.write(2, NO_HOOKS_RESIZE.encode())
        except OSError:
            pass
        os._exit(EXIT_RESIZE)
    code = StopCode.RESIZE if signum == signal.SIGUSR1 else StopCode.PREEMPT
    _requested = max(_requested, code)


def install_signal_handlers() -> None:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, _on_signal)


def requested() -> StopCode:
    return StopCode(_requested)


def agreed() -> StopCode:
    return StopCode(_agreed)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Die with the controller: a SIGKILLed agent must not leave workers behind (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() == 1:   # the parent died before prctl took effect
        os._exit(1)


class ElasticWorker:
    """Per-process hooks; every method is cheap except :meth:`agree_stop` (one tiny all-reduce)."""

    def __init__(self, heartbeat_dir: str | None, events_file: str | None, local_rank: int,
                 context: LaunchContext | None = None):
        expect_worker_hooks()   # this process reads stop requests (agree_stop): a signal no longer ends it
        ctx = launch_context() if context is None else context
        self.context = ctx
        self.heartbeat_file = heartbeat_path(heartbeat_dir, local_rank) if heartbeat_dir else None
        self.events_file = events_file
        self.local_rank = local_rank
        self.marks: dict[str, float] = ctx.start_marks()
        self.launch_mode = ctx.launch_mode.value
        self.world = ctx.launched_world
        self.round = ctx.round
        self._beat(f"{STARTED_BEAT} {time.time():.3f}\n")   # --startup-timeout runs from here

    @classmethod
    def from_env(cls) -> "ElasticWorker | None":
        ctx = launch_context()
        if not ctx.under_elastor_run:
            return None
        return cls(ctx.heartbeat_dir, ctx.events_file, int(os.environ.get("LOCAL_RANK", "0")), ctx)

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def heartbeat(self, iteration: int, last: bool = False) -> None:
        """``iteration`` done; ``last``: it was the run's final one (the controller then forks no more
        standby workers: the job is finishing)."""
        self._beat(f"{int(iteration)} {time.time():.3f}{' last' if last else ''}\n")

    def _beat(self, text: str, path: str | None = None) -> None:
        path = path or self.heartbeat_file
        if not path:
            return
        tmp = f"{path}.tmp"
        line = text.encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o600)   # never through a link: the folder is ours alone, but check
        except OSError as e:
            log.warning("heartbeat file %s not written (%s)", tmp, e)
            return
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def agree_stop(self) -> StopCode:
        """The largest stop code requested on any rank (collective: every rank calls it each iteration)."""
        global _agreed
        import torch
        import torch.distributed as dist
        local = int(requested())
        if not (dist.is_available() and dist.is_initialized()):
            _agreed = StopCode(local)
            self._mark_resize()
            return _agreed
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([local], dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        _agreed = StopCode(int(t.item()))
        self._mark_resize()
        return _agreed

    def _mark_resize(self) -> None:
        """The ranks agreed on a resize: say so beside the heartbeat, so that the controller tells the
        exit code 75 that follows from a script's own (which it charges to --max-restarts)."""
        if _agreed is StopCode.RESIZE and self.heartbeat_file:
            self._beat(f"{time.time():.3f}\n", resize_marker(self.heartbeat_file))

    def report_started(self, rank: int, **fields) -> None:
        """Rank 0 appends a ``worker_started`` event (start-up marks, resumed step, layout, world);
        local rank 0 of every node tells the node's standby pool which modules a worker imports."""
        if self.local_rank == 0:
            write_module_list(self.context.standby_dir)
        if rank != 0 or not self.events_file:
            return
        rec = {"event": EventKind.WORKER_STARTED.value, "time": time.time(), "node": "workers", "round": self.round,
               "launch_mode": self.launch_mode, **self.marks, **fields}
        try:
            append_line(self.events_file, rec)
        except (OSError, ValueError) as e:  # events are a report, never a reason to stop training (ConfigError
            # is a ValueError: the file swapped for one that is not ours)
            log.warning("could not append to the events file %s: %s", self.events_file, e)


def _library_dirs() -> tuple[str, ...]:
    import site
    import sysconfig
    dirs = {sysconfig.get_paths().get("purelib", ""), sysconfig.get_paths().get("platlib", "")}
    dirs |= set(getattr(site, "getsitepackages", lambda: [])())
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # elastor_ds itself
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs | {pkg} if d)


def write_module_list(folder: str | None) -> None:
    """Write the installed-library modules this process imported (in import order) to
    ``folder/modules.json``: the next standby workers import them before they are needed. The
    trainer's own modules (its script folder) are left out: they run as the trainer imports them."""
    if not folder:
        return
    import json
    import sys
    roots = _library_dirs()
    names = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if name.startswith("__") or not isinstance(f, str) or not os.path.abspath(f).startswith(roots):
            continue
        names.append(name)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".modules.{os.getpid()}.tmp")
        with open(tmp, "w") as fh:
            json.dump(names, fh)
        os.replace(tmp, os.path.join(folder, "modules.json"))
    except OSError as e:  # a report for the next launch, never a reason to stop training
        log.warning("could not write the standby module list to %s: %s", folder, e)
