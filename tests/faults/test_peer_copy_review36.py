"""Review 36 of peer copies (real gloo processes, real files):

* ``PeerCopier.close()`` waits (bounded) for this rank's answers to its senders: a receiver that
  refused a sender and closed before that sender listened for its answer left it waiting, and its copy
  failed on a broken transport instead of with the receiver's "no";
* a sender whose header a receiver refuses (announced longer than a receiver takes) learns it from the
  receiver's answer and fails that copy at once; before, its header send waited for a receive that
  never came until the transport's timeout, which failed the transport for the rest of the launch.
"""
from __future__ import annotations

import json
import os
import time
import zlib

import pytest

from dist_utils import job_secret_file, run_world

pytestmark = [pytest.mark.timeout(150)]

STEP5 = "step_000000005"
SLOW_S = 4.0     # the slow sender's delay before it listens for its answer
TIMEOUT_S = 30   # the transport's timeout


def _files_of(rank: int) -> dict[str, bytes]:
    body = bytes(((rank + 5) * 19 + i) % 251 for i in range(20_000 + 1000 * rank))
    return {f"data_{rank:05d}.safetensors": body}


def _write_step(nodedir: str, rank: int, world: int, refuse: int = -1) -> str:
    """This rank's files of step 5 and the whole step's manifest; rank ``refuse``'s file gets another
    CRC32 in it (a copy this node must not take)."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    d = os.path.join(nodedir, "local", STEP5)
    os.makedirs(d, exist_ok=True)
    for rel, b in _files_of(rank).items():
        with open(os.path.join(d, rel), "wb") as f:
            f.write(b)
    files = {rel: FileEntry(rel, len(b), zlib.crc32(b) ^ (1 if r == refuse else 0), r)
             for r in range(world) for rel, b in _files_of(r).items()}
    tmp = os.path.join(d, f".manifest.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(Manifest(step=5, tensors={}, files=files, world_size=world).dumps())
    os.replace(tmp, os.path.join(d, "manifest.json"))
    return d


def _close_worker(rank, world, base):
    """Node 0 = ranks 0, 1 (both send to rank 2); node 1 = rank 2 (sends to rank 0). Rank 2's node
    refuses rank 1's file. Rank 1 is slow to listen for its answer; rank 2 closes and leaves."""
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    node = 0 if rank < 2 else 1
    nodedir = os.path.join(base, f"elastor-node{node}")
    os.makedirs(nodedir, exist_ok=True)
    os.environ["ELASTOR_JOB_SECRET_FILE"] = job_secret_file(base)
    cp = pc.PeerCopier.create([2, 1], nodedir, peer_copies=1, timeout_s=TIMEOUT_S)
    d = _write_step(nodedir, rank, world, refuse=1 if rank == 2 else -1)
    if rank == 1:   # between its header and listening for the answer (the budget check of its receives)
        budget = pc._check_budget
        pc._check_budget = lambda incoming, sd: (time.sleep(SLOW_S), budget(incoming, sd))
    t0 = time.monotonic()
    st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank).items()])
    cp.wait()
    t1 = time.monotonic()
    closed = cp.close(timeout_s=TIMEOUT_S)
    out = {"error": st.error, "copy_s": t1 - t0, "close_s": time.monotonic() - t1, "closed": closed,
           "answers": len(cp._answers), "broken": cp.transport._broken}
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_close_waits_for_the_answers_a_slow_sender_has_not_taken_yet(tmp_path):
    run_world(_close_worker, 3, str(tmp_path), timeout_s=120)
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(3)]
    assert r[0]["error"] is None and r[2]["error"] is None, r
    # rank 2 refused rank 1 and was done long before rank 1 listened; its close waited for that answer
    assert r[2]["copy_s"] < SLOW_S - 1, r
    assert SLOW_S - 2 < r[2]["close_s"] < TIMEOUT_S - 10 and r[2]["closed"] and r[2]["answers"] == 0, r
    assert r[1]["broken"] is None and r[2]["broken"] is None, r
    # so rank 1 learnt the answer, at once, not a broken transport
    assert r[1]["error"] == "rank(s) [2] did not accept this rank's files (see their logs)", r
    assert r[1]["copy_s"] < SLOW_S + 5, r


# ------------------------------------------------------------------ a header its receiver does not take
def _long_names(rank: int) -> dict[str, bytes]:
    """Rank 0: 8 files with 200-character names (a header of ~2.6 KB); rank 1: one file."""
    if rank == 0:
        return {f"data_{'y' * 200}_{i}.safetensors": bytes([i + 1]) * (1500 + i) for i in range(8)}
    return _files_of(rank)


def _refused_header_worker(rank, world, base):
    """Two nodes of one rank each; rank 1 takes headers of at most 2 000 bytes (as a receiver of
    another build might), rank 0 takes 1 MiB and announces ~2.6 KB."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    if rank == 1:
        pc._MAX_HEADER = 2000
    nodedir = os.path.join(base, f"elastor-node{rank}")
    os.makedirs(nodedir, exist_ok=True)
    os.environ["ELASTOR_JOB_SECRET_FILE"] = job_secret_file(base)
    cp = pc.PeerCopier.create([1, 1], nodedir, peer_copies=1, timeout_s=TIMEOUT_S)
    d = os.path.join(nodedir, "local", STEP5)
    os.makedirs(d, exist_ok=True)
    for rel, b in _long_names(rank).items():
        with open(os.path.join(d, rel), "wb") as f:
            f.write(b)
    files = {rel: FileEntry(rel, len(b), zlib.crc32(b), r) for r in range(world) for rel, b in _long_names(r).items()}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write(Manifest(step=5, tensors={}, files=files, world_size=world).dumps())
    t0 = time.monotonic()
    st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _long_names(rank).items()])
    cp.wait()
    copy_s = time.monotonic() - t0
    closed = cp.close(timeout_s=TIMEOUT_S)
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump({"error": st.error, "s": copy_s, "sent": st.bytes_sent, "closed": closed,
                   "broken": cp.transport._broken}, f)


def test_a_sender_whose_header_is_refused_learns_it_at_once(tmp_path):
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    run_world(_refused_header_worker, 2, str(tmp_path), timeout_s=120)
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    hdr = r0["error"] or ""
    assert hdr.startswith("rank(s) [1] refused this rank's header of ") and r0["sent"] == 0, r0
    assert int(hdr.split("header of ")[1].split(" bytes")[0]) > 2000, r0
    assert r1["error"] is None and r1["sent"] == sum(len(b) for b in _long_names(1).values()), r1
    assert max(r0["s"], r1["s"]) < 10, (r0, r1)   # not the transport's 30 s timeout
    assert r0["broken"] is None and r1["broken"] is None, (r0, r1)   # the transports are still good
    assert not (tmp_path / "elastor-node1" / "peer").exists() or not os.listdir(tmp_path / "elastor-node1" / "peer")
    got = tmp_path / "elastor-node0" / "peer" / origin_id(str(tmp_path / "elastor-node1")) / STEP5
    assert (got / "COMPLETE").exists()
    for rel, b in _long_names(1).items():
        assert (got / rel).read_bytes() == b
