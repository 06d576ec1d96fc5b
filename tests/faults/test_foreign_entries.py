"""Entries in a checkpoint root that a save did not make (QA round 6, Q6-3, Q6-4): a ``step_<N>``
symlink was swapped away by the commit under an internal temp name and then "removed" by every
retention in the log (it never was); a user's folder named like a save's temp dir was deleted.
Now neither is touched: a commit over a link fails naming it, and retention deletes only temp dirs
holding nothing but what a save writes."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.errors import CheckpointError


def _save(eng: CheckpointEngine, step: int) -> None:
    eng.save(step, [full_shard("w", torch.arange(8.0) + step)])
    eng.wait()


def test_a_step_symlink_is_never_replaced_renamed_or_said_removed(tmp_path, caplog):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("KEEP")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(victim, root / "step_000000003")
    eng = CheckpointEngine(str(root), keep=2)
    caplog.set_level(logging.INFO)
    _save(eng, 2)
    with pytest.raises(CheckpointError, match="step_000000003 is a symlink, not a step"):
        _save(eng, 3)
    for step in (4, 5, 6):
        _save(eng, step)
    assert os.readlink(root / "step_000000003") == str(victim)
    assert (victim / "keep.txt").read_text() == "KEEP" and os.listdir(victim) == ["keep.txt"]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp_step_")]
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000003", "step_000000005",
                                                                           "step_000000006"]
    removed = {n for r in caplog.records if r.getMessage().startswith("retention removed ")
               for n in r.getMessage()[len("retention removed "):].split(", ")}
    assert "step_000000003" not in removed and "step_000000002" in removed, removed
    out = torch.zeros(8)
    assert eng.load(None, [full_shard("w", out)]).step == 6 and torch.equal(out, torch.arange(8.0) + 6)
    eng.finalize()


def test_a_linked_committed_looking_step_is_not_retired(tmp_path, caplog):
    """A link to a folder holding a manifest counts among the steps when listing, but retention
    never removes (or renames) it, never enters it, and does not say it removed it."""
    caplog.set_level(logging.INFO)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text("{}")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(victim, root / "step_000000001")
    eng = CheckpointEngine(str(root), keep=1)
    for step in (2, 3):
        _save(eng, step)
    assert os.path.islink(root / "step_000000001") and sorted(os.listdir(victim)) == ["manifest.json"]
    assert not [r for r in caplog.records if "retention removed" in r.getMessage() and "step_000000001" in r.getMessage()]
    eng.finalize()


def test_retention_deletes_only_temp_dirs_a_save_left(tmp_path, caplog):
    root = tmp_path / "root"
    root.mkdir()
    user = root / ".tmp_step_000000002_x"      # a user's folder, named like a temp dir
    user.mkdir()
    (user / "f").write_text("tmpdata")
    linked = root / ".tmp_step_000000002_y"    # a link to one: never followed
    target = tmp_path / "t"
    target.mkdir()
    (target / "data_00000.safetensors").write_text("x")
    os.symlink(target, linked)
    crashed = root / ".tmp_step_000000002_1234_99_0"   # what a save that died leaves
    (crashed / "rank_state").mkdir(parents=True)
    (crashed / "data_00000.safetensors").write_bytes(b"\0" * 64)
    (crashed / "data_00000.crc32").write_bytes(b"\0" * 8)
    (crashed / "rank_state" / "rank_00000.json").write_text("{}")
    (crashed / "manifest.json.tmp.1234").write_text("{")
    eng = CheckpointEngine(str(root), keep=2)
    with caplog.at_level(logging.WARNING):
        for step in (3, 4):
            _save(eng, step)
    assert (user / "f").read_text() == "tmpdata"
    assert os.path.islink(linked) and os.listdir(target) == ["data_00000.safetensors"]
    assert not crashed.exists()
    said = [r.getMessage() for r in caplog.records if "retention leaves" in r.getMessage()]
    assert len([m for m in said if str(user) in m]) == 1 and "holds 'f', which no save writes" in " ".join(said)
    eng.finalize()
