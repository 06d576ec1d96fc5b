"""Peer copies of memory snapshots: the ring plan (pure, hand-computed expectations) and the gloo
transport (real processes, real files on disk, byte-for-byte against what each rank wrote)."""
from __future__ import annotations

import json
import os
import zlib

import pytest

from dist_utils import run_world
from elastor_ds.checkpoint.snapshot.peer_plan import PeerTransfer, node_of_rank, peer_bytes_by_node, plan_peer_copies
from elastor_ds.errors import ConfigError

STEP5, STEP6 = "step_000000005", "step_000000006"


def _oid(name: str) -> str:
    """The origin id a node directory named ``name`` on this host gets (host + directory name)."""
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    return origin_id(os.path.join("/x", name))


# ---------------------------------------------------------------- the plan (pure)
@pytest.mark.unit
def test_ring_two_nodes_uneven():
    # node 0 = ranks 0,1; node 1 = rank 2: both of node 0's ranks send to rank 2, rank 2 sends to rank 0
    assert plan_peer_copies([2, 1]) == (PeerTransfer(0, 2, 0, 1), PeerTransfer(1, 2, 0, 1), PeerTransfer(2, 0, 1, 0))


@pytest.mark.unit
def test_ring_three_nodes_two_copies():
    got = {(t.copy, t.src, t.dst) for t in plan_peer_copies([1, 2, 1], 2)}
    # ranks: node0 = {0}, node1 = {1, 2}, node2 = {3}
    assert got == {(1, 0, 1), (1, 1, 3), (1, 2, 3), (1, 3, 0),
                   (2, 0, 3), (2, 1, 0), (2, 2, 0), (2, 3, 1)}


@pytest.mark.unit
def test_no_transfers_on_one_node_or_zero_copies():
    assert plan_peer_copies([4]) == ()
    assert plan_peer_copies([2, 2], 0) == ()


@pytest.mark.unit
def test_too_many_copies_is_a_config_error():
    with pytest.raises(ConfigError, match="peer_copies=2 but the job has 2 nodes"):
        plan_peer_copies([2, 2], 2)


@pytest.mark.unit
def test_every_rank_sends_each_copy_once_to_another_node():
    for ppn in ([1, 1], [3, 1, 2], [2, 2, 2, 2], [1, 4]):
        for k in range(1, len(ppn)):
            plan = plan_peer_copies(ppn, k)
            assert sorted((t.copy, t.src) for t in plan) == [(c, r) for c in range(1, k + 1) for r in range(sum(ppn))]
            for t in plan:
                assert node_of_rank(ppn, t.src) == t.src_node != t.dst_node == node_of_rank(ppn, t.dst)


@pytest.mark.unit
def test_peer_bytes_by_node():
    plan = plan_peer_copies([2, 1])
    assert peer_bytes_by_node(plan, {0: 100, 1: 50, 2: 7}, 2) == [7, 150]


# ---------------------------------------------------------------- the transport (gloo, real processes)
def _files_of(rank: int, step: int) -> dict[str, bytes]:
    body = bytes(((rank + 1) * 31 + step * 7 + i) % 251 for i in range(40_000 + 1000 * rank))
    return {f"data_{rank:05d}.safetensors": body, f"data_{rank:05d}.crc": body[:64],
            f"rank_state/rank_{rank:05d}.json": json.dumps({"rank": rank, "step": step}).encode()}


def _crc_as_sent(rank: int, step: int, rel: str, b: bytes, corrupt_rank: int) -> int:
    crc = zlib.crc32(b)
    if step == 6 and rank == corrupt_rank and rel.endswith(".safetensors"):
        crc ^= 1   # what the receiver computes will not match: as if a byte flipped on the way
    return crc


def _write_step(nodedir: str, rank: int, step: int, world: int = 3, corrupt_rank: int = -1) -> str:
    """This rank's files of ``step`` and (as a node-local memory snapshot has) the whole step's
    manifest, listing every rank's files: what a receiver checks a sender's announced files against."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    d = os.path.join(nodedir, "local", f"step_{step:09d}")
    for rel, b in _files_of(rank, step).items():
        p = os.path.join(d, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(b)
    files = {rel: FileEntry(rel, len(b), _crc_as_sent(r, step, rel, b, corrupt_rank), r)
             for r in range(world) for rel, b in _files_of(r, step).items()}
    tmp = os.path.join(d, f".manifest.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(Manifest(step=step, tensors={}, files=files, world_size=world).dumps())
    os.replace(tmp, os.path.join(d, "manifest.json"))
    return d


def _job_key(base: str) -> None:
    """The job's secret file (0600, 32 random bytes; the same for every rank) in the environment."""
    path = os.path.join(base, "job.secret")
    if not os.path.exists(path):
        fd = os.open(path + f".{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, bytes(range(32)))
        os.close(fd)
        os.replace(path + f".{os.getpid()}", path)
    os.environ["ELASTOR_JOB_SECRET_FILE"] = path   # elastor_ds.checkpoint.auth.ENV_JOB_SECRET_FILE


def _worker(rank, world, base, ppn, corrupt_rank):
    from elastor_ds.checkpoint.snapshot.peer_copy import PeerCopier, PeerFile
    from elastor_ds.checkpoint.snapshot.peer_plan import node_of_rank

    node = node_of_rank(ppn, rank)
    nodedir = os.path.join(base, f"elastor-node{node}")
    os.makedirs(nodedir, exist_ok=True)
    _job_key(base)
    if rank == 2:   # a copy from a node that left the ring earlier: dropped once the new copy completes
        stale = os.path.join(nodedir, "peer", "elastor-gone", "step_000000004")
        os.makedirs(stale)
        open(os.path.join(stale, "COMPLETE"), "w").close()
    cp = PeerCopier.create(ppn, nodedir, peer_copies=1, timeout_s=60)
    for step in (5, 6):
        d = _write_step(nodedir, rank, step, world, corrupt_rank)
        files = [PeerFile(rel, len(b), _crc_as_sent(rank, step, rel, b, corrupt_rank))
                 for rel, b in _files_of(rank, step).items()]
        st = cp.submit(d, files)
        cp.wait()
        assert st.error is None, st.error
        assert st.bytes_sent == sum(len(b) for b in _files_of(rank, step).values())
    assert cp.close(timeout_s=30)


@pytest.mark.timeout(120)
def test_ring_copy_two_nodes_bytes_equal_and_older_dropped(tmp_path):
    ppn = [2, 1]
    run_world(_worker, 3, str(tmp_path), ppn, -1, timeout_s=60)
    n0, n1 = tmp_path / "elastor-node0", tmp_path / "elastor-node1"
    # node 1 holds node 0's ranks 0 and 1; node 0 holds node 1's rank 2; only the newest step is kept
    o0, o1 = _oid("elastor-node0"), _oid("elastor-node1")
    assert o0.endswith("-elastor-node0") and o0 != o1
    assert sorted(os.listdir(n1 / "peer")) == [o0]
    assert sorted(os.listdir(n0 / "peer")) == [o1]
    # step 5's copy is dropped; its data files stay as spares the next copy is received into
    assert sorted(os.listdir(n1 / "peer" / o0)) == [".spare", STEP6]
    assert sorted(os.listdir(n0 / "peer" / o1)) == [".spare", STEP6]
    for holder, ranks, origin in ((n1, (0, 1), o0), (n0, (2,), o1)):
        spares = holder / "peer" / origin / ".spare"
        want5 = {rel: b for r in ranks for rel, b in _files_of(r, 5).items() if rel.endswith(".safetensors")}
        assert sorted(os.listdir(spares)) == sorted(want5)
        assert all((spares / rel).read_bytes() == b for rel, b in want5.items())
    for holder, ranks, origin in ((n1, (0, 1), o0), (n0, (2,), o1)):
        d = holder / "peer" / origin / STEP6
        assert (d / "COMPLETE").exists()
        visible = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))
        want = sorted(["COMPLETE"] + [rel for r in ranks for rel in _files_of(r, 6)])
        assert visible == want
        for r in ranks:
            for rel, b in _files_of(r, 6).items():
                assert (d / rel).read_bytes() == b, (holder, rel)


@pytest.mark.timeout(120)
def test_copy_that_arrives_with_a_bad_crc_is_not_complete(tmp_path):
    run_world(_worker, 3, str(tmp_path), [2, 1], 1, timeout_s=60)
    n1 = tmp_path / "elastor-node1"
    d6 = n1 / "peer" / _oid("elastor-node0") / STEP6
    assert not (d6 / "COMPLETE").exists()                      # rank 1's data file failed its check
    assert not (d6 / "data_00001.safetensors").exists()
    assert (d6 / "data_00000.safetensors").read_bytes() == _files_of(0, 6)["data_00000.safetensors"]
    # the previous complete copy is kept, since the newer one never completed
    d5 = n1 / "peer" / _oid("elastor-node0") / STEP5
    assert (d5 / "COMPLETE").exists()
    assert (d5 / "data_00001.safetensors").read_bytes() == _files_of(1, 5)["data_00001.safetensors"]
    # the other direction is unaffected
    assert (tmp_path / "elastor-node1" / "peer").exists()
    assert (tmp_path / "elastor-node0" / "peer" / _oid("elastor-node1") / STEP6 / "COMPLETE").exists()


@pytest.mark.unit
def test_node_memory_need_counts_the_predecessors_bytes():
    from elastor_ds.checkpoint.snapshot.peer_plan import node_memory_need
    # node 0 = ranks 0,1 (100 + 50 bytes), node 1 = rank 2 (7 bytes); keep 1
    got = node_memory_need([2, 1], {0: 100, 1: 50, 2: 7}, keep=1, peer_copies=1)
    assert got == [{"own": 150, "peer": 7, "need": 150 * 2 + 2 * 7},
                   {"own": 7, "peer": 150, "need": 7 * 2 + 2 * 150}]
    assert node_memory_need([2, 1], {0: 100, 1: 50, 2: 7}, keep=2, peer_copies=0)[1]["need"] == 7 * 3


MIB = 2 ** 20


def _budget_worker(rank, world, base, out):
    from elastor_ds.comm import TorchComm
    from elastor_ds.integrations.deepspeed.config import MemorySnapshotConfig
    from elastor_ds.checkpoint.snapshot.tier import MemoryBudgetError, MemoryTier

    node = 0 if rank < 2 else 1   # two "nodes" = two node directories: ranks 0,1 and rank 2
    mcfg = MemorySnapshotConfig(keep=2, peer_copies=1, dir=os.path.join(base, f"n{node}"),
                                max_bytes=(10 ** 6 if node == 0 else 4000) * MIB)
    comm = TorchComm.create(60)
    tier = MemoryTier(mcfg, comm)
    try:
        tier.check_budget({0: 1000, 1: 1000, 2: 100}[rank] * MIB, comm, estimated=False)
        msg = "fits"
    except MemoryBudgetError as e:
        msg = str(e)
    with open(os.path.join(out, f"r{rank}.txt"), "w") as f:
        f.write(msg)


@pytest.mark.timeout(120)
def test_budget_counts_the_peer_copy_a_node_holds(tmp_path):
    """Node 1 writes 100 MiB per snapshot but holds node 0's 2000 MiB as its peer copy: 100 x 3 +
    2000 x 2 = 4300 MiB > its 4000 MiB cap (counting its own bytes only would say 400 MiB: fits)."""
    out = tmp_path / "out"
    out.mkdir()
    run_world(_budget_worker, 3, str(tmp_path), str(out), timeout_s=60)
    for r in range(3):                                     # every rank raises, naming node 1's numbers
        msg = (out / f"r{r}.txt").read_text()
        assert "write 100.0 MiB per snapshot x 3 (keep 2 + 1 being written)" in msg, msg
        assert "1.95 GiB x 2 (held + arriving) = 4.20 GiB" in msg and "/n1/local can hold 3.91 GiB" in msg, msg


@pytest.mark.unit
def test_origin_id_names_host_and_directory(monkeypatch):
    import socket
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-1.cluster")
    a = origin_id("/dev/shm/my job")
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-2.cluster")
    b = origin_id("/dev/shm/my job")            # the same --snapshot-dir on another node
    assert a == "gpu-node-1.cluster-my_job" and b == "gpu-node-2.cluster-my_job"


# ---------------------------------------------------------------- a lying sender (issue 19)
LIES = {
    "huge": lambda rel, b: [rel, 1 << 34, zlib.crc32(b)],                  # 16 GiB announced for a 41 KB file
    "unlisted": lambda rel, b: ["data_09999.safetensors", len(b), zlib.crc32(b)],   # no such file in the manifest
    "other-rank": lambda rel, b: [f"data_{0:05d}.safetensors", len(_files_of(0, 5)["data_00000.safetensors"]),
                                  zlib.crc32(_files_of(0, 5)["data_00000.safetensors"])],  # rank 0's file
}


def _liar_worker(rank, world, base, lie):
    """Ranks 0 and 2 run the real copier; rank 1 (node 0, which only sends to rank 2) speaks the
    protocol by hand and announces a file the manifest does not back. It posts its header and its
    data sends, and leaves without waiting for them (an attacker does not)."""
    import torch

    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    ppn = [2, 1]
    node = 0 if rank < 2 else 1
    nodedir = os.path.join(base, f"elastor-node{node}")
    os.makedirs(nodedir, exist_ok=True)
    _job_key(base)
    cp = pc.PeerCopier.create(ppn, nodedir, peer_copies=1, timeout_s=30)
    d = _write_step(nodedir, rank, 5, world)
    if rank != 1:
        st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank, 5).items()])
        cp.wait()
        assert st.error is None, st.error
        assert cp.close(timeout_s=30)
        return
    rel, body = next((r, b) for r, b in _files_of(1, 5).items() if r.endswith(".safetensors"))
    entry = LIES[lie](rel, body)
    if hasattr(pc, "file_mac"):   # the attacker adapts to the receiver's protocol version
        entry.append(pc.file_mac(cp.key, cp.origin, "step_000000005", entry[0], body))
    header = json.dumps({"origin": cp.origin, "step": "step_000000005", "seq": 1, "src": 1, "files": [entry]}).encode()
    tr = cp.transport   # the copier's own transport, spoken by hand
    tr.isend(torch.tensor([len(header)], dtype=torch.int64), 2, tag=1).wait()
    tr.isend(header, 2, tag=2).wait()
    tr.isend(body, 2, tag=16)   # not waited for


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_sender_writes_nothing_and_completes_nothing(tmp_path, lie):
    run_world(_liar_worker, 3, str(tmp_path), lie, timeout_s=60)
    origin = _oid("elastor-node0")
    got = tmp_path / "elastor-node1" / "peer" / origin / STEP5
    # rank 0's files arrived (an honest sender of the same node); nothing of rank 1's announcement was
    # written or allocated, not even a part file; the copy of node 0 is not complete
    on_disk = {str(p.relative_to(got)): p.stat().st_size for p in got.rglob("*") if p.is_file()} if got.exists() else {}
    honest = {rel: len(b) for rel, b in _files_of(0, 5).items()}
    assert not (got / "COMPLETE").exists(), on_disk
    assert {k: v for k, v in on_disk.items() if not k.startswith(".from_")} == honest, on_disk
    # the other direction (rank 2 -> rank 0) is complete: one liar does not stop the ring
    assert (tmp_path / "elastor-node0" / "peer" / _oid("elastor-node1") / STEP5 / "COMPLETE").exists()


def _enospc_worker(rank, world, base, out):
    """Two nodes of one rank each. On node 1, the tmpfs is full while rank 0's copy of step 5 is
    received (``posix_fallocate`` of its part files fails with ENOSPC, as when the node's other
    receiving ranks used the room the budget check saw free). Each rank times its two copies."""
    import errno
    import time

    from elastor_ds.checkpoint.snapshot.peer_copy import PeerCopier, PeerFile

    nodedir = os.path.join(base, f"elastor-node{rank}")
    os.makedirs(nodedir, exist_ok=True)
    _job_key(base)
    full = [rank == 1]
    real = os.posix_fallocate

    def fallocate(fd, off, n):
        if full[0] and os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, off, n)
    os.posix_fallocate = fallocate
    cp = PeerCopier.create([1, 1], nodedir, peer_copies=1, timeout_s=60)
    times, errors = [], []
    for step in (5, 6):
        d = _write_step(nodedir, rank, step, world)
        files = [PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank, step).items()]
        t0 = time.monotonic()
        st = cp.submit(d, files)
        cp.wait()
        times.append(time.monotonic() - t0)
        errors.append(None if st.error is None else str(st.error))
        full[0] = False
    assert cp.close(timeout_s=30)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "errors": errors}, f)


@pytest.mark.timeout(180)
def test_a_copy_that_does_not_fit_is_drained_not_left_hanging(tmp_path):
    """The receiver cannot create the files of a copy (ENOSPC): it receives the bytes into a scratch
    buffer and drops them, so the sender's sends are matched at once. Before, it posted no receive,
    the sender waited for the transport's 60 s timeout, and the failed transport failed every later
    copy of the launch. Oracles: the senders' times and errors, the files on node 1."""
    out = tmp_path / "out"
    out.mkdir()
    run_world(_enospc_worker, 2, str(tmp_path), str(out), timeout_s=150)
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert r0["errors"] == [None, None] and r1["errors"] == [None, None], (r0, r1)
    assert max(r0["times"] + r1["times"]) < 30, (r0, r1)
    d = tmp_path / "elastor-node1" / "peer" / _oid("elastor-node0")
    assert not (d / STEP5 / "COMPLETE").exists()                 # dropped, nothing half-made left
    left = [p.name for p in (d / STEP5).rglob("*")] if (d / STEP5).exists() else []
    assert not [n for n in left if n.endswith(".part")], left
    assert (d / STEP6 / "COMPLETE").exists()
    for rel, b in _files_of(0, 6).items():
        assert (d / STEP6 / rel).read_bytes() == b
    assert (tmp_path / "elastor-node0" / "peer" / _oid("elastor-node1") / STEP6 / "COMPLETE").exists()


def _late_manifest_worker(rank, world, base, out):
    """Two nodes of one rank each. On node 1 the step's manifest appears 0.3 s after this rank's
    submit: as on a rank that is not its node's committer, whose node copy of the step is committed
    by another rank right after the commit broadcast."""
    import threading
    import time

    from elastor_ds.checkpoint.snapshot.peer_copy import PeerCopier, PeerFile

    nodedir = os.path.join(base, f"elastor-node{rank}")
    os.makedirs(nodedir, exist_ok=True)
    _job_key(base)
    cp = PeerCopier.create([1, 1], nodedir, peer_copies=1, timeout_s=30)
    d = _write_step(nodedir, rank, 5, world)
    later = None
    if rank == 1:
        os.replace(os.path.join(d, "manifest.json"), os.path.join(nodedir, "manifest.later"))
        later = threading.Timer(0.3, os.replace, (os.path.join(nodedir, "manifest.later"),
                                                  os.path.join(d, "manifest.json")))
    t0 = time.monotonic()
    st = cp.submit(d, [PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank, 5).items()])
    if later is not None:
        later.start()
    cp.wait()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"s": time.monotonic() - t0, "error": st.error}, f)
    assert cp.close(timeout_s=30)


@pytest.mark.timeout(120)
def test_a_receiver_waits_for_its_nodes_manifest_of_the_step(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_world(_late_manifest_worker, 2, str(tmp_path), str(out), timeout_s=100)
    r = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [x["error"] for x in r] == [None, None] and max(x["s"] for x in r) < 10, r
    d = tmp_path / "elastor-node1" / "peer" / _oid("elastor-node0") / STEP5
    assert (d / "COMPLETE").exists()
    for rel, b in _files_of(0, 5).items():
        assert (d / rel).read_bytes() == b


def _refused_worker(rank, world, base, out):
    """Two nodes of one rank each. Node 1's manifest of step 6 gives rank 0's data file another
    CRC32 than rank 0 announces (a copy this node must not take); steps 5 and 7 are consistent."""
    import time

    from elastor_ds.checkpoint.snapshot.peer_copy import PeerCopier, PeerFile

    nodedir = os.path.join(base, f"elastor-node{rank}")
    os.makedirs(nodedir, exist_ok=True)
    _job_key(base)
    cp = PeerCopier.create([1, 1], nodedir, peer_copies=1, timeout_s=30)
    res = []
    for step in (5, 6, 7):
        d = _write_step(nodedir, rank, step, world, corrupt_rank=0 if rank == 1 else -1)   # (step 6 only)
        t0 = time.monotonic()
        st = cp.submit(d, [PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank, step).items()])
        cp.wait()
        res.append({"s": time.monotonic() - t0, "error": st.error, "sent": st.bytes_sent})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    assert cp.close(timeout_s=30)


@pytest.mark.timeout(150)
def test_a_refused_copy_fails_at_once_and_the_next_one_goes_through(tmp_path):
    """The receiver refuses a sender's files (they do not match its node's manifest). It tells the
    sender, which sends nothing: its copy fails at once, naming the receiver, and the transport
    stays usable. Before, the sender's data sends waited for receives that never came until the
    transport's timeout (30 s here), and the failed transport failed the next copy too."""
    out = tmp_path / "out"
    out.mkdir()
    run_world(_refused_worker, 2, str(tmp_path), str(out), timeout_s=130)
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert "did not accept" in (r0[1]["error"] or "") and r0[1]["sent"] == 0 and r0[1]["s"] < 10, r0
    assert [r0[0]["error"], r0[2]["error"]] == [None, None] and [x["error"] for x in r1] == [None] * 3, (r0, r1)
    d = tmp_path / "elastor-node1" / "peer" / _oid("elastor-node0")
    step7 = d / "step_000000007"
    assert not (d / STEP6 / "COMPLETE").exists() and (step7 / "COMPLETE").exists()
    for rel, b in _files_of(0, 7).items():
        assert (step7 / rel).read_bytes() == b
