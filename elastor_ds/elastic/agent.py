"""``elastor run``'s agent: torch.distributed.elastic's ``LocalElasticAgent`` (c10d rendezvous,
worker groups, per-rank logs) with elastor's run loop.

The loop (``_invoke_run``), every ``monitor_interval``:

1. Operator requests: SIGTERM/SIGINT -> forward SIGTERM to the workers (they save the current
   iteration durably and exit 0); SIGUSR1 (devices are back) -> SIGUSR1 to the workers (they save
   and exit ``EXIT_RESIZE``), then relaunch on the larger world. A second SIGINT kills at once.
2. Observe each worker: exit code, signal, heartbeat age (``--hang-timeout``), SIGSTOP state.
3. Failure: SIGKILL the rest of the local group at once (survivors of a lost peer cannot save
   anyway; waiting for a SIGTERM grace period only delays recovery), ask :mod:`policy` which
   devices to use (probing GPUs for ``probe``), then set ``spec.local_world_size`` and run a new
   rendezvous + start; or stop with the policy's reason.
4. All exited ``EXIT_RESIZE``: relaunch (scale-up, or another node changed the membership).
   All exited 0: done (after the exit barrier with the other nodes).
5. Another node waiting in the rendezvous while ours are healthy: ask ours to stop gracefully.
6. Multi-node: every ``keep_alive_interval`` read the other nodes' liveness counters
   (:mod:`liveness`). A node silent for ``keep_alive_interval`` x ``keep_alive_max_attempt`` is lost
   (a power cut or a cut cable sends no reset: the workers would block in gloo): as 3, cause
   ``node_lost``. A controller that cannot reach the round's store for that bound minus one
   interval kills its own workers at once (fenced) and leaves the job with exit code 1.

Each relaunch exports the launched world to the workers (``ELASTOR_PROCS_PER_NODE`` read from the
round's store, where every agent published its local size). Every step is an event record.

Workers come from :mod:`standby` (interpreters that did their imports while the previous round
trained) unless ``--no-standby``; the rendezvous, ranks, environment and logs stay torch's.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from . import overrides
from . import probe as probe_mod
from ..checkpoint.snapshot.server import NodeSnapshots
from .events import EventKind, EventLog
from .ledger import FailureLedger
from .liveness import Beacon, LivenessConfig, PeerBook, bounded, read_peers
from .private import private_dir
from .policy import Action, DeviceBook, OnFailure, WorkerOutcome, decide_after_failure, decide_scale_up, settle
from .rdzv_auth import rendezvous_key, signed_handler
from .store_auth import Purpose, SealedStore, StoreAuth
from ..checkpoint.paths import printable
from .protocol import (ENV_COLLECTIVE_TIMEOUT, ENV_DEVICES, ENV_EVENTS_FILE, ENV_GPU_MEMORY_GB, ENV_HEARTBEAT_DIR,
                       ENV_INITIAL_WORLD, ENV_PROCS_PER_NODE, ENV_PYTHON, ENV_ROUND, ENV_SNAPSHOT_DIR,
                       ENV_SNAPSHOT_SERVER_HOST, EXIT_RESIZE, STARTED_BEAT, collective_bound, heartbeat_path,
                       resize_marker)
from .standby import StandbyAgentMixin, StandbyPool
from .standby_main import DEFAULT_PRELOAD

log = logging.getLogger("elastor.run")
__all__ = ["ElastorAgent", "RendezvousError", "RunConfig", "build_agent", "node_name", "store_lost_reason",
           "store_unreachable"]


def register_stack_dump() -> None:
    """SIGUSR2 makes ``elastor run`` write every thread's stack to its stderr and carry on (to see
    where a controller that stopped reacting waits: a rendezvous call, a store, a worker)."""
    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)


@dataclass
class RunConfig:
    script: str
    script_args: list[str]
    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_id: str = "none"
    rdzv_conf: dict = field(default_factory=dict)
    max_restarts: int = 3
    monitor_interval: float = 0.1
    on_failure: OnFailure = OnFailure.SHRINK
    hang_timeout: float | None = None
    startup_timeout: float | None = None   # from a worker's hooks attaching to its first heartbeat (None: off)
    events: str | None = None
    log_dir: str = "elastor_logs"
    shutdown_timeout: float = 120.0
    exit_barrier_timeout: float = 300.0
    gpu_memory_gb: float | None = None
    probe_timeout: float = 60.0
    probe_interval: float = 60.0
    use_gpu: bool = False
    node_name: str = ""
    tee: bool = True
    standby: bool = True                 # workers from pre-imported standby interpreters (--no-standby: off)
    standby_preload: tuple[str, ...] = DEFAULT_PRELOAD
    standby_fork: bool = True            # standbys forked from one template per node (--no-standby-fork: off)
    job_secret_file: str | None = None   # --job-secret-file: the key of the snapshot server and peer copies
    local_addr: str | None = None        # this node's address (torchrun's --local-addr)


class _PreemptedInRendezvous(Exception):
    """A stop signal while waiting in the rendezvous, or before this launch's workers were started:
    no worker runs, nothing to checkpoint."""

    def __init__(self, during: str = "rendezvous"):
        super().__init__(during)
        self.during = during    # "rendezvous" | "start"


class _Stopping:
    def __init__(self, kind: str, deadline: float, devices: tuple[int, ...] = ()):
        self.kind = kind            # "preempt" | "scale_up" | "membership"
        self.deadline = deadline
        self.devices = devices      # devices to add back after the stop (scale-up)
        self.t0 = time.monotonic()


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


_PF_EXITING = 0x4          # a task's flags (/proc/PID/stat field 9): it has begun to exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)
ERROR_TAIL_BYTES = 64 * 1024   # of a failed worker's stderr log read for its last error line


def _proc_exiting(pid: int) -> bool:
    """The OS shows ``pid`` (our child, not reaped) on its way out: a SIGKILL pending, its exit
    begun, or a zombie (possibly a group leader whose other threads still exit). A killed worker
    closes its sockets inside its exit, so its peers can fail on them and be reaped before it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            pending = [int(ln.split()[1], 16) for ln in f if ln.startswith(("SigPnd:", "ShdPnd:"))]
        return any(p & _SIGKILL_BIT for p in pending)
    except (OSError, IndexError, ValueError):
        return False


class ElastorAgent(StandbyAgentMixin, LocalElasticAgent):
    def __init__(self, spec: WorkerSpec, cfg: RunConfig, events: EventLog, book: DeviceBook,
                 logs_specs: DefaultLogsSpecs, store_auth: StoreAuth | None = None):
        super().__init__(spec, logs_specs=logs_specs, start_method="spawn",
                         exit_barrier_timeout=cfg.exit_barrier_timeout, shutdown_timeout=int(cfg.shutdown_timeout))
        self.cfg, self.events, self.book = cfg, events, book
        # `nohup elastor run ...`: the hang-up is ignored on purpose (a closed terminal must not stop
        # training); read before torch's process context or our own handlers replace it
        self._hup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        # torch's process context installs its own terminate handler, at every start, for the signals
        # this names (SIGTERM, SIGINT, SIGHUP and SIGQUIT by default): until ours were put back, a stop
        # while workers started (the standby template importing: seconds) exited 1 with no record, and
        # SIGQUIT never came back. Only SIGPWR (whose default is to terminate anyway) is left to it
        os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGPWR" if hasattr(signal, "SIGPWR") else "SIGTERM")
        self._unrequested_resizes = 0   # relaunches after an EXIT_RESIZE no rank had agreed on (count as restarts)
        # elastor's values in the store (ledger, beats, snapshot servers) sealed with the job key (None: unsigned)
        self.store_auth = store_auth
        self._rdzv_round = ""   # the rendezvous round of the current worker group (bound into sealed values)
        self.ledger = FailureLedger(cfg.node_name, auth=store_auth)
        self.round = 0
        self.restarts_used = 0
        self.initial_world: int | None = None
        self.procs_per_node: list[int] = []
        self.devices: tuple[int, ...] = ()
        self.exit_code = 0
        self.message = ""
        self.preempted = False   # stopped cleanly by a stop signal (exit_code 128 + it)
        self._preempt = False
        self._preempt_signum = 0   # the first stop signal: a preempted job exits 128 + it
        self.stopped_early = None   # callable: the stop signal that came before these handlers were installed, or 0
        self._force = False
        self._scale_up = False
        self._stopping: _Stopping | None = None
        self._stop_at_start = False   # the stop signal came before this launch's workers had been started
        self._in_rendezvous = False
        self._last_probe = time.monotonic()
        self._hb_dir = os.path.join(cfg.log_dir, "heartbeat")
        self._visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")   # before we narrow it per launch
        self._visible = [x for x in (self._visible_env or "").split(",") if x.strip()]
        # liveness of the other nodes of a round (multi-node only) and this node's self-fencing
        self.liveness = LivenessConfig.from_rdzv_conf(cfg.rdzv_conf) if cfg.max_nodes > 1 else None
        self.beacon = Beacon(self.liveness, self._fence, auth=store_auth) if self.liveness else None
        self._peer_book: PeerBook | None = None
        self._peer_ranks: list[int] = []
        self._next_peer_read = 0.0
        self._fence_reason = ""
        if cfg.local_addr and not os.environ.get(ENV_SNAPSHOT_SERVER_HOST):
            os.environ[ENV_SNAPSHOT_SERVER_HOST] = cfg.local_addr
        # this node's snapshot server; addresses of every node's go to the workers at each launch
        self.snapshots = NodeSnapshots(os.environ.get(ENV_SNAPSHOT_DIR), cfg.rdzv_endpoint.split(",")[0],
                                       multi_node=cfg.max_nodes > 1, secret_file=cfg.job_secret_file)

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGUSR1:
            self._scale_up = True
            return
        if self._preempt and signum == signal.SIGINT:
            self._force = True
        self._preempt = True
        self._preempt_signum = self._preempt_signum or signum
        if self._in_rendezvous:   # the rendezvous may wait minutes for other nodes: leave now
            raise _PreemptedInRendezvous()

    def install_signal_handlers(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(s, signal.SIG_IGN if s == signal.SIGHUP and self._hup_ignored else self._on_signal)
        register_stack_dump()

    # ------------------------------------------------------------------ torch elastic hooks
    def _rendezvous(self, worker_group) -> None:
        self._in_rendezvous = True
        try:
            if self._preempt:
                raise _PreemptedInRendezvous()
            super()._rendezvous(worker_group)
        finally:
            self._in_rendezvous = False

    def _assign_worker_ranks(self, store, group_rank, group_world_size, spec):
        workers = super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        self.procs_per_node = overrides.local_world_sizes(store, group_world_size)
        # the round's number: its store's key prefix, bound into every sealed value of the round
        self._rdzv_round = str(overrides.rendezvous_round(spec.rdzv_handler))
        auth = self.store_auth
        self.snapshots.publish(store if auth is None else SealedStore(
            store, auth, Purpose.SNAPSHOT_SERVER, self._rdzv_round, "read as a node without a snapshot server"),
            group_rank, group_world_size)
        if self.beacon is not None:
            self.beacon.retarget(store, group_rank, self._rdzv_round)
            self._peer_book = PeerBook(self.liveness.timeout)
            self._peer_ranks = [r for r in range(group_world_size) if r != group_rank]
            self._next_peer_read = 0.0
        return workers

    def _start_workers(self, worker_group):
        n = worker_group.spec.local_world_size
        self.devices = self.book.usable[:n]
        world = sum(self.procs_per_node) or n
        if self.initial_world is None:
            self.initial_world = world
        hb = os.path.join(self._hb_dir, f"round{self.round}")
        private_dir(self._hb_dir, "heartbeat folder")   # 0700, ours, checked: workers write files there
        private_dir(hb, "heartbeat folder")
        env = {ENV_PROCS_PER_NODE: ",".join(map(str, self.procs_per_node or [n])),
               ENV_INITIAL_WORLD: str(self.initial_world), ENV_ROUND: str(self.round), ENV_HEARTBEAT_DIR: hb,
               ENV_DEVICES: ",".join(map(str, self.devices)), **self.snapshots.env()}
        if self.cfg.events:
            env[ENV_EVENTS_FILE] = os.path.abspath(self.cfg.events)
        if self.cfg.gpu_memory_gb:
            env[ENV_GPU_MEMORY_GB] = str(self.cfg.gpu_memory_gb)
        if self.cfg.hang_timeout:   # the workers' own backstop; the controller's hang detection acts first
            env[ENV_COLLECTIVE_TIMEOUT] = f"{collective_bound(self.cfg.hang_timeout):g}"
        if self.cfg.use_gpu:
            ids = [self._visible[d] if d < len(self._visible) else str(d) for d in self.devices]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        os.environ.update(env)
        # torch names the per-rank log folder attempt_<TORCHELASTIC_RESTART_COUNT> (max_restarts minus
        # its remaining restarts, which this loop never spends): one folder per launch, not one for all
        self._remaining_restarts = worker_group.spec.max_restarts - self.round
        if self._preempt:   # the stop came after the rendezvous, before the workers: start none
            raise _PreemptedInRendezvous("start")
        pids = super()._start_workers(worker_group)
        self.install_signal_handlers()   # the process context installed torch's own handlers
        # a stop that came while they were being started (the first start waits seconds for the standby
        # template's imports): they had not begun; one ending on it before attaching hooks lost nothing
        self._stop_at_start = self._preempt
        self.events.emit(EventKind.LAUNCH, round=self.round, world_size=world, procs_per_node=self.procs_per_node,
                         node_rank=worker_group.group_rank, local_world_size=n, devices=list(self.devices),
                         global_ranks=[w.global_rank for w in worker_group.workers], pids=list(pids.values()),
                         launch_modes=self.launch_modes())
        log.info("round %d: %d worker(s) on devices %s; world %d = %s per node", self.round, n, list(self.devices),
                 world, self.procs_per_node)
        self.round += 1
        return pids

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        self.install_signal_handlers()
        try:
            early = self.stopped_early() if self.stopped_early is not None else 0
            if early:   # while the CLI set up
                self._preempt = True
                self._preempt_signum = self._preempt_signum or int(early)
                raise _PreemptedInRendezvous()
            if self.standby is not None:   # the first launch's workers import while the rendezvous runs
                self.standby.fill()
            return self._invoke_run(role)
        except _PreemptedInRendezvous as e:
            where = "waiting in the rendezvous" if e.during == "rendezvous" else "starting the workers"
            self.events.emit(EventKind.PREEMPTED, stop_s=0.0, during=e.during)
            log.warning("preempted while %s: no worker was running, nothing to checkpoint", where)
            self._preempted(f"preempted while {where} (no worker was running, nothing to checkpoint); rerun to resume")
            return self._result(True)
        finally:
            if self.beacon is not None:
                self.beacon.silence()
            self._shutdown(signal.SIGKILL, timeout=5)
            self.snapshots.close()
            self.close_standby()

    # ------------------------------------------------------------------ helpers
    def _handlers(self) -> dict:
        return dict(getattr(self._pcontext, "subprocess_handlers", {}) or {})

    def _signal_workers(self, sig: int) -> None:
        for h in self._handlers().values():
            if h.proc.poll() is None:
                try:
                    os.kill(h.proc.pid, sig)
                except ProcessLookupError:
                    pass

    def _kill_all(self) -> float:
        """SIGKILL every live worker (and its process group); returns seconds until all are reaped."""
        t0 = time.monotonic()
        hs = self._handlers()
        for h in hs.values():
            if h.proc.poll() is None:
                _sigkill(h.proc.pid)
        for h in hs.values():
            try:
                h.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - best effort; close() below escalates
                pass
        self._close_context()
        return time.monotonic() - t0

    def _close_context(self) -> None:
        if self._pcontext is not None:
            self._pcontext.close(signal.SIGKILL, 2)
            self._pcontext = None

    def _heartbeat(self, local_rank: int) -> tuple[float | None, int | None]:
        t, it, _ = self._heartbeat_record(local_rank)
        return t, it

    def _heartbeat_record(self, local_rank: int) -> tuple[float | None, int | None, bool]:
        """(time, iteration, whether it was the run's last) of a worker's newest heartbeat; a worker
        that attached its hooks and has done no iteration yet: (time it attached, None, False)."""
        path = heartbeat_path(os.path.join(self._hb_dir, f"round{self.round - 1}"), local_rank)
        try:
            st = os.stat(path)
            with open(path) as f:
                words = f.read(256).split()
            if words[:1] == [STARTED_BEAT]:
                return st.st_mtime, None, False
            return st.st_mtime, int(words[0]), words[2:3] == ["last"]
        except (OSError, ValueError, IndexError):
            return None, None, False

    def _resize_agreed(self) -> bool:
        """Some worker of this round agreed on a resize (``ElasticWorker.agree_stop``): its ranks were
        asked for one, here or on another node."""
        hb = os.path.join(self._hb_dir, f"round{self.round - 1}")
        return any(os.path.exists(resize_marker(heartbeat_path(hb, lr))) for lr in self._handlers())

    def _restarts_counted(self) -> int:
        """Failure relaunches of the job plus this node's relaunches after an unrequested EXIT_RESIZE."""
        return self.restarts_used + self._unrequested_resizes

    def _fence(self, silent_s: float) -> None:
        """Watchdog thread: this node has not reached the round's store for ``silent_s`` s. Kill the
        workers now (before the other nodes can declare this one lost and start a round without it)."""
        self._fence_reason = (f"this node lost contact with the rendezvous store at {self.cfg.rdzv_endpoint} for "
                              f"{silent_s:.1f} s (> {self.liveness.fence_after:g} s = keep_alive_interval x "
                              f"keep_alive_max_attempt - keep_alive_interval): it was fenced out of the job (its "
                              f"workers were killed, it commits nothing); the other nodes go on without it. Check "
                              f"its network, then start it again to rejoin")
        log.error("%s", self._fence_reason)
        for h in self._handlers().values():
            _sigkill(h.proc.pid)
        self.events.emit(EventKind.FENCED, silent_s=silent_s, fence_after_s=self.liveness.fence_after)

    def _lost_peers(self, now: float) -> list[int]:
        """Node ranks of this round that have been silent past the liveness timeout (read every interval)."""
        if self._peer_book is None or not self._peer_ranks or now < self._next_peer_read:
            return []
        self._next_peer_read = now + self.liveness.interval
        store = self._worker_group.store
        return self._bounded(lambda: read_peers(store, self._peer_book, self._peer_ranks, now, self.store_auth,
                                                self._rdzv_round), "liveness read")

    def _bounded(self, fn, what: str):
        """A store call of the monitor loop: at most the store's read timeout, less once fenced."""
        if self.liveness is None:
            return fn()
        return bounded(fn, float(self.cfg.rdzv_conf.get("read_timeout", 60)), what,
                       give_up=lambda: self.beacon.fenced)

    def _store_lost(self, err: Exception) -> RunResult:
        """A store call of the monitor loop failed (after the store's read timeout): stop, exit 1."""
        self._kill_all()
        reason = self._fence_reason or store_lost_reason(self.cfg, err, "its workers were killed")
        return self._stop_job(reason)

    def _observe(self, wg) -> list[WorkerOutcome]:
        rows = []
        now = time.time()
        handlers = sorted(self._handlers().items())
        check = self._stopping is None and bool(self.cfg.hang_timeout or self.cfg.startup_timeout)
        beats = {lr: self._heartbeat_record(lr) for lr, _ in handlers} if check else {}
        for lr, h in handlers:
            rc = h.proc.poll()
            hung = stopped = False
            if rc is None and check:
                t_hb, it, last = beats[lr]
                # a worker whose newest beat was its run's last iteration is not timed: what it does
                # next (a final save, an evaluation, finalize, waiting for the others to finish) has no
                # heartbeat. Judged on its own beat, not on the others': one rank can finish long before
                # another still training (which is timed as before), and a rank that exited, with or
                # without a heartbeat, says nothing about the rest. A collective stuck after the last
                # beat still ends the workers through their own collective timeout
                # (ELASTOR_COLLECTIVE_TIMEOUT_S where the trainer applies it); an exit or a signal is
                # still a failure. Before its first iteration a worker has --startup-timeout from
                # attaching its hooks; without a heartbeat record (no hooks) it is never timed
                limit = None if last else self.cfg.hang_timeout if it is not None else self.cfg.startup_timeout
                if t_hb is not None and limit and now - t_hb > limit:
                    hung = True
                    stopped = _proc_state(h.proc.pid) in ("T", "t")
            rows.append([lr, h, rc, hung, stopped])
        if any(r[3] for r in rows):
            # a hang: every rank waits on every other, so whichever beat last is a few ms apart; a
            # stopped worker is hung whatever its last beat (it cannot move, the others wait on it)
            for r in rows:
                if r[2] is None and not r[3] and _proc_state(r[1].proc.pid) in ("T", "t"):
                    r[3] = r[4] = True
        # a worker failed: those still running may be on their way out (killed: see policy.settle)
        failing = any(r[2] not in (None, 0, EXIT_RESIZE) for r in rows)
        outs = []
        for lr, h, rc, hung, stopped in rows:
            dev = self.devices[lr] if lr < len(self.devices) else lr
            outs.append(WorkerOutcome(local_rank=lr, device=dev, global_rank=wg.workers[lr].global_rank, exitcode=rc,
                                      hung=hung, stopped=stopped, stop_signalled=self._stopping is not None,
                                      exiting=failing and rc is None and _proc_exiting(h.proc.pid)))
        return outs

    def _worker_error(self, local_rank: int) -> str:
        """The last error line of a worker's stderr log, if any."""
        errs = getattr(self._pcontext, "stderrs", {}) or {}
        path = errs.get(local_rank)
        if not path or not os.path.exists(path):
            return ""
        with open(path, "rb") as f:   # its tail only: a worker may have written gigabytes
            f.seek(max(0, os.fstat(f.fileno()).st_size - ERROR_TAIL_BYTES))
            text = f.read(ERROR_TAIL_BYTES).decode("utf-8", errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        hits = [ln for ln in lines if "error" in ln.lower()]
        # the worker's text goes into the stop reason, the log and the terminal: escapes shown, not run
        return printable((hits or lines or [""])[-1][:500])

    def _launch(self) -> None:
        wg = self._worker_group
        wg.spec.local_world_size = len(self.book.usable)
        self._stopping = None
        self.events.emit(EventKind.RENDEZVOUS, round=self.round, local_world_size=wg.spec.local_world_size)
        self._initialize_workers(wg)

    def _result(self, ok: bool) -> RunResult:
        return RunResult(state=WorkerState.SUCCEEDED if ok else WorkerState.FAILED)

    def _preempted(self, message: str) -> None:
        """A stop signal ended the job before it finished (the state saved, or nothing started): exit
        128 + the signal (143 for SIGTERM), as a process ended by it, so that ``elastor run ... &&
        next_step`` and a scheduler do not take the unfinished job for a finished one."""
        self.preempted = True
        self.exit_code = 128 + (self._preempt_signum or signal.SIGTERM)
        self.message = message

    def _stop_job(self, reason: str, code: int = 1) -> RunResult:
        self.exit_code, self.message = code, reason
        self.events.emit(EventKind.STOPPED, reason=reason, exit_code=code)
        log.error("%s", reason)
        return self._result(False)

    def _returning_devices(self) -> tuple[int, ...]:
        """Lost devices that may be used again: all of them on the operator's word (CPU), those that pass
        a probe on GPU."""
        if not self.book.lost:
            return ()
        if self.cfg.use_gpu:
            res, dur = probe_mod.probe_gpus(sorted(self.book.lost), self.cfg.probe_timeout, self._visible_env)
            ok = [d for d, passed in res.items() if passed]
            self.events.emit(EventKind.PROBE, devices=sorted(self.book.lost), passed=ok, duration_s=dur,
                             reason="scale-up")
            return decide_scale_up(self.book, ok)
        return decide_scale_up(self.book, None)

    # ------------------------------------------------------------------ the loop
    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        wg = self._worker_group
        spec = wg.spec
        self._launch()
        while True:
            time.sleep(spec.monitor_interval)
            now = time.monotonic()
            if self._force:
                self._kill_all()
                return self._stop_job("interrupted twice: workers killed without a final checkpoint", 130)
            if self.beacon is not None and self.beacon.fenced:
                self._kill_all()
                return self._stop_job(self._fence_reason)
            try:
                lost_nodes = self._lost_peers(now)
            except Exception as e:  # noqa: BLE001 - a store that does not answer within its read timeout
                return self._store_lost(e)
            if lost_nodes:
                outs = [dataclasses.replace(o, peer_lost=o.exitcode is None) for o in self._observe(wg)]
                res = self._on_failure(wg, outs, lost_nodes=lost_nodes)
                if res is not None:
                    return res
                continue
            if self._preempt and (self._stopping is None or self._stopping.kind != "preempt"):
                self.events.emit(EventKind.PREEMPT_REQUESTED)
                log.warning("preemption: asking the workers to checkpoint the current iteration and exit")
                self._stopping = _Stopping("preempt", now + self.cfg.shutdown_timeout)
                self._signal_workers(signal.SIGTERM)
            elif self._stopping is None and (self._scale_up or self._probe_due(now)):
                operator = self._scale_up
                self._scale_up = False
                back = self._returning_devices()
                if back:
                    self.events.emit(EventKind.SCALE_UP_REQUESTED, devices=list(back),
                                     source="operator" if operator else "probe")
                    log.info("scale-up: device(s) %s usable again; stopping the workers at a checkpoint", list(back))
                    self._stopping = _Stopping("scale_up", now + self.cfg.shutdown_timeout, back)
                    self._signal_workers(signal.SIGUSR1)
                elif operator:
                    log.info("scale-up requested but no lost device is usable again (lost: %s)", sorted(self.book.lost))
            outs = self._observe(wg)
            # spare workers while the job trains: not for a stopping job, nor once a worker has ended or
            # done its last iteration (the job is finishing: standbys forked then are never used, QA
            # round 8, F8.8)
            if self.standby is not None and not self._preempt and all(o.exitcode is None for o in outs):
                beats = [self._heartbeat_record(lr) for lr in self._handlers()]   # each file read once a tick
                if not any(last for _, _, last in beats):   # training: every worker has done an iteration
                    self.standby.tick(bool(beats) and all(it is not None for _, it, _ in beats))
            if any(o.failed for o in outs):
                outs = settle(lambda: self._observe(wg), outs)   # the root cause, not its collateral first
                res = self._on_failure(wg, outs)
                if res is not None:
                    return res
                continue
            if outs and all(o.exitcode is not None for o in outs):
                codes = {o.exitcode for o in outs}
                stop_s = time.monotonic() - self._stopping.t0 if self._stopping else 0.0
                if codes == {0}:
                    if self.beacon is not None:
                        self.beacon.disarm()   # done: waiting at the exit barrier is no reason to fence
                    self._close_context()
                    if self._stopping is not None and self._stopping.kind == "preempt":
                        self.events.emit(EventKind.PREEMPTED, stop_s=stop_s)
                        log.info("preempted: workers saved and exited in %.1f s", stop_s)
                        self._preempted("preempted: state saved, rerun to resume")
                    else:
                        self.events.emit(EventKind.FINISHED)
                    self._exit_barrier()
                    return self._result(True)
                # EXIT_RESIZE (possibly with 0s): relaunch on the current devices
                if self._stopping is None and not self._resize_agreed():
                    # nobody here asked for a resize and no worker's ranks agreed on one (another node's
                    # request): the script's own exit code 75 (EX_TEMPFAIL), which relaunched for ever
                    # without counting a restart. It counts now, with the failures
                    self._unrequested_resizes += 1
                    if self._restarts_counted() > self.cfg.max_restarts:
                        self._close_context()
                        return self._stop_job(
                            f"the workers exited {EXIT_RESIZE} (elastor's resize code) {self._unrequested_resizes} "
                            f"times though no resize was asked for (does the script exit {EXIT_RESIZE} itself?); "
                            f"stopping after --max-restarts {self.cfg.max_restarts}")
                self._close_context()
                if self._stopping is not None and self._stopping.kind == "scale_up":
                    back = self.book.restore(self._stopping.devices)
                    self.events.emit(EventKind.SCALE_UP, devices=back, stop_s=stop_s)
                else:
                    self.events.emit(EventKind.TEARDOWN, reason="workers stopped for a membership change",
                                     duration_s=stop_s)
                self._launch()
                continue
            if self._stopping is not None and now > self._stopping.deadline:
                kind = self._stopping.kind
                log.error("workers did not stop within --shutdown-timeout %.0f s; killing them", self.cfg.shutdown_timeout)
                self._kill_all()
                if kind == "preempt":
                    return self._stop_job(f"workers did not checkpoint and exit within --shutdown-timeout "
                                          f"{self.cfg.shutdown_timeout:.0f} s; raise it above the worst-case save time")
                if kind == "scale_up":
                    self.book.restore(self._stopping.devices)
                self._launch()
                continue
            try:
                waiting = self._stopping is None and \
                    self._bounded(spec.rdzv_handler.num_nodes_waiting, "num_nodes_waiting") > 0
            except Exception as e:  # noqa: BLE001 - RendezvousConnectionError, DistStoreError after the read timeout
                return self._store_lost(e)
            if waiting:
                self.events.emit(EventKind.MEMBERSHIP, waiting=True)
                log.info("another node is waiting in the rendezvous: stopping the workers at a checkpoint")
                self._stopping = _Stopping("membership", now + self.cfg.shutdown_timeout)
                self._signal_workers(signal.SIGUSR1)

    def _close_rendezvous(self) -> None:
        try:
            self._worker_group.spec.rdzv_handler.shutdown()
        except Exception as e:  # noqa: BLE001 - stopping anyway; the others time out instead
            log.warning("could not close the rendezvous for the other nodes: %s", e)


    def _probe_due(self, now: float) -> bool:
        if not (self.cfg.use_gpu and self.cfg.on_failure is OnFailure.PROBE and self.book.lost):
            return False
        if now - self._last_probe < self.cfg.probe_interval:
            return False
        self._last_probe = now
        return True

    def _on_failure(self, wg, outs: list[WorkerOutcome], lost_nodes: list[int] | None = None) -> RunResult | None:
        failed = [o for o in outs if o.failed]
        if (not lost_nodes and self._stop_at_start and self._stopping is not None and self._stopping.kind == "preempt"
                and all(o.signal in (signal.SIGTERM, signal.SIGINT) for o in failed)):
            # the stop came while this launch's workers were being started: those that ended on it had
            # not attached their hooks, so had not begun (a restore at most): a preemption, not a failure
            dur = self._kill_all()
            self.events.emit(EventKind.TEARDOWN, duration_s=dur)
            self.events.emit(EventKind.PREEMPTED, stop_s=time.monotonic() - self._stopping.t0, during="start")
            log.warning("preempted while the workers started: they had not begun training, nothing to checkpoint")
            self._preempted("preempted while the workers started (they had not begun training, nothing to "
                            "checkpoint); rerun to resume")
            return self._result(True)
        if self._stopping is not None and self._stopping.kind == "scale_up":
            # the workers were stopping to grow onto devices that came back: they still have, whatever
            # failed on the way (the relaunch below clears the stop, and with it the request)
            back = self.book.restore(self._stopping.devices)
            log.info("a failure while scaling up: device(s) %s stay in the next launch's pool", list(back))
        claim = self.ledger.claim(wg.store, self._rdzv_round)   # first: the node that reports first is the round's primary
        preempting = self._stopping is not None and self._stopping.kind == "preempt"
        last_hb = [t for t in (self._heartbeat(o.local_rank)[0] for o in failed if o.hung) if t]
        primary = sorted(failed, key=lambda o: (o.cause.value != "signal", o.cause.value != "hang", o.local_rank))[0]
        if lost_nodes:
            book = self._peer_book
            log.warning("node(s) %s of this round silent for more than %.1f s: lost", lost_nodes, self.liveness.timeout)
        self.events.emit(EventKind.FAILURE, cause=primary.cause.value, world_size=sum(self.procs_per_node),
                         lost_nodes=[{"node_rank": r, "snapshot_server": (self.snapshots.peers + [""] * (r + 1))[r],
                                      "silent_s": book.silent_for(r, time.monotonic())} for r in lost_nodes]
                         if lost_nodes else None,
                         last_heartbeat=min(last_hb) if last_hb else None, job_failures=claim.failures,
                         collateral_of=None if claim.primary else claim.by,
                         ranks=[{"local_rank": o.local_rank, "global_rank": o.global_rank, "device": o.device,
                                 "cause": o.cause.value, "exitcode": o.exitcode, "signal": o.signal_name(),
                                 "stopped": o.stopped} for o in failed])
        log.warning("failure: %s", ", ".join(
            f"rank {o.global_rank} (device {o.device}) {o.cause.value}"
            + (f" ({o.signal_name()})" if o.signal else f" (code {o.exitcode})" if o.exitcode is not None else "")
            for o in failed))
        errors = {o.local_rank: self._worker_error(o.local_rank) for o in failed if o.cause.value == "rejected"}
        dur = self._kill_all()
        self.events.emit(EventKind.TEARDOWN, duration_s=dur)
        if preempting:
            if all(o.signal in (signal.SIGTERM, signal.SIGINT) for o in failed):
                return self._stop_job("preempted: a worker ended on the stop signal before confirming a checkpoint "
                                      "(the script has no elastor hooks, ElasticWorker, or had not attached them "
                                      "yet); the newest committed checkpoint may be an earlier step: `elastor "
                                      "inspect <the --save folder>` names it")
            return self._stop_job("a worker failed while checkpointing for preemption; the newest committed "
                                  "checkpoint may be an earlier step: `elastor inspect <the --save folder>` names it")
        probe_ok = None
        if self.cfg.on_failure is OnFailure.PROBE and self.cfg.use_gpu:
            probe_ok, pdur = probe_mod.probe_gpus(list(self.book.usable), self.cfg.probe_timeout, self._visible_env)
            self.events.emit(EventKind.PROBE, devices=list(self.book.usable),
                             passed=[d for d, ok in probe_ok.items() if ok], duration_s=pdur, reason="failure")
        used = claim.failures - 1 if claim.primary else claim.failures   # job failures before this one
        used += self._unrequested_resizes   # and this node's relaunches after a script's own exit 75
        dec = decide_after_failure(self.cfg.on_failure, self.book, outs, used, self.cfg.max_restarts, probe_ok,
                                   collateral_of=None if claim.primary else claim.by)
        self.events.emit(EventKind.DECISION, action=dec.action.value, devices=list(dec.devices), lost=list(dec.lost),
                         reason=dec.reason, restarts_used=used, counted=dec.counts_as_restart)
        if dec.action is Action.STOP:
            err = next((e for e in errors.values() if e), "")
            if claim.primary and self.cfg.max_nodes > 1 and "--max-restarts" in dec.reason:
                self._close_rendezvous()   # the job is over: the other nodes must not wait for this one
            return self._stop_job(dec.reason + (f": {err}" if err else ""))
        log.info("%s", dec.reason)
        self.book.lose(dec.lost)
        if dec.counts_as_restart:
            self.restarts_used = claim.failures
        self._launch()
        return None


def store_lost_reason(cfg: RunConfig, err: BaseException, then: str) -> str:
    """The one message for a store that stopped answering, whichever call met it first (the monitor
    loop's liveness read, or the next round's rendezvous after the workers exited)."""
    from .rdzv_auth import ForgedStateError
    forged = _in_chain(err, ForgedStateError)
    if forged is not None:   # the store answered, with a state this job did not write
        return f"{forged}; this node leaves the job, {then}"
    reason = (f"lost contact with the rendezvous store at {cfg.rdzv_endpoint} ({type(err).__name__}: {err}); "
              f"this node leaves the job, {then}")
    if cfg.rdzv_backend == "c10d":
        reason += (". A c10d job ends with its store's host: run the store outside the nodes that can fail "
                   "(python -m elastor_ds.elastic.store_main, --rdzv-conf is_host=0) or use --rdzv-backend "
                   "etcd-v2 with every etcd member in --rdzv-endpoint")
    return reason


def _in_chain(err: BaseException, cls: "type | tuple[type, ...]") -> "BaseException | None":
    """The first exception of class ``cls`` (or of one of the classes) in ``err``'s cause / context chain, or None."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, cls):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def store_unreachable(err: BaseException) -> bool:
    """The rendezvous failed because the store's connection broke (not because a node closed it)."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    return _in_chain(err, (RendezvousConnectionError, DistNetworkError, DistStoreError, ConnectionError)) is not None


def build_agent(cfg: RunConfig, events: EventLog) -> ElastorAgent:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"   # restarts read stale gloo addresses otherwise
    if cfg.local_addr and not os.environ.get("GLOO_SOCKET_IFNAME"):
        ifname = interface_of(cfg.local_addr)
        if ifname:   # gloo binds the interface of the host name's address otherwise (not this one)
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    params = RendezvousParameters(backend=cfg.rdzv_backend, endpoint=cfg.rdzv_endpoint, run_id=cfg.rdzv_id,
                                  min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, local_addr=cfg.local_addr,
                                  **cfg.rdzv_conf)
    # the dynamic rendezvous's state is a pickle torch reads from the store: signed with the job's key
    key = rendezvous_key(cfg.job_secret_file, cfg.max_nodes > 1) if cfg.rdzv_backend in ("c10d", "etcd-v2") else None
    if cfg.rdzv_backend == "etcd-v2":   # every etcd member listed, not only the first (torch's handler)
        from .etcd_rdzv import create_handler
        from .rdzv_args import check_endpoints
        handler = create_handler(params, check_endpoints(cfg.rdzv_endpoint, cfg.rdzv_backend, lambda h, p: None),
                                 cfg.local_addr, key=key)
    elif cfg.rdzv_backend == "c10d":
        handler = signed_handler(params, key)
    else:
        try:
            handler = rdzv_registry.get_rendezvous_handler(params)
        except Exception as e:  # noqa: BLE001 - etcd (v1): the client's connection errors, as etcd-v2 reports them
            if cfg.rdzv_backend != "etcd" or not type(e).__module__.split(".")[0] in ("etcd", "urllib3"):
                raise
            from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
            raise RendezvousConnectionError(f"the etcd server did not answer: {type(e).__name__}: {e}") from e
    spec = WorkerSpec(role="default", local_world_size=cfg.nproc_per_node, rdzv_handler=handler,
                      entrypoint=os.environ.get(ENV_PYTHON) or __import__("sys").executable,
                      args=("-u", "-m", "elastor_ds.elastic.worker_main", cfg.script, *cfg.script_args),
                      max_restarts=cfg.max_restarts, monitor_interval=cfg.monitor_interval)
    logs = DefaultLogsSpecs(log_dir=cfg.log_dir, redirects=Std.ALL, tee=Std.ALL if cfg.tee else Std.NONE)
    book = DeviceBook(tuple(range(cfg.nproc_per_node)))
    # elastor's own store values are sealed with the same job key (per purpose, run, round and key)
    auth = StoreAuth(key, handler.get_run_id()) if key is not None else None
    agent = ElastorAgent(spec, cfg, events, book, logs, store_auth=auth)
    # the rendezvous's own store outlives rounds: the job's failure count lives there (c10d backend)
    agent.ledger = FailureLedger(cfg.node_name, overrides.rendezvous_store(handler), handler.get_run_id(), auth=auth)
    if cfg.standby:
        agent.standby = StandbyPool(size=cfg.nproc_per_node, folder=os.path.join(cfg.log_dir, "standby"),
                                    preload=tuple(cfg.standby_preload), python=spec.entrypoint, fork=cfg.standby_fork,
                                    on_spawn=lambda pids: events.emit(EventKind.STANDBY, pids=pids))
    return agent


def _sigkill(pid: int) -> None:
    """SIGKILL a worker's process group (it leads one), else the worker alone; gone already is fine."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
            return
        except (ProcessLookupError, PermissionError):
            continue


def interface_of(addr: str) -> str | None:
    """The name of the local network interface that holds ``addr`` (None: no interface does)."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return None


def check_local_addr(addr: str) -> None:
    """``--local-addr``: an IP address must be one of this node's (a host name is taken as given)."""
    import ipaddress
    from ..errors import ConfigError
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return
    if interface_of(addr) is None:
        raise ConfigError(f"--local-addr {addr}: no network interface of this node has that address; give one of "
                          f"this node's addresses (see `ip addr`) or its host name")


def node_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
