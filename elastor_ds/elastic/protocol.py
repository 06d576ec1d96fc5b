"""The contract between ``elastor run`` and its workers (pure): environment variables, exit codes,
stop codes and heartbeat files.

1. The controller launches each worker as ``python -m elastor_ds.elastic.worker_main SCRIPT ARGS``
   with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) plus the ``ENV_*`` below.
2. A worker touches its heartbeat file once per iteration (:func:`heartbeat_path`); a running
   worker whose heartbeat is older than ``--hang-timeout`` is hung.
3. The controller asks for a graceful stop with a signal: SIGTERM/SIGINT (preemption: save and exit
   ``EXIT_OK``) or SIGUSR1 (resize: save and exit ``EXIT_RESIZE``). Workers agree on the largest
   stop code with one all-reduce at the end of an iteration, save that iteration, wait until it is
   durable and exit.
4. A worker that rejects the launched world (the planner finds no plan, the flags do not fit)
   exits ``EXIT_USAGE``: the controller does not retry that world.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass

ENV_EVENTS_FILE = "ELASTOR_EVENTS_FILE"          # JSONL the workers' rank 0 appends its events to
ENV_HEARTBEAT_DIR = "ELASTOR_HEARTBEAT_DIR"      # folder of per-local-rank heartbeat files
ENV_PROCS_PER_NODE = "ELASTOR_PROCS_PER_NODE"    # "2,1": processes per node of this launch, by node rank
ENV_INITIAL_WORLD = "ELASTOR_INITIAL_WORLD_SIZE"  # world size of the controller's first launch
ENV_GPU_MEMORY_GB = "ELASTOR_GPU_MEMORY_GB"      # per-device memory for the planner (optional)
ENV_ROUND = "ELASTOR_ROUND"                      # launches by this controller before this one
ENV_T_START = "ELASTOR_T_PROCESS_START"          # set by worker_main: wall time the process started
#                                                  (a standby worker: the time it was assigned its rank)
ENV_LAUNCH_MODE = "ELASTOR_LAUNCH_MODE"          # LaunchMode of this worker process
ENV_T_STANDBY_SPAWN = "ELASTOR_T_STANDBY_SPAWN"  # a standby worker: wall time its process started
ENV_T_STANDBY_READY = "ELASTOR_T_STANDBY_READY"  # a standby worker: wall time its imports were done
ENV_STANDBY_DIR = "ELASTOR_STANDBY_DIR"          # node-local folder of the standby pool (modules list)
ENV_COLLECTIVE_TIMEOUT = "ELASTOR_COLLECTIVE_TIMEOUT_S"  # seconds a collective may wait (2 x --hang-timeout)

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


def collective_timeout_s(env: dict[str, str] | None = None) -> float | None:
    """The bound on any one collective the controller gave this launch (:func:`collective_bound`),
    or None (not under ``elastor run``, or hang detection off: torch's defaults, 30 minutes for
    gloo). A worker blocked in a collective with a peer that vanished without a reset fails after
    this long on its own, even where no controller watches."""
    env = os.environ if env is None else env
    raw = env.get(ENV_COLLECTIVE_TIMEOUT, "").strip()
    if not raw:
        return None
    try:
        t = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_COLLECTIVE_TIMEOUT}={raw!r}: expected a number of seconds > 0") from None
    if not (t > 0 and t < float("inf")):
        raise ValueError(f"{ENV_COLLECTIVE_TIMEOUT}={raw!r}: expected a number of seconds > 0")
    return t


def heartbeat_path(folder: str, local_rank: int) -> str:
    return os.path.join(folder, f"heartbeat_{int(local_rank)}")


@dataclass(frozen=True)
class LaunchedWorld:
    """The world a controller launched: processes per node (by node rank) and device memory."""
    procs_per_node: tuple[int, ...]
    gpu_memory_gb: float | None = None
    initial_world_size: int | None = None

    @property
    def world_size(self) -> int:
        return sum(self.procs_per_node)


def procs_per_node(env: dict[str, str] | None = None) -> list[int]:
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
        raise ValueError(f"WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local}: both must be >= 1")
    nodes = [local] * (world // local)
    if world % local:
        nodes.append(world % local)
    return nodes


def node_of_rank(procs: list[int] | tuple[int, ...]) -> list[int]:
    """Node index of every global rank, for processes per node ``procs`` (ranks fill node 0 first)."""
    return [n for n, k in enumerate(procs) for _ in range(k)]


def launched_world(env: dict[str, str] | None = None) -> LaunchedWorld | None:
    """The world from the controller's environment, or None when not launched by ``elastor run``."""
    env = os.environ if env is None else env
    raw = env.get(ENV_PROCS_PER_NODE)
    if not raw:
        return None
    try:
        per_node = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"{ENV_PROCS_PER_NODE}={raw!r}: expected comma-separated process counts") from None
    if not per_node or min(per_node) < 1:
        raise ValueError(f"{ENV_PROCS_PER_NODE}={raw!r}: every node needs >= 1 process")
    mem = env.get(ENV_GPU_MEMORY_GB)
    init = env.get(ENV_INITIAL_WORLD)
    return LaunchedWorld(per_node, float(mem) if mem else None, int(init) if init else None)
