"""elastor's threads carry their names to the OS (``elastor_ds/threads.py``). Oracle: the kernel's
own record of each thread's name, ``/proc/self/task/<tid>/comm``."""
from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.threads import NamedThread, os_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names from /proc (Linux)")


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def test_os_names_shorten_the_prefix_and_fit_15_bytes():
    assert os_name("elastor-writer") == "el-writer"
    assert os_name("elastor-heartbeat-0123456789ab") == "el-heartbeat-01"
    assert os_name("plain-name-longer-than-fifteen") == "plain-name-long"
    assert os_name("elastor-" + "é" * 10) == "el-" + "é" * 6            # 15 bytes
    assert os_name("elastor-x" + "é" * 10) == "el-x" + "é" * 5          # never half a character


def test_a_named_thread_shows_its_name_to_the_kernel():
    seen: list = []

    def run() -> None:
        seen.append(_comm(threading.get_native_id()))
    t = NamedThread(target=run, name="elastor-direct-write")
    t.start()
    t.join()
    assert seen == ["el-direct-write"]
    assert _comm(threading.get_native_id()) != "el-direct-write"   # the caller keeps its own name


def test_the_checkpoint_writer_thread_is_named(tmp_path):
    eng = CheckpointEngine(str(tmp_path / "ck"))
    try:
        eng.save(1, [full_shard("w", torch.arange(1024.0))])
        eng.wait()
        # this engine's own writer thread (another test's engine in this process could be named so too)
        tid = eng._thread.native_id
        assert str(tid) in os.listdir("/proc/self/task")
        assert _comm(tid) == "el-writer"
    finally:
        eng.finalize()
