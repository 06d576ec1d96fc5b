"""Review 33 of the snapshot server and its readers (real sockets, real files, real processes).

- a hostile server cannot hold a reader by trickling or flooding an answer's *head* (status line,
  headers, interim ``100 Continue`` answers): the whole answer has one deadline;

Oracles: the wall time, the error type and message, bytes written by the test itself."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
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
