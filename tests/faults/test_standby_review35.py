"""Review 35: the agent's loop neither waits nor spins on a standby the template forked.

The loop refills the standby pool with ``StandbyTemplate.fork_nowait`` (through ``StandbyPool.tick``)
once per ``--monitor-interval``: the fork request goes out at one tick, the reply is collected at a
later one (a non-blocking ``recv``, once a tick). But once the reply had come, the same call waited,
polling every 0.5 ms, for up to 5 s until the new standby led its own session (the standby does
that once it has seen the agent adopt it, so it needs a CPU first): on a loaded node the loop (hang
checks, stop signals) stood still for that time and the controller took CPU from training. The
check is now one look per tick; a blocking ``fork`` (a launch) waits with a growing poll interval.

A template of the test's own (through the ``python`` the agent starts it with) speaks the real
protocol and forks with the real ``standby_template.fork_standby``, so the standby is adopted by this
process exactly as by the agent; its standby waits ``SLOW_S`` before leading its own session, as a
standby that gets no CPU for that long would."""
from __future__ import annotations

import os
import stat
import sys
import time

import pytest

from elastor_ds.elastic.standby import PENDING, StandbyTemplate

pytestmark = pytest.mark.timeout(120)

SLOW_S = 2.5

FAKE_TEMPLATE = """
import json, os, socket, sys, time
from elastor_ds.elastic import standby_template as t
from elastor_ds.elastic.protocol import ENV_STANDBY_TEMPLATE_FD
sock = socket.socket(fileno=int(os.environ.pop(ENV_STANDBY_TEMPLATE_FD)))
sock.send(b"R")                                  # imports done
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 4096, 2)
    if not msg:
        os._exit(0)
    agent = json.loads(msg)["agent"]
    pid = t.fork_standby(agent)
    if pid == 0:                                 # the standby
        sock.close()
        os.dup2(fds[0], 0)
        while os.getppid() != agent:             # adopted by the agent (the subreaper)
            time.sleep(0.001)
        time.sleep(float(sys.argv[1]))           # no CPU for a while (a loaded node)
        os.setsid()
        os.write(fds[1], b"R")
        os.close(fds[1])
        sys.stdin.buffer.read()                  # its assignment, or EOF when retired
        os._exit(0)
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps({"pid": pid}).encode())
"""


@pytest.fixture
def template(tmp_path):
    script = tmp_path / "fake_template.py"
    script.write_text(FAKE_TEMPLATE)
    python = tmp_path / "python"   # StandbyTemplate runs [python, "-u", "-m", "...standby_template"]
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} {SLOW_S}\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(tmp_path / "template.log", "ab") as log:
        tpl = StandbyTemplate(str(python), dict(os.environ, PYTHONPATH=root), log, import_timeout=60.0)
        try:
            yield tpl
        finally:
            tpl.close()


def test_collecting_a_slow_standby_neither_blocks_nor_spins_the_agents_loop(template):
    interval = 0.05   # the tests' --monitor-interval (the default is 0.1)
    longest, ticks, cpu, made = 0.0, 0, 0.0, PENDING
    t0 = time.monotonic()
    while made is PENDING:
        assert time.monotonic() - t0 < 60, "no standby after 60 s"
        c, t = time.thread_time(), time.monotonic()
        made = template.fork_nowait(sys.executable)
        longest = max(longest, time.monotonic() - t)
        cpu += time.thread_time() - c
        ticks += 1
        if made is PENDING:
            time.sleep(interval)
    took = time.monotonic() - t0
    assert made is not None and template.state == "ready", template.state
    proc, ready_r = made
    try:
        assert os.getpgid(proc.pid) == proc.pid          # it leads its own group, as before
        assert took >= SLOW_S, took                      # it was collected once it did
        assert ticks >= SLOW_S / 2 / interval, ticks     # over many ticks (one look each)...
        assert longest < 0.5, longest                    # ...none of which waited for it
        assert cpu < 0.04, (cpu, ticks)                  # nor spent the CPU polling
    finally:
        proc.stdin.close()   # EOF: the standby exits
        assert proc.wait(timeout=30) == 0
        os.close(ready_r)


def test_a_blocking_fork_waits_for_a_slow_standby_without_spinning(template):
    c, t = time.thread_time(), time.monotonic()
    made = template.fork(sys.executable)
    took, cpu = time.monotonic() - t, time.thread_time() - c
    assert made is not None, template.state
    proc, ready_r = made
    try:
        assert os.getpgid(proc.pid) == proc.pid and took >= SLOW_S, took
        assert cpu < 0.04, cpu   # a few hundred looks at most, not one every 0.5 ms
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        os.close(ready_r)


def test_a_standby_not_handed_over_when_the_template_closes_is_killed_and_reaped(template):
    """Between the reply and the standby leading its session, the request stays out across ticks:
    the pool closing then (the job ends) must leave no process behind."""
    t0 = time.monotonic()
    while template._pending is None or template._pending.pid is None:
        assert time.monotonic() - t0 < 60, "no reply from the template"
        assert template.fork_nowait(sys.executable) is PENDING
        time.sleep(0.05)
    pid = template._pending.pid
    assert os.getpgid(pid) != pid   # still in the template's group: not handed over yet
    template.close()
    assert template._pending is None
    with pytest.raises(ChildProcessError):   # reaped by the close: no zombie, no process left
        os.waitpid(pid, os.WNOHANG)
    assert not os.path.exists(f"/proc/{pid}")
