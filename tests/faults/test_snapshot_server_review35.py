"""Review 35 of the snapshot server and peer copies, as an attacker on the host or network without
the job secret and as a buggy job member with it (real sockets, real files, real gloo processes).

Oracles: raw HTTP written by hand and signed by hand with hmac/hashlib (an attacker does not use
our client); the bytes the test wrote; the files on disk after a copy."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import time
import zlib

import pytest

from dist_utils import job_secret_file, run_world
from elastor_ds.checkpoint.snapshot.server import SnapshotServer

pytestmark = [pytest.mark.timeout(120)]

STEP = "step_000000007"
KEY = bytes(range(7, 39))
DATA = bytes((i * 13 + 5) % 256 for i in range(100_000))


def _node(tmp_path):
    """A node directory holding one committed memory snapshot (one data file)."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    root = tmp_path / "node"
    d = root / "local" / STEP
    d.mkdir(parents=True)
    (d / "data_00000.safetensors").write_bytes(DATA)
    files = {"data_00000.safetensors": FileEntry("data_00000.safetensors", len(DATA), zlib.crc32(DATA), 0)}
    (d / "manifest.json").write_text(Manifest(step=7, tensors={}, files=files, world_size=1).dumps())
    return root


def _auth(method: str, path: str, rng: str, port: int, when: str | None = None) -> str:
    """The auth headers computed by hand: HMAC-SHA256 over method, path, range, nonce, time and the
    server's published address."""
    nonce = secrets.token_hex(16)
    when = when or str(int(time.time()))
    msg = b"req\n" + "\n".join([method, path, rng, nonce, when, f"127.0.0.1:{port}"]).encode() + b"\n"
    return (f"X-Elastor-Nonce: {nonce}\r\nX-Elastor-Time: {when}\r\n"
            f"X-Elastor-Auth: {hmac.new(KEY, msg, hashlib.sha256).hexdigest()}\r\n")


def _signed_get(port: int, rng: str = "bytes=0-9", close: bool = True, extra: str = "") -> bytes:
    path = f"/f/local/{STEP}/data_00000.safetensors"
    conn = "Connection: close\r\n" if close else ""
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: {rng}\r\n{_auth('GET', path, rng, port)}{extra}{conn}"
            f"\r\n").encode()


def _exchange(port: int, raw: bytes, timeout: float = 20.0) -> bytes:
    """Send ``raw``, then read until the server closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        buf = b""
        while True:
            try:
                k = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not k:
                break
            buf += k
    return buf


def _statuses(buf: bytes) -> list[int]:
    return [int(line.split(b" ", 2)[1]) for line in buf.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


# ------------------------------------------------------------------ 1. the "100-continue" phase
@pytest.mark.unit
def test_an_unauthenticated_expect_100_continue_is_not_invited_to_send_its_body(tmp_path):
    """Before: any client that announced a 1 TB body with ``Expect: 100-continue`` got ``100
    Continue`` (an invitation to send it) before its MAC was even looked at. Now: 417, closed."""
    root = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        for method in ("GET", "POST"):
            buf = _exchange(srv.port, f"{method} /f/local/{STEP}/data_00000.safetensors HTTP/1.1\r\nHost: x\r\n"
                                      f"Expect: 100-continue\r\nContent-Length: {10 ** 12}\r\n\r\n".encode())
            assert not buf.startswith(b"HTTP/1.1 100"), buf[:80]
            assert b"100 Continue" not in buf
            assert _statuses(buf) == [417 if method == "GET" else 405], buf[:200]
        assert srv.bytes_served == 0


@pytest.mark.unit
@pytest.mark.parametrize("framing", ["Content-Length", "Transfer-Encoding"])
def test_a_signed_request_that_carries_a_body_is_refused_and_its_body_never_parsed(tmp_path, framing):
    """A signed GET whose body is a second signed request (a member's client, or whoever captured
    the first in flight and appended to it). Before: the server ignored the declared body, so it was
    parsed as the next request on the keep-alive connection and served (two 206 answers, 20 bytes).
    Now the head that announces a body is refused (413) before authentication and nothing is served."""
    root = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        inner = _signed_get(srv.port, "bytes=10-19")
        if framing == "Content-Length":
            outer = _signed_get(srv.port, close=False, extra=f"Content-Length: {len(inner)}\r\n")
            raw = outer + inner
        else:
            outer = _signed_get(srv.port, close=False, extra="Transfer-Encoding: chunked\r\n")
            raw = outer + f"{len(inner):x}\r\n".encode() + inner + b"\r\n0\r\n\r\n"
        buf = _exchange(srv.port, raw)
        assert _statuses(buf) == [413], buf[:300]
        assert DATA[:10] not in buf and DATA[10:20] not in buf
        assert srv.bytes_served == 0
        # a plain signed GET (no body, or Content-Length: 0) is served as before
        assert _statuses(_exchange(srv.port, _signed_get(srv.port, extra="Content-Length: 0\r\n"))) == [206]
        assert srv.bytes_served == 10


# ------------------------------------------------------------------ 3. replay
@pytest.mark.unit
def test_a_captured_request_is_not_replayable_after_its_nonce_is_forgotten_under_load(tmp_path):
    """The server remembers at most MAX_NONCES (200 000) nonces. Before: past that it forgot the
    oldest, so a request captured on the wire was served again within its 300 s clock window once
    200 000 others had been seen (a restore of many small reads, or a member's retries). Now a request
    stamped no later than a forgotten nonce's is refused. The load is simulated by handing the server
    200 001 fresh nonces directly (200 001 real connections would take minutes); the capture and the
    replay are real requests on the wire."""
    root = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        captured = _signed_get(srv.port)
        first = _exchange(srv.port, captured)
        assert _statuses(first) == [206] and first.endswith(DATA[:10])
        assert _statuses(_exchange(srv.port, captured)) == [401]    # replayed at once: refused (as before)
        for _ in range(200_001):
            srv._srv.fresh_nonce(secrets.token_hex(16))
        replay = _exchange(srv.port, captured)
        assert _statuses(replay) == [401], replay[:200]
        assert srv.bytes_served == 10
        # the job's own new requests (a later second than any forgotten nonce) are served
        floor = int(time.time())
        while int(time.time()) <= floor:   # the wall clock's next second: what a new request is stamped with
            time.sleep(0.05)
        assert _statuses(_exchange(srv.port, _signed_get(srv.port))) == [206]


@pytest.mark.unit
def test_a_member_whose_clock_runs_ahead_does_not_push_the_others_requests_out_under_load(tmp_path):
    """The companion of the test above (it guards the fix's design; the server before it had no such
    rule): a member's request stamped 200 s ahead (within the 300 s skew), then 200 001 others. The
    nonces forgotten first are the earliest stamped, so the refusal floor stays at those: the others'
    next requests are served (forgetting in arrival order would have put the floor 200 s ahead)."""
    root = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        path = f"/f/local/{STEP}/data_00000.safetensors"
        ahead = (f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n"
                 f"{_auth('GET', path, 'bytes=0-9', srv.port, when=str(int(time.time()) + 200))}"
                 f"Connection: close\r\n\r\n").encode()
        assert _statuses(_exchange(srv.port, ahead)) == [206]
        for _ in range(200_001):
            srv._srv.fresh_nonce(secrets.token_hex(16))
        floor = int(time.time())
        while int(time.time()) <= floor:   # the wall clock's next second: what a new request is stamped with
            time.sleep(0.05)
        assert _statuses(_exchange(srv.port, _signed_get(srv.port))) == [206]
        assert _statuses(_exchange(srv.port, ahead)) == [401]   # and the one ahead is still not replayable

# ------------------------------------------------------------------ 1. the peer copy's header phase (gloo)
STEP5 = "step_000000005"


def _files_of(rank: int) -> dict[str, bytes]:
    body = bytes(((rank + 3) * 17 + i) % 251 for i in range(30_000 + 1000 * rank))
    return {f"data_{rank:05d}.safetensors": body, f"rank_state/rank_{rank:05d}.json": json.dumps({"r": rank}).encode()}


def _write_step(nodedir: str, rank: int, world: int) -> str:
    """This rank's files of step 5 and the whole step's manifest (every rank's files, their writer)."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    d = os.path.join(nodedir, "local", STEP5)
    for rel, b in _files_of(rank).items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(b)
    files = {rel: FileEntry(rel, len(b), zlib.crc32(b), r) for r in range(world) for rel, b in _files_of(r).items()}
    tmp = os.path.join(d, f".manifest.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(Manifest(step=5, tensors={}, files=files, world_size=world).dumps())
    os.replace(tmp, os.path.join(d, "manifest.json"))
    return d


def _header(cp, entry: list, origin: str | None = None) -> bytes:
    return json.dumps({"origin": origin or cp.origin, "step": STEP5, "seq": 1, "src": 1, "files": entry}).encode()


def _spoof(cp, rel, body):     # its own file, correctly MAC'd, under another node's origin id
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    return _header(cp, [[rel, len(body), zlib.crc32(body), pc.file_mac(cp.key, "node-x", STEP5, rel, body)]], "node-x")


def _dup(cp, rel, body):       # its own file, correctly MAC'd, listed twice
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    e = [rel, len(body), zlib.crc32(body), pc.file_mac(cp.key, cp.origin, STEP5, rel, body)]
    return _header(cp, [e, list(e)])


BAD_HEADERS = {
    "duplicate": _dup,
    "bad-entry": lambda cp, rel, body: _header(cp, [["x"]]),
    "deep": lambda cp, rel, body: b"[" * 200_000,               # json.loads: RecursionError
    "not-an-object": lambda cp, rel, body: b"[1, 2, 3]",
    "other-origin": _spoof,
    "over-1-MiB": lambda cp, rel, body: b" " * ((1 << 20) + 1),   # more than a header may be: never received
}


def _bad_header_worker(rank, world, base, kind):
    """Ranks 0 and 2 run the real copier (node 0 = ranks 0, 1 sends to rank 2; rank 2 sends to rank
    0). Rank 1 speaks the protocol by hand: a header that is not a valid one, then (as a sender
    does) its data sends, one per listed file, not waited for."""
    import torch

    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    node = 0 if rank < 2 else 1
    nodedir = os.path.join(base, f"elastor-node{node}")
    os.makedirs(nodedir, exist_ok=True)
    os.environ["ELASTOR_JOB_SECRET_FILE"] = job_secret_file(base)
    cp = pc.PeerCopier.create([2, 1], nodedir, peer_copies=1, timeout_s=30)
    d = _write_step(nodedir, rank, world)
    if rank != 1:
        t0 = time.monotonic()
        st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank).items()])
        cp.wait()
        with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
            json.dump({"error": st.error, "s": time.monotonic() - t0}, f)
        assert cp.close(timeout_s=30)
        return
    rel, body = next((r, b) for r, b in _files_of(1).items() if r.endswith(".safetensors"))
    header = BAD_HEADERS[kind](cp, rel, body)
    tr = cp.transport
    tr.isend(torch.tensor([len(header)], dtype=torch.int64), 2, tag=1).wait()
    sent = tr.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), 2, tag=2)
    if len(header) <= 1 << 20:   # (a header too long is not received: not waited for)
        sent.wait()
    for k in range(2):
        tr.isend(torch.frombuffer(bytearray(body), dtype=torch.uint8), 2, tag=16 + k)   # not waited for


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", sorted(BAD_HEADERS))
def test_a_bad_header_refuses_that_sender_only_and_allocates_nothing_for_it(tmp_path, kind):
    """Before: a header that failed to parse (not JSON, nested 200 000 deep, not an object, a bad
    entry), or one announced longer than 1 MiB, failed the receiver's whole exchange: the honest
    sender of the same step never got its answer (here its copy failed when the receiver moved on;
    in a live job it waits for the transport's timeout, and the failed transport fails every later
    copy of the launch). A file listed twice passed every check and was allocated, received and
    moved twice (the second move failed the exchange); one under another node's origin id was written
    into that node's copies. Now that sender alone is refused, before anything is allocated for it;
    the honest sender's files arrive."""
    run_world(_bad_header_worker, 3, str(tmp_path), kind, timeout_s=120)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r2 = json.loads((tmp_path / "rank2.json").read_text())
    assert r0["error"] is None and r2["error"] is None, (r0, r2)
    assert r0["s"] < 20 and r2["s"] < 20, (r0, r2)   # not the transport's 30 s timeout
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    got = tmp_path / "elastor-node1" / "peer" / origin_id(str(tmp_path / "elastor-node0")) / STEP5
    on_disk = {str(p.relative_to(got)): p.read_bytes() for p in got.rglob("*") if p.is_file()}
    assert not (got / "COMPLETE").exists()
    assert {k: v for k, v in on_disk.items() if not k.startswith(".from_")} == _files_of(0), sorted(on_disk)
    assert os.listdir(tmp_path / "elastor-node1" / "peer") == [got.parent.name]   # nothing under another origin
    back = tmp_path / "elastor-node0" / "peer" / origin_id(str(tmp_path / "elastor-node1")) / STEP5
    assert (back / "COMPLETE").exists()
    for rel, b in _files_of(2).items():
        assert (back / rel).read_bytes() == b


# ------------------------------------------------------------------ origin ids: two nodes with one name
@pytest.mark.unit
def test_node_origins_tell_apart_nodes_that_share_an_id():
    from elastor_ds.checkpoint.snapshot.peer_copy import node_origins
    # ranks: node0 = 0, 1; node1 = 2; node2 = 3 (nodes 0 and 2: the same host name and directory name)
    assert node_origins([2, 1, 1], ["h-snap", "h-snap", "g-snap", "h-snap"]) == \
        ["h-snap-n0", "h-snap-n0", "g-snap", "h-snap-n2"]
    assert node_origins([1, 1], ["a", "b"]) == ["a", "b"]
    # a suffixed id that meets another node's own id: every node numbered
    assert node_origins([1, 1, 1], ["a", "a", "a-n1"]) == ["a-n0", "a-n1", "a-n1-n2"]


def _same_name_worker(rank, world, base):
    """Two nodes of one rank each whose snapshot directories have the same name (base/n<rank>/snap)
    on one host: the same origin id, as two containers given one host name."""
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    nodedir = os.path.join(base, f"n{rank}", "snap")
    os.makedirs(nodedir, exist_ok=True)
    os.environ["ELASTOR_JOB_SECRET_FILE"] = job_secret_file(base)
    cp = pc.PeerCopier.create([1, 1], nodedir, peer_copies=1, timeout_s=30)
    d = _write_step(nodedir, rank, world)
    st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files_of(rank).items()])
    cp.wait()
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump({"error": st.error, "completed": st.completed}, f)
    assert cp.close(timeout_s=30)


@pytest.mark.timeout(150)
def test_two_nodes_with_the_same_origin_id_copy_to_each_other(tmp_path):
    """Before: each node refused its partner's copy as its own (the same origin id): no node held a
    copy of the other, and a restore after losing one read storage. Now they are told apart."""
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    run_world(_same_name_worker, 2, str(tmp_path), timeout_s=120)
    same = origin_id(str(tmp_path / "n0" / "snap"))
    assert same == origin_id(str(tmp_path / "n1" / "snap"))
    for me, other in ((0, 1), (1, 0)):
        r = json.loads((tmp_path / f"rank{me}.json").read_text())
        assert r == {"error": None, "completed": [f"{same}-n{other}"]}, r
        got = tmp_path / f"n{me}" / "snap" / "peer"
        assert os.listdir(got) == [f"{same}-n{other}"]
        assert (got / f"{same}-n{other}" / STEP5 / "COMPLETE").exists()
        for rel, b in _files_of(other).items():
            assert (got / f"{same}-n{other}" / STEP5 / rel).read_bytes() == b


# ------------------------------------------------------------------ 4. answers: a member's server answering other bytes
def _keyed_fake(answer_range: str, size: int, body: bytes):
    """A server of the job (it has the key; keep-alive): its index says it holds ``local/STEP``, a
    HEAD gives the file's size as 100 000, and a GET is answered with ``answer_range`` of a file of
    ``size`` bytes, correctly MAC'd for that request: a buggy member, not a forger."""
    import threading

    from elastor_ds.checkpoint.auth import response_mac
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)

    def answer(c, head: bytes) -> None:
        line, *fields = head.split(b"\r\n")
        nonce = next(f.split(b":", 1)[1].strip().decode() for f in fields if f.lower().startswith(b"x-elastor-nonce:"))
        if line.startswith(b"GET /index/"):
            idx = json.dumps({"local": True, "peer": []}).encode()
            out = (200, "", "", idx, idx)
        elif line.startswith(b"HEAD "):
            out = (200, "", "100000", b"", b"")
        else:
            out = (206, answer_range, str(size), body, body)
        code, crange, fsize, mac_body, sent = out
        mac = response_mac(KEY, nonce, code, crange, fsize, [mac_body])
        extra = (f"Content-Range: {crange}\r\n" if crange else "") + (f"X-File-Size: {fsize}\r\n" if fsize else "")
        length = len(body) if code == 206 else (0 if line.startswith(b"HEAD ") else len(sent))
        c.sendall(f"HTTP/1.1 {code} X\r\nContent-Length: {length}\r\n{extra}X-Elastor-Auth: {mac}\r\n\r\n".encode()
                  + sent)

    def conn(c):
        with c:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    k = c.recv(65536)
                    if not k:
                        return
                    buf += k
                head, buf = buf.split(b"\r\n\r\n", 1)
                answer(c, head)

    def serve():
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=conn, args=(c,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return ls


@pytest.mark.unit
@pytest.mark.parametrize("answer", ["other-range", "other-size"])
def test_an_answer_for_other_bytes_than_asked_is_refused_before_its_body_is_taken(answer):
    """Asked bytes 10..19 of a 100 000-byte file (its HEAD said so), a server of the job answers
    bytes 0..9, or bytes 10..19 of a file now 200 000 bytes long, MAC'd correctly. Before: the client
    took the bytes (the MAC covers the range, but nobody compared it with the request): 0..9 landed
    where 10..19 belong. Now: CorruptCheckpointError naming both, the destination untouched."""
    from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
    from elastor_ds.errors import CorruptCheckpointError
    rng, size, body = (("bytes 0-9/100000", 100_000, DATA[:10]) if answer == "other-range" else
                       ("bytes 10-19/200000", 200_000, DATA[10:20]))
    ls = _keyed_fake(rng, size, body)
    src = RemoteSource(f"127.0.0.1:{ls.getsockname()[1]}", STEP, KEY, timeout_s=10, busy_wait_s=1)
    buf = bytearray(b"\xee" * 10)
    try:
        assert src.has("data_00000.safetensors", 100_000)
        with pytest.raises(CorruptCheckpointError, match=r"asked for 10-19/100000, answered"):
            src.read_into("data_00000.safetensors", 10, [memoryview(buf)])
    finally:
        src.close()
        ls.close()
    assert buf == b"\xee" * 10


# ------------------------------------------------------------------ 1. an honest header too long to be taken
def _many_files(rank: int) -> dict[str, bytes]:
    """Rank 0: 8 files with 200-character names (a header of ~2.6 KB); rank 1: the usual two files."""
    if rank == 0:
        return {f"data_{'x' * 200}_{i}.safetensors": bytes([i]) * (1000 + i) for i in range(8)}
    return _files_of(rank)


def _big_header_worker(rank, world, base):
    """Two nodes of one rank each; a header may hold 2 000 bytes here (_MAX_HEADER, 1 MiB in a job)."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    pc._MAX_HEADER = 2000
    nodedir = os.path.join(base, f"elastor-node{rank}")
    os.makedirs(nodedir, exist_ok=True)
    os.environ["ELASTOR_JOB_SECRET_FILE"] = job_secret_file(base)
    cp = pc.PeerCopier.create([1, 1], nodedir, peer_copies=1, timeout_s=30)
    d = os.path.join(nodedir, "local", STEP5)
    for rel, b in _many_files(rank).items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(b)
    files = {rel: FileEntry(rel, len(b), zlib.crc32(b), r) for r in range(world) for rel, b in _many_files(r).items()}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write(Manifest(step=5, tensors={}, files=files, world_size=world).dumps())
    t0 = time.monotonic()
    st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _many_files(rank).items()])
    cp.wait()
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump({"error": st.error, "s": time.monotonic() - t0, "sent": st.bytes_sent}, f)
    assert cp.close(timeout_s=30)


@pytest.mark.timeout(150)
def test_a_header_longer_than_a_receiver_takes_fails_that_copy_only_and_at_once(tmp_path):
    """Before: the sender sent it anyway; the receiver failed its whole exchange on it, so the
    partner's copy the other way failed too, and the sender's header send waited for a receive that
    never came until the transport's timeout (30 s here), which fails the transport. Now the sender
    sends an empty header, its copy fails at once saying why, and the copy the other way arrives."""
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    run_world(_big_header_worker, 2, str(tmp_path), timeout_s=120)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["error"] and "more than a receiver takes (2000)" in r0["error"] and r0["sent"] == 0, r0
    assert r1["error"] is None and r1["sent"] == sum(len(b) for b in _files_of(1).values()), r1
    assert max(r0["s"], r1["s"]) < 20, (r0, r1)
    assert not (tmp_path / "elastor-node1" / "peer").exists() or not os.listdir(tmp_path / "elastor-node1" / "peer")
    got = tmp_path / "elastor-node0" / "peer" / origin_id(str(tmp_path / "elastor-node1")) / STEP5
    assert (got / "COMPLETE").exists()
    for rel, b in _files_of(1).items():
        assert (got / rel).read_bytes() == b
