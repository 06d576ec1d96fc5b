"""A worker SIGKILLed while its peer fails on the broken connection: the controller's judgement waits
(policy.settle) until the signal death is seen, so the killed worker is the culprit and ``shrink``
drops its device. Real processes, a real connection reset, a real SIGKILL. In the CI failure that
led here (test_kill_mid_iteration_shrinks_then_scales_back_up, 2026-12-04), the controller saw the
peer's exit 1 (gloo: "connection reset by peer") in the same look that found the killed worker
still running. Here the victim resets its connection 50 ms before its SIGKILL, so that order is
certain: without the settle, the failure names no culprit (checked: the same test with
``judged = outs`` fails)."""
from __future__ import annotations

import subprocess
import sys
import time

from elastor_ds.elastic.policy import DeviceBook, OnFailure, WorkerOutcome, culprits, decide_after_failure, settle

# rank 0: the peer, exits 1 as soon as its connection to rank 1 is reset (as gloo's send/recv does)
PEER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.recv(1)
sys.exit(1)
"""
# rank 1: accepts the peer, resets the connection, then SIGKILLs itself 50 ms later (the injected fault)
VICTIM = """
import os, signal, socket, struct, sys, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
time.sleep(0.2)
conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
conn.close()                      # RST: the peer fails now
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_peer_that_fails_on_the_reset_connection_does_not_hide_the_killed_worker():
    victim = subprocess.Popen([sys.executable, "-c", VICTIM], stdout=subprocess.PIPE, text=True)
    port = int(victim.stdout.readline())
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)])
    procs = [peer, victim]
    try:
        def observe() -> list[WorkerOutcome]:
            return [WorkerOutcome(i, i, global_rank=i, exitcode=p.poll()) for i, p in enumerate(procs)]
        t_end = time.monotonic() + 30
        outs = observe()
        while not any(o.failed for o in outs):   # the controller's loop: look until something failed
            assert time.monotonic() < t_end, "no worker ended"
            time.sleep(0.001)
            outs = observe()
        judged = settle(observe, outs)
        assert [o.local_rank for o in culprits(judged)] == [1], judged
        book = DeviceBook((0, 1))
        dec = decide_after_failure(OnFailure.SHRINK, book, judged, 0, 3, None)
        assert list(dec.lost) == [1] and list(dec.devices) == [0], dec
    finally:
        for p in procs:
            p.kill()
            p.wait()
