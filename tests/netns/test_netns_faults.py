"""Real node losses between network-namespace nodes (see elastor_ds/testing/netns.py): one
`elastor run` per node with --local-addr, the c10d store in a namespace of its own, the example
trainer (tiny GPT, DP3 with ZeRO-1 over 2 + 1 processes), memory snapshots with one peer copy.

Faults: a whole node SIGKILLed; a node whose link is cut (no reset reaches anyone); a node
partitioned off for 30 s that comes back (and hosts global rank 0). Each test asserts the step
resumed from (the newest step the survivor holds in memory, read from disk right after the
fault), the bytes per restore source, the losses of the re-run iterations (equal to those the
uninterrupted run logged), the detection bound, and that no process and no namespace is left."""
from __future__ import annotations

import os
import time

import pytest

from elastic_utils import assert_losses_reproduce
from elastor_ds.elastic.events import read_jsonl
from elastor_ds.testing.netns import Cut
from netns_jobs import KEEP_ALIVE_S, LIVENESS_TIMEOUT_S, NodeJob, Store, restorable_step, wait_until

pytestmark = pytest.mark.timeout(400)
ITERS = 12


def _start(bed_factory, tmp_path):
    bed = bed_factory(["store", "n0", "n1"])
    store = Store(bed, "store", tmp_path)
    big = NodeJob(bed, "n0", tmp_path, store.endpoint, nproc=2, iters=ITERS)     # node rank 0: ranks 0, 1
    small = NodeJob(bed, "n1", tmp_path, store.endpoint, nproc=1, iters=ITERS)   # node rank 1: rank 2
    return bed, store, big, small


def _strike_point(survivor: NodeJob, lost: NodeJob, nodes) -> int:
    """Wait for a step >= 3 whose peer copy (lost -> survivor) is complete."""
    def ready():
        s = restorable_step(survivor, lost)
        return s if s is not None and s >= 3 else None
    return wait_until(ready, nodes, 240, "a step with a complete peer copy")


def _after_detection(survivor: NodeJob, lost: NodeJob, timeout: float = 60) -> tuple[dict, int]:
    """The survivor's failure event, and the step it can restore from memory (read from disk once
    its workers are torn down and before the relaunched ones snapshot again)."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        td = [e for e in survivor.event_list() if e.get("event") == "teardown"]
        if td:
            fail = next(e for e in survivor.event_list() if e.get("event") == "failure")
            step = restorable_step(survivor, lost)
            assert step is not None, "no complete peer copy on the survivor"
            return fail, step
        time.sleep(0.02)
    raise AssertionError(f"the survivor did not detect the loss in {timeout} s:\n{survivor.output()[-6000:]}")


def _check_recovery(survivor: NodeJob, lost: NodeJob, step: int, t_fault: float, world_after: int) -> dict:
    recs = read_jsonl(survivor.metrics)
    before = [r for r in recs if r["time"] <= t_fault]
    assert before and {r["world_size"] for r in before} == {3}
    assert recs[-1]["world_size"] == world_after and recs[-1]["iteration"] == ITERS
    reruns = assert_losses_reproduce(recs, ITERS)          # re-run losses equal the uninterrupted run's
    last_before = max(r["iteration"] for r in before)
    started = [e for e in survivor.event_list() if e.get("event") == "worker_started"]
    assert started[-1]["resumed_from"] == step, (started[-1], step)
    assert reruns == last_before - step, (reruns, last_before, step)
    rest = [e for e in survivor.event_list() if e.get("event") == "restore"][-1]
    assert rest["tier"] == "memory" and rest["step"] == step, rest
    by = rest["bytes"]
    # bytes per source: nothing from storage, no remote node asked; the lost node's ranks came from
    # the peer copy the survivor holds, the survivor's own ranks from its local snapshot
    assert by.get("storage", 0) == 0 and not any(k.startswith("remote:") for k in by), by
    assert set(by) <= {"local-memory", "peer-memory", "storage"}, by
    assert by["peer-memory"] > 0 and by["local-memory"] > 0, by
    return {"recs": recs, "rest": rest, "last_before": last_before, "reruns": reruns}


def _no_process_left(bed, *names):
    left = {n: bed.pids(n) for n in names if bed.pids(n)}
    assert not left, f"processes left on nodes: {left}"


def test_whole_node_lost(bed_factory, tmp_path):
    bed, store, big, small = _start(bed_factory, tmp_path)
    _strike_point(big, small, [big, small])
    t_fault = time.time()
    killed = bed.kill_node("n1")
    big.note_injected("whole node lost (SIGKILL)", t_fault)
    assert killed
    fail, step = _after_detection(big, small)
    assert big.wait() == 0, big.output()[-6000:]
    out = _check_recovery(big, small, step, t_fault, world_after=2)
    # the dead processes' sockets were closed by the (shared) kernel, which resets the connections:
    # the survivor's workers fail at once, well under the liveness bound
    assert fail["time"] - t_fault < LIVENESS_TIMEOUT_S + 1, fail
    _no_process_left(bed, "n0", "n1")
    rec = [e for e in big.event_list() if e.get("event") == "recovery"]
    assert rec and rec[-1]["resumed_from"] == step


def test_silent_node_loss_is_detected_in_bounded_time(bed_factory, tmp_path):
    bed, store, big, small = _start(bed_factory, tmp_path)
    _strike_point(big, small, [big, small])
    t_fault = time.time()
    bed.cut("n1", Cut.LINK_DOWN)
    big.note_injected("silent node loss (link down)", t_fault)
    fail, step = _after_detection(big, small)
    # bounded detection: the survivor saw node 1's counter stop, and called it lost after the
    # liveness timeout (+ one read period + the monitor interval + slack for a loaded machine)
    assert fail["cause"] == "node_lost", fail
    assert [n["node_rank"] for n in fail["lost_nodes"]] == [1], fail
    detect = fail["time"] - t_fault
    assert LIVENESS_TIMEOUT_S - KEEP_ALIVE_S <= detect <= LIVENESS_TIMEOUT_S + KEEP_ALIVE_S + 2.0, detect
    # the cut node fenced itself (it could not reach the store) and left with exit 1
    assert small.wait(timeout=120) == 1, small.output()[-6000:]
    fenced = small.first("fenced")
    assert fenced is not None and fenced["time"] < fail["time"], (fenced, fail)
    assert "fenced out of the job" in small.output()
    assert big.wait() == 0, big.output()[-6000:]
    _check_recovery(big, small, step, t_fault, world_after=2)
    _no_process_left(bed, "n0", "n1")


def _manifests_seen(ckpt: str, seen: dict) -> None:
    """Record (world size, commit time) of every committed storage step now in ``ckpt``."""
    import json
    for d in os.listdir(ckpt) if os.path.isdir(ckpt) else ():
        if d.startswith("step_") and d not in seen:
            try:
                with open(os.path.join(ckpt, d, "manifest.json")) as f:
                    m = json.load(f)
            except (OSError, ValueError):
                continue
            seen[d] = (m["world_size"], m["created_unix"])


def test_partitioned_node_is_fenced_and_commits_nothing(bed_factory, tmp_path):
    """Node 0 (global ranks 0 and 1: rank 0 logs metrics and commits checkpoints) is cut off for
    30 s, then its link comes back. It must not train on as a second job nor commit a step: it
    fences itself (kills its workers) before the survivor can count it lost, and exits 1."""
    bed, store, big, small = _start(bed_factory, tmp_path)
    _strike_point(small, big, [big, small])
    t_fault = time.time()
    bed.cut("n0", Cut.DROP)
    small.note_injected("network partition (node 0 cut off for 30 s)", t_fault)
    fail, step = _after_detection(small, big)
    assert fail["cause"] == "node_lost" and [n["node_rank"] for n in fail["lost_nodes"]] == [0], fail
    assert big.wait(timeout=60) == 1, big.output()[-6000:]
    fenced = big.first("fenced")
    assert fenced is not None and fenced["time"] < fail["time"], (fenced, fail)
    assert "fenced out of the job" in big.output()
    assert not bed.pids("n0")            # nothing of node 0 is left to act when the link returns
    seen: dict = {}
    while time.time() < t_fault + 30:
        _manifests_seen(small.ckpt, seen)
        time.sleep(0.05)
    bed.heal("n0")
    assert small.wait() == 0, small.output()[-6000:]
    _manifests_seen(small.ckpt, seen)
    out = _check_recovery(small, big, step, t_fault, world_after=1)
    # no split brain: after the cut only the survivor's world (1 process) logged iterations and
    # committed steps (1 s of grace: a record whose collectives had finished before the cut)
    assert {r["world_size"] for r in out["recs"] if r["time"] > t_fault + 1} == {1}
    late = {d: w for d, (w, t) in seen.items() if t > t_fault + 1}
    assert late and set(late.values()) == {1}, seen
    _no_process_left(bed, "n0", "n1")


def test_slow_link_is_not_a_node_loss(bed_factory, tmp_path):
    """Node 1's link throttled to 4 Mbit/s in both directions (a token bucket whose short queue
    drops bursts; netem delay/loss where the kernel has it) from iteration 3 on: iterations slow
    down, but no node is declared lost or fenced, nothing restarts, every iteration runs once."""
    bed, store, big, small = _start(bed_factory, tmp_path)
    wait_until(lambda: big.latest() is not None and big.latest() >= 3, [big, small], 240, "iteration 3")
    t_fault = time.time()
    qdisc = bed.slow("n1", rate_kbit=4000)
    big.note_injected(f"slow link ({qdisc} 4 Mbit/s)", t_fault)
    assert big.wait() == 0, big.output()[-6000:]
    assert small.wait() == 0, small.output()[-6000:]
    recs = read_jsonl(big.metrics)
    assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1))
    assert {r["world_size"] for r in recs} == {3}
    for node in (big, small):
        kinds = [e["event"] for e in node.event_list()]
        assert "failure" not in kinds and "fenced" not in kinds and kinds.count("launch") == 1, kinds
    before = sorted(r["iter_time_s"] for r in recs if r["time"] < t_fault and r["iteration"] > 1)
    after = sorted(r["iter_time_s"] for r in recs if r["time"] > t_fault + 2)
    assert before and after and after[len(after) // 2] > before[len(before) // 2], (before, after)
    _no_process_left(bed, "n0", "n1")
