"""The rendezvous survives losing any one node: torch elastic's etcd-v2 rendezvous against a
three-member etcd cluster (Debian's etcd-server, one member in each of n0, n1 and e2), one
`elastor run` on n0 (global ranks 0 and 1: node rank 0, the node that would host a c10d store) and
one on n1 (rank 2), `--rdzv-endpoint` listing all three members.

Node 0 is lost whole (SIGKILL of every process in its namespace: its controller, its workers and
its etcd member). The survivor keeps a quorum (n1 + e2), detects the loss, rendezvous again
without node 0, and resumes at world 1 from memory: its own snapshot plus the peer copy of node
0's files it holds (0 bytes from storage)."""
from __future__ import annotations

import time

import pytest

from elastor_ds.testing.etcd_cluster import EtcdCluster, etcd_unavailable
from netns_jobs import (ITERS, LIVENESS_TIMEOUT_S, NodeJob, after_detection, check_recovery, final_manifest,
                        no_process_left, restore_bytes, strike_point)

pytestmark = pytest.mark.timeout(300)


def _require_etcd() -> None:
    """As root (the netns tier runs only as root) a missing etcd is a failure, not a skip:
    scripts/setup_env.sh installs etcd-server and requirements-dev.txt pins the client."""
    why = etcd_unavailable()
    if why:
        pytest.fail(f"etcd tier: {why}")
    try:
        import etcd  # noqa: F401
    except ModuleNotFoundError:
        pytest.fail("etcd tier: the python-etcd client is not installed (requirements-dev.txt pins python-etcd)")


def test_etcd_rendezvous_survives_losing_node0(bed_factory, tmp_path):
    _require_etcd()
    bed = bed_factory(["n0", "n1", "e2"])
    cluster = EtcdCluster(bed, ["n0", "n1", "e2"], str(tmp_path / "etcd"))
    cluster.wait_healthy()
    big = NodeJob(bed, "n0", tmp_path, cluster.endpoint, nproc=2, iters=ITERS, rdzv_backend="etcd-v2")
    small = NodeJob(bed, "n1", tmp_path, cluster.endpoint, nproc=1, iters=ITERS, rdzv_backend="etcd-v2")
    strike_point(small, big, [big, small])
    launch = big.first("launch")
    assert launch is not None and launch["node_rank"] == 0 and launch["global_ranks"] == [0, 1], launch
    t_fault = time.time()
    killed = bed.kill_node("n0")
    small.note_injected("node 0 lost whole (controller, workers and its etcd member SIGKILLed)", t_fault)
    assert killed
    fail, step, files = after_detection(small, big)
    # its workers failed at once (the dead node's sockets were reset); one failure, counted once
    # (the failure ledger on etcd's store: there is no compare-and-set)
    assert fail["time"] - t_fault < LIVENESS_TIMEOUT_S + 1, fail
    assert fail["job_failures"] == 1 and fail["collateral_of"] is None, fail
    assert small.wait() == 0, small.output()[-6000:]
    check_recovery(small, big, step, t_fault, world_after=1,
                   expect_bytes=lambda: restore_bytes(files, [2], final_manifest(small.ckpt)))   # n1 held 2
    launches = [e for e in small.event_list() if e.get("event") == "launch"]
    assert [(e["world_size"], e["node_rank"]) for e in launches] == [(3, 1), (1, 0)], launches
    assert "fenced" not in [e["event"] for e in small.event_list()]
    assert cluster.health("n1") and cluster.health("e2")      # the quorum that carried the job
    cluster.stop()                                               # the harness's service, not the job's
    no_process_left(bed, "n0", "n1", "e2")
