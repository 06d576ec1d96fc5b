"""A restore's reads from another node when whatever answers at that node's address is hostile (a
local user who took the port after the node's server died, a fake entry among the peers, something
on the path): it must not make the reader allocate what it says, nor hold the restore for as long
as it likes. The reader gives up on that source (the restore then reads the next one, or storage).

Oracles: the bytes the fake server managed to send before the reader closed the connection, the
wall time, and the error type."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
from elastor_ds.errors import IncompleteCheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

STEP = "step_000000001"


class Fake:
    """One connection: reads the request, then runs ``answer(conn)``; counts the bytes it sent."""

    def __init__(self, answer):
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(4)
        self.port = self.ls.getsockname()[1]
        self.sent = 0
        self.answer = answer
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def send(self, c, data):
        c.sendall(data)
        self.sent += len(data)

    def _serve(self):
        c, _ = self.ls.accept()
        c.recv(65536)
        try:
            self.answer(self, c)
        except OSError:
            pass
        finally:
            c.close()
            self.ls.close()


def source(fake, timeout_s=2.0):
    return RemoteSource(f"127.0.0.1:{fake.port}", STEP, os.urandom(32), timeout_s=timeout_s, busy_wait_s=1.0)


def test_a_busy_answer_with_a_huge_body_is_not_read_whole():
    """``503`` (unauthenticated, as every busy answer) followed by 256 MiB, close-delimited: the
    reader read it all into memory before; now it reads at most 64 KiB and hangs up."""
    def answer(f, c):
        f.send(c, b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\n")
        chunk = b"x" * (1 << 20)
        for _ in range(256):
            f.send(c, chunk)
    f = Fake(answer)
    src = source(f)
    assert src._get_index() == {"local": False, "peer": []} and src._down
    f.t.join(30)
    assert f.sent < 32 << 20, f"the fake server got {f.sent >> 20} MiB out: the reader kept reading"


def test_a_busy_answer_that_announces_100_terabytes_is_no_memory_error():
    def answer(f, c):
        f.send(c, b"HTTP/1.1 503 Busy\r\nContent-Length: 100000000000000\r\n\r\n" + b"x" * 1000)
        time.sleep(3)
    src = source(Fake(answer))
    assert src._get_index() == {"local": False, "peer": []} and src._down   # not MemoryError


def test_an_index_answer_trickled_a_byte_a_second_is_abandoned():
    def answer(f, c):
        f.send(c, b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\nX-Elastor-Auth: 00\r\n\r\n")
        for _ in range(60):
            f.send(c, b"x")
            time.sleep(1)
    src = source(Fake(answer), timeout_s=2.0)
    t0 = time.monotonic()
    assert src._get_index() == {"local": False, "peer": []} and src._down
    assert time.monotonic() - t0 < 10


def test_a_range_answer_trickled_a_byte_a_second_is_abandoned():
    """A range read of 1 MiB whose answer trickles: given up after ``timeout_s`` plus the time the
    bytes take at 1 MiB/s (3 s here), not after each byte's own timeout forever."""
    def answer(f, c):
        f.send(c, b"HTTP/1.1 206 Partial\r\nContent-Length: 1048576\r\nContent-Range: bytes 0-1048575/1048576\r\n"
                  b"X-Elastor-Auth: 00\r\n\r\n")
        for _ in range(60):
            f.send(c, b"x")
            time.sleep(1)
    f = Fake(answer)
    src = source(f, timeout_s=2.0)
    src._index = {"local": True, "peer": []}
    src._where["data_00000.safetensors"] = f"local/{STEP}/data_00000.safetensors"
    src._local.no_ahead = True
    buf = bytearray(1 << 20)
    t0 = time.monotonic()
    with pytest.raises(IncompleteCheckpointError, match="not received within"):
        src.read_into("data_00000.safetensors", 0, [memoryview(buf)])
    assert time.monotonic() - t0 < 10
