"""The controller's snapshot server and the cross-node chunk sources (real sockets, real files).

Oracles: the bytes written to the files by the test itself; raw HTTP requests written by hand
(an attacker does not use our client), signed by hand with hmac/hashlib for the legitimate ones."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
import zlib

import pytest

from elastor_ds.checkpoint.snapshot.peer_sources import PeerCopySource, RemoteSource, node_sources
from elastor_ds.checkpoint.snapshot.server import NodeSnapshots, SnapshotServer, advertised_host
from elastor_ds.errors import ConfigError, IncompleteCheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

STEP = "step_000000007"
KEY = bytes(range(100, 132))


def _manifest(files: dict[str, bytes], step: int = 7) -> str:
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    return Manifest(step=step, tensors={}, files={n: FileEntry(n, len(b), zlib.crc32(b), 0) for n, b in files.items()},
                    world_size=1).dumps()


def _node(tmp_path):
    """A node directory: committed local/STEP (its manifest lists the data file and the rank state),
    a COMPLETE peer copy of node B, an incomplete one of C, a save in progress, an unlisted file
    in the committed step, and secrets next to and inside the node directory."""
    root = tmp_path / "node"
    data = bytes((i * 7 + 3) % 256 for i in range(300_000))
    (root / "local" / STEP / "rank_state").mkdir(parents=True)
    (root / "local" / STEP / "data_00000.safetensors").write_bytes(data)
    (root / "local" / STEP / "rank_state" / "rank_00000.json").write_text('{"a": 1}')
    (root / "local" / STEP / "manifest.json").write_text(_manifest({"data_00000.safetensors": data,
                                                                    "rank_state/rank_00000.json": b'{"a": 1}'}))
    (root / "local" / STEP / "not_listed.bin").write_text("inside secret")
    (root / "local" / ".tmp_step_000000008_x").mkdir()
    (root / "local" / ".tmp_step_000000008_x" / "data_00000.safetensors").write_bytes(b"partial")
    pb = root / "peer" / "nodeB" / STEP
    pb.mkdir(parents=True)
    (pb / "data_00002.safetensors").write_bytes(data[::-1])
    (pb / "COMPLETE").write_text(json.dumps({"origin": "nodeB", "files": {"data_00002.safetensors": len(data)}}))
    pc = root / "peer" / "nodeC" / STEP
    pc.mkdir(parents=True)
    (pc / "data_00003.safetensors").write_bytes(b"x" * 10)   # no COMPLETE: a copy in flight
    (root / ".elastor-owner").write_text("inside secret")
    (root / "weights.pt").write_text("inside secret")        # any file under --snapshot-dir: not served
    (tmp_path / "secret.txt").write_text("top secret")
    return root, data


def _sign(key: bytes, method: str, path: str, rng: str = "", nonce: str | None = None, when: str | None = None, *,
          port: int) -> str:
    """The auth headers, computed by hand (HMAC-SHA256 over method, path, range, nonce, time and the
    server's published address, here 127.0.0.1:``port``)."""
    nonce = nonce or secrets.token_hex(16)
    when = when or str(int(time.time()))
    msg = b"req\n" + "\n".join([method, path, rng, nonce, when, f"127.0.0.1:{port}"]).encode() + b"\n"
    mac = hmac.new(key, msg, hashlib.sha256).hexdigest()
    return f"X-Elastor-Nonce: {nonce}\r\nX-Elastor-Time: {when}\r\nX-Elastor-Auth: {mac}\r\n"


def _raw(port: int, request: bytes, timeout: float = 10) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        buf = b""
        while True:
            k = s.recv(65536)
            if not k:
                break
            buf += k
    status = int(buf.split(b" ", 2)[1])
    return status, buf.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in buf else b""


def _req(path: str, key: bytes | None = KEY, rng: str = "", method: str = "GET", *, port: int) -> bytes:
    auth = _sign(key, method, path, rng, port=port) if key is not None else ""
    r = f"Range: {rng}\r\n" if rng else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{r}{auth}Connection: close\r\n\r\n".encode()


def _get(port: int, path: str, key: bytes | None = KEY) -> tuple[int, bytes]:
    return _raw(port, _req(path, key, port=port))


def test_range_reads_and_index(tmp_path):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        st, body = _raw(srv.port, _req(f"/f/local/{STEP}/data_00000.safetensors", rng="bytes=1000-1999", port=srv.port))
        assert st == 206 and body == data[1000:2000]
        st, body = _get(srv.port, f"/f/local/{STEP}/rank_state/rank_00000.json")
        assert st == 200 and body == b'{"a": 1}'
        st, body = _get(srv.port, f"/index/{STEP}")
        assert st == 200 and body == b'{"local": true, "peer": ["nodeB"]}'
        st, body = _get(srv.port, "/index/step_000000099")
        assert st == 200 and body == b'{"local": false, "peer": []}'
        assert srv.bytes_served == 1000 + 8


@pytest.mark.parametrize("path", [
    "/f/../secret.txt", "/f/local/../../secret.txt", "/f/%2e%2e/secret.txt", "/f/local/%2E%2E/%2E%2E/secret.txt",
    "/f//etc/passwd", "/f/%2fetc/passwd", "/f/link_out", "/f/local/link_dir/secret.txt", "/f/local",
    "/f/local/.tmp_step_000000008_x/data_00000.safetensors", "/f/fifo", "/f/local\\..\\..\\secret.txt",
    "/f/local/%00x", "/index/../../etc", "/etc/passwd", "/f/link_in",
    # under --snapshot-dir but in no committed snapshot: never served
    "/f/weights.pt", "/f/.elastor-owner", f"/f/local/{STEP}/not_listed.bin", f"/f/local/{STEP}/manifest.json",
    f"/f/peer/nodeC/{STEP}/data_00003.safetensors", f"/f/peer/nodeB/{STEP}/COMPLETE",
])
def test_refuses_names_outside_the_node_directory(tmp_path, path):
    root, _ = _node(tmp_path)
    os.symlink(str(tmp_path / "secret.txt"), str(root / "link_out"))
    os.symlink(str(tmp_path), str(root / "local" / "link_dir"))
    os.symlink(str(root / "local" / STEP / "manifest.json"), str(root / "link_in"))   # even inside: no symlinks
    os.mkfifo(str(root / "fifo"))
    with SnapshotServer(str(root), KEY) as srv:
        st, body = _get(srv.port, path)
    assert st in (403, 404), (path, st, body)
    assert b"top secret" not in body and b"root:" not in body and b"inside secret" not in body


def test_read_only_methods(tmp_path):
    root, _ = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        for m in ("PUT", "DELETE", "POST"):
            st, _ = _raw(srv.port, f"{m} /f/local/{STEP}/manifest.json HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                                   f"{_sign(KEY, m, f'/f/local/{STEP}/manifest.json', port=srv.port)}Connection: close\r\n\r\n".encode())
            assert st == 405
    assert json.loads((root / "local" / STEP / "manifest.json").read_text())["step"] == 7


def test_remote_source_reads_local_and_peer_copies(tmp_path):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        src = RemoteSource(srv.address, STEP, KEY)
        assert src.name == f"remote:{srv.address}"
        assert src.has("data_00000.safetensors", len(data))
        assert not src.has("data_00000.safetensors", len(data) - 1)       # wrong size: not this file
        assert src.has("data_00002.safetensors", len(data))                # held as node B's peer copy
        assert not src.has("data_00003.safetensors", 10)                   # node C's copy is not COMPLETE
        a, b = bytearray(5000), bytearray(123_456)
        src.read_into("data_00000.safetensors", 70_000, [memoryview(a), memoryview(b)])
        assert bytes(a) + bytes(b) == data[70_000:70_000 + 5000 + 123_456]
        c = bytearray(4096)
        src.read_into("data_00002.safetensors", 0, [memoryview(c)])
        assert bytes(c) == data[::-1][:4096]
        with pytest.raises(IncompleteCheckpointError):                       # past the end: short
            src.read_into("data_00000.safetensors", len(data) - 10, [memoryview(bytearray(100))])
        # from several threads at once (one connection per thread)
        outs = [bytearray(10_000) for _ in range(4)]
        ts = [threading.Thread(target=src.read_into, args=("data_00000.safetensors", 1000 * i, [memoryview(o)]))
              for i, o in enumerate(outs)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert all(bytes(o) == data[1000 * i:1000 * i + 10_000] for i, o in enumerate(outs))
        assert src.bytes_read == 5000 + 123_456 + 4096 + 40_000
        src.close()
    with pytest.raises(IncompleteCheckpointError):                           # the node is gone
        src.read_into("data_00000.safetensors", 0, [memoryview(bytearray(10))])
    gone = RemoteSource(srv.address, STEP, KEY)
    assert not gone.has("data_00000.safetensors", len(data))


def test_peer_copy_source_only_complete_copies(tmp_path):
    root, data = _node(tmp_path)
    src = PeerCopySource(str(root), STEP)
    assert src.has("data_00002.safetensors", len(data))
    assert not src.has("data_00003.safetensors", 10)
    assert not src.has("data_00000.safetensors", len(data))   # this node's own files are not peer copies
    buf = bytearray(777)
    src.read_into("data_00002.safetensors", 100, [memoryview(buf)])
    assert bytes(buf) == data[::-1][100:877] and src.bytes_read == 777
    with pytest.raises(Exception):
        src.has("../../secret.txt", 10)


def test_node_sources_skip_this_node(tmp_path):
    root, _ = _node(tmp_path)
    srcs = node_sources(STEP, snapshot_dir=str(root), peers=["127.0.0.1:1", "127.0.0.1:2"], self_address="127.0.0.1:1",
                        key=KEY)
    assert [s.name for s in srcs] == ["peer-memory", "remote:127.0.0.1:2"]
    # without the job key no other node's server is read
    os.environ.pop("ELASTOR_JOB_SECRET_FILE", None)
    srcs = node_sources(STEP, snapshot_dir=str(root), peers=["127.0.0.1:1", "127.0.0.1:2"], self_address="127.0.0.1:1")
    assert [s.name for s in srcs] == ["peer-memory"]
    assert node_sources(STEP, snapshot_dir="", peers=[], self_address="") == []


def test_advertised_host_loopback():
    assert advertised_host("127.0.0.1:29500") == "127.0.0.1"
    assert advertised_host("localhost:0") in ("127.0.0.1", "::1")


# ---------------------------------------------------------------- as an attacker (issue 19)
DATA = f"/f/local/{STEP}/data_00000.safetensors"


def _still_serves(srv, data) -> None:
    src = RemoteSource(srv.address, STEP, KEY, busy_wait_s=20)
    buf = bytearray(4096)
    assert src.has("data_00000.safetensors", len(data))
    src.read_into("data_00000.safetensors", 5000, [memoryview(buf)])
    assert bytes(buf) == data[5000:9096]
    src.close()


def test_no_token_and_wrong_token_get_nothing(tmp_path, caplog):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.snapshot.server"):
            for key in (None, bytes(32), KEY[:-1] + b"\0"):
                for path in (DATA, f"/index/{STEP}", f"/f/peer/nodeB/{STEP}/data_00002.safetensors"):
                    st, body = _get(srv.port, path, key)
                    assert st == 401, (key, path, st)
                    assert data[:64] not in body and data[::-1][:64] not in body and b"nodeB" not in body
        assert srv.bytes_served == 0
        assert "refused GET" in caplog.text
        _still_serves(srv, data)


def test_replayed_or_edited_request_and_paths_outside_snapshots(tmp_path):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        captured = _req(DATA, rng="bytes=0-99", port=srv.port)       # a legitimate request, sniffed on the network
        st, body = _raw(srv.port, captured)
        assert st == 206 and body == data[:100]
        st, body = _raw(srv.port, captured)           # replayed as is: the nonce was used
        assert st == 401 and data[:100] not in body
        for other in ("/f/weights.pt", "/f/../secret.txt", f"/f/local/{STEP}/not_listed.bin"):
            edited = captured.replace(DATA.encode(), other.encode())   # the path swapped, the MAC kept
            st, body = _raw(srv.port, edited)
            assert st == 401 and b"secret" not in body, (other, st)
            st, body = _get(srv.port, other)          # even properly signed: not a committed snapshot file
            assert st in (403, 404) and b"secret" not in body, (other, st)
        stale = _raw(srv.port, f"GET {DATA} HTTP/1.1\r\nHost: x\r\n{_sign(KEY, 'GET', DATA, when=str(int(time.time()) - 3600), port=srv.port)}"
                               f"Connection: close\r\n\r\n".encode())
        assert stale[0] == 401
        _still_serves(srv, data)


def test_500_idle_connections_do_not_lock_out_the_job(tmp_path):
    root, data = _node(tmp_path)
    base_threads = threading.active_count()
    with SnapshotServer(str(root), KEY, head_timeout_s=2.0) as srv:
        idle = []
        try:
            for _ in range(500):
                idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            time.sleep(0.5)
            # one thread per admitted connection at most; the rest were answered 503 and closed
            assert threading.active_count() <= base_threads + 32 + 4, threading.active_count()
            t0 = time.monotonic()
            _still_serves(srv, data)
            assert time.monotonic() - t0 < 10, "a legitimate request waited past the head timeout bound"
            # and none is held forever: every idle connection was closed by the server (503 when it came
            # in over the limit, EOF once the 2 s head timeout passed)
            time.sleep(2.5)
            closed = 0
            for s in idle:
                s.settimeout(5)
                got = b""
                try:
                    while True:
                        k = s.recv(4096)
                        if not k:
                            break
                        got += k
                except (ConnectionResetError, socket.timeout):
                    pass
                closed += got == b"" or got.startswith(b"HTTP/1.1 503")
            # (over the limit: evicted as the oldest unauthenticated, or refused with 503 while the
            # evicted ones' threads ended)
            assert closed == 500 and srv.busy_refused + srv.evicted > 0, (closed, srv.busy_refused, srv.evicted)
        finally:
            for s in idle:
                s.close()


def test_idle_connections_reopened_without_pause_do_not_lock_out_the_job(tmp_path):
    """Anyone who can reach the port keeps 40 connections open that never send a request, and opens
    new ones as the server closes them (every 0.2 s): the slots must not all go to them. Before,
    32 idle connections took every slot until the head timeout, so each of the job's requests got
    503 and a restore gave up on this node; now a new connection evicts the oldest one that has
    not authenticated, and the job's reads go through."""
    root, data = _node(tmp_path)
    stop = threading.Event()
    with SnapshotServer(str(root), KEY) as srv:
        def hog():
            held = []
            while not stop.is_set():
                held = [c for c in held if c.fileno() >= 0]
                while len(held) < 40:
                    held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
                stop.wait(0.2)
                for c in held[:10]:   # the oldest ones, which the server may have evicted: anew
                    c.close()
                held = held[10:]
            for c in held:
                c.close()
        t = threading.Thread(target=hog, daemon=True)
        t.start()
        try:
            time.sleep(1.0)
            src = RemoteSource(srv.address, STEP, KEY, busy_wait_s=4)
            t0 = time.monotonic()
            for _ in range(5):
                buf = bytearray(4096)
                assert src.has("data_00000.safetensors", len(data))
                src.read_into("data_00000.safetensors", 5000, [memoryview(buf)])
                assert bytes(buf) == data[5000:9096]
            src.close()
            assert time.monotonic() - t0 < 10
            assert srv.evicted > 0
        finally:
            stop.set()
            t.join(10)


def test_huge_range_long_name_and_big_head_get_4xx_not_a_traceback(tmp_path, caplog, capfd):
    root, data = _node(tmp_path)
    big = root / "local" / STEP / "big.bin"
    with open(big, "wb") as f:
        f.truncate(20 << 20)
    (root / "local" / STEP / "manifest.json").write_text(_manifest({"data_00000.safetensors": data,
                                                                    "rank_state/rank_00000.json": b'{"a": 1}',
                                                                    "big.bin": bytes(20 << 20)}))
    with SnapshotServer(str(root), KEY) as srv:
        huge = "bytes=" + "9" * 5000 + "-"
        for rng in (huge, "bytes=0-" + "9" * 40, f"bytes=0-{(17 << 20) - 1}", "bytes=5-1,7-9"):
            path = f"/f/local/{STEP}/big.bin"
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: {rng}\r\n{_sign(KEY, 'GET', path, rng, port=srv.port)}"
                          f"Connection: close\r\n\r\n".encode())
                head = s.recv(4096)
            code = int(head.split(b" ", 2)[1])
            assert 400 <= code < 500, (rng[:40], head[:200])
        with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.snapshot.server"):
            long_name = "/f/" + "A\x1b[2J" * 2000                   # 10 KB of name with terminal escapes
            st, _ = _raw(srv.port, f"GET {long_name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            assert st in (401, 414, 431)
            st, _ = _raw(srv.port, b"GET /f/x HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"p" * 70_000 + b"\r\n\r\n")
            assert st in (400, 431)
            name = "/f/" + "B" * 3000                               # fits the head, refused by auth
            st, _ = _raw(srv.port, f"GET {name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            assert st == 401
        for rec in caplog.records:
            assert len(rec.getMessage()) < 400 and "\x1b" not in rec.getMessage(), rec.getMessage()[:200]
        assert "Traceback" not in capfd.readouterr().err
        # a legitimate 16 MiB range of the big file still works, and the server still serves the job
        src = RemoteSource(srv.address, STEP, KEY)
        assert src.has("big.bin", 20 << 20)
        buf = bytearray(20 << 20)                                  # read in 16 MiB + 4 MiB pieces
        src.read_into("big.bin", 0, [memoryview(buf)])
        assert buf == bytes(20 << 20)
        _still_serves(srv, data)


def test_remote_source_refuses_answers_not_signed_with_the_job_key(tmp_path):
    """A server of another job (another key) answering for the address: nothing it says is used."""
    root, data = _node(tmp_path)
    with SnapshotServer(str(root), bytes(32)) as other:
        src = RemoteSource(other.address, STEP, KEY)
        assert not src.has("data_00000.safetensors", len(data))   # its 401 carries no valid MAC


class _Store:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v

    def multi_get(self, keys):
        return [self.d.get(k, b"") for k in keys]


def _secret(tmp_path, mode=0o600, n=32) -> str:
    p = tmp_path / "job.secret"
    p.write_bytes(os.urandom(n))
    os.chmod(p, mode)
    return str(p)


def test_server_starts_only_for_memory_snapshots_on_a_multi_node_job_with_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTOR_SNAPSHOT_SERVER_HOST", "127.0.0.1")
    snap = tmp_path / "snap"
    snap.mkdir()
    secret = _secret(tmp_path)
    single = NodeSnapshots(str(snap), "127.0.0.1:1", multi_node=False, secret_file=secret)
    multi = NodeSnapshots(str(snap), "127.0.0.1:1", multi_node=True, secret_file=secret)
    nokey = NodeSnapshots(str(snap), "127.0.0.1:1", multi_node=True)
    try:
        for ns in (single, multi, nokey):
            ns.publish(_Store(), 0, 1)
            assert ns.server is None                      # no memory snapshots yet: nothing to serve
        (snap / "local").mkdir()                           # the trainer wrote memory snapshots
        for ns in (single, multi, nokey):
            ns.publish(_Store(), 0, 1)
        assert single.server is None and nokey.server is None
        assert multi.server is not None and multi.env()["ELASTOR_SNAPSHOT_SELF"] == multi.server.address
        env = multi.env()
        assert env["ELASTOR_JOB_SECRET_FILE"] == secret
        assert not any(open(secret, "rb").read().hex() in v for v in env.values())
    finally:
        for ns in (single, multi, nokey):
            ns.close()


@pytest.mark.parametrize("problem", ["mode", "short", "symlink"])
def test_bad_job_secret_file_is_a_config_error(tmp_path, problem):
    if problem == "mode":
        path = _secret(tmp_path, mode=0o644)
    elif problem == "short":
        path = _secret(tmp_path, n=8)
    else:
        path = str(tmp_path / "link")
        os.symlink(_secret(tmp_path), path)
    with pytest.raises(ConfigError, match="job-secret-file"):
        NodeSnapshots(str(tmp_path), "127.0.0.1:1", multi_node=True, secret_file=path)


def test_job_secret_file_messages_name_the_size_and_a_safe_fix(tmp_path):
    """QA round 6, Q6-8: a 100,000-byte file read as "65537 bytes" (the bounded read, not the
    size); for a file another user owns, the suggested ``head -c 32 ... > FILE``, run by this user,
    would write the secret into that user's file (it stays theirs, readable by them)."""
    from elastor_ds.checkpoint.auth import load_key
    big = _secret(tmp_path, n=100000)
    with pytest.raises(ConfigError, match=r": 100000 bytes; it needs 32 to 65536"):
        load_key(big)
    theirs = str(tmp_path / "theirs")
    fd = os.open(theirs, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    os.chown(theirs, 1001, 1001)
    with pytest.raises(ConfigError) as e:
        load_key(theirs)
    msg = str(e.value)
    assert "owned by uid 1001" in msg and "NEWFILE" in msg and f"> {theirs}" not in msg, msg


def test_a_members_probe_of_a_file_not_held_is_not_logged_as_an_attack_and_no_version_is_shown(tmp_path, caplog):
    """QA round 10: a cross-node restore probes each holder in turn, and the server logged every
    authenticated 404 as a WARNING "refused ...", like the attacks beside them. A job member's request
    of a file this node does not hold is now a debug line; an unauthenticated one stays a warning.
    The ``Server`` header no longer names the Python version (answers go to anyone who connects)."""
    root, _ = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.snapshot.server"):
            st, _ = _raw(srv.port, _req(f"/f/local/{STEP}/data_00001.safetensors", method="HEAD", port=srv.port))
            assert st == 404
            assert "refused" not in caplog.text, caplog.text
            st, _ = _get(srv.port, f"/f/local/{STEP}/data_00001.safetensors", key=None)
            assert st == 401 and "refused GET" in caplog.text, caplog.text
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /index/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = s.recv(4096).decode("latin-1")
    server = next(line for line in head.split("\r\n") if line.lower().startswith("server:"))
    assert server == "Server: elastor-snapshots/2", server
