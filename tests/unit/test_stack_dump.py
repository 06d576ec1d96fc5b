"""`kill -USR2 <elastor run>` writes every thread's stack to stderr and the process carries on
(elastor_ds.elastic.agent.register_stack_dump), in a real child process."""
from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, signal, threading, time
from elastor_ds.elastic.agent import register_stack_dump
register_stack_dump()
def parked_helper():
    time.sleep(30)
threading.Thread(target=parked_helper, daemon=True).start()
time.sleep(0.2)
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.2)
print("still running")
"""


def test_sigusr2_dumps_every_thread_and_the_process_carries_on():
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "still running"
    assert p.stderr.count("hread 0x") >= 2 and "in parked_helper" in p.stderr and "Current thread" in p.stderr, p.stderr
