"""Two writers in one checkpoint root (QA round 5, Q5-15): a second engine's retention removes the
temp dir of a save still being written. That save must fail with a ConcurrentWriterError that says
so, commit nothing, and leave the other writer's steps whole."""
from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint.planning.manifest import CRC_TABLE_SUFFIX
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.errors import ConcurrentWriterError


def _load(root: str, n: int) -> torch.Tensor:
    out = torch.zeros(n)
    eng = CheckpointEngine(root, keep=2)
    eng.load(None, [full_shard("q", out)])
    eng.finalize()
    return out


def test_second_engine_removing_the_temp_dir_fails_the_save_by_name(tmp_path):
    root = str(tmp_path / "ck")
    a, b = CheckpointEngine(root, keep=2), CheckpointEngine(root, keep=2)
    a.save(3, [full_shard("q", torch.arange(4.0))])
    a.wait()
    written, release = threading.Event(), threading.Event()
    inner = b.storage.write_data_file

    def paused(*args, **kwargs):   # b's writer stops after its data file, inside its temp dir
        out = inner(*args, **kwargs)
        written.set()
        assert release.wait(60)
        return out

    b.storage.write_data_file = paused
    b.save(4, [full_shard("q", torch.full((4,), 2.0))])
    assert written.wait(60)
    temp = [n for n in os.listdir(root) if n.startswith(".tmp_step_000000004_")]
    assert len(temp) == 1
    a.save(4, [full_shard("q", torch.full((4,), 7.0))])   # a commits step 4; its retention removes b's temp dir
    a.wait()
    assert not os.path.exists(os.path.join(root, temp[0]))
    release.set()
    with pytest.raises(ConcurrentWriterError) as ei:
        b.wait()
    msg = str(ei.value)
    assert "another writer" in msg and root in msg and "own checkpoint directory" in msg
    assert "FileNotFoundError" not in msg
    assert torch.equal(_load(root, 4), torch.full((4,), 7.0))   # a's step 4, whole
    assert open(os.path.join(root, "latest")).read().strip() == "step_000000004"
    a.finalize()
    b.finalize()


def test_a_temp_dir_recreated_without_a_rank_file_is_not_committed(tmp_path):
    """Removed and then recreated by a rank that wrote later (``makedirs``): the listing before the
    commit misses the earlier files, so nothing commits and ``latest`` stays."""
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, keep=2)
    eng.save(1, [full_shard("q", torch.arange(3.0))])
    eng.wait()
    inner = eng.storage.write_file

    def wipe_then_write(path, data):   # the CRC table is written after the data file: wipe the folder first
        if path.endswith(CRC_TABLE_SUFFIX):
            shutil.rmtree(os.path.dirname(path))
        return inner(path, data)

    eng.storage.write_file = wipe_then_write
    eng.save(2, [full_shard("q", torch.full((3,), 5.0))])
    with pytest.raises(ConcurrentWriterError, match="data_00000.safetensors vanished"):
        eng.wait()
    assert open(os.path.join(root, "latest")).read().strip() == "step_000000001"
    assert not os.path.exists(os.path.join(root, "step_000000002"))
    eng.storage.write_file = inner
    eng.finalize()
    assert torch.equal(_load(root, 3), torch.arange(3.0))


WRITER = """
import sys, torch
from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.errors import ConcurrentWriterError
root, first = sys.argv[1], int(sys.argv[2])
eng = CheckpointEngine(root, keep=100, async_save=False)
for step in range(first, 50, 2):
    try:
        eng.save(step, [full_shard("a", torch.randn(1 << 18)), full_shard("b", torch.randn(1 << 18))])
    except ConcurrentWriterError:
        print("lost", step)
    except Exception as e:
        print("OTHER", step, type(e).__name__, e)
"""


def test_two_processes_saving_into_one_root_never_commit_a_step_without_its_files(tmp_path):
    """QA round 7, Q7-1: the other engine's retention deleted a temp dir by walking it, and went on
    emptying it after this engine had renamed it to its step: a save that returned success left a
    committed step holding only its manifest (3 of 4 runs). Retention now renames a directory away
    before deleting it. Oracle: the checkpoint verifier on every committed step, after two
    processes saved 25 steps each into one root; a losing save may fail, only as ConcurrentWriterError."""
    import subprocess
    import sys

    from elastor_ds.checkpoint.verify import verify
    root = tmp_path / "ck"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(first)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for first in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert not any("OTHER" in o for o in outs), outs
    steps = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert len(steps) >= 25
    bad = {s: [str(p) for p in verify(str(root / s))] for s in steps}
    assert not any(bad.values()), {s: b for s, b in bad.items() if b}
