"""A memory snapshot's data files are recycled: a save renames a retired step's file into its own
temporary folder and writes over it (:mod:`elastor_ds.checkpoint.storage.tmpfs`). These tests pin
down which files may be taken and which steps a restore may pick. Oracles: the values each step
was saved with (a constant per step), read back by a fresh engine, and the directory listing."""
from __future__ import annotations

import os

import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.settings import parse_memory_snapshot
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.checkpoint.snapshot.tier import MemoryTier
from elastor_ds.checkpoint.storage import TmpfsStorage
from elastor_ds.comm.collectives import LocalComm
from elastor_ds.errors import AsyncSaveError


def engine(root):
    return CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, optimistic_plan=True)


def save(eng, w, step):
    w.fill_(step)
    eng.save(step, [full_shard("w", w)])
    eng.wait()


def loads(root, step):
    out = torch.empty(64, 256)
    res = CheckpointEngine(root).load(None, [full_shard("w", out)])
    return res.step == step and bool((out == step).all())


def failing_commit(eng, monkeypatch, step):
    real = eng.storage.commit

    def commit(tmp_dir, s, text):
        if s == step:
            raise OSError(5, "simulated crash before the commit")
        return real(tmp_dir, s, text)
    monkeypatch.setattr(eng.storage, "commit", commit)


@pytest.mark.parametrize("how", ["re-save", "node copy missing"])
def test_a_save_never_takes_the_data_file_of_the_step_latest_names(tmp_path, monkeypatch, how):
    """keep=1. ``re-save``: the run went back and saved step 3 again (the list of committed steps
    held it twice, so step 3 itself counted as retired). ``node copy missing``: rank 0 committed
    step 4 but this node's copy of it is not there (its commit failed, or has not happened yet), so
    this node's ``latest`` still names step 3. Either way the next save, which then fails before its
    commit, must not have taken step 3's file: the node keeps a snapshot that loads."""
    root = str(tmp_path / "local")
    eng = engine(root)
    w = torch.zeros(64, 256)
    for s in (1, 2, 3):
        save(eng, w, s)
    if how == "re-save":
        save(eng, w, 3)
    else:
        eng.storage.committed(os.path.join(root, commit_mod.step_dirname(4)))   # what the broadcast says
        # and no retired file waits in .recycle (this node's retention runs after its copy's commit)
        for n in os.listdir(eng.storage.recycle_dir):
            os.unlink(os.path.join(eng.storage.recycle_dir, n))
    failing_commit(eng, monkeypatch, 5)
    w.fill_(5)
    eng.save(5, [full_shard("w", w)])
    with pytest.raises(AsyncSaveError):
        eng.wait()
    eng.finalize()
    assert os.path.basename(commit_mod.read_latest(root)) == commit_mod.step_dirname(3)
    assert loads(root, 3)


def test_a_restore_never_picks_a_step_newer_than_latest(tmp_path, monkeypatch):
    """Snapshots 1-6, then the run goes back (it reloaded an older checkpoint) and snapshots step 4
    again. Retention never removes a step newer than the one just saved, so step 6 of the abandoned
    trajectory is still on disk; ``latest`` names step 4, and only steps up to it are candidates."""
    mem = tmp_path / "mem"
    cfg = parse_memory_snapshot({"dir": str(mem), "interval_steps": 1, "keep": 1, "peer_copies": 0})
    tier = MemoryTier(cfg, LocalComm())
    w = torch.zeros(64, 256)
    for s in (1, 2, 3, 4, 5, 6, 4):
        save(tier.ckpt, w, s)
    tier.ckpt.finalize()
    on_disk = [s for s, _ in commit_mod.list_committed(tier.root)]
    assert on_disk == [4, 6]
    assert sorted(tier.committed_steps()) == [4]


def test_files_of_ranks_on_another_node_are_not_kept_for_recycling(tmp_path, monkeypatch):
    """After a re-launch the ranks on this node are others than before (rank 1 moved to another
    node). Retention moves a retired step's data files to ``.recycle`` for this node's ranks to
    write over; a file no rank of this node will take is deleted, not kept in memory for the rest
    of the run."""
    import socket

    from elastor_ds.checkpoint.storage import tmpfs
    root = str(tmp_path / "local")

    class TwoNodes(LocalComm):
        world_size = 2

        def all_gather_object(self, obj):   # rank 0 (us) on this node, rank 1 on another host
            return [obj, ("elsewhere", obj[1])]
    st = TmpfsStorage(root)
    st.set_up(TwoNodes(), keep=1)
    assert st._recycle_names == {tmpfs.data_file_name(0)}
    os.makedirs(st.recycle_dir)
    for r in (0, 1):   # what retention left there from the launch before (ranks 0 and 1 on this node)
        with open(os.path.join(st.recycle_dir, tmpfs.data_file_name(r)), "wb") as f:
            f.write(b"x" * 4096)
    commit_mod.apply_retention(root, 1, recycle_dir=st.recycle_dir, recycle_names=st._recycle_names)
    assert sorted(os.listdir(st.recycle_dir)) == [tmpfs.data_file_name(0)]
    assert socket.gethostname() != "elsewhere"


def test_a_link_named_like_a_data_file_is_never_written_through_nor_recycled(tmp_path):
    """A symlink named like a rank's data file in ``.recycle`` (or in a retired step) must not be
    taken as the file to write over: the save would truncate and overwrite whatever it points to,
    and commit the link. The target stays as it was, the step holds a regular file of its own, and
    retention never moves a link into ``.recycle``."""
    root = str(tmp_path / "local")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious user data\n" * 10)
    eng = engine(root)
    os.makedirs(os.path.join(root, ".recycle"))
    os.symlink(victim, os.path.join(root, ".recycle", "data_00000.safetensors"))
    w = torch.zeros(64, 256)
    save(eng, w, 1)
    step1 = os.path.join(root, commit_mod.step_dirname(1), "data_00000.safetensors")
    assert victim.read_text() == "precious user data\n" * 10
    assert not os.path.islink(step1) and os.path.isfile(step1)
    assert loads(root, 1)
    other = tmp_path / "other.txt"
    other.write_text("x")
    os.unlink(os.path.join(root, ".recycle", "data_00000.safetensors"))
    os.symlink(other, os.path.join(root, commit_mod.step_dirname(1), "data_00001.safetensors"))
    commit_mod.recycle_data_files(os.path.join(root, commit_mod.step_dirname(1)), os.path.join(root, ".recycle"))
    assert os.listdir(os.path.join(root, ".recycle")) == ["data_00000.safetensors"]
    assert not os.path.islink(os.path.join(root, ".recycle", "data_00000.safetensors"))
    save(eng, w, 2)
    eng.finalize()
    assert other.read_text() == "x" and loads(root, 2)


@pytest.mark.parametrize("kind", ["tmpfs", "posix"])
def test_retention_keeps_a_later_saves_temp_dir_after_the_run_went_back(tmp_path, kind):
    """A run that went back to an older step (a reload; ``load: none`` into a used folder) leaves the
    steps of the trajectory it left on disk. Retention after committing step 4 deleted every temp dir
    up to the newest committed step (50), so also step 5's, which another rank's writer was already
    writing (seen: FileNotFoundError on rank 1's CRC table, the snapshot failed). Temp dirs up to the
    step just committed are stale; newer ones are another save's."""
    from elastor_ds.checkpoint.storage import PosixStorage
    root = str(tmp_path / "ck")
    store = (lambda: TmpfsStorage(root)) if kind == "tmpfs" else (lambda: PosixStorage(root, sync=False))
    w = torch.empty(64, 256)
    old = CheckpointEngine(root, storage=store(), keep=1)
    save(old, w, 50)     # the trajectory the run left
    old.finalize()
    inflight = os.path.join(root, commit_mod.tmp_dirname(5, "123_4_1"))   # rank 1's writer, step 5
    stale = os.path.join(root, commit_mod.tmp_dirname(3, "99_1_0"))       # a killed save of step 3
    for d in (inflight, stale):
        os.makedirs(d)
        with open(os.path.join(d, "data_00001.safetensors"), "wb") as f:
            f.write(b"x" * 100)
    eng = CheckpointEngine(root, storage=store(), keep=1)
    save(eng, w, 4)
    assert os.path.isdir(inflight) and os.listdir(inflight) == ["data_00001.safetensors"]
    assert not os.path.exists(stale)
    assert os.path.isdir(os.path.join(root, commit_mod.step_dirname(50)))   # never one newer than the save
    assert loads(root, 4)
    eng.finalize()
