"""A program that exits without ``finalize()``: the engine's writer thread is stopped at exit after
the save it is writing, so that save commits and no thread of ours is alive while the interpreter
finalizes (a daemon thread caught there inside a C call can abort the process: "terminate called
without an active exception", exit -6, seen once in CI). Oracles: the child's exit status and
stderr, and the committed step read back and verified by a fresh engine in this process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.checkpoint.verify import verify

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import sys, torch
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    g = torch.Generator().manual_seed(3)
    t = torch.randn(64, 1 << 18, generator=g)          # 64 MiB: the write outlasts the script
    eng = CheckpointEngine(sys.argv[1])
    eng.save(5, [full_shard("t", t)])
    print("saved", flush=True)                         # and exit, no wait(), no finalize()
""")


def test_a_program_that_exits_without_finalize_commits_its_last_save_and_exits_0(tmp_path):
    root = str(tmp_path / "ck")
    p = subprocess.run([sys.executable, "-c", CHILD, root], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-2000:])
    assert p.stdout.strip() == "saved"
    assert [s for s, _ in commit_mod.list_committed(root)] == [5]
    out = torch.zeros(64, 1 << 18)
    res = CheckpointEngine(root).load(None, [full_shard("t", out)])
    assert res.step == 5 and verify(res.step_dir) == []
    assert torch.equal(out, torch.randn(64, 1 << 18, generator=torch.Generator().manual_seed(3)))


LATE = textwrap.dedent('''
    import atexit, sys, torch
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    t = torch.full((1 << 20,), 1.0)
    eng = CheckpointEngine(sys.argv[1])
    def last_save():                                   # registered before the first save: runs after
        eng.save(2, [full_shard("t", t * 2)])          # the engine's own exit handler (atexit is LIFO)
        print("late save returned", flush=True)
    atexit.register(last_save)
    eng.save(1, [full_shard("t", t)])
    eng.wait()
    print("saved", flush=True)
''')


def test_a_save_from_an_exit_handler_that_runs_after_the_writers_stopped_is_committed(tmp_path):
    """The engine's exit handler stops the writer threads; a save made later (from an atexit
    handler registered before the first save) started a new writer that nobody waited for, and was
    lost without a word. It is now written before ``save()`` returns."""
    root = str(tmp_path / "ck")
    p = subprocess.run([sys.executable, "-c", LATE, root], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-2000:])
    assert p.stdout.split() == ["saved", "late", "save", "returned"]
    assert [s for s, _ in commit_mod.list_committed(root)] == [1, 2]
    out = torch.zeros(1 << 20)
    res = CheckpointEngine(root).load(None, [full_shard("t", out)])
    assert res.step == 2 and verify(res.step_dir) == [] and torch.equal(out, torch.full((1 << 20,), 2.0))
