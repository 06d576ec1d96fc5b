"""A process that used a TorchComm exits cleanly (issue 12: Megatron-LM launches aborted at exit).

Two launches of the full Megatron-LM sequence died after a clean run with "terminate called without
an active exception" (SIGABRT, no Python error). Cause: the liveness heartbeat is a daemon thread
that calls ``TCPStore.add`` (C++, GIL released); when the interpreter finalizes while it is inside
that call, CPython ends the thread with a forced unwind on its way back to the GIL, which the C++
runtime turns into ``std::terminate``. The heartbeats are now stopped and joined at exit.

The child makes each heartbeat slow (the real store call, repeated: a store on a loaded machine),
so the thread is inside C++ almost all the time when the interpreter exits. Oracle: the exit status
(before the fix: -6 and that message, every time).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from elastor_ds.comm import collectives as c

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    real_beat = c._Liveness._beat

    def slow_beat(self, store):
        for _ in range(2000):
            real_beat(self, store)

    c._Liveness._beat = slow_beat
    lv = [c._Liveness(("127.0.0.1", server.port), f"t{i}", 0, 2, 0.5) for i in range(2)]
    time.sleep(0.4)  # both heartbeats are beating (inside TCPStore.add) when the interpreter exits
    print("exiting", flush=True)
""")


def test_heartbeat_threads_do_not_abort_the_interpreter_exit():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and "exiting" in r.stdout, (r.returncode, r.stderr[-2000:])
        assert "terminate called" not in r.stderr, r.stderr[-2000:]
