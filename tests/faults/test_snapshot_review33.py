"""Review 33 of the snapshot server and its readers (real sockets, real files, real processes).

- a hostile server cannot hold a reader by trickling or flooding an answer's *head* (status line,
  headers, interim ``100 Continue`` answers): the whole answer has one deadline;
- a signed request names the server it is for: one sent to a relay (an address someone put in the
  unauthenticated rendezvous store) is refused by the real server, and the relay reads nothing;
- the missing folders above a named snapshot directory are made 0700 whatever the umask;
- a reader marks a node down after two index requests that time out, not one;
- a request's time, step and origin names are plain ASCII digits and names, without a trailing newline;

Oracles: the wall time, the error type and message, bytes written by the test itself."""
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
import urllib.parse
import zlib

import pytest

from elastor_ds.checkpoint.private_dir import ensure_private_dir
from elastor_ds.elastic import snapshot_dir
from elastor_ds.elastic.protocol import ENV_SNAPSHOT_DIR

from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
from elastor_ds.checkpoint.snapshot.server import SnapshotServer
from elastor_ds.errors import IncompleteCheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STEP = "step_000000007"
KEY = bytes(range(100, 132))


class Fake:
    """A hostile server: each connection reads a request, then ``answer(self, conn)`` runs for at most
    ``for_s`` seconds (then the connection closes)."""

    def __init__(self, answer, for_s: float = 12.0, conns: int = 1):
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(8)
        self.port = self.ls.getsockname()[1]
        self.answer, self.for_s, self.conns = answer, for_s, conns
        self.sent = 0
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def until(self) -> float:
        return time.monotonic() + self.for_s

    def _serve(self) -> None:
        for _ in range(self.conns):
            c, _ = self.ls.accept()
            c.recv(65536)
            try:
                self.answer(self, c)
            except OSError:
                pass
            finally:
                c.close()
        self.ls.close()


def _trickle_head(first: bytes):
    def answer(f, c):
        c.sendall(first)
        end = f.until()
        while time.monotonic() < end:      # a header line that never ends, a byte every 0.3 s
            c.sendall(b"X")
            f.sent += 1
            time.sleep(0.3)
    return answer


def _source(port: int) -> RemoteSource:
    return RemoteSource(f"127.0.0.1:{port}", STEP, KEY, timeout_s=1.0, busy_wait_s=1.0)


def test_an_index_answer_whose_head_trickles_is_abandoned_at_its_deadline():
    f = Fake(_trickle_head(b"HTTP/1.1 200 OK\r\n"))
    src = _source(f.port)
    t0 = time.monotonic()
    assert src._get_index() == {"local": False, "peer": []} and src._down
    assert time.monotonic() - t0 < 4.0, "the reader waited for the trickled head (timeout_s=1)"


def test_an_endless_run_of_100_continue_is_abandoned_at_its_deadline():
    def answer(f, c):
        msg = b"HTTP/1.1 100 Continue\r\n\r\n" * 1024
        end = f.until()
        while time.monotonic() < end:
            c.sendall(msg)
            f.sent += len(msg)
    f = Fake(answer)
    src = _source(f.port)
    t0 = time.monotonic()
    assert src._get_index() == {"local": False, "peer": []} and src._down
    assert time.monotonic() - t0 < 4.0, f"the reader took {f.sent >> 20} MiB of interim answers"


def _placed(src: RemoteSource) -> None:
    src._index = {"local": True, "peer": []}
    src._where["d"] = f"local/{STEP}/d"


def test_a_range_answer_whose_head_trickles_is_abandoned_at_its_deadline():
    f = Fake(_trickle_head(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4096\r\n"))
    src = _source(f.port)
    _placed(src)
    src._local.no_ahead = True
    t0 = time.monotonic()
    with pytest.raises(IncompleteCheckpointError, match="within 1"):
        src.read_into("d", 0, [memoryview(bytearray(4096))])
    assert time.monotonic() - t0 < 4.0


def test_a_request_sent_ahead_whose_answer_head_trickles_is_abandoned_not_asked_again():
    f = Fake(_trickle_head(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4096\r\n"))
    src = _source(f.port)
    _placed(src)
    src.prefetch("d", 0, 4096)      # sent now, on a connection of its own
    t0 = time.monotonic()
    with pytest.raises(IncompleteCheckpointError, match="not received within 1 s"):
        src.read_into("d", 0, [memoryview(bytearray(4096))])
    assert time.monotonic() - t0 < 4.0
    src.close()


def test_an_index_answer_is_not_read_beyond_64_kib_before_its_mac_is_checked():
    """An /index answer (unauthenticated until its MAC is checked) announcing 1 MiB, sent 16 KiB
    every 0.1 s: the reader stops after 64 KiB (0.4 s), not at its deadline."""
    def answer(f, c):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\nX-Elastor-Auth: 00\r\n\r\n")
        for _ in range(64):
            c.sendall(b"{" * (16 << 10))
            time.sleep(0.1)
    f = Fake(answer)
    src = RemoteSource(f"127.0.0.1:{f.port}", STEP, KEY, timeout_s=3.0, busy_wait_s=1.0)
    t0 = time.monotonic()
    assert src._get_index() == {"local": False, "peer": []} and src._down
    assert time.monotonic() - t0 < 1.5


def _node(tmp_path):
    """A node directory with one committed snapshot: local/STEP/data_00000.safetensors (300 kB)."""
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    root = tmp_path / "node"
    d = root / "local" / STEP
    d.mkdir(parents=True)
    data = bytes((i * 7 + 3) % 256 for i in range(300_000))
    (d / "data_00000.safetensors").write_bytes(data)
    m = Manifest(step=7, tensors={}, files={"data_00000.safetensors": FileEntry("data_00000.safetensors", len(data),
                                                                              zlib.crc32(data), 0)}, world_size=1)
    (d / "manifest.json").write_text(m.dumps())
    os.chmod(root, 0o700)
    return root, data


class Relay:
    """Forwards every connection to ``port`` and records what comes back (an attacker's listener)."""

    def __init__(self, port: int):
        self.up = port
        self.captured = bytearray()
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(16)
        self.address = f"127.0.0.1:{self.ls.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.up))
            threading.Thread(target=self._pipe, args=(c, up, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, c, True), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, record: bool) -> None:
        try:
            while (k := a.recv(65536)):
                if record:
                    self.captured.extend(k)
                b.sendall(k)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_a_signed_request_relayed_from_another_address_is_refused_and_reads_nothing(tmp_path, caplog):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        relay = Relay(srv.port)
        try:
            src = RemoteSource(relay.address, STEP, KEY, timeout_s=5.0, busy_wait_s=1.0)
            with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.snapshot.server"):
                assert not src.has("data_00000.safetensors", len(data))
            src.close()
            assert src._down and src._index == {"local": False, "peer": []}
            assert data[:1000] not in bytes(relay.captured) and b'"local": true' not in bytes(relay.captured)
            assert srv.bytes_served == 0
            assert f"the request is addressed to '{relay.address}', this server publishes {srv.address}" in caplog.text
            # the same reader at the server's own address reads the bytes
            direct = RemoteSource(srv.address, STEP, KEY)
            buf = bytearray(4096)
            assert direct.has("data_00000.safetensors", len(data))
            direct.read_into("data_00000.safetensors", 5000, [memoryview(buf)])
            assert bytes(buf) == data[5000:9096]
            direct.close()
        finally:
            relay.ls.close()


def test_missing_folders_of_a_named_snapshot_dir_are_0700_under_umask_0(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SNAPSHOT_DIR, raising=False)
    old = os.umask(0)
    try:
        sd = snapshot_dir.prepare(str(tmp_path / "a" / "b" / "snap"), "job")
        mem = ensure_private_dir(str(tmp_path / "x" / "y" / "mem"), "elastor.memory_snapshot.dir")
    finally:
        os.umask(old)
    modes = {d: oct(os.lstat(tmp_path / d).st_mode & 0o7777) for d in ("a", "a/b", "a/b/snap", "x", "x/y", "x/y/mem")}
    assert modes == dict.fromkeys(modes, "0o700"), modes
    assert sd.path == str(tmp_path / "a" / "b" / "snap") and sd.created and mem == str(tmp_path / "x" / "y" / "mem")
    # a worker's check of the same directory (its folders included) accepts it
    assert ensure_private_dir(sd.path, "ELASTOR_SNAPSHOT_DIR") == sd.path
    snapshot_dir.cleanup(sd)
    assert not os.path.exists(sd.path)


def _signed(srv, path: str, when: str = "") -> bytes:
    """A request signed by hand (HMAC-SHA256 over method, path, range, nonce, time, server address)."""
    nonce, when = secrets.token_hex(16), when or str(int(time.time()))
    msg = b"req\n" + "\n".join(["GET", path, "", nonce, when, srv.address]).encode("utf-8", "surrogateescape") + b"\n"
    mac = hmac.new(KEY, msg, hashlib.sha256).hexdigest()
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Elastor-Nonce: {nonce}\r\nX-Elastor-Time: {when}\r\n"
            f"X-Elastor-Auth: {mac}\r\nConnection: close\r\n\r\n").encode("latin-1")   # as http.server reads it


def _answer(port: int, req: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        buf = b""
        while (k := s.recv(65536)):
            buf += k
    return buf


def test_a_time_of_superscript_digits_is_a_401_not_a_dropped_connection(tmp_path):
    root, _ = _node(tmp_path)
    with SnapshotServer(str(root), KEY) as srv:
        got = _answer(srv.port, _signed(srv, f"/index/{STEP}", when="\u00b2\u00b3"))
        assert got.startswith(b"HTTP/1.1 401 ") and got.endswith(b"authentication required\n"), got[:200]


_ARABIC_STEP = "step_" + "\u0663" * 9   # Arabic-Indic digit three: \\d matches it


@pytest.mark.parametrize("path", [f"/index/{STEP}%0a", f"/f/local/{STEP}%0a/data_00000.safetensors",
                                  "/index/" + urllib.parse.quote(_ARABIC_STEP)])
def test_a_step_name_with_a_trailing_newline_or_non_ascii_digits_is_not_a_step(tmp_path, path):
    root, _ = _node(tmp_path)
    (root / "local" / _ARABIC_STEP).mkdir()
    with SnapshotServer(str(root), KEY) as srv:
        got = _answer(srv.port, _signed(srv, path))
        why = b"not a file of a committed snapshot" if path.startswith("/f/") else b"not a step directory name"
        assert got.startswith(b"HTTP/1.1 404 ") and got.endswith(why + b"\n"), got[:300]
        assert srv.bytes_served == 0


def test_one_index_answer_that_times_out_does_not_drop_the_node_a_second_is_asked():
    """The first connection's answer stalls past the deadline; the second is the server's real
    answer (signed with the job key by the fake, as the node's server would): the node stays."""
    from elastor_ds.checkpoint.auth import response_mac

    def answer(f, c):
        if f.n == 0:
            f.n += 1
            time.sleep(2.5)          # no answer within timeout_s=1
            return
        body = b'{"local": true, "peer": []}'
        nonce = f.nonce
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Elastor-Auth: %s\r\n\r\n%s"
                  % (len(body), response_mac(KEY, nonce, 200, "", "", [body]).encode(), body))
        time.sleep(0.5)

    class Fake2(Fake):
        n = 0
        nonce = ""

        def _serve(self) -> None:   # each connection in a thread of its own: the stalled one blocks nothing
            for _ in range(self.conns):
                c, _ = self.ls.accept()
                req = c.recv(65536).decode("latin-1")
                self.nonce = [ln.split(": ", 1)[1] for ln in req.split("\r\n") if ln.startswith("X-Elastor-Nonce")][0]
                threading.Thread(target=self._one, args=(c,), daemon=True).start()
            self.ls.close()

        def _one(self, c: socket.socket) -> None:
            try:
                self.answer(self, c)
            finally:
                c.close()

    f = Fake2(answer, conns=2)
    src = _source(f.port)
    assert src._get_index() == {"local": True, "peer": []} and not src._down


def test_a_connection_that_evicts_an_idle_one_takes_its_slot_without_waiting(tmp_path):
    """Every slot taken (one idle unauthenticated connection, one authenticated keep-alive), a new
    connection evicts the idle one. It waited up to 1 s for the evicted connection's thread to
    free its slot, and got 503 when that thread ran later (a flood of connections on a busy node:
    each accept waited); now the evicted connection's slot is handed over at once."""
    root, _ = _node(tmp_path)
    with SnapshotServer(str(root), KEY, max_connections=2) as srv:
        inner = srv._srv
        real = inner._release

        def slow_release(request):   # a handler thread that runs late (a busy node)
            time.sleep(2.0)
            real(request)
        inner._release = slow_release
        idle = socket.create_connection(("127.0.0.1", srv.port), timeout=10)   # unauthenticated, idle
        time.sleep(0.2)
        keep = socket.create_connection(("127.0.0.1", srv.port), timeout=10)   # authenticated, kept alive
        keep.sendall(_signed(srv, f"/index/{STEP}").replace(b"Connection: close", b"Connection: keep-alive"))
        assert keep.recv(65536).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        got = _answer(srv.port, _signed(srv, f"/index/{STEP}"))
        assert got.startswith(b"HTTP/1.1 200 "), got[:200]
        assert time.monotonic() - t0 < 0.9
        assert srv.evicted == 1 and srv.busy_refused == 0
        for c in (idle, keep):
            c.close()
