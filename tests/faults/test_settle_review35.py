"""Review 35: the culprit of a failure is found however long the killed worker takes to exit.

A killed worker closes its sockets inside its exit, so a peer fails on the reset connection (exit 1)
and can be reaped first. ``policy.settle`` looked again for a fixed 0.3 s; a killed worker whose exit
took longer (a loaded node, a GPU process releasing its memory and device files) was still running
then, the failure named no culprit and ``shrink`` relaunched on the dead worker's device. The
controller now reads the OS's view of each running worker (``_proc_exiting``: SIGKILL pending, exit
begun, zombie) and waits for the exit status of one on its way out, up to ``SETTLE_EXITING_S``.

The real-process test makes the victim's exit slow the way the kernel allows a user process to: its
group leader (the main thread) exits first, so the process is a zombie leader that cannot be reaped
while its last thread lives, as a SIGKILLed multi-threaded worker is while its other threads still
exit. That thread resets the peer's connection, lives on for longer than 0.3 s, then SIGKILLs the
process."""
from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from elastor_ds.elastic.agent import ElastorAgent, _proc_exiting
from elastor_ds.elastic.policy import (SETTLE_EXITING_S, SETTLE_S, DeviceBook, OnFailure, WorkerOutcome, culprits,
                                       decide_after_failure, settle)

pytestmark = pytest.mark.timeout(120)

# rank 0: the peer, exits 1 as soon as its connection to rank 1 is reset (as gloo's send/recv does)
PEER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.recv(1)
sys.exit(1)
"""
# rank 1: the killed worker whose exit takes ``argv[1]`` seconds after it reset its peer's connection
SLOW_EXIT = """
import ctypes, os, signal, socket, struct, sys, threading, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()

def last_thread():
    # the group leader has exited: the process is a zombie leader, not reapable while this thread lives
    while open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.005)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()                         # RST: the peer fails now
    time.sleep(float(sys.argv[1]))       # the rest of the exit
    os.kill(os.getpid(), signal.SIGKILL)

threading.Thread(target=last_thread).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def _observer(procs):
    """ElastorAgent._observe over real processes (no hang check), as the controller's loop calls it."""
    handlers = {lr: SimpleNamespace(proc=p) for lr, p in enumerate(procs)}
    agent = SimpleNamespace(_handlers=lambda: handlers, _heartbeat_record=lambda lr: (None, None, False),
                            cfg=SimpleNamespace(hang_timeout=None, startup_timeout=None), _stopping=None,
                            devices=list(range(len(procs))))
    wg = SimpleNamespace(workers=[SimpleNamespace(global_rank=lr) for lr in range(len(procs))])
    return lambda: ElastorAgent._observe(agent, wg)


def _first_failure(observe, timeout: float = 60.0) -> list[WorkerOutcome]:
    """The controller's loop: look until something failed."""
    t_end = time.monotonic() + timeout
    outs = observe()
    while not any(o.failed for o in outs):
        assert time.monotonic() < t_end, "no worker ended"
        time.sleep(0.01)
        outs = observe()
    return outs


def test_a_killed_worker_whose_exit_outlasts_the_short_window_is_still_the_culprit():
    slow_s = 1.5   # five times SETTLE_S, far below SETTLE_EXITING_S
    assert SETTLE_S < slow_s < SETTLE_EXITING_S
    victim = subprocess.Popen([sys.executable, "-c", SLOW_EXIT, str(slow_s)], stdout=subprocess.PIPE, text=True)
    port = int(victim.stdout.readline())
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)])
    procs = [peer, victim]
    try:
        observe = _observer(procs)
        outs = _first_failure(observe)
        # the peer's exit 1 is seen while the killed worker still runs, and the OS shows it exiting
        assert [(o.exitcode, o.exiting) for o in outs] == [(1, False), (None, True)], outs
        t0 = time.monotonic()
        judged = settle(observe, outs)
        waited = time.monotonic() - t0
        assert [(o.local_rank, o.exitcode) for o in judged] == [(0, 1), (1, -9)], judged
        assert [o.local_rank for o in culprits(judged)] == [1], judged
        assert waited < SETTLE_EXITING_S, waited   # it ended with the exit, not at the bound
        dec = decide_after_failure(OnFailure.SHRINK, DeviceBook((0, 1)), judged, 0, 3, None)
        assert list(dec.lost) == [1] and list(dec.devices) == [0], dec
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_plain_exit_beside_a_running_worker_is_judged_after_the_short_window():
    """The common case keeps its latency: nothing is exiting, so the judgement comes after SETTLE_S."""
    peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    procs = [peer, busy]
    try:
        observe = _observer(procs)
        outs = _first_failure(observe)
        assert [(o.exitcode, o.exiting) for o in outs] == [(1, False), (None, False)], outs
        t0 = time.monotonic()
        judged = settle(observe, outs)
        waited = time.monotonic() - t0
        assert [(o.exitcode, o.exiting) for o in judged] == [(1, False), (None, False)] and culprits(judged) == []
        assert SETTLE_S <= waited < 10.0, waited   # the short window (generous on a loaded machine), not 30 s
        assert not _proc_exiting(busy.pid)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_settle_waits_for_an_exiting_worker_up_to_its_bound():
    """Scripted observations, a fake clock: a worker shown exiting is waited for past SETTLE_S until
    its exit status shows (at 1 s here: culprit rank 1); one exiting for ever is judged at the bound;
    one that stops exiting (reaped with a plain exit) ends the wait at once."""
    t = [0.0]

    def clock():
        return t[0]

    def sleep(s):
        t[0] += s
    exit1 = WorkerOutcome(0, 0, exitcode=1)
    dying = WorkerOutcome(1, 1, exiting=True)
    killed = WorkerOutcome(1, 1, exitcode=-9)
    looks = [0]

    def observe():
        looks[0] += 1
        return [exit1, killed if t[0] >= 1.0 - 1e-9 else dying]
    got = settle(observe, [exit1, dying], window_s=0.3, poll_s=0.02, clock=clock, sleep=sleep, exiting_s=30.0)
    assert got == [exit1, killed] and [o.local_rank for o in culprits(got)] == [1]
    assert abs(t[0] - 1.0) < 1e-6 and looks[0] == 50

    t[0], looks[0] = 0.0, 0
    got = settle(lambda: looks.__setitem__(0, looks[0] + 1) or [exit1, dying], [exit1, dying], window_s=0.3,
                 poll_s=0.02, clock=clock, sleep=sleep, exiting_s=30.0)
    assert got == [exit1, dying] and 30.0 <= t[0] < 30.03 and culprits(got) == []

    t[0] = 0.0
    seen = iter([[exit1, dying], [exit1, WorkerOutcome(1, 1, exitcode=1)]])
    got = settle(lambda: next(seen), [exit1, dying], window_s=0.3, poll_s=0.02, clock=clock, sleep=sleep)
    assert [o.exitcode for o in got] == [1, 1] and abs(t[0] - 0.04) < 1e-9
