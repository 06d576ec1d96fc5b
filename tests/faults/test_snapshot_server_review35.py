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

from elastor_ds.checkpoint.snapshot.server import SnapshotServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

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
