"""A storage load reads its rank state file through the step's source, checked against the
manifest's CRC32, like a memory restore does (before, a storage load read it with a plain open and
no check: an edited state loaded silently).

Oracle: the state saved (kept here), and the bytes the test edits itself."""
from __future__ import annotations

import hashlib
import json
import os
import zlib

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


def test_a_rank_state_that_is_not_json_is_a_corrupt_checkpoint_not_a_traceback(tmp_path):
    root = str(tmp_path / "ck")
    path = _save(root, {"seed": 1})
    # an attacker writes bytes that are not JSON and fixes the manifest to match them: the file's
    # size and CRC32 (zlib), and the manifest's own SHA-256 (its canonical text, by hand)
    bad = b"\xff{not json"
    with open(path, "wb") as f:
        f.write(bad)
    mpath = os.path.join(os.path.dirname(os.path.dirname(path)), "manifest.json")
    doc = json.load(open(mpath))
    doc["files"]["rank_state/rank_00000.json"].update(size=len(bad), crc32=f"{zlib.crc32(bad):08x}")
    body = {k: v for k, v in doc.items() if k != "checksum"}
    doc["checksum"] = "sha256:" + hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    with open(mpath, "w") as f:
        json.dump(doc, f)
    with pytest.raises(CorruptCheckpointError, match="rank state is not JSON"):
        _load(root)
