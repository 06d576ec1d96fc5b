"""The checkpoint writer's scheduling (elastor_ds.checkpoint.writer_sched): under SCHED_IDLE while a
save runs that nobody waits for, back to SCHED_OTHER when the training loop waits or the deadline
passes, helpers included; read back from the kernel (``os.sched_getscheduler`` of each thread).
The engine cases starve the writer for real: a child process pinned to one CPU next to a busy
process of normal priority, so an idle-scheduled writer gets no cycles until it is escalated."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elastor_ds.checkpoint.settings import WriterSched
from elastor_ds.checkpoint.writer_sched import WriterPriority, thread_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_getscheduler"),
                                reason="SCHED_IDLE is Linux's; elsewhere the writer keeps its priority")


def policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


class Group:
    """A writer thread of ``prio`` and one helper it started, both parked until released."""

    def __init__(self, prio: WriterPriority):
        self.prio, self.tids, self.go = prio, {}, threading.Event()
        ready = threading.Barrier(3)

        def helper():
            self.tids["helper"] = threading.get_native_id()
            ready.wait()
            self.go.wait()

        def writer():
            prio.enter(nice=True)
            self.tids["writer"] = threading.get_native_id()
            h = threading.Thread(target=thread_target(helper))
            h.start()
            ready.wait()
            self.go.wait()
            h.join()
            prio.leave()
        self.thread = threading.Thread(target=writer)
        self.thread.start()
        ready.wait()

    def policies(self) -> tuple[int, int]:
        time.sleep(0.05)   # the helper registers itself right after it starts
        return policy(self.tids["writer"]), policy(self.tids["helper"])

    def close(self) -> None:
        self.go.set()
        self.thread.join()


def test_idle_while_nobody_waits_normal_once_someone_does():
    prio = WriterPriority(WriterSched.IDLE, nice=3, deadline_s=60)
    g = Group(prio)
    try:
        assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)        # between saves
        assert os.getpriority(os.PRIO_PROCESS, g.tids["writer"]) >= 3  # the nice value was added
        prio.begin()
        assert g.policies() == (os.SCHED_IDLE, os.SCHED_IDLE)          # the helper follows the writer
        prio.urgent("wait")
        assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)
        assert prio.end() == "wait"
        prio.begin()
        assert g.policies() == (os.SCHED_IDLE, os.SCHED_IDLE)
        assert prio.end() is None                                       # finished in the background
        assert prio.escalations == 1
    finally:
        g.close()


@pytest.mark.parametrize("sched, during, after, why", [
    ("idle", os.SCHED_IDLE, os.SCHED_OTHER, "deadline"),   # the deadline escalates without a wait
    ("nice", os.SCHED_OTHER, os.SCHED_OTHER, None),         # "nice" never uses SCHED_IDLE
])
def test_past_the_deadline(sched, during, after, why):
    # a deadline of 1 s: at 0.2 s a loaded machine (CI beside other jobs) read the policies after the
    # watcher had already escalated them
    prio = WriterPriority(sched, deadline_s=1.0)
    g = Group(prio)
    try:
        prio.begin()
        assert g.policies() == (during, during)
        time.sleep(1.6)
        assert g.policies() == (after, after)
        assert prio.end() == why and prio.escalations == (1 if why else 0)
        prio.begin()   # the next save gets its own deadline from the same watcher thread
        assert g.policies() == (during, during)
        time.sleep(1.6)
        assert g.policies() == (after, after) and prio.end() == why
        watcher = prio._watcher
        prio.close()
        if watcher is not None:
            watcher.join(2)
            assert not watcher.is_alive()
        assert sched == "nice" or watcher is not None
    finally:
        g.close()


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="fast"):
        WriterPriority("fast")
    with pytest.raises(ValueError, match="deadline_s=0"):
        WriterPriority("idle", deadline_s=0)


def test_a_helpers_cpu_time_is_added_to_its_group():
    """A helper started through thread_target burns ~60 ms of CPU (its own thread clock, read by
    the helper itself as the oracle); the group's helper_cpu_s grows by that much once it ends,
    and a thread outside any group adds nothing."""
    prio = WriterPriority("nice")
    spent = {}

    def burn():
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.06:
            sum(range(1000))
        spent["cpu"] = time.thread_time() - c0

    def writer():
        prio.enter(nice=True)
        try:
            t = threading.Thread(target=thread_target(burn))
            t.start()
            t.join()
        finally:
            prio.leave()
    w = threading.Thread(target=writer)
    w.start()
    w.join()
    assert spent["cpu"] >= 0.06
    assert spent["cpu"] <= prio.helper_cpu_s <= spent["cpu"] + 0.01
    before = prio.helper_cpu_s
    t = threading.Thread(target=thread_target(burn))   # not in a group: unwrapped
    t.start()
    t.join()
    assert prio.helper_cpu_s == before


CHILD = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile, time, torch
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.storage import PosixStorage
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.comm.collectives import LocalComm
    from elastor_ds.layout.region import Region
    sched, deadline, waits, root = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "wait", sys.argv[4]
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    busy = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {%d})\\nwhile True: pass" % cpu])
    try:
        time.sleep(0.3)
        torch.manual_seed(0)
        ts = [torch.randn(512, 4096) for _ in range(4)]   # 32 MiB in column tiles: ~0.1 s of writer CPU
        shards = [TensorShard(f"t{i}", (512, 4096), Region((0, 0), (512, 4096)), t) for i, t in enumerate(ts)]
        eng = CheckpointEngine(root, LocalComm(), storage=PosixStorage(root), writer_sched=sched,
                               writer_deadline_s=deadline)
        t0 = time.perf_counter()
        eng.save(1, shards)
        if waits:
            st = eng.wait()
        else:
            while not eng.local_idle() and time.perf_counter() - t0 < 60:
                time.sleep(0.01)
            st = eng.wait()
        took = time.perf_counter() - t0
    finally:
        busy.kill()
        busy.wait()
    out = [torch.zeros(512, 4096) for _ in range(4)]
    CheckpointEngine(root).load(None, [TensorShard(f"t{i}", (512, 4096), Region((0, 0), (512, 4096)), o)
                                       for i, o in enumerate(out)])
    print(json.dumps({"escalated": st.writer_escalated, "took": took,
                      "equal": all(torch.equal(a, b) for a, b in zip(ts, out))}))
""")


def run_child(tmp_path, sched: str, deadline: float, wait: str) -> dict:
    root = tmp_path / f"{sched}-{wait}"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CHILD, sched, str(deadline), wait, str(root)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_starved_writer_is_escalated_at_its_deadline(tmp_path):
    """One CPU, a busy process beside the trainer: the idle-scheduled writer makes no progress, the
    deadline (1.5 s) hands it its normal priority, the save completes and loads back bit for bit."""
    r = run_child(tmp_path, "idle", 1.5, "poll")
    assert r["escalated"] == "deadline" and r["took"] >= 1.5 and r["equal"], r


def test_a_wait_escalates_at_once(tmp_path):
    r = run_child(tmp_path, "idle", 30.0, "wait")
    assert r["escalated"] == "wait" and r["took"] < 15 and r["equal"], r


def test_a_nice_writer_is_never_escalated(tmp_path):
    r = run_child(tmp_path, "nice", 1.0, "poll")
    assert r["escalated"] is None and r["equal"], r


def test_boosted_lifts_a_background_save_only_while_inside_and_never_undoes_an_escalation():
    """A fence waiting for a lock the writer holds: the writer and its helper run at normal
    priority inside ``boosted()``, in the background again after; a ``wait()`` meanwhile
    escalates for good (the boost's exit leaves it so); between saves the boost changes nothing."""
    prio = WriterPriority(WriterSched.IDLE, nice=0, deadline_s=60)
    g = Group(prio)
    try:
        with prio.boosted():
            assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)    # no save: nothing to lift
        prio.begin()
        assert g.policies() == (os.SCHED_IDLE, os.SCHED_IDLE)
        with prio.boosted():
            assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)
        assert g.policies() == (os.SCHED_IDLE, os.SCHED_IDLE)
        with prio.boosted():
            prio.urgent("wait")
        assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)
        assert prio.end() == "wait"
    finally:
        g.close()


def test_a_helper_started_inside_boosted_runs_at_normal_priority_until_the_boost_ends():
    """A live write's writer starts its O_DIRECT helper while a fence boosts it: the new helper
    takes the boost too (the kernel's record), and goes to the background with the others when
    the boost ends; nested boosts end with the outer one."""
    prio = WriterPriority(WriterSched.IDLE, nice=0, deadline_s=60)
    prio.begin()
    with prio.boosted():
        with prio.boosted():
            g = Group(prio)          # writer and helper enter the group inside the boost
            try:
                assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)
            except BaseException:
                g.close()
                raise
        try:
            assert g.policies() == (os.SCHED_OTHER, os.SCHED_OTHER)   # the outer boost still holds
        except BaseException:
            g.close()
            raise
    try:
        assert g.policies() == (os.SCHED_IDLE, os.SCHED_IDLE)
    finally:
        g.close()
        prio.end()


UNPRIVILEGED = textwrap.dedent('''
    import logging, os, threading
    logging.basicConfig(level=logging.INFO)
    from elastor_ds.checkpoint.writer_sched import WriterPriority, idle_can_be_undone
    wp = WriterPriority("idle")
    wp.begin()                                   # a save nobody waits for
    tid, go, seen = [], threading.Event(), []
    def writer():
        wp.enter(nice=True)
        tid.append(threading.get_native_id())
        go.wait()
    t = threading.Thread(target=writer)
    t.start()
    while not tid:
        pass
    seen.append(os.sched_getscheduler(tid[0]))
    wp.urgent("wait")                            # the loop waits for the save: full speed now
    seen.append(os.sched_getscheduler(tid[0]))
    go.set()
    t.join()
    print(idle_can_be_undone(), wp.sched.value, *seen)
''')


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user")
def test_a_process_that_may_not_undo_sched_idle_gets_a_nice_writer(tmp_path):
    """Linux lets a thread leave SCHED_IDLE only with CAP_SYS_NICE or an RLIMIT_NICE above its nice
    value; an ordinary user has neither (limit 0). Such a process's idle writer could never be
    given its priority back when the loop waits for it, at the deadline or for a fence. Run as
    ``nobody`` (RLIMIT_NICE 0): the writer runs at SCHED_OTHER (its nice value) throughout
    instead. Before, it went to SCHED_IDLE and stayed there after ``urgent()`` (the kernel's
    record: 5, 5)."""
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                        UNPRIVILEGED], capture_output=True, text=True, timeout=60, cwd="/",
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "nice", str(os.SCHED_OTHER), str(os.SCHED_OTHER)], p.stdout
    assert "may not raise a thread back from SCHED_IDLE" in p.stderr


def test_a_thread_of_the_group_takes_the_lock_only_at_normal_priority(monkeypatch):
    """The group's lock is Python's, which the kernel cannot boost: a thread that held it while
    SCHED_IDLE could be kept off the CPU while a training thread waits for it (in begin(), urgent()
    or boosted()) on a machine whose cores are all busy. Every acquisition of the lock by a thread of
    the group (entering, ending a save, leaving) is recorded with that thread's policy at that
    moment, read from the kernel: always SCHED_OTHER; and a helper that enters during a background
    save still ends up idle-scheduled."""
    from elastor_ds.checkpoint import writer_sched
    prio = WriterPriority(WriterSched.IDLE, deadline_s=60)
    seen: list[tuple[str, int]] = []
    real = prio._lock

    class Recording:
        def __enter__(self):
            if getattr(writer_sched._local, "group", None) is prio:
                seen.append((threading.current_thread().name, policy(threading.get_native_id())))
            return real.__enter__()

        def __exit__(self, *a):
            return real.__exit__(*a)

        def __getattr__(self, name):
            return getattr(real, name)
    monkeypatch.setattr(prio, "_lock", Recording())
    prio.begin()                                   # a background save: the group is idle-scheduled
    g = Group(prio)
    try:
        assert g.policies() == (os.SCHED_IDLE, os.SCHED_IDLE)
    finally:
        g.close()
    done = []

    def writer_ends_a_save():            # the writer thread of the background save begun above
        prio.enter()
        done.append(policy(threading.get_native_id()))
        prio.end()
        prio.leave()
    t = threading.Thread(target=writer_ends_a_save, name="writer")
    t.start()
    t.join()
    assert done == [os.SCHED_IDLE]
    assert seen and all(p == os.SCHED_OTHER for _, p in seen), repr(seen)[-600:]
