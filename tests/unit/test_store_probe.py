"""The Python wait for a c10d store this node does not host (elastic/store_probe.py): who waits,
for how long (twice read_timeout), and the connect loop, with a fake clock and fake connections."""
from __future__ import annotations

import socket
import threading

import pytest

from elastor_ds.elastic.store_probe import client_deadline_s, wait_for_store

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("conf, local, want", [
    ({}, False, 120.0),                                   # torch's default read_timeout 60, twice
    ({"read_timeout": 5.0}, False, 10.0),
    ({"is_host": False, "read_timeout": 5.0}, False, 10.0),
    ({"is_host": False}, True, 120.0),                    # given: a client even on its own machine
    ({"is_host": True}, False, None),                     # this node hosts the store
    ({}, True, None),                                     # torch decides this machine hosts it
])
def test_deadline_follows_torchs_rule(conf, local, want):
    assert client_deadline_s("node0", conf, matches_this_machine=lambda h: local) == want


def test_torchs_own_rule_calls_loopback_this_machine():
    assert client_deadline_s("127.0.0.1", {}) is None
    assert client_deadline_s("localhost", {"read_timeout": 3.0}) is None


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_refused_until_the_deadline_returns_the_last_error():
    clk, seen = _Clock(), []

    def refuse(addr, timeout):
        clk.t += 0.01
        raise ConnectionRefusedError(111, "Connection refused")
    why = wait_for_store("h", 1, 3.0, connect=refuse, clock=clk, sleep=clk.sleep, on_wait=seen.append)
    assert why == "ConnectionRefusedError: Connection refused"
    assert seen == [why]                  # told once, not per try
    assert 103.0 <= clk.t < 103.3         # it stops at the deadline


def test_accepted_after_some_refusals_returns_none_and_closes():
    clk, closed, tries = _Clock(), [], []

    class Conn:
        def close(self):
            closed.append(True)

    def connect(addr, timeout):
        tries.append(timeout)
        if len(tries) < 4:
            raise ConnectionRefusedError(111, "Connection refused")
        return Conn()
    assert wait_for_store("h", 1, 10.0, connect=connect, clock=clk, sleep=clk.sleep) is None
    assert len(tries) == 4 and closed == [True]
    assert all(0 < t <= 2.0 for t in tries)   # one black-holed try never eats the whole bound


def test_a_real_listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    t = threading.Thread(target=lambda: srv.accept()[0].close(), daemon=True)
    t.start()
    try:
        assert wait_for_store("127.0.0.1", port, 5.0) is None
    finally:
        t.join(5)
        srv.close()
    assert wait_for_store("127.0.0.1", port, 0.6) == "ConnectionRefusedError: Connection refused"
