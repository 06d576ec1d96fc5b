"""A storage load reads its rank state file through the step's source, checked against the
manifest's CRC32, like a memory restore does (before, a storage load read it with a plain open and
no check: an edited state loaded silently).

Oracle: the state saved (kept here), and the bytes the test edits itself."""
from __future__ import annotations

import os

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.errors import CorruptCheckpointError
from elastor_ds.layout.region import Region

pytestmark = pytest.mark.unit

SHAPE = (8, 16)


def _save(root: str, state: dict) -> str:
    eng = CheckpointEngine(root, async_save=False)
    eng.save(3, [TensorShard("w", SHAPE, Region.full(SHAPE), torch.ones(*SHAPE))], rank_state=state)
    eng.wait()
    return os.path.join(commit_mod.resolve(root), "rank_state", "rank_00000.json")


def _load(root: str):
    return CheckpointEngine(root).load(None, [TensorShard("w", SHAPE, Region.full(SHAPE), torch.zeros(*SHAPE))])


def test_the_rank_state_loads_as_saved(tmp_path):
    root = str(tmp_path / "ck")
    _save(root, {"seed": 1, "rng": [1, 2, 3]})
    assert _load(root).rank_state == {"seed": 1, "rng": [1, 2, 3]}


def test_an_edited_rank_state_that_is_still_json_is_refused(tmp_path):
    root = str(tmp_path / "ck")
    path = _save(root, {"seed": 1})
    data = open(path, "rb").read()
    assert b'"seed":1' in data
    with open(path, "wb") as f:
        f.write(data.replace(b'"seed":1', b'"seed":7'))   # same size, valid JSON
    with pytest.raises(CorruptCheckpointError, match=r"rank_state/rank_00000.json.*CRC32"):
        _load(root)


def test_a_rank_state_that_is_not_json_is_a_corrupt_checkpoint_not_a_traceback(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    path = _save(root, {"seed": 1})
    # the attacker also fixed the manifest's CRC: the bytes pass the check and are still not JSON
    from elastor_ds.checkpoint import sources as sources_mod
    real = sources_mod.read_file
    monkeypatch.setattr(sources_mod, "read_file", lambda *a, **k: (b"\xff{not json", "storage")
                        if a[1].startswith("rank_state/") else real(*a, **k))
    with pytest.raises(CorruptCheckpointError, match="rank state is not JSON"):
        _load(root)
    assert os.path.exists(path)
