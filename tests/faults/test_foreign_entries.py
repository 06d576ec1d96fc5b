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
from elastor_ds.checkpoint import commit as commit_mod
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


def test_a_temp_dir_another_user_made_first_is_never_written_through(tmp_path):
    """A shared root (sticky, writable by all): another user who made the next save's temp dir first,
    with a link in it to a file of the job's user, had the save write through the link (the file
    became a CRC table) and commit a step that user owned. The temp dir's name now carries a keyed
    hash (not to be guessed from earlier names), and a folder the job did not make is refused: the
    save fails, the file is intact, nothing is committed."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)
    eng = CheckpointEngine(str(root), keep=5, async_save=False)
    _save(eng, 1)
    first = eng._temp_nonce(1)
    assert eng._temp_nonce(2) != first.rsplit("_", 2)[0] + "_2", "the next name follows from the last one"
    # the attacker guessed right (here: given the name): made the folder and the links before the save
    planted = root / commit_mod.tmp_dirname(2, eng._temp_nonce(eng._saves))
    planted.mkdir()
    for name in ("data_00000.safetensors", "data_00000.crc32", "manifest.json"):
        os.symlink(victim, planted / name)
    os.chown(planted, 65534, 65534)
    os.chmod(planted, 0o777)
    with pytest.raises(CheckpointError, match="belongs to uid 65534"):
        eng.save(2, [full_shard("w", torch.arange(8.0) + 2)])
        eng.wait()
    assert victim.read_text() == "precious"
    assert not (root / "step_000000002").exists() and sorted(os.listdir(planted)) == [
        "data_00000.crc32", "data_00000.safetensors", "manifest.json"]
    _save(eng, 3)   # the next save has a folder of its own
    out = torch.zeros(8)
    assert eng.load(None, [full_shard("w", out)]).step == 3 and torch.equal(out, torch.arange(8.0) + 3)
    eng.finalize()


def test_a_link_in_the_save_folder_is_not_followed_by_the_data_writers(tmp_path):
    """The writers open their files without following a link (the folder check above aside)."""
    from elastor_ds.checkpoint.direct_write import write_stream_direct
    from elastor_ds.checkpoint.fileformat import write_stream
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    for i, write in enumerate((write_stream, write_stream_direct)):
        link = tmp_path / f"data_{i}.safetensors"
        os.symlink(victim, link)
        with pytest.raises(OSError):
            write(str(link), b"x" * 4096, [memoryview(bytearray(8192))])
    assert victim.read_text() == "precious"


def test_retention_leaves_committed_steps_it_did_not_make(tmp_path, caplog):
    """keep=1 deleted a step of another user (copied in by a colleague) and a step holding a file
    the user had added (notes beside the data) whole. Both stay now, said in one warning; the
    steps saves made still go."""
    caplog.set_level(logging.WARNING)
    root = tmp_path / "root"
    eng = CheckpointEngine(str(root), keep=1, async_save=False)
    for step in (1, 2, 3):
        _save(eng, step)
    # (step 1 is gone by now; make two more old steps as a colleague and the user would have)
    for step in (0, 1):
        eng2 = CheckpointEngine(str(tmp_path / f"other{step}"), keep=5, async_save=False)
        _save(eng2, step)
        eng2.finalize()
        os.rename(tmp_path / f"other{step}" / f"step_{step:09d}", root / f"step_{step:09d}")
    os.chown(root / "step_000000000", 4242, 4242)
    (root / "step_000000001" / "eval_notes.txt").write_text("mine")
    _save(eng, 4)
    _save(eng, 5)
    eng.finalize()
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [
        "step_000000000", "step_000000001", "step_000000005"]
    assert (root / "step_000000001" / "eval_notes.txt").read_text() == "mine"
    said = [r.getMessage() for r in caplog.records if "retention leaves alone" in r.getMessage()]
    assert len(said) == 1 and "belongs to uid 4242" in said[0] and "'eval_notes.txt'" in said[0], said
