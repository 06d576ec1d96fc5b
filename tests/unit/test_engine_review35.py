"""Review 35 of the checkpoint engine: a program that raises out of its training loop without
``finalize()`` left a snapshot's worth of memory in ``<snapshot dir>/local/.recycle`` (the retired
data file kept for the next snapshot to write over) until the next start. The exit handler now
releases it, and only it: the committed steps stay for the relaunch. Oracle: a real child process
that raises, the files left on disk after it exited, and a load of the committed step compared with
the tensor the child saved (with and without the background writer thread)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.checkpoint.storage import TmpfsStorage
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 1 << 20   # floats: 4 MiB per snapshot


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))


def shm_dir(tmp_path) -> str:
    """A folder on /dev/shm (the memory tier's usual place), else under tmp_path."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(prefix="elastor-review35-", dir="/dev/shm")
    return str(tmp_path)


# ---------------------------------------------------------------- finding 1: .recycle left at exit
RAISES_IN_LOOP = """
    import sys, torch
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    from elastor_ds.checkpoint.storage import TmpfsStorage
    root, async_save = sys.argv[1], sys.argv[2] == "1"
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, async_save=async_save)
    w = torch.zeros(%d)
    for step in (1, 2, 3):          # a training loop with a snapshot every step
        w.fill_(float(step))
        eng.save(step, [full_shard("w", w)])
        eng.wait()
    w.fill_(-1.0)
    raise RuntimeError("boom in the training loop")   # no try/finally, no finalize()
""" % N


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", [True, False])
def test_a_program_that_raises_without_finalize_leaves_no_recycled_snapshot(tmp_path, async_save):
    base = shm_dir(tmp_path)
    try:
        root = os.path.join(base, "local")
        p = run_child(RAISES_IN_LOOP, root, "1" if async_save else "0")
        assert p.returncode == 1 and "RuntimeError: boom in the training loop" in p.stderr, p.stderr[-3000:]
        recycle = os.path.join(root, ".recycle")
        left = os.listdir(recycle) if os.path.isdir(recycle) else []
        assert left == [], f"{recycle} holds {[(n, os.path.getsize(os.path.join(recycle, n))) for n in left]}"
        # the committed snapshot is kept, whole, for the relaunch
        steps = commit_mod.list_committed(root)
        assert [s for s, _ in steps] == [3]
        got = torch.zeros(N)
        res = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1).load(None, [full_shard("w", got)])
        assert res.step == 3 and torch.equal(got, torch.full((N,), 3.0))
    finally:
        if base != str(tmp_path):
            shutil.rmtree(base, ignore_errors=True)


