"""The controller's view of a hang (ElastorAgent._observe with real processes): when one worker is
SIGSTOPped, every rank stops beating at about the same time and the one whose last beat is oldest
may be a rank that only waits. The stopped worker must still be named the culprit (hung and
stopped), whatever its own last beat, so that its device is the one dropped."""
from __future__ import annotations

import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from elastor_ds.elastic.agent import ElastorAgent
from elastor_ds.elastic.policy import culprits


@pytest.fixture
def two_workers():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _observe(procs, beats, hang_timeout=4.0, startup_timeout=None, iteration=7):
    """``beats``: each worker's newest heartbeat time; ``iteration`` None: they are the records of
    hooks that attached, no iteration done yet."""
    handlers = {lr: SimpleNamespace(proc=p) for lr, p in enumerate(procs)}
    agent = SimpleNamespace(_handlers=lambda: handlers, _heartbeat_record=lambda lr: (beats[lr], iteration, False),
                            cfg=SimpleNamespace(hang_timeout=hang_timeout, startup_timeout=startup_timeout),
                            _stopping=None, devices=[0, 1])
    wg = SimpleNamespace(workers=[SimpleNamespace(global_rank=lr) for lr in range(len(procs))])
    return ElastorAgent._observe(agent, wg)


def _wait_stopped(pid: int) -> None:
    for _ in range(200):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_a_stopped_worker_with_the_newer_beat_is_the_culprit(two_workers):
    two_workers[1].send_signal(signal.SIGSTOP)
    _wait_stopped(two_workers[1].pid)
    now = time.time()
    # rank 0 (running, waiting on rank 1) beat 4.02 s ago, rank 1 (stopped) 3.98 s ago: only rank 0
    # is past the 4 s timeout, as in the failed CI run of test_sigstopped_worker_is_a_hang_and_is_dropped
    outs = _observe(two_workers, {0: now - 4.02, 1: now - 3.98})
    assert [(o.local_rank, o.hung, o.stopped) for o in outs] == [(0, True, False), (1, True, True)]
    assert [o.local_rank for o in culprits(outs)] == [1]


def test_no_hang_no_culprit_even_if_a_worker_is_stopped(two_workers):
    two_workers[1].send_signal(signal.SIGSTOP)
    _wait_stopped(two_workers[1].pid)
    now = time.time()
    outs = _observe(two_workers, {0: now - 1.0, 1: now - 1.0})   # nobody past the timeout yet
    assert [(o.hung, o.stopped) for o in outs] == [(False, False), (False, False)]


def test_a_hang_with_nothing_stopped_names_no_culprit(two_workers):
    now = time.time()
    outs = _observe(two_workers, {0: now - 5.0, 1: now - 3.0})
    assert [(o.local_rank, o.hung, o.stopped) for o in outs] == [(0, True, False), (1, False, False)]
    assert culprits(outs) == []


def test_before_the_first_iteration_the_startup_timeout_applies(two_workers):
    """A worker whose hooks attached 5 s ago and that has done no iteration: hung under a 4 s
    start-up allowance, not under 10 s, whatever --hang-timeout says; without a record (no hooks,
    or not attached yet) never."""
    now = time.time()
    outs = _observe(two_workers, {0: now - 5.0, 1: now - 0.5}, hang_timeout=1.0, startup_timeout=4.0, iteration=None)
    assert [(o.local_rank, o.hung) for o in outs] == [(0, True), (1, False)]
    outs = _observe(two_workers, {0: now - 5.0, 1: now - 0.5}, hang_timeout=1.0, startup_timeout=10.0, iteration=None)
    assert [o.hung for o in outs] == [False, False]
    outs = _observe(two_workers, {0: now - 5.0, 1: now - 0.5}, hang_timeout=1.0, startup_timeout=None, iteration=None)
    assert [o.hung for o in outs] == [False, False]
    outs = _observe(two_workers, {0: None, 1: None}, hang_timeout=1.0, startup_timeout=0.1, iteration=None)
    assert [o.hung for o in outs] == [False, False]
