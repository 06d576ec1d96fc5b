"""The contract between ``elastor run`` and its workers (pure): environment variables, the launch
context a worker reads from them, exit codes, stop codes and heartbeat files.

This module owns every ``ELASTOR_*`` name: no other module of the package spells one
(``tests/unit/test_protocol.py`` fails if one does). A new variable is a new constant here, with
who sets it and who reads it, a field of :class:`LaunchContext` when a worker reads it, and a row
in docs/elastic.md.

1. The controller launches each worker as ``python -m elastor_ds.elastic.worker_main SCRIPT ARGS``
   with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) plus the ``ENV_*`` below.
2. A worker reads them once, as one validated value: :func:`launch_context` (a bad value is a
   :class:`~elastor_ds.errors.ConfigError` naming the variable, at the first read, not deep inside
   a save).
3. A worker touches its heartbeat file once per iteration (:func:`heartbeat_path`); a running
   worker whose heartbeat is older than ``--hang-timeout`` is hung. Its hooks write a first
   :data:`STARTED_BEAT` record when they attach: a worker with no iteration done
   ``--startup-timeout`` after that is hung too (a worker without hooks writes none).
4. The controller asks for a graceful stop with a signal: SIGTERM/SIGINT (preemption: save and exit
   ``EXIT_OK``) or SIGUSR1 (resize: save and exit ``EXIT_RESIZE``). Workers agree on the largest
   stop code with one all-reduce at the end of an iteration, save that iteration, wait until it is
   durable and exit.
5. A worker that rejects the launched world (the planner finds no plan, the flags do not fit)
   exits ``EXIT_USAGE``: the controller does not retry that world.
"""
from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import ConfigError

# ---------------------------------------------------------------- the names (who sets -> who reads)
# the controller -> every worker of a launch (agent.ElastorAgent._start_workers unless said otherwise);
# a worker reads them through LaunchContext
ENV_ROUND = "ELASTOR_ROUND"                      # launches before this one -> worker events, the example's fault hook
ENV_PROCS_PER_NODE = "ELASTOR_PROCS_PER_NODE"    # "2,1" by node rank -> planner (autoplan, example), peer copies
ENV_INITIAL_WORLD = "ELASTOR_INITIAL_WORLD_SIZE"  # world of the first launch -> --elastor-plan on-change
ENV_DEVICES = "ELASTOR_DEVICES"                  # this node's device slots, "0,2" -> LaunchContext (reports)
ENV_GPU_MEMORY_GB = "ELASTOR_GPU_MEMORY_GB"      # --gpu-memory-gb (optional) -> the trainer's planner
ENV_COLLECTIVE_TIMEOUT = "ELASTOR_COLLECTIVE_TIMEOUT_S"  # 2 x --hang-timeout -> deepspeed api.init_distributed
ENV_HEARTBEAT_DIR = "ELASTOR_HEARTBEAT_DIR"      # folder of per-local-rank heartbeat files -> ElasticWorker
ENV_EVENTS_FILE = "ELASTOR_EVENTS_FILE"          # --events JSONL -> ElasticWorker, snapshot tier's restore record
ENV_SNAPSHOT_DIR = "ELASTOR_SNAPSHOT_DIR"        # snapshot_dir.prepare (--snapshot-dir) -> snapshot tier, peer sources
ENV_SNAPSHOT_PEERS = "ELASTOR_SNAPSHOT_PEERS"    # NodeSnapshots.env: every node's server -> peer_sources.node_sources
ENV_SNAPSHOT_SELF = "ELASTOR_SNAPSHOT_SELF"      # NodeSnapshots.env: this node's server -> node_sources (left out)
ENV_JOB_SECRET_FILE = "ELASTOR_JOB_SECRET_FILE"  # NodeSnapshots.env: --job-secret-file's path -> auth.job_key
ENV_STANDBY_DIR = "ELASTOR_STANDBY_DIR"          # StandbyPool: the pool's folder -> workers' module list, standbys
# set inside the worker process itself
ENV_LAUNCH_MODE = "ELASTOR_LAUNCH_MODE"          # StandbyPool.assign (a LaunchMode; unset: spawn) -> ElasticWorker
ENV_T_START = "ELASTOR_T_PROCESS_START"          # worker_main, standby_main: start (standby: assigned) -> ElasticWorker
ENV_T_STANDBY_SPAWN = "ELASTOR_T_STANDBY_SPAWN"  # standby_main: wall time the standby process started -> ElasticWorker
ENV_T_STANDBY_READY = "ELASTOR_T_STANDBY_READY"  # standby_main: wall time its imports were done -> ElasticWorker
# the controller -> its standby interpreters only (not for trainers)
ENV_STANDBY_PRELOAD = "ELASTOR_STANDBY_PRELOAD"  # StandbyPool._spawn: modules to import -> standby_main
ENV_STANDBY_READY_FD = "ELASTOR_STANDBY_READY_FD"  # StandbyPool._spawn: the readiness pipe -> standby_main
ENV_STANDBY_TEMPLATE_FD = "ELASTOR_STANDBY_TEMPLATE_FD"  # StandbyTemplate: its socketpair end -> standby_template
# the user -> ``elastor run`` (the controller's own environment)
ENV_SNAPSHOT_SERVER_HOST = "ELASTOR_SNAPSHOT_SERVER_HOST"  # user, else the agent (--local-addr) -> NodeSnapshots
ENV_FORCE_CPU = "ELASTOR_FORCE_CPU"              # user: treat the node as GPU-less -> elastic.cli
ENV_PYTHON = "ELASTOR_PYTHON"                    # user: the workers' interpreter -> agent.build_agent
# bench scripts and tests -> the example trainer (examples/megatron_gpt; the package never reads them)
ENV_SIM_LAYER_S = "ELASTOR_SIM_LAYER_S"          # bench/tests: simulated seconds per layer by TP -> gpt_pipe.py
ENV_PROFILE_BREAKDOWN = "ELASTOR_PROFILE_BREAKDOWN"  # bench: file for per-rank timings -> pretrain_gpt.py

#: what a worker's :class:`LaunchContext` is read from
WORKER_ENV = (ENV_ROUND, ENV_PROCS_PER_NODE, ENV_INITIAL_WORLD, ENV_DEVICES, ENV_GPU_MEMORY_GB,
              ENV_COLLECTIVE_TIMEOUT, ENV_HEARTBEAT_DIR, ENV_EVENTS_FILE, ENV_SNAPSHOT_DIR, ENV_SNAPSHOT_PEERS,
              ENV_SNAPSHOT_SELF, ENV_JOB_SECRET_FILE, ENV_STANDBY_DIR, ENV_LAUNCH_MODE, ENV_T_START,
              ENV_T_STANDBY_SPAWN, ENV_T_STANDBY_READY, ENV_SNAPSHOT_SERVER_HOST)
STANDBY_ENV = (ENV_STANDBY_PRELOAD, ENV_STANDBY_READY_FD, ENV_STANDBY_TEMPLATE_FD)
USER_ENV = (ENV_SNAPSHOT_SERVER_HOST, ENV_FORCE_CPU, ENV_PYTHON)
EXAMPLE_ENV = (ENV_SIM_LAYER_S, ENV_PROFILE_BREAKDOWN)
#: every ``ELASTOR_*`` name, once (docs/elastic.md documents each)
ENV_NAMES = tuple(dict.fromkeys(WORKER_ENV + STANDBY_ENV + USER_ENV + EXAMPLE_ENV))

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_RESIZE = 75   # EX_TEMPFAIL: stopped at a durable checkpoint so the job can be relaunched resized


class LaunchMode(str, enum.Enum):
    """How a worker process came to be: spawned by torch's launcher (``--no-standby``), a standby
    that had done its imports when it was assigned (``warm``), or one that was still importing or
    was spawned for the assignment (``cold``)."""
    SPAWN = "spawn"
    WARM = "standby-warm"
    COLD = "standby-cold"


class StopCode(enum.IntEnum):
    """What a worker was asked to do; workers agree on the maximum."""
    NONE = 0
    RESIZE = 1    # save, exit EXIT_RESIZE; the controller relaunches on a different world
    PREEMPT = 2   # save, exit EXIT_OK; the job ends

    def exit_code(self) -> int:
        return EXIT_RESIZE if self is StopCode.RESIZE else EXIT_OK


def collective_bound(hang_timeout_s: float) -> float:
    """The bound on one collective for a launch with ``--hang-timeout``: twice it, so that the
    controller's own hang detection (a heartbeat older than ``--hang-timeout``, which names the hung
    worker) acts first, and the workers' timeout only where nothing else does."""
    return 2.0 * hang_timeout_s


STARTED_BEAT = "started"   # the heartbeat file's first word once a worker attached its hooks, before an iteration


def heartbeat_path(folder: str, local_rank: int) -> str:
    return os.path.join(folder, f"heartbeat_{int(local_rank)}")


def resize_marker(heartbeat_file: str) -> str:
    """Written by a worker whose ranks agreed on a resize (``ElasticWorker.agree_stop``): its exit
    ``EXIT_RESIZE`` was asked for (here or on another node), not the script's own."""
    return f"{heartbeat_file}.resize"


@dataclass(frozen=True)
class LaunchedWorld:
    """The world a controller launched: processes per node (by node rank) and device memory."""
    procs_per_node: tuple[int, ...]
    gpu_memory_gb: float | None = None
    initial_world_size: int | None = None

    @property
    def world_size(self) -> int:
        return sum(self.procs_per_node)


# ---------------------------------------------------------------- parsing, one variable at a time
_SET_BY_RUN = "`elastor run` sets it; unset it to run the script without `elastor run`"


def _raw(env: Mapping[str, str], name: str) -> Optional[str]:
    """The variable's value, stripped; None when unset or empty (empty means unset everywhere)."""
    value = env.get(name)
    value = value.strip() if value is not None else ""
    return value or None


def _bad(name: str, raw: str, want: str, fix: str = _SET_BY_RUN) -> ConfigError:
    return ConfigError(f"{name}={raw!r}: expected {want} ({fix})")


def _int(env: Mapping[str, str], name: str, low: int) -> Optional[int]:
    raw = _raw(env, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, f"an integer >= {low}") from None
    if value < low:
        raise _bad(name, raw, f"an integer >= {low}")
    return value


def _ints(env: Mapping[str, str], name: str, low: int, what: str) -> Optional[tuple[int, ...]]:
    raw = _raw(env, name)
    if raw is None:
        return None
    try:
        values = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise _bad(name, raw, f"comma-separated {what}") from None
    if min(values) < low:
        raise _bad(name, raw, f"comma-separated {what}, each >= {low}")
    return values


def _positive(env: Mapping[str, str], name: str, what: str, fix: str = _SET_BY_RUN) -> Optional[float]:
    raw = _raw(env, name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, raw, f"{what} > 0", fix) from None
    if not (value > 0 and math.isfinite(value)):
        raise _bad(name, raw, f"{what} > 0", fix)
    return value


def _addresses(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = _raw(env, name)
    out = tuple(a.strip() for a in (raw or "").split(",") if a.strip())
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(name, raw or "", "comma-separated HOST:PORT addresses")
    return out


def _launch_mode(env: Mapping[str, str]) -> LaunchMode:
    raw = _raw(env, ENV_LAUNCH_MODE)
    if raw is None:
        return LaunchMode.SPAWN
    try:
        return LaunchMode(raw)
    except ValueError:
        raise _bad(ENV_LAUNCH_MODE, raw, "one of " + ", ".join(m.value for m in LaunchMode)) from None


# ---------------------------------------------------------------- the launch context
@dataclass(frozen=True)
class LaunchContext:
    """What a worker process gets from ``elastor run``, validated. Every field has the value a
    process outside ``elastor run`` sees: round 0, nothing else known."""
    round: int = 0                                   # ENV_ROUND: launches before this one
    procs_per_node: Optional[tuple[int, ...]] = None  # ENV_PROCS_PER_NODE, by node rank
    initial_world_size: Optional[int] = None         # ENV_INITIAL_WORLD
    devices: Optional[tuple[int, ...]] = None        # ENV_DEVICES: this node's device slots
    gpu_memory_gb: Optional[float] = None            # ENV_GPU_MEMORY_GB
    collective_timeout_s: Optional[float] = None     # ENV_COLLECTIVE_TIMEOUT
    heartbeat_dir: Optional[str] = None              # ENV_HEARTBEAT_DIR
    events_file: Optional[str] = None                # ENV_EVENTS_FILE
    snapshot_dir: Optional[str] = None               # ENV_SNAPSHOT_DIR
    snapshot_peers: tuple[str, ...] = ()             # ENV_SNAPSHOT_PEERS, node-rank order
    snapshot_self: Optional[str] = None              # ENV_SNAPSHOT_SELF
    snapshot_server_host: Optional[str] = None       # ENV_SNAPSHOT_SERVER_HOST
    job_secret_file: Optional[str] = None            # ENV_JOB_SECRET_FILE: the path, never the secret
    standby_dir: Optional[str] = None                # ENV_STANDBY_DIR
    launch_mode: LaunchMode = LaunchMode.SPAWN       # ENV_LAUNCH_MODE
    t_process_start: Optional[float] = None          # ENV_T_START
    t_standby_spawn: Optional[float] = None          # ENV_T_STANDBY_SPAWN
    t_standby_ready: Optional[float] = None          # ENV_T_STANDBY_READY

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "LaunchContext":
        """Parse and check every variable of :data:`WORKER_ENV` in ``env`` (default
        ``os.environ``); an unset or empty variable takes the field's default. ConfigError names
        the first bad variable and its value."""
        env = os.environ if env is None else env
        return cls(
            round=_int(env, ENV_ROUND, 0) or 0,
            procs_per_node=_ints(env, ENV_PROCS_PER_NODE, 1, "process counts (every node needs >= 1 process)"),
            initial_world_size=_int(env, ENV_INITIAL_WORLD, 1),
            devices=_ints(env, ENV_DEVICES, 0, "device indices"),
            gpu_memory_gb=_positive(env, ENV_GPU_MEMORY_GB, "a number of GB", "from `elastor run --gpu-memory-gb`"),
            collective_timeout_s=_positive(env, ENV_COLLECTIVE_TIMEOUT, "a number of seconds"),
            heartbeat_dir=_raw(env, ENV_HEARTBEAT_DIR),
            events_file=_raw(env, ENV_EVENTS_FILE),
            snapshot_dir=_raw(env, ENV_SNAPSHOT_DIR),
            snapshot_peers=_addresses(env, ENV_SNAPSHOT_PEERS),
            snapshot_self=_raw(env, ENV_SNAPSHOT_SELF),
            snapshot_server_host=_raw(env, ENV_SNAPSHOT_SERVER_HOST),
            job_secret_file=_raw(env, ENV_JOB_SECRET_FILE),
            standby_dir=_raw(env, ENV_STANDBY_DIR),
            launch_mode=_launch_mode(env),
            t_process_start=_positive(env, ENV_T_START, "a wall time in seconds"),
            t_standby_spawn=_positive(env, ENV_T_STANDBY_SPAWN, "a wall time in seconds"),
            t_standby_ready=_positive(env, ENV_T_STANDBY_READY, "a wall time in seconds"),
        )

    @property
    def under_elastor_run(self) -> bool:
        """Whether a controller watches this worker (it gave a heartbeat folder or an events file)."""
        return bool(self.heartbeat_dir or self.events_file)

    @property
    def launched_world(self) -> LaunchedWorld | None:
        """The world the controller launched, or None without ``ENV_PROCS_PER_NODE``."""
        if self.procs_per_node is None:
            return None
        return LaunchedWorld(self.procs_per_node, self.gpu_memory_gb, self.initial_world_size)

    def start_marks(self) -> dict[str, float]:
        """The start-up timestamps that are set, by event field name."""
        marks = {"t_process_start": self.t_process_start, "t_standby_spawn": self.t_standby_spawn,
                 "t_standby_ready": self.t_standby_ready}
        return {k: v for k, v in marks.items() if v is not None}


_cached: Optional[tuple[tuple[Optional[str], ...], LaunchContext]] = None


def launch_context() -> LaunchContext:
    """This process's :class:`LaunchContext`, parsed once. It is parsed again only when one of its
    variables changed in ``os.environ`` (the controller narrowing its own environment, a test's
    monkeypatch): a lookup of each name, never a stale value."""
    global _cached
    key = tuple(os.environ.get(n) for n in WORKER_ENV)
    cached = _cached
    if cached is not None and cached[0] == key:
        return cached[1]
    ctx = LaunchContext.from_env(os.environ)
    _cached = (key, ctx)
    return ctx


def _context(env: Optional[Mapping[str, str]]) -> LaunchContext:
    return launch_context() if env is None else LaunchContext.from_env(env)


def collective_timeout_s(env: Optional[Mapping[str, str]] = None) -> float | None:
    """The bound on any one collective the controller gave this launch (:func:`collective_bound`),
    or None (not under ``elastor run``, or hang detection off: torch's defaults, 30 minutes for
    gloo). A worker blocked in a collective with a peer that vanished without a reset fails after
    this long on its own, even where no controller watches."""
    return _context(env).collective_timeout_s


def launched_world(env: Optional[Mapping[str, str]] = None) -> LaunchedWorld | None:
    """The world from the controller's environment, or None when not launched by ``elastor run``."""
    return _context(env).launched_world


def procs_per_node(env: Optional[Mapping[str, str]] = None) -> list[int]:
    """Processes per node (by node rank) of this launch: ``ELASTOR_PROCS_PER_NODE`` under
    ``elastor run`` (nodes may differ), else ``WORLD_SIZE`` cut into ``LOCAL_WORLD_SIZE`` pieces
    (torchrun: every node the same). ``LOCAL_WORLD_SIZE`` alone is wrong for uneven nodes: it is this
    node's count, so ranks on a 1-process node would map 2 ranks of a 2-process node to 2 nodes."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    lw = launched_world(env)
    if lw is not None and lw.world_size == world:
        return list(lw.procs_per_node)
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if world < 1 or local < 1:
        raise ConfigError(f"WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local}: both must be >= 1")
    nodes = [local] * (world // local)
    if world % local:
        nodes.append(world % local)
    return nodes


def node_of_rank(procs: list[int] | tuple[int, ...]) -> list[int]:
    """Node index of every global rank, for processes per node ``procs`` (ranks fill node 0 first)."""
    return [n for n, k in enumerate(procs) for _ in range(k)]


_HOOKS_EXPECTED = False


def expect_worker_hooks() -> None:
    """This process reads stop requests (``ElasticWorker.agree_stop``): an ``ElasticWorker`` calls
    it, and so does a trainer that attaches one only after a long set-up (Megatron-LM's train()).
    Until then a stop signal ends a process launched by ``worker_main`` as the signal would
    (``worker._on_signal``)."""
    global _HOOKS_EXPECTED
    _HOOKS_EXPECTED = True


def worker_hooks_expected() -> bool:
    return _HOOKS_EXPECTED
