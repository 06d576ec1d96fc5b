"""How the background checkpoint writer shares the CPU with training: on the cycles training leaves
idle while nobody waits for it, at its normal (niced) priority as soon as someone does.

Why: a writer thread at nice +10..19 still takes the core from the training thread in slices
(the kernel's fair scheduler owes a niced thread its share when it wakes). On the development VM,
with two ranks computing on two cores, each training thread spent 11-31 % of a write waiting on its
core's run queue behind the niced writer and its helpers, whose own CPU was a few percent of that
time (``bench/results/2026-12-02-writer-sched.md``). Under ``SCHED_IDLE`` (Linux, per thread,
allowed without privileges) a waking training thread preempts the writer at once: the same runs
showed 1 % run-queue wait.

The price: a ``SCHED_IDLE`` writer makes no progress while every core is busy. So the writer is
*escalated* back to ``SCHED_OTHER`` (keeping its nice value) when the training loop waits for it
(:meth:`WriterPriority.urgent`: ``wait()``, a save behind an unfinished one, ``finalize()``) and
at the latest ``deadline_s`` seconds after a save starts (one watcher thread per engine, at normal
priority), so a save is never starved for longer than that. A GPU job's host cores are mostly idle, so there the
writer finishes at full speed without ever being escalated.

Threads the writer starts (the ``O_DIRECT`` write helper, the fsync helper) inherit its
policy from the kernel; they enter the writer's group (:func:`thread_target`) so that an escalation
reaches them too. Elsewhere than Linux, or where the kernel refuses, threads keep the priority they
have (logged once at debug level).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

from ..threads import NamedThread
from .settings import DEFAULT_WRITER_DEADLINE_S, DEFAULT_WRITER_SCHED, WriterSched

log = logging.getLogger(__name__)

__all__ = ["WriterPriority", "WriterSched", "thread_target", "DEFAULT_WRITER_SCHED", "DEFAULT_WRITER_DEADLINE_S"]


_local = threading.local()   # .group: the WriterPriority whose thread this is
_warned: list[bool] = []
_warned_nice: list[bool] = []


def _rlimit_nice() -> str:
    try:
        import resource
        return str(resource.getrlimit(resource.RLIMIT_NICE)[0])
    except (ImportError, AttributeError, OSError, ValueError):
        return "unknown"


def _set_policy(tid: int, idle: bool) -> bool:
    policy = getattr(os, "SCHED_IDLE" if idle else "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except OSError as e:   # ESRCH: the thread has ended; EPERM: refused (kept as it is)
        if not _warned:
            _warned.append(True)
            log.debug("checkpoint writer thread %d keeps its scheduling policy (%s)", tid, e)
        return False


_escalation: list[bool] = []   # cached answer of idle_can_be_undone()


def idle_can_be_undone() -> bool:
    """Whether a thread of this process that went to ``SCHED_IDLE`` may be set back to ``SCHED_OTHER``.
    Linux allows that only with ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` above the thread's nice value
    (the default limit, 0, forbids it: an unprivileged process can lower its threads' priority but
    never raise it again). Tried once per process on a throwaway thread, which is the only reliable
    test (capabilities, containers and the limit all enter)."""
    if _escalation:
        return _escalation[0]
    idle, other = getattr(os, "SCHED_IDLE", None), getattr(os, "SCHED_OTHER", None)
    if idle is None or other is None or not hasattr(os, "sched_setscheduler"):
        _escalation.append(False)
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))
        except OSError:
            ok.append(False)
            return
        try:
            os.sched_setscheduler(0, other, os.sched_param(0))
            ok.append(True)
        except OSError:
            ok.append(False)
    t = threading.Thread(target=probe, name="elastor-sched-probe", daemon=True)
    t.start()
    t.join()
    _escalation.append(bool(ok and ok[0]))
    return _escalation[0]


def _add_nice(tid: int, increment: int) -> None:
    if not increment:
        return
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
    except (AttributeError, OSError) as e:
        log.debug("checkpoint writer keeps its priority (setpriority refused: %s)", e)


class WriterPriority:
    """The scheduling of one engine's writer thread and the helpers it starts."""

    def __init__(self, sched: "WriterSched | str" = DEFAULT_WRITER_SCHED, nice: int = 0,
                 deadline_s: float = DEFAULT_WRITER_DEADLINE_S):
        self.set_sched(sched)
        if not deadline_s > 0:
            raise ValueError(f"writer deadline_s={deadline_s}: must be > 0 seconds")
        self.nice = int(nice)
        self.deadline_s = float(deadline_s)
        self._lock = threading.Condition()   # guards the state below; notified when a deadline moves
        self._tids: set[int] = set()
        self._background = False   # True while a save runs that nobody waits for
        self._deadline = 0.0       # time.monotonic() when the current background save is escalated
        self._watcher: Optional[threading.Thread] = None   # one per group, started with the first save
        self._escalated: "str | bool" = False
        self._boosts = 0           # boosted() contexts open: the group runs at normal priority meanwhile
        self.escalations = 0       # how many saves were escalated (by a wait or the deadline)
        self.helper_cpu_s = 0.0    # CPU seconds of the helper threads that have ended (thread_target)

    def set_sched(self, sched: "WriterSched | str") -> None:
        """The policy (before the writer's first save): ``"idle"`` becomes ``"nice"`` in a process
        that may not undo ``SCHED_IDLE`` (:func:`idle_can_be_undone`)."""
        self.sched = WriterSched(sched)
        if self.sched is WriterSched.IDLE and not idle_can_be_undone():
            # an idle-scheduled writer could never be given its priority back (not when the loop
            # waits for it, not at the deadline, not for a fence): it would wait for idle cores
            # however long training keeps them busy; a lowered priority throughout instead
            if not _warned_nice:
                _warned_nice.append(True)
                log.info("checkpoint writer: this process may not raise a thread back from SCHED_IDLE (no "
                         "CAP_SYS_NICE, RLIMIT_NICE %s), so the writer runs at a lowered nice value instead of on "
                         "idle cycles only (writer_sched \"nice\"); CAP_SYS_NICE, or `ulimit -e 20` before the "
                         "launch where the hard limit allows it, lets it run idle", _rlimit_nice())
            self.sched = WriterSched.NICE

    def enter(self, nice: bool = False) -> None:
        """Called first by every thread of the group (``nice``: the writer thread itself, which
        also lowers its nice value once; helpers inherit it)."""
        tid = threading.get_native_id()
        _local.group = self
        if nice:
            _add_nice(tid, self.nice)
        if self.sched is not WriterSched.IDLE:
            with self._lock:
                self._tids.add(tid)
            return
        # the kernel gave a new thread its creator's policy (idle, if the writer is): normal first, so
        # that it never holds the lock while idle-scheduled (a training thread that waits for the lock
        # in boosted() or begin() would wait for an idle core: the lock is not the kernel's to boost)
        _set_policy(tid, False)
        with self._lock:
            self._tids.add(tid)
            idle = self._background and not self._boosts
        if idle:
            _set_policy(tid, True)
            # a boost or escalation between the lock's release and the line above set this thread
            # normal before it went idle: follow the state again (each of them sets every thread's policy
            # under the lock, after changing the state, so the last word is the state's)
            if not (self._background and not self._boosts):
                _set_policy(tid, False)

    def _normal_self(self) -> None:
        """Before an idle-scheduled thread of the group takes the lock: normal priority (it is about
        to end, or to finish a save; begin() sets it idle again for the next one)."""
        if self.sched is WriterSched.IDLE:
            _set_policy(threading.get_native_id(), False)

    def leave(self) -> None:
        self._normal_self()
        with self._lock:
            self._tids.discard(threading.get_native_id())
        _local.group = None

    def begin(self) -> None:
        """A save was handed to the writer: background priority until :meth:`urgent` or the deadline.
        On the training thread: a notify, no thread start (the watcher is started once)."""
        if self.sched is not WriterSched.IDLE:
            return
        with self._lock:
            self._background = True
            self._escalated = False
            self._deadline = time.monotonic() + self.deadline_s
            for t in self._tids:
                _set_policy(t, not self._boosts)
            if self._watcher is None:
                self._watcher = NamedThread(target=self._watch, name="elastor-writer-deadline", daemon=True)
                self._watcher.start()
            self._lock.notify()

    def _watch(self) -> None:
        """Escalate a background save whose deadline has passed (sleeps while none runs)."""
        me = threading.current_thread()
        with self._lock:
            while self._watcher is me:
                if not self._background:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._escalate("deadline")

    def close(self, join_s: float = 0.0) -> None:
        """Stop the watcher (the engine's writer stopped); the next :meth:`begin` starts a new one.
        ``join_s``: wait that long for it to end (at interpreter exit: no thread of ours may still
        run when the interpreter finalizes)."""
        with self._lock:
            watcher, self._watcher = self._watcher, None
            self._lock.notify_all()
        if join_s > 0 and watcher is not None and watcher is not threading.current_thread():
            watcher.join(join_s)

    def urgent(self, why: str = "wait") -> None:
        """Someone waits for the save: normal priority until the next save."""
        if self.sched is not WriterSched.IDLE:
            return
        with self._lock:
            self._escalate(why)

    @contextlib.contextmanager
    def boosted(self) -> Iterator[None]:
        """A background save's threads at normal priority for the duration, then back in the
        background unless someone escalated it meanwhile: for the training thread when it waits
        for a lock the writer holds (a live write's fence), which a ``SCHED_IDLE`` holder would
        only release once a core goes idle."""
        if self.sched is not WriterSched.IDLE:
            yield
            return
        with self._lock:
            self._boosts += 1
            if self._background and self._boosts == 1:
                for t in self._tids:
                    _set_policy(t, False)
        try:
            yield
        finally:
            with self._lock:
                self._boosts -= 1
                if self._background and not self._boosts:
                    for t in self._tids:
                        _set_policy(t, True)

    def _escalate(self, why: str) -> None:
        """(Lock held.) The background save, if any, back to normal priority."""
        if not self._background:
            return
        self._background = False
        self._escalated = why
        self.escalations += 1
        for t in self._tids:
            _set_policy(t, False)
        log.debug("checkpoint writer escalated to normal priority (%s)", why)

    def end(self) -> Optional[str]:
        """The save finished: nothing to escalate any more. Returns why it was escalated (``"wait"``,
        ``"deadline"``), or None when it finished in the background (or the policy is ``nice``)."""
        if getattr(_local, "group", None) is self:   # the writer itself: never idle while it holds the lock
            self._normal_self()
        with self._lock:
            why, self._escalated = self._escalated, False
            self._background = False
            return why or None


def thread_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped to run in the calling thread's writer group, if it has one (a helper thread
    of the writer: an escalation of the writer reaches it, and its CPU time is added to the
    group's ``helper_cpu_s`` when it ends)."""
    group: Optional[WriterPriority] = getattr(_local, "group", None)
    if group is None:
        return fn

    def run(*a: Any, **k: Any) -> Any:
        group.enter()
        cpu0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent = time.thread_time() - cpu0
            group._normal_self()
            with group._lock:
                group.helper_cpu_s += spent
            group.leave()
    return run
