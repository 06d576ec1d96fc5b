"""Reads from another node's snapshot server sent ahead (``RemoteSource.prefetch``, the reader's
hints) and the answer's MAC checked as the bytes arrive: real server, real sockets, real files.

Oracles: the bytes the test wrote; the server's own count of bytes sent (a request sent ahead is
answered before any read asks for it, and never twice); a byte flipped on the wire by a proxy
written here (the answer's MAC, not the reader's CRC, must catch it)."""
from __future__ import annotations

import random
import socket
import threading
import time
import zlib

import pytest

from elastor_ds.checkpoint.snapshot import peer_sources
from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
from elastor_ds.checkpoint.snapshot.server import SnapshotServer
from elastor_ds.errors import CorruptCheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

STEP = "step_000000007"
KEY = bytes(range(7, 39))
A, B = "data_00000.safetensors", "data_00001.safetensors"


def _node(tmp_path, size: int = 3 << 20) -> tuple[str, bytes, bytes]:
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    a = bytes((i * 131 + 7) % 251 for i in range(size))
    b = a[::-1]
    d = tmp_path / "node" / "local" / STEP
    d.mkdir(parents=True)
    (d / A).write_bytes(a)
    (d / B).write_bytes(b)
    files = {n: FileEntry(n, len(x), zlib.crc32(x), 0) for n, x in ((A, a), (B, b))}
    (d / "manifest.json").write_text(Manifest(step=7, tensors={}, files=files, world_size=1).dumps())
    return str(tmp_path / "node"), a, b


def _wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_a_request_sent_ahead_is_answered_before_its_read_and_never_twice(tmp_path):
    root, a, _ = _node(tmp_path)
    with SnapshotServer(root, KEY) as srv:
        src = RemoteSource(srv.address, STEP, KEY)
        assert src.has(A, len(a))
        base = srv.bytes_served
        src.prefetch(A, 0, 65536)           # small enough to sit whole in the socket buffers
        assert _wait_for(lambda: srv.bytes_served == base + 65536), "the hint did not reach the server"
        out = bytearray(65536)
        src.read_into(A, 0, [memoryview(out)])
        assert bytes(out) == a[:65536]
        time.sleep(0.2)
        assert srv.bytes_served == base + 65536       # the read used the answer sent ahead
        src.close()


def test_announced_reads_in_order_across_pieces_and_files(tmp_path, monkeypatch):
    """As the reader reads: hints for the next reads, then the reads, pieces smaller than a read
    (a read spans several requests), a read of another file in between, hints never read."""
    monkeypatch.setattr(peer_sources, "MAX_RANGE", 256 << 10)   # the client's request size only
    root, a, b = _node(tmp_path)
    with SnapshotServer(root, KEY) as srv:
        src = RemoteSource(srv.address, STEP, KEY)
        assert src.has(A, len(a)) and src.has(B, len(b))
        reads = [(o, 300_000) for o in range(0, 2_400_000, 300_000)]
        for i, (off, n) in enumerate(reads):
            for off2, n2 in reads[i + 1:i + 4]:
                src.prefetch(A, off2, n2)
            out = bytearray(n)
            src.read_into(A, off, [memoryview(out)[:1000], memoryview(out)[1000:]])
            assert bytes(out) == a[off:off + n], f"read at {off}"
            if i == 3:   # another file in between: A's hints are dropped, later reads of A still right
                other = bytearray(500_000)
                src.read_into(B, 12_345, [memoryview(other)])
                assert bytes(other) == b[12_345:12_345 + 500_000]
        src.prefetch(A, 2_900_000, 100_000)          # announced, never read
        src.prefetch(B, 0, 1 << 20)
        back = bytearray(4096)                        # an earlier offset: the stale ones go
        src.read_into(A, 0, [memoryview(back)])
        assert bytes(back) == a[:4096]
        total = sum(n for _, n in reads) + 500_000 + 4096
        assert src.bytes_read == total
        # the server sent what was read, plus at most the answers ahead that were dropped
        # (each at most one request, 256 KiB here)
        assert _wait_for(lambda: srv.bytes_served >= total)
        assert srv.bytes_served <= total + 2 * (256 << 10)
        src.close()


def test_reads_ahead_use_two_connections_per_thread(tmp_path, monkeypatch):
    """A reading thread keeps two keep-alive connections (the answer being read, the request ahead),
    not one per request (a new TCP handshake and server thread each time) nor three (the server
    holds 32 for every node's readers)."""
    monkeypatch.setattr(peer_sources, "MAX_RANGE", 128 << 10)
    root, a, _ = _node(tmp_path)
    with SnapshotServer(root, KEY) as srv:
        accepted = []
        real = srv._srv.process_request

        def counting(request, addr):
            accepted.append(addr)
            return real(request, addr)
        srv._srv.process_request = counting
        src = RemoteSource(srv.address, STEP, KEY)
        assert src.has(A, len(a))
        for off in range(0, 2 << 20, 256 << 10):
            src.prefetch(A, off + (256 << 10), 256 << 10)
            out = bytearray(256 << 10)
            src.read_into(A, off, [memoryview(out)])
            assert bytes(out) == a[off:off + len(out)]
        assert len(accepted) <= 1 + peer_sources.MAX_AHEAD, accepted
        src.close()


class _FlipProxy:
    """A TCP proxy that flips one byte of the body of every ``206`` answer it relays (at body
    offset ``at``), on every connection: a network that changes bytes on the way."""

    def __init__(self, port: int, at: int = 1000):
        self.port, self.at = port, at
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.flipped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.port))
            methods: list[bytes] = []   # of the requests relayed on this connection, in order
            threading.Thread(target=self._requests, args=(c, s, methods), daemon=True).start()
            threading.Thread(target=self._answers, args=(s, c, methods), daemon=True).start()

    @staticmethod
    def _requests(src: socket.socket, dst: socket.socket, methods: list) -> None:
        buf = b""
        try:
            while (k := src.recv(65536)):
                buf += k
                while b"\r\n\r\n" in buf:   # requests without bodies: GET and HEAD
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    methods.append(head.split(b" ", 1)[0])
                    dst.sendall(head + b"\r\n\r\n")
        except OSError:
            pass
        finally:
            dst.close()

    def _answers(self, src: socket.socket, dst: socket.socket, methods: list) -> None:
        buf = b""
        n = 0
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    k = src.recv(65536)
                    if not k:
                        return
                    buf += k
                head, buf = buf.split(b"\r\n\r\n", 1)
                n += 1
                if methods[n - 1] == b"HEAD":
                    dst.sendall(head + b"\r\n\r\n")
                    continue
                length = int([ln.split(b":", 1)[1] for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length:")][0])
                while len(buf) < length:
                    k = src.recv(65536)
                    if not k:
                        return
                    buf += k
                body, buf = bytearray(buf[:length]), buf[length:]
                if head.split(b" ", 2)[1] == b"206" and length > self.at:
                    body[self.at] ^= 0x01
                    self.flipped += 1
                dst.sendall(head + b"\r\n\r\n" + bytes(body))
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        self.lsock.close()


def test_a_byte_changed_on_the_way_fails_the_answer_whether_sent_ahead_or_not(tmp_path):
    root, a, _ = _node(tmp_path)
    with SnapshotServer(root, KEY) as srv:
        proxy = _FlipProxy(srv.port)
        try:
            src = RemoteSource(proxy.address, STEP, KEY, target=srv.address)   # the proxy forwards on purpose
            assert src.has(A, len(a))                       # HEAD and index answers pass unchanged
            with pytest.raises(CorruptCheckpointError, match="failed its authentication"):
                src.read_into(A, 0, [memoryview(bytearray(50_000))])
            src.prefetch(A, 100_000, 50_000)                # the same, sent ahead
            out = bytearray(50_000)
            with pytest.raises(CorruptCheckpointError, match="failed its authentication"):
                src.read_into(A, 100_000, [memoryview(out)])
            assert proxy.flipped >= 2
            src.close()
            # the same reads without the proxy: the bytes are right (the server was not at fault)
            direct = RemoteSource(srv.address, STEP, KEY)
            assert direct.has(A, len(a))
            direct.prefetch(A, 100_000, 50_000)
            direct.read_into(A, 100_000, [memoryview(out)])
            assert bytes(out) == a[100_000:150_000]
            direct.close()
        finally:
            proxy.close()


def test_server_answers_without_nagle_delay(tmp_path):
    """Each accepted connection has TCP_NODELAY: the last short segment of an answer is not held
    back until the client's delayed ACK (a 40 ms stall per request on Linux)."""
    root, a, _ = _node(tmp_path)
    with SnapshotServer(root, KEY) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as c:
            c.sendall(b"GET /index/" + STEP.encode() + b" HTTP/1.1\r\n")   # a head not finished yet
            assert _wait_for(lambda: len(srv._srv._deadlines) == 1)
            (conn,) = list(srv._srv._deadlines)
            # set by the handler's setup, in its own thread, after the server registered the socket
            assert _wait_for(lambda: conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, 5.0)


def test_a_server_at_its_connection_limit_still_serves_a_reader_that_sends_ahead(tmp_path):
    """One slot: the request sent ahead is refused (503); the reader frees its slot, stops sending
    ahead and reads everything on one connection, promptly."""
    root, a, _ = _node(tmp_path)
    with SnapshotServer(root, KEY, max_connections=1) as srv:
        src = RemoteSource(srv.address, STEP, KEY, busy_wait_s=10)
        assert src.has(A, len(a))
        t0 = time.monotonic()
        piece = 256 << 10
        for off in range(0, 2 << 20, piece):
            for nxt in range(off + piece, min(off + 4 * piece, 2 << 20), piece):
                src.prefetch(A, nxt, piece)
            out = bytearray(piece)
            src.read_into(A, off, [memoryview(out)])
            assert bytes(out) == a[off:off + piece]
        assert time.monotonic() - t0 < 8, "the reader waited on its own request ahead"
        assert srv.busy_refused >= 1
        src.close()


def test_random_hints_and_reads_from_threads_against_a_crowded_server(tmp_path, monkeypatch):
    """Three threads share one source, each announcing and reading random ranges (reads that were
    announced, reads that were not, hints never read, other files), against a server with four
    connection slots: every read returns the file's bytes, promptly."""
    monkeypatch.setattr(peer_sources, "MAX_RANGE", 96 << 10)
    root, a, b = _node(tmp_path, size=1 << 20)
    files = {A: a, B: b}
    with SnapshotServer(root, KEY, max_connections=4) as srv:
        src = RemoteSource(srv.address, STEP, KEY, busy_wait_s=20)
        assert src.has(A, len(a)) and src.has(B, len(b))
        errors: list = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    name = rng.choice([A, B])
                    size = len(files[name])
                    n = rng.randrange(1, 300_000)
                    off = rng.randrange(0, size - n)
                    for _ in range(rng.randrange(0, 4)):   # hints: some for this read, some not
                        hn = rng.randrange(1, 300_000)
                        ho = off if rng.random() < 0.3 else rng.randrange(0, size - hn)
                        src.prefetch(rng.choice([name, name, A, B]), ho, hn)
                    out = bytearray(n)
                    cut = rng.randrange(0, n + 1)
                    src.read_into(name, off, [memoryview(out)[:cut], memoryview(out)[cut:]])
                    if bytes(out) != files[name][off:off + n]:
                        errors.append(f"seed {seed}: {name} at {off}+{n} differs")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"seed {seed}: {type(e).__name__}: {e}")
        t0 = time.monotonic()
        ts = [threading.Thread(target=worker, args=(s,)) for s in (1, 2, 3)]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
        assert not any(t.is_alive() for t in ts), "a reader hung"
        assert not errors, errors
        assert time.monotonic() - t0 < 45
        src.close()
