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
from elastor_ds.checkpoint.sources import STORAGE, DirSource
from elastor_ds.checkpoint.storage import TmpfsStorage
from elastor_ds.comm import TorchComm
from elastor_ds.errors import ConfigError, CorruptCheckpointError

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


# ---------------------------------------------------------------- finding 3: unverified bytes after a failed load
M = 4096   # floats per tensor
BEFORE = 7.0   # every destination element before the load


def _saved(tmp_path):
    """A committed step of tensors "a" (-1, -2, ...) and "b" (0.5, 1.5, ...): no value twice."""
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, async_save=False)
    a = -torch.arange(1, M + 1, dtype=torch.float32)
    b = torch.arange(M, dtype=torch.float32) + 0.5
    eng.save(1, [full_shard("a", a), full_shard("b", b)])
    eng.finalize()
    return root, commit_mod.resolve(root), a, b


def _destinations():
    return torch.full((M,), BEFORE), torch.full((M,), BEFORE)


def _only_allowed(got: torch.Tensor, saved: torch.Tensor) -> None:
    """Every element is the checkpoint's, the value before the load, or zero."""
    ok = (got == saved) | (got == BEFORE) | (got == 0)
    bad = (~ok).nonzero().flatten()[:5].tolist()
    assert not bad, f"elements {bad} hold {got[bad].tolist()}: neither checkpoint, previous nor zero"


@pytest.mark.timeout(120)
def test_a_load_that_fails_its_crc_leaves_no_corrupt_bytes_in_the_destination(tmp_path):
    """A bit flipped in the data file on storage (the only source): the read lands in the destination
    and fails its block CRC. The corrupt value stayed in the destination after the raise."""
    root, step_dir, a, b = _saved(tmp_path)
    data = os.path.join(step_dir, "data_00000.safetensors")
    with open(data, "rb") as f:
        raw = f.read()
    pat = torch.tensor([5.5], dtype=torch.float32).numpy().tobytes()   # b[5]
    assert raw.count(pat) == 1
    at = raw.index(pat)
    with open(data, "r+b") as f:
        f.seek(at)
        f.write(torch.tensor([99.0], dtype=torch.float32).numpy().tobytes())
    da, db = _destinations()
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        CheckpointEngine(root).load(None, [full_shard("a", da), full_shard("b", db)])
    assert float(db[5]) == 0.0          # the failed read's bytes, zeroed (was 99.0)
    assert not bool((db == 99.0).any()) and not bool((da == 99.0).any())
    _only_allowed(da, a)
    _only_allowed(db, b)


class ForgingSource(DirSource):
    """A peer that answers with forged bytes: they reach the reader's buffer, then the MAC check
    (as the peer sources do it, after the bytes arrived) fails."""

    def __init__(self, step_dir: str):
        super().__init__(step_dir, "peer-memory")
        self.in_memory = False
        self.forged = 0

    def read_into(self, relpath, offset, views):
        super().read_into(relpath, offset, views)
        if relpath.endswith(".safetensors"):
            for v in views:
                v[:] = b"\x5a" * len(v)
            self.forged += 1
            raise CorruptCheckpointError(f"peer-memory: {relpath} bytes {offset}..: MAC mismatch (forged)")


@pytest.mark.timeout(120)
def test_a_load_whose_every_source_forges_bytes_leaves_none_of_them_in_the_destination(tmp_path):
    root, step_dir, a, b = _saved(tmp_path)
    forged = float(torch.frombuffer(bytearray(b"\x5a" * 4), dtype=torch.float32)[0])
    srcs = []

    def sources(d, man):
        srcs[:] = [ForgingSource(d), ForgingSource(d)]   # two peers, both forging: the load fails
        return list(srcs)
    da, db = _destinations()
    with pytest.raises(CorruptCheckpointError, match="MAC mismatch"):
        CheckpointEngine(root).load(None, [full_shard("a", da), full_shard("b", db)], sources=sources)
    assert all(s.forged for s in srcs)
    for got, saved in ((da, a), (db, b)):
        assert not bool((got == forged).any()), "the forged bytes stayed in the destination"
        _only_allowed(got, saved)
    # with storage behind the forging peer, the load reads the file again from storage: every byte right
    da, db = _destinations()

    def with_storage(d, man):
        return [ForgingSource(d), DirSource(d, STORAGE)]
    res = CheckpointEngine(root).load(None, [full_shard("a", da), full_shard("b", db)], sources=with_storage)
    assert res.step == 1 and torch.equal(da, a) and torch.equal(db, b)
