"""Standby workers: processes that have done the trainer's imports before a (re)launch needs them.

Recovery time under ``elastor run`` was ~90% worker start-up (spawning interpreters that import
torch, DeepSpeed and Megatron). :class:`StandbyPool` keeps one pre-spawned interpreter per device
slot of the node (:mod:`standby_main`), each importing those modules in the background and then
waiting for a rank. A launch still goes through torch.distributed.elastic unchanged (c10d
rendezvous, rank assignment, the worker environment, per-rank logs, watchdog): only the step that
would ``Popen`` each worker hands the worker's argv, environment and log files to a standby
instead (:class:`StandbyContext`, a ``SubprocessContext`` whose handlers take a standby). The
agent remains the parent of every worker (exit codes, signals, ``killpg`` and the parent-death
signal behave as with a spawned worker); a standby serves one assignment and never forks, so
every round gets fresh processes.

CUDA: a standby never initialises CUDA on purpose. It is spawned with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (``torch.cuda.is_available`` then asks NVML, not the driver)
and reports whether an import loaded the driver anyway; such a standby is used only when its
``CUDA_VISIBLE_DEVICES`` equals the assignment's (the driver read the variable already), else it
is retired and the worker starts cold. There is no fork after imports, so no CUDA state can be
inherited.

Replacements are spawned once the round's workers are training (their first heartbeat), or after
``refill_delay`` seconds, so the standbys' imports do not compete with the relaunch they speed up.

Fork from a template (the default; ``--no-standby-fork`` turns it off): the imports are done once
per node, by :mod:`standby_template`, and each standby is forked from it (milliseconds, no CPU
taken from training) and adopted by the agent (:class:`StandbyTemplate`). The template never
initialises CUDA either; when an import loaded the driver anyway, it forks nothing and standbys are
spawned as above.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ..threads import NamedThread
from . import overrides
from .private import open_private, private_dir
from .protocol import ENV_LAUNCH_MODE, ENV_STANDBY_DIR, LaunchMode
from .protocol import ENV_STANDBY_PRELOAD as ENV_PRELOAD
from .protocol import ENV_STANDBY_READY_FD as ENV_READY_FD
from .protocol import ENV_STANDBY_TEMPLATE_FD
from .standby_main import DEFAULT_PRELOAD

log = logging.getLogger("elastor.run")

WORKER_MODULE = "elastor_ds.elastic.worker_main"
PENDING = "pending"   # StandbyTemplate.fork_nowait: no standby yet, ask again at the next tick


@dataclass
class Standby:
    proc: subprocess.Popen
    ready_fd: int
    t_spawn: float
    visible: str | None            # CUDA_VISIBLE_DEVICES it was spawned with
    state: str = "importing"       # importing | ready | cuda (driver loaded by an import)
    t_ready: float | None = None

    def poll(self) -> str:
        if self.state == "importing" and self.ready_fd >= 0:
            try:
                b = os.read(self.ready_fd, 1)
            except BlockingIOError:
                return self.state
            except OSError:
                b = b""
            if b:
                self.state = "cuda" if b == b"C" else "ready"
                self.t_ready = time.time()
            os.close(self.ready_fd)
            self.ready_fd = -1
        return self.state

    def alive(self) -> bool:
        return self.proc.poll() is None

    def retire(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(timeout=5)


_PR_SET_CHILD_SUBREAPER = 36


@contextlib.contextmanager
def _subreaper():
    """This process adopts the orphans of its descendants while active (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


# How long a standby from the template may take to lead its own session once the template replied:
# it needs a CPU first, which a loaded node (training on every core) may not give it for seconds
ADOPT_TIMEOUT_S = 30.0


@dataclass
class _Request:
    """A fork request out to the template (the lock held for every change)."""
    stdin_w: int                  # the new standby's assignment pipe (our end)
    ready_r: int                  # its readiness pipe (our end)
    reaper: contextlib.ExitStack  # this process is a child subreaper until the standby is ours
    t_sent: float
    pid: int | None = None        # the standby (our child) once the template replied; None again once reaped
    t_reply: float = 0.0

    def leads_group(self) -> bool:
        """One look: the standby leads its own process group (it leaves the template's once adopted:
        a signal to its group must reach it and nothing else). False: not yet; OSError: it exited,
        or it did not within :data:`ADOPT_TIMEOUT_S` of the reply."""
        pid = self.pid
        try:
            if os.getpgid(pid) == pid:
                return True
            gone = os.waitpid(pid, os.WNOHANG)[0] == pid
        except (ProcessLookupError, ChildProcessError):
            gone = True
        if gone:
            self.pid = None
            raise OSError(f"the standby {pid} from the template exited before it was handed over")
        if time.monotonic() > self.t_reply + ADOPT_TIMEOUT_S:
            raise OSError(f"the standby {pid} from the template did not start its own session within "
                          f"{ADOPT_TIMEOUT_S:g} s")
        return False

    def wait_group_leader(self) -> None:
        """:meth:`leads_group`, waiting (a launch needs the standby now): looks 0.5 ms apart at first,
        then further apart (20 ms at most), so a slow standby costs no CPU."""
        pause = 0.0005
        while not self.leads_group():
            time.sleep(pause)
            pause = min(2 * pause, 0.02)


class _AdoptedProcess(subprocess.Popen):
    """A ``Popen`` for a child this process adopted rather than spawned (a standby forked by the
    template): ``poll``, ``wait``, ``send_signal``, ``kill`` and ``stdin`` work as for a spawned one,
    since the pid is our own child."""

    def __init__(self, pid: int, stdin, args: list[str]):   # noqa: D107 - no process is started here
        self.args = args
        self.pid = pid
        self.returncode = None
        self.stdin, self.stdout, self.stderr = stdin, None, None
        self._waitpid_lock = threading.Lock()
        self._child_created = True
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self.text_mode = False
        self.universal_newlines = False
        self.encoding = self.errors = None
        self.pipesize = -1


class StandbyTemplate:
    """The node's template interpreter (:mod:`standby_template`) and the agent's end of its socket."""

    def __init__(self, python: str, env: dict[str, str], log_file, import_timeout: float = 300.0):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(env, **{ENV_STANDBY_TEMPLATE_FD: str(theirs.fileno())})
        try:
            self.proc = subprocess.Popen([python, "-u", "-m", "elastor_ds.elastic.standby_template"], env=env,
                                         stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self.state = "importing"   # importing | ready | unusable
        self.import_timeout = import_timeout
        self.t_spawn = time.time()
        self._lock = threading.Lock()
        self._pending: _Request | None = None   # the fork request out

    def _wait_ready(self, block: bool = True) -> bool:
        if self.state == "importing":
            self.sock.settimeout(max(0.0, self.t_spawn + self.import_timeout - time.time()) if block else 0.0)
            try:
                b = self.sock.recv(16)
            except (BlockingIOError, socket.timeout):
                if not block:
                    return False
                b = b""
            except OSError:
                b = b""
            self.state = "ready" if b == b"R" else "unusable"
            if b == b"C":
                log.warning("standby template pid %d loaded the CUDA driver while importing: standbys are "
                            "spawned one by one instead", self.proc.pid)
            elif b != b"R":
                log.warning("standby template pid %d is not usable (%s): standbys are spawned one by one",
                            self.proc.pid, "exited" if self.proc.poll() is not None else "no answer")
            if self.state == "unusable":   # it would only hold memory (and a CUDA driver) from here on
                self.close()
        return self.state == "ready"

    def importing(self) -> bool:
        """Still importing (checked without blocking)."""
        with self._lock:
            self._wait_ready(block=False)
            return self.state == "importing"

    def fork(self, python: str) -> tuple[subprocess.Popen, int] | None:
        """A new standby (our child) and the read end of its readiness pipe, or None when the
        template cannot fork (then the caller spawns one). Waits for the template's imports and
        for its reply; a request already sent by :meth:`fork_nowait` is the one collected."""
        with self._lock:
            if not self._send_request(wait_ready=True):
                return None
            return self._collect(python, block=True)

    def fork_nowait(self, python: str):
        """As :meth:`fork` without waiting: :data:`PENDING` while the template imports or a
        request is out (call again later), else what :meth:`fork` returns. The agent's loop
        refills through this, so a signal is acted on at its next tick, not after the template
        has imported the modules the workers learned (seconds)."""
        with self._lock:
            if self._pending is None:
                if not self._send_request(wait_ready=False):
                    return PENDING if self.state == "importing" else None
                return PENDING
            return self._collect(python, block=False)

    def _send_request(self, wait_ready: bool) -> bool:
        """Send one fork request (lock held); True when one is out."""
        if self._pending is not None:
            return True
        if not self._wait_ready(block=wait_ready):
            return False
        stdin_r, stdin_w = os.pipe()
        ready_r, ready_w = os.pipe()
        reaper = contextlib.ExitStack()
        try:
            # A, the template's intermediate child, exits once B is forked: B must come to us
            reaper.enter_context(_subreaper())
            socket.send_fds(self.sock, [json.dumps({"agent": os.getpid()}).encode()], [stdin_r, ready_w])
        except OSError as e:
            reaper.close()
            for fd in (stdin_w, ready_r):
                os.close(fd)
            self._unusable(e)
            return False
        finally:
            os.close(stdin_r)
            os.close(ready_w)
        self._pending = _Request(stdin_w, ready_r, reaper, time.monotonic())
        return True

    def _collect(self, python: str, block: bool):
        """The reply to the request that is out (lock held): the adopted standby, None when the
        template failed, or :data:`PENDING` (``block`` False: no reply yet, or the standby does not
        lead its own session yet; one look at each, the loop asks again at its next tick)."""
        req = self._pending
        try:
            if req.pid is None:
                deadline = req.t_sent + self.import_timeout   # it may import the learned modules first
                self.sock.settimeout(max(0.0, deadline - time.monotonic()) if block else 0.0)
                try:
                    raw = self.sock.recv(4096)
                except (BlockingIOError, socket.timeout):
                    if not block and time.monotonic() < deadline:
                        return PENDING
                    raise OSError(f"no reply to a fork request within {self.import_timeout:g} s") from None
                reply = json.loads(raw or b"{}")
                pid = reply.get("pid") if isinstance(reply, dict) else None
                if not isinstance(pid, int) or pid <= 0:
                    raise OSError(f"the template did not fork a standby ({reply.get('error') if isinstance(reply, dict) else reply})")
                if _parent_of(pid) != os.getpid():   # never signal or wait on a pid that is not our child
                    raise OSError(f"pid {pid} from the template is not this controller's child")
                req.pid, req.t_reply = pid, time.monotonic()
            if block:
                req.wait_group_leader()
            elif not req.leads_group():
                return PENDING
        except (OSError, ValueError) as e:
            self._drop_pending()
            self._unusable(e)
            return None
        self._pending = None
        req.reaper.close()
        os.set_blocking(req.ready_r, False)
        return _AdoptedProcess(req.pid, os.fdopen(req.stdin_w, "wb"),
                               [python, "-m", "elastor_ds.elastic.standby_template", "(fork)"]), req.ready_r

    def _drop_pending(self) -> None:
        req, self._pending = self._pending, None
        if req is None:
            return
        if req.pid is not None:   # forked, our child, not handed over: it must not outlive the request
            with contextlib.suppress(OSError):
                os.kill(req.pid, signal.SIGKILL)
                os.waitpid(req.pid, 0)
            req.pid = None
        req.reaper.close()
        for fd in (req.stdin_w, req.ready_r):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _unusable(self, e: Exception) -> None:
        log.warning("standby template pid %d: %s; standbys are spawned one by one from now on", self.proc.pid, e)
        self.state = "unusable"
        self.close()

    def close(self) -> None:
        self._drop_pending()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)


@dataclass
class StandbyPool:
    """Pre-spawned worker interpreters of one node (``size``: its device slots)."""
    size: int
    folder: str
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    python: str = sys.executable
    refill_delay: float = 60.0
    idle: list[Standby] = field(default_factory=list)
    assigned: dict[int, str] = field(default_factory=dict)   # local rank -> LaunchMode of the last launch
    spawned: int = 0
    on_spawn: object = None        # callable(pids) told about every standby made (the agent's event log)
    fork: bool = True              # standbys forked from the node's template (False: each spawned and importing)
    template: StandbyTemplate | None = None
    _refill_at: float | None = None
    _refilling: bool = False

    def __post_init__(self) -> None:
        # private (0700, ours, checked): the learned module list there is imported by every standby
        private_dir(self.folder, "standby folder")
        os.environ[ENV_STANDBY_DIR] = self.folder   # workers write the module list there
        self._log = os.fdopen(open_private(os.path.join(self.folder, "standby.log")), "ab")

    # -------------------------------------------------------------- processes
    def _spawn(self, env: dict[str, str] | None = None) -> Standby:
        if env is None and self.fork:   # a plain standby: forked from the template when it can
            sb = self._fork()
            if sb is not None:
                return sb
        return self._spawn_interpreter(env)

    def _spawn_interpreter(self, env: dict[str, str] | None) -> Standby:
        r, w = os.pipe()
        os.set_blocking(r, False)
        env = dict(self._standby_env(env), **{ENV_READY_FD: str(w)})
        try:
            proc = subprocess.Popen([self.python, "-u", "-m", "elastor_ds.elastic.standby_main"], env=env,
                                    stdin=subprocess.PIPE, stdout=self._log, stderr=self._log, pass_fds=(w,),
                                    start_new_session=True)
        finally:
            os.close(w)
        self.spawned += 1
        return Standby(proc, r, time.time(), env.get("CUDA_VISIBLE_DEVICES"))

    def _template(self) -> StandbyTemplate:
        if self.template is None:
            self.template = StandbyTemplate(self.python, self._standby_env(None), self._log)
        return self.template

    def _adopt(self, made) -> Standby:
        self.spawned += 1
        return Standby(made[0], made[1], time.time(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _fork(self) -> Standby | None:
        made = self._template().fork(self.python)
        return None if made is None else self._adopt(made)

    def _standby_env(self, env: dict[str, str] | None) -> dict[str, str]:
        env = dict(os.environ if env is None else env)
        env[ENV_PRELOAD] = ",".join(self.preload)
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        return env

    def _added(self, new: list[Standby]) -> list[int]:
        self.idle += new
        if new:
            log.info("standby: %d worker interpreter(s) %s", len(new), "forked from the template"
                     if self.template is not None and self.template.state == "ready" else "spawned (importing)")
            if self.on_spawn is not None:
                self.on_spawn([s.proc.pid for s in new])
        return [s.proc.pid for s in new]

    def fill(self) -> list[int]:
        """Spawn standbys until ``size`` are idle, waiting for each fork; returns the new processes'
        pids. The agent's loop refills with :meth:`tick` instead, which never waits."""
        self._refill_at = None
        self._refilling = False
        self.idle = [s for s in self.idle if s.alive() or s.retire()]
        if self.fork and self._template().importing():
            return []   # the first launch forks its workers from the template once it is ready
        return self._added([self._spawn() for _ in range(max(0, self.size - len(self.idle)))])

    def _refill_step(self) -> None:
        """One step of a refill that never blocks: the standbys forked or spawned so far, and at
        most one fork request left out for the next step."""
        self.idle = [s for s in self.idle if s.alive() or s.retire()]
        new: list[Standby] = []
        while len(self.idle) + len(new) < self.size:
            if self.fork and self._template().state != "unusable":
                made = self.template.fork_nowait(self.python)
                if made is PENDING:
                    break
                if made is not None:
                    new.append(self._adopt(made))
                    continue
            new.append(self._spawn_interpreter(None))
        self._added(new)
        if len(self.idle) >= self.size:
            self._refilling = False

    def ready_count(self) -> int:
        return sum(1 for s in self.idle if s.alive() and s.poll() in ("ready", "cuda"))

    def take(self, visible: str | None) -> Standby | None:
        """An idle standby for an assignment with ``CUDA_VISIBLE_DEVICES=visible`` (ready ones
        first, then the oldest importing one), or None."""
        usable = []
        for s in list(self.idle):
            st = s.poll() if s.alive() else "dead"
            if st == "dead" or (st == "cuda" and s.visible != visible):
                if st == "cuda":
                    log.warning("standby pid %d loaded the CUDA driver while importing (CUDA_VISIBLE_DEVICES=%s, "
                                "assignment needs %s): retired, the worker starts cold", s.proc.pid, s.visible,
                                visible)
                self.idle.remove(s)
                s.retire()
                continue
            usable.append(s)
        if not usable:
            return None
        best = min(usable, key=lambda s: (s.state == "importing", s.t_spawn))
        self.idle.remove(best)
        return best

    def assign(self, local_rank: int, argv: tuple, env: dict[str, str], stdout: str | None,
               stderr: str | None) -> subprocess.Popen:
        """Make a worker: hand (argv, env, logs) to a standby, or spawn one for it (cold)."""
        sb = self.take(env.get("CUDA_VISIBLE_DEVICES"))
        if sb is not None:
            mode = LaunchMode.WARM if sb.state in ("ready", "cuda") else LaunchMode.COLD
        elif self.fork and (sb := self._fork()) is not None:   # imported once, in the template (waits for it)
            mode = LaunchMode.WARM
            # a standby forked now (or the fork a refill left pending when a worker died and the
            # refill stopped) is reported like every other: the event log names every standby
            if self.on_spawn is not None:
                self.on_spawn([sb.proc.pid])
        else:   # spawned with the worker's own environment: CUDA reads the right devices from the start
            sb = self._spawn(env)
            mode = LaunchMode.COLD
        env = dict(env, **{ENV_LAUNCH_MODE: mode.value})
        # the assignment itself goes down the standby's stdin (a pipe only we hold), never a file
        # another user could swap: the standby reads it to EOF
        payload = json.dumps({"argv": list(argv), "env": env, "stdout": stdout, "stderr": stderr, "cwd": os.getcwd(),
                              "t_assigned": time.time()}).encode()
        if len(payload) <= _PIPE_ATOMIC:
            _hand_over(sb.proc, payload)
        else:   # more than a pipe buffer: a standby still importing would block the agent until it reads
            NamedThread(target=_hand_over, args=(sb.proc, payload), name="elastor-standby-assign",
                             daemon=True).start()
        if sb.ready_fd >= 0:
            os.close(sb.ready_fd)
            sb.ready_fd = -1
        self.assigned[local_rank] = mode.value
        return sb.proc

    def schedule_refill(self) -> None:
        self._refill_at = time.monotonic() + self.refill_delay

    def tick(self, workers_training: bool) -> None:
        """Refill once the new workers train (or ``refill_delay`` after the launch), a step at a
        time: this returns at once, whatever the template is doing."""
        if self._refill_at is not None and (workers_training or time.monotonic() >= self._refill_at):
            self._refill_at = None
            self._refilling = True
        if self._refilling:
            self._refill_step()

    def close(self) -> None:
        for s in self.idle:
            s.retire()
        self.idle = []
        self._refill_at = None
        self._refilling = False
        if self.template is not None:
            self.template.close()
            self.template = None
        with contextlib.suppress(OSError):
            self._log.close()


_PIPE_ATOMIC = 60_000   # below the 64 KiB Linux pipe buffer: written at once, never blocks


def _hand_over(proc: subprocess.Popen, payload: bytes) -> None:
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except (BrokenPipeError, OSError, ValueError) as e:   # it died just now: the agent sees it exit, like a spawn failure
        log.warning("standby pid %d could not take its assignment (%s)", proc.pid, e)


# ------------------------------------------------------------------ torch.distributed.elastic glue
def _worker_argv(entrypoint: str, args: tuple) -> tuple | None:
    """SCRIPT ARGS... of ``python -u -m elastor_ds.elastic.worker_main SCRIPT ARGS...``, else None."""
    a = [str(x) for x in args]
    if "-m" in a and a.index("-m") + 1 < len(a) and a[a.index("-m") + 1] == WORKER_MODULE:
        return tuple(a[a.index("-m") + 2:])
    return None


class _StandbyHandler(SubprocessHandler):
    """torch's subprocess handler, with the worker process taken from the pool instead of Popen."""

    def __init__(self, pool: StandbyPool, entrypoint: str, args: tuple, env: dict[str, str], stdout: str | None,
                 stderr: str | None, local_rank_id: int, numa_options=None):
        self._pool = pool
        self._entry = entrypoint
        super().__init__(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)

    def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        argv = _worker_argv(self._entry, tuple(args[1:]))
        if argv is None:   # not our worker entry point: spawn it the stock way
            return super()._popen(args, env)
        return self._pool.assign(self.local_rank_id, argv, env, self._stdout.name if self._stdout else None,
                                 self._stderr.name if self._stderr else None)


class StandbyContext(SubprocessContext):
    """A ``SubprocessContext`` whose workers come from a :class:`StandbyPool`."""

    def __init__(self, pool: StandbyPool, **kw):
        super().__init__(**kw)
        self._pool = pool

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the standby context was started twice")
        self.subprocess_handlers = {
            lr: _StandbyHandler(self._pool, entrypoint=self.entrypoint, args=self.args[lr], env=self.envs[lr],
                                stdout=self.stdouts[lr], stderr=self.stderrs[lr], local_rank_id=lr,
                                numa_options=self._numa_options)
            for lr in range(self.nprocs)}


@contextlib.contextmanager
def _start_processes_from(pool: StandbyPool):
    """While active, ``LocalElasticAgent._start_workers`` builds a :class:`StandbyContext` where it
    would call ``start_processes`` (everything else it does, the worker environment included, is
    unchanged)."""
    def make(original):
        def start_processes(name, entrypoint, args, envs, logs_specs, log_line_prefixes=None, start_method="spawn",
                            numa_options=None, duplicate_stdout_filters=None, duplicate_stderr_filters=None, **_):
            if not isinstance(entrypoint, str):
                return original(name=name, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
                                log_line_prefixes=log_line_prefixes, start_method=start_method,
                                numa_options=numa_options, duplicate_stdout_filters=duplicate_stdout_filters,
                                duplicate_stderr_filters=duplicate_stderr_filters)
            ctx = StandbyContext(pool, name=name, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
                                 log_line_prefixes=log_line_prefixes, numa_options=numa_options,
                                 duplicate_stdout_filters=duplicate_stdout_filters,
                                 duplicate_stderr_filters=duplicate_stderr_filters)
            try:
                ctx.start()
            except Exception:
                ctx.close()
                raise
            return ctx
        return start_processes

    with overrides.replaced_start_processes(make):
        yield


class StandbyAgentMixin:
    """For a ``LocalElasticAgent`` subclass: launches take standby workers when ``self.standby`` is
    a pool (None: torch's own spawn, ``elastor run --no-standby``)."""
    standby: StandbyPool | None = None

    def _start_workers(self, worker_group):
        pool = self.standby
        if pool is None:
            return super()._start_workers(worker_group)
        pool.assigned = {}
        with _start_processes_from(pool):
            pids = super()._start_workers(worker_group)
        pool.schedule_refill()
        return pids

    def launch_modes(self) -> list[str]:
        pool = self.standby
        if pool is None:
            return []
        return [pool.assigned.get(lr, LaunchMode.SPAWN.value) for lr in sorted(pool.assigned)]

    def close_standby(self) -> None:
        if self.standby is not None:
            self.standby.close()
