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
