"""What to do after a failure, a scale-up request or a preemption (pure: values in, decisions out;
only :func:`settle` waits, through the clock and the observer it is given).

Devices are the node's local slots (GPU ids, or process slots on CPU). Local rank ``i`` of a launch
runs on ``usable[i]``. A worker is a *culprit* when it died of a signal the controller did not send
(SIGKILL, SIGSEGV, ...) or was found stopped (SIGSTOP) while hung; a worker that exited non-zero
on its own is not (its peers' loss makes survivors fail with a communication error). Because those
survivors can end before the killed worker can be reaped, a failure whose every worker merely
exited non-zero is looked at again for up to :data:`SETTLE_S`, and for as long as the OS shows a
worker on its way out (killed, or exiting but not reapable yet), up to :data:`SETTLE_EXITING_S`
(:func:`settle`). Policies:

- ``shrink``: culprits' devices are lost; relaunch on the rest (no culprit: same devices again).
- ``restart``: relaunch on the same devices (a transient fault).
- ``probe``: the devices that pass a health probe (GPU); without GPUs it behaves as ``shrink``.

Failure relaunches count against ``max_restarts``; resizes and membership changes do not. One
failure counts once for the job: a node whose workers failed only because another node's did (its
*collateral*, see :mod:`ledger`) relaunches without counting it. A world the trainer rejects (exit
code 2: no plan fits, flags do not fit) is not retried.
"""
from __future__ import annotations

import enum
import signal as _signal
import time as _time
from dataclasses import dataclass, field

from ..errors import ConfigError
from .protocol import EXIT_RESIZE, EXIT_USAGE


class OnFailure(enum.Enum):
    SHRINK = "shrink"
    RESTART = "restart"
    PROBE = "probe"


class Cause(enum.Enum):
    SIGNAL = "signal"      # died of a signal the controller did not send
    EXIT = "exit"          # exited non-zero
    HANG = "hang"          # no heartbeat for --hang-timeout seconds
    REJECTED = "rejected"  # exit code 2: the trainer cannot run the launched world
    NODE_LOST = "node_lost"  # another node of the round went silent (liveness): the worker is healthy


class Action(enum.Enum):
    RELAUNCH = "relaunch"
    STOP = "stop"


@dataclass(frozen=True)
class WorkerOutcome:
    """One local worker at detection time."""
    local_rank: int
    device: int
    global_rank: int = -1
    exitcode: int | None = None      # None: still running at detection (then torn down by the controller)
    hung: bool = False               # heartbeat older than the hang timeout
    stopped: bool = False            # process state T (SIGSTOP) at detection
    stop_signalled: bool = False     # the controller had sent it a stop signal (SIGTERM/SIGUSR1)
    peer_lost: bool = False          # running, but a node of its round was lost (see liveness)
    exiting: bool = False            # running, but the OS shows it on its way out (SIGKILL pending, exit
                                     # in progress, a zombie not reapable yet): its exit status follows

    @property
    def signal(self) -> int | None:
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    def signal_name(self) -> str | None:
        s = self.signal
        if s is None:
            return None
        try:
            return _signal.Signals(s).name
        except ValueError:
            return f"signal {s}"

    @property
    def failed(self) -> bool:
        return self.hung or self.peer_lost or (self.exitcode is not None and self.exitcode not in (0, EXIT_RESIZE))

    @property
    def cause(self) -> Cause | None:
        if self.hung:
            return Cause.HANG
        if self.peer_lost:
            return Cause.NODE_LOST
        if self.exitcode is None or self.exitcode in (0, EXIT_RESIZE):
            return None
        if self.exitcode < 0:
            # killed by the stop signal the controller sent: it was already on its way out (e.g. an
            # interpreter exiting after a peer's loss resets its handlers): not the device's fault
            if self.stop_signalled and -self.exitcode in (_signal.SIGTERM, _signal.SIGUSR1, _signal.SIGINT):
                return Cause.EXIT
            return Cause.SIGNAL
        return Cause.REJECTED if self.exitcode == EXIT_USAGE else Cause.EXIT


# How long a failure whose every worker merely exited non-zero is watched before it is judged. A
# worker killed by a signal closes its sockets before the kernel lets its parent reap it, so a peer
# can fail on the reset connection (exit 1) and be seen first: judged then, the failure names no
# culprit and ``shrink`` relaunches on the dead worker's device (seen in CI under load).
SETTLE_S = 0.3
# The killed worker is already on its way out when its peer fails (its sockets close inside its
# exit), but its exit can take far longer than SETTLE_S to end: on a loaded node it waits for a CPU,
# and a GPU process releases its memory and its device files first. While the OS shows a running
# worker exiting (WorkerOutcome.exiting), the judgement waits for its exit status, up to this bound
# (an exit stuck for longer, in the driver, is judged as it is). It ends as soon as the worker is reaped.
SETTLE_EXITING_S = 30.0
SETTLE_POLL_S = 0.02


def settle(observe, outcomes: list[WorkerOutcome], window_s: float = SETTLE_S, poll_s: float = SETTLE_POLL_S,
           clock=None, sleep=None, exiting_s: float = SETTLE_EXITING_S) -> list[WorkerOutcome]:
    """``outcomes`` (some failed), or a later ``observe()`` of the same workers: while every failure
    is a plain exit (no signal death, hang or lost node yet) and some worker still runs, look again
    every ``poll_s`` for up to ``window_s``, or up to ``exiting_s`` while some running worker is
    ``exiting``; return as soon as a failure of another cause shows, or every worker has ended."""
    clock = clock or _time.monotonic
    sleep = sleep or _time.sleep
    t0 = clock()
    deadline, exiting_deadline = t0 + window_s, t0 + max(window_s, exiting_s)

    def undecided(outs: list[WorkerOutcome]) -> bool:
        return (all(o.cause in (Cause.EXIT, Cause.REJECTED) for o in outs if o.failed)
                and any(o.exitcode is None for o in outs))

    def dying(outs: list[WorkerOutcome]) -> bool:
        return any(o.exiting for o in outs if o.exitcode is None)
    while undecided(outcomes) and clock() < (exiting_deadline if dying(outcomes) else deadline):
        sleep(poll_s)
        outcomes = observe()
    return outcomes


def culprits(outcomes: list[WorkerOutcome]) -> list[WorkerOutcome]:
    """The workers whose device is suspect: signal deaths, and hung workers found stopped (when no
    hung worker is stopped, a hang names no culprit: every rank waits on every other)."""
    sig = [o for o in outcomes if o.cause is Cause.SIGNAL]
    stopped = [o for o in outcomes if o.hung and o.stopped]
    return sorted(sig + stopped, key=lambda o: o.local_rank)


def failure_summary(outcomes: list[WorkerOutcome]) -> str:
    """The failure of a launch in a few words, as a job's last line names it (torchrun's summary
    names its root cause): the culprits (signal deaths, hung workers found stopped) first, else the
    hung, the ones whose node was lost, the ones that exited non-zero; "" when none failed."""
    failed = [o for o in outcomes if o.failed]
    if not failed:
        return ""
    picked = culprits(outcomes) or [o for o in failed if o.hung] or [o for o in failed if o.peer_lost] or failed
    o = picked[0]
    who = f"local rank {o.local_rank}" + (f" (rank {o.global_rank})" if o.global_rank >= 0 else "")
    if o.hung:
        how = "hung (stopped)" if o.stopped else "hung"
    elif o.peer_lost:
        how = "stopped by the loss of a node of its round"
    elif o.signal is not None:
        how = f"killed by {o.signal_name()}"
    else:
        how = f"exited with code {o.exitcode}"
    more = f" (and {len(failed) - 1} other worker(s) of this node)" if len(failed) > 1 else ""
    return f"{who} {how}{more}"


@dataclass
class DeviceBook:
    """The node's device slots: which are usable, which were lost (and may return)."""
    all_devices: tuple[int, ...]
    lost: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.all_devices:
            raise ConfigError("a node needs at least one device slot (--nproc-per-node >= 1)")

    @property
    def usable(self) -> tuple[int, ...]:
        return tuple(d for d in self.all_devices if d not in self.lost)

    def lose(self, devices) -> None:
        self.lost |= set(devices) & set(self.all_devices)

    def restore(self, devices) -> list[int]:
        back = sorted(set(devices) & self.lost)
        self.lost -= set(back)
        return back


@dataclass(frozen=True)
class Decision:
    action: Action
    devices: tuple[int, ...] = ()        # devices of the next launch (RELAUNCH)
    lost: tuple[int, ...] = ()           # devices newly treated as lost
    counts_as_restart: bool = True
    reason: str = ""


def decide_after_failure(policy: OnFailure, book: DeviceBook, outcomes: list[WorkerOutcome], restarts_used: int,
                         max_restarts: int, probe_ok: dict[int, bool] | None = None,
                         collateral_of: str | None = None) -> Decision:
    """The decision after a failed launch. ``probe_ok`` (device -> passed) is given for ``probe``
    on GPU; ``probe`` without it behaves as ``shrink``. ``collateral_of``: the node this round's
    failure is charged to, when it is not this one (then the restart budget is that node's to
    check, and this relaunch does not count). Updates nothing: apply ``lost`` yourself."""
    failed = [o for o in outcomes if o.failed]
    rejected = [o for o in failed if o.cause is Cause.REJECTED]
    if rejected and len(rejected) == len(failed):
        return Decision(Action.STOP, reason=f"the trainer rejected the launched world (exit code {EXIT_USAGE} on "
                                            f"local ranks {[o.local_rank for o in rejected]}): a usage error (a flag, a config, a "
                                            f"plan) or a world the model cannot run on; see the worker's error "
                                            f"above")
    if collateral_of is None and restarts_used >= max_restarts:
        last = failure_summary(outcomes)
        return Decision(Action.STOP, reason=f"--max-restarts {max_restarts} exhausted ({restarts_used} relaunches "
                                            f"after failures){f'; the last failure: {last}' if last else ''}; "
                                            f"raise --max-restarts to keep going")
    current = book.usable
    if policy is OnFailure.RESTART:
        lost: tuple[int, ...] = ()
    elif policy is OnFailure.PROBE and probe_ok is not None:
        lost = tuple(d for d in current if not probe_ok.get(d, False))
    else:
        lost = tuple(sorted({o.device for o in culprits(outcomes)}))
    devices = tuple(d for d in current if d not in lost)
    if not devices:
        return Decision(Action.STOP, lost=lost, reason=f"no usable device left on this node (lost {list(lost)}); "
                                                       f"the node leaves the job")
    what = "same devices" if not lost else f"without device(s) {list(lost)}"
    if collateral_of is not None:
        return Decision(Action.RELAUNCH, devices=devices, lost=lost, counts_as_restart=False,
                        reason=f"{policy.value}: relaunch on {len(devices)} device(s), {what} (collateral of the "
                               f"failure on {collateral_of}: not counted against --max-restarts)")
    return Decision(Action.RELAUNCH, devices=devices, lost=lost,
                    reason=f"{policy.value}: relaunch on {len(devices)} device(s), {what}")


def decide_scale_up(book: DeviceBook, returned: list[int] | None) -> tuple[int, ...]:
    """Devices to add back: ``returned`` (probe results) or, for an operator's request (None),
    every lost device. Empty: nothing to do."""
    cand = sorted(book.lost) if returned is None else sorted(set(returned) & book.lost)
    return tuple(cand)
