"""Recovery from memory across nodes: two `elastor run` controllers on this machine as two nodes
(c10d rendezvous on a store the test hosts, so either node may die), the example trainer (tiny GPT,
data parallel with ZeRO-1: every rank needs every weight, so a restore under a new world needs the
files other ranks wrote), memory snapshots every iteration, real processes, real SIGKILLs.

- a whole node dies (controller and workers SIGKILLed): the survivor restores the lost ranks'
  regions from its peer copy; nothing is read from storage (a storage checkpoint of the same
  step exists and is not touched); re-run iterations reproduce the losses logged before.
- a worker dies and the world shrinks (DP3 -> DP2, optimizer partitions resharded) without peer
  copies: each node reads the regions the other node's ranks wrote from that node's server.
- a corrupt peer copy (a flipped byte): that file falls back to storage (logged), losses exact.
- a peer copy every 2nd step only (``--elastor-memory-snapshot-peer-copy-interval 2``, so each node
  keeps 3 snapshots): node B is frozen while A's newest snapshot is an odd (uncopied) step, then
  killed; the survivor cannot find B's files of that step anywhere (no storage checkpoint yet), so
  it restores the newest copied step from its own memory and its peer copy, 0 bytes from storage.

Oracles: the losses the job logged before the failure; the events' ``restore`` record (bytes per
source, summed over ranks by the trainer); the files on disk.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import free_port
from elastic_utils import ROOT, TRAINER, check_reruns, read_jsonl, storage_latest, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "6", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--zero-stage", "1", "--profile-iters", "0"]
# each transformer layer also sleeps per micro-batch (bench hook of the example model): an iteration
# takes ~0.5 s, so the test can act between a snapshot's peer copy and the next snapshot
SLOW = json.dumps({"1": 0.08})


class Node:
    def __init__(self, tmp, name: str, nproc: int, port: int, iters: int, peer_copies: int, save_interval: int,
                 memory_flags=("--elastor-memory-snapshot-keep", "1")):
        self.name = name
        self.snapdir = str(tmp / f"shm{name}")
        self.events = str(tmp / f"{name}_events.jsonl")
        self.metrics = str(tmp / "metrics.jsonl")
        self.ckpt = str(tmp / "ckpt")
        self.out = open(str(tmp / f"{name}.out"), "w")
        secret = str(tmp / "job.secret")   # the job's secret, the same file for both nodes (0600, ours)
        if not os.path.exists(secret):
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, os.urandom(32))
            os.close(fd)
        cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
               "--job-secret-file", secret,
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "peer",
               "--rdzv-conf", "is_host=0,join_timeout=120,last_call_timeout=4,keep_alive_interval=1,"
                              "keep_alive_max_attempt=3",
               "--on-failure", "shrink", "--max-restarts", "3", "--monitor-interval", "0.1", "--events", self.events,
               "--snapshot-dir", self.snapdir, TRAINER, *MODEL, "--train-iters", str(iters), "--save", self.ckpt,
               "--load", self.ckpt, "--save-interval", str(save_interval), "--metrics-file", self.metrics,
               "--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", str(peer_copies),
               *memory_flags]
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="",
                   ELASTOR_SIM_LAYER_S=SLOW)
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=str(tmp), env=env,
                                     start_new_session=True)

    def event_list(self) -> list[dict]:
        return read_jsonl(self.events)

    def output(self) -> str:
        self.out.flush()
        with open(self.out.name, errors="replace") as f:
            return f.read()

    def workers(self) -> dict[int, int]:
        """global rank -> pid of this controller's live workers, from its latest ``launch`` event (a
        standby worker's /proc environment is the one it was spawned with, not its rank's)."""
        import psutil
        launches = [e for e in read_jsonl(self.events) if e.get("event") == "launch"]
        out = {}
        for rank, pid in zip(launches[-1]["global_ranks"], launches[-1]["pids"]) if launches else ():
            try:
                p = psutil.Process(pid)
                if p.ppid() == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out[int(rank)] = pid
            except psutil.NoSuchProcess:
                continue
        return out

    def kill_node(self) -> None:
        """SIGKILL the controller and every process under it (workers, standbys) at once."""
        import psutil
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        os.killpg(self.proc.pid, signal.SIGKILL)
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        psutil.wait_procs(procs, timeout=10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.kill_node()
            except Exception:  # noqa: BLE001 - cleanup
                pass

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node {self.name} did not finish in {timeout} s:\n{self.output()[-6000:]}")

    def latest(self, sub: str = "local") -> int | None:
        try:
            with open(os.path.join(self.snapdir, sub, "latest")) as f:
                return int(f.read().strip().rsplit("_", 1)[1])
        except (OSError, ValueError, IndexError):
            return None


def _store(port: int):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)


def _restores(*nodes) -> list[dict]:
    return [e for n in nodes for e in read_jsonl(n.events) if e.get("event") == "restore"]


def _copy_ready(a: Node, b: Node, want_storage: bool):
    """A step S whose memory snapshot is committed on A, whose peer copy of B's files on A is
    COMPLETE and (want_storage) whose storage checkpoint is committed: the moment to strike."""
    s = a.latest()
    if s is None or s < 3:
        return None
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    d = os.path.join(a.snapdir, "peer", origin_id(b.snapdir), f"step_{s:09d}")
    if not os.path.exists(os.path.join(d, "COMPLETE")):
        return None
    if want_storage and storage_latest(a.ckpt) != s:
        return None
    return s, d


def _remove_storage_data(ckpt: str) -> int:
    """Delete the data files of every committed storage step (manifests stay): a restore that read
    a byte from storage would fail. Returns how many were removed."""
    n = 0
    for d in os.listdir(ckpt):
        if d.startswith("step_"):
            for f in os.listdir(os.path.join(ckpt, d)):
                if f.endswith(".safetensors"):
                    os.unlink(os.path.join(ckpt, d, f))
                    n += 1
    return n


def _run_node_loss(tmp_path, corrupt: bool):
    port = free_port()
    store = _store(port)
    iters = 9
    a = Node(tmp_path, "A", 2, port, iters, peer_copies=1, save_interval=1)
    b = Node(tmp_path, "B", 1, port, iters, peer_copies=1, save_interval=1)
    try:
        for _ in range(20):   # freeze B (no snapshot or save can commit without it) at a ready step
            wait_until(lambda: _copy_ready(a, b, want_storage=True), [a, b], 240,
                       "a step with a complete peer copy and a storage checkpoint")
            _signal_node(b, signal.SIGSTOP)
            time.sleep(1.0)   # an in-flight commit of A's next snapshot lands now, or cannot happen
            hit = _copy_ready(a, b, want_storage=True)   # A's newest snapshot, not the one seen before
            if hit is not None:
                break
            _signal_node(b, signal.SIGCONT)
        else:
            raise AssertionError("never froze node B with A's newest snapshot copied and durable")
        s, peer_dir = hit
        if corrupt:
            data = sorted(f for f in os.listdir(peer_dir) if f.endswith(".safetensors"))
            assert data, os.listdir(peer_dir)
            p = os.path.join(peer_dir, data[0])
            with open(p, "r+b") as f:      # a byte in the last tensor's data (past the header)
                f.seek(os.path.getsize(p) - 5)
                v = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([v[0] ^ 0x40]))
        b.kill_node()
        t_kill = time.time()
        if not corrupt:   # the restore must not need storage: its committed data files are gone (our counters aside)
            assert _remove_storage_data(a.ckpt) > 0
        assert a.wait() == 0, a.output()[-6000:]
    finally:
        a.kill()
        b.kill()
        del store
    recs = read_jsonl(a.metrics)
    check_reruns(recs, a.event_list() + b.event_list(), iters, at_least=0)   # a node lost: <= 1 iteration
    # before the kill 3 processes on 2 nodes, after it 2 processes on node A
    killed_at = [r for r in recs if r["time"] <= t_kill]
    assert killed_at and all(r["world_size"] == 3 for r in killed_at)
    assert recs[-1]["world_size"] == 2
    started = [e for e in read_jsonl(a.events) if e.get("event") == "worker_started"]
    rest = _restores(a)[-1]
    return s, rest, started, recs, a


def test_whole_node_lost_survivor_restores_from_its_peer_copy(tmp_path):
    s, rest, started, recs, a = _run_node_loss(tmp_path, corrupt=False)
    by = rest["bytes"]
    assert rest["step"] >= s and rest["tier"] == "memory", rest
    assert by.get("storage", 0) == 0, by                       # storage had the same step: not read
    assert by.get("peer-memory", 0) > 0 and by.get("local-memory", 0) > 0, by
    assert not any(k.startswith("remote:") for k in by), by     # node B is gone: nobody to ask
    # before the kill every snapshot's peer copy ran in the background (the trainer reports rank 0's)
    copies = [r for r in recs if r["world_size"] == 3 and "peer_copy_s" in r]
    assert copies and all(r["peer_copy_ok"] and r["peer_copy_bytes"] > 0 for r in copies), copies
    # lost work <= 1 iteration: resumed from the newest snapshot, at most one behind the last logged
    last_before = max(r["iteration"] for r in recs if r["world_size"] == 3)
    assert started[-1]["resumed_from"] >= last_before - 1, (started[-1], last_before)


def test_corrupt_peer_copy_falls_back_to_storage(tmp_path):
    s, rest, _, _, a = _run_node_loss(tmp_path, corrupt=True)
    by = rest["bytes"]
    # per-file fallback: the corrupt copy's file came from storage, everything else from memory
    assert rest["tier"] == "memory" and rest["step"] >= s, rest
    assert by.get("storage", 0) > 0 and by.get("local-memory", 0) > 0, by
    out = a.output()
    assert "the copy in peer copy held in this node's memory " in out and "fails its CRC32 check" in out, out[-6000:]
    assert "; reading it from storage " in out, out[-6000:]


def test_reshard_reads_the_other_nodes_memory_through_its_server(tmp_path):
    port = free_port()
    store = _store(port)
    iters = 9
    a = Node(tmp_path, "A", 2, port, iters, peer_copies=0, save_interval=100)
    b = Node(tmp_path, "B", 1, port, iters, peer_copies=0, save_interval=100)
    try:
        wait_until(lambda: a.latest() is not None and a.latest() >= 3 and b.latest() == a.latest(), [a, b], 240,
              "memory snapshots on both nodes")
        victim = max(a.workers())
        os.kill(a.workers()[victim], signal.SIGKILL)
        assert a.wait() == 0, a.output()[-6000:]
        assert b.wait() == 0, b.output()[-6000:]
    finally:
        a.kill()
        b.kill()
        del store
    recs = read_jsonl(a.metrics)
    check_reruns(recs, a.event_list() + b.event_list(), iters, at_least=0)   # memory snapshots: <= 1 iteration
    sizes = []
    for r in recs:
        if not sizes or sizes[-1] != r["world_size"]:
            sizes.append(r["world_size"])
    assert sizes == [3, 2], sizes
    rest = _restores(a, b)[-1]
    by = rest["bytes"]
    remote = {k: v for k, v in by.items() if k.startswith("remote:")}
    assert rest["tier"] == "memory" and by.get("storage", 0) == 0, rest
    assert len(remote) == 2 and all(v > 0 for v in remote.values()), by   # each node read from the other
    assert by.get("peer-memory", 0) == 0 and by.get("local-memory", 0) > 0, by


def _odd_step_with_older_copy(a: Node, b: Node):
    """A's newest snapshot is an odd step S (not peer-copied) and A holds B's COMPLETE copy of S - 1."""
    s = a.latest()
    if s is None or s < 3 or s % 2 == 0:
        return None
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    d = os.path.join(a.snapdir, "peer", origin_id(b.snapdir), f"step_{s - 1:09d}")
    return (s, d) if os.path.exists(os.path.join(d, "COMPLETE")) else None


def _signal_node(node: Node, sig) -> None:
    import psutil
    for p in [psutil.Process(node.proc.pid)] + psutil.Process(node.proc.pid).children(recursive=True):
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def test_peer_copy_interval_restores_the_newest_copied_step(tmp_path):
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    port = free_port()
    store = _store(port)
    iters = 11
    flags = ("--elastor-memory-snapshot-peer-copy-interval", "2")   # keep defaults to 2 / 1 + 1 = 3
    a = Node(tmp_path, "A", 2, port, iters, peer_copies=1, save_interval=100, memory_flags=flags)
    b = Node(tmp_path, "B", 1, port, iters, peer_copies=1, save_interval=100, memory_flags=flags)
    try:
        for _ in range(20):   # freeze B (no snapshot can commit without it) at the right moment
            wait_until(lambda: _odd_step_with_older_copy(a, b), [a, b], 240,
                       "an odd newest snapshot with a complete copy of the step before")
            _signal_node(b, signal.SIGSTOP)
            time.sleep(1.0)   # an in-flight commit of A's next snapshot lands now, or cannot happen
            hit = _odd_step_with_older_copy(a, b)
            if hit is not None and a.latest() == hit[0]:
                break
            _signal_node(b, signal.SIGCONT)
        else:
            raise AssertionError("never froze node B with an uncopied newest snapshot")
        newest, copied_dir = hit
        peer_root = os.path.dirname(copied_dir)
        copies = sorted(d for d in os.listdir(peer_root) if os.path.exists(os.path.join(peer_root, d, "COMPLETE")))
        assert copies == [f"step_{newest - 1:09d}"], copies      # the odd step itself was never copied
        assert sorted(os.listdir(os.path.join(a.snapdir, "local"))).count(f"step_{newest:09d}") == 1
        b.kill_node()
        assert storage_latest(a.ckpt) is None                     # nothing durable yet: memory or nothing
        assert a.wait() == 0, a.output()[-6000:]
    finally:
        a.kill()
        b.kill()
        del store
    rest = _restores(a)[-1]
    by = rest["bytes"]
    assert rest["tier"] == "memory" and rest["step"] == newest - 1, rest
    assert by.get("storage", 0) == 0 and by.get("peer-memory", 0) > 0 and by.get("local-memory", 0) > 0, by
    assert f"trying the older memory snapshot of step {newest - 1}" in a.output(), a.output()[-6000:]
    recs = read_jsonl(a.metrics)
    # exactly the iterations after the copied step re-run, with the losses logged before the failure
    check_reruns(recs, a.event_list() + b.event_list(), iters, at_least=1)
