"""One conformance scenario for every storage backend (torchft style), plus what sets them apart.

The scenario (single process, ``LocalComm``): three saves with ``keep=2``, then ``latest``,
retention and a bitwise load; then a save that dies before its commit leaves no checkpoint (the
newest committed step, ``latest`` and a load are unchanged, its temp dir is no checkpoint) and the
next save commits and sweeps that temp dir away. It runs against the posix backend, the tmpfs
backend with and without in-place staging, and :class:`RecordingStorage`: a backend written here,
in a test file, that the engine takes without a change to it (the seam's claim: a new backend is a
new module). The fsync tests patch ``os.fsync``: the posix backend syncs, the tmpfs one never does.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.planning.manifest import Manifest
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.sources import ChunkSource
from elastor_ds.checkpoint.storage import Capabilities, PosixStorage, Storage, TmpfsStorage
from elastor_ds.comm.collectives import Comm
from elastor_ds.errors import AsyncSaveError, ConfigError, IncompleteCheckpointError
from elastor_ds.layout.region import Region

SHAPE = (48, 40)


class RecordingStorage(Storage):
    """A backend of its own: every call goes to a posix backend and is recorded by name."""

    def __init__(self, root: str):
        self.inner = PosixStorage(root)
        self.root = self.inner.root
        self.caps = Capabilities(durable=True, node_local=False, stages_in_place=False)
        self.calls: list[str] = []
        self.fail_commit = False   # a "crash" between the last data write and the commit

    def _rec(self, name: str) -> PosixStorage:
        self.calls.append(name)
        return self.inner

    def set_up(self, comm: Comm, keep: int) -> None:
        self._rec("set_up").set_up(comm, keep)

    def temp_dir(self, step: int, nonce: str) -> str:
        return self._rec("temp_dir").temp_dir(step, nonce)

    def write_data_file(self, path: str, header: bytes, buffers: Sequence[memoryview], *, chunk_crcs: list[int],
                        block_crcs: list[list[int]], block_size: int) -> tuple[int, int]:
        return self._rec("write_data_file").write_data_file(path, header, buffers, chunk_crcs=chunk_crcs,
                                                            block_crcs=block_crcs, block_size=block_size)

    def write_file(self, path: str, data: bytes) -> None:
        self._rec("write_file").write_file(path, data)

    def seal_file(self, path: str) -> None:
        self._rec("seal_file").seal_file(path)

    def commit(self, tmp_dir: str, step: int, manifest_text: str) -> str:
        inner = self._rec("commit")
        if self.fail_commit:
            raise OSError(f"simulated crash before the commit of step {step}")
        return inner.commit(tmp_dir, step, manifest_text)

    def abort(self, tmp_dir: str) -> None:
        self._rec("abort").abort(tmp_dir)

    def committed(self, step_dir: str) -> None:
        self._rec("committed").committed(step_dir)

    def retain(self, keep: int, protect: str, unusable: frozenset = frozenset()) -> list[str]:
        return self._rec("retain").retain(keep, protect, unusable)

    def close(self, committer: bool) -> None:
        self._rec("close").close(committer)

    def resolve(self, path: str) -> str:
        return self._rec("resolve").resolve(path)

    def is_step(self, path: str) -> bool:
        return self._rec("is_step").is_step(path)

    def list_steps(self, root: str) -> list[tuple[int, str]]:
        return self._rec("list_steps").list_steps(root)

    def read_manifest(self, step_dir: str) -> Manifest:
        return self._rec("read_manifest").read_manifest(step_dir)

    def read_text(self, step_dir: str, name: str) -> str:
        return self._rec("read_text").read_text(step_dir, name)

    def check_files(self, step_dir: str, manifest: Manifest) -> None:
        self._rec("check_files").check_files(step_dir, manifest)

    def verify_files(self, step_dir: str, names: Iterable[str], manifest: Manifest) -> list:
        return self._rec("verify_files").verify_files(step_dir, names, manifest)

    def source(self, step_dir: str) -> ChunkSource:
        return self._rec("source").source(step_dir)


BACKENDS: dict[str, Callable[[str], Storage]] = {
    "posix": PosixStorage,
    "tmpfs": TmpfsStorage,
    "tmpfs-no-staging": lambda root: TmpfsStorage(root, stage_in_place=False),
    "recording": RecordingStorage,
}


def _value(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(*SHAPE, generator=g)


def _shards(t: torch.Tensor) -> list[TensorShard]:
    """Two row halves, as two ranks of a TP2 layout would hold them."""
    h = SHAPE[0] // 2
    return [TensorShard("w", SHAPE, Region((0, 0), (h, SHAPE[1])), t[:h]),
            TensorShard("w", SHAPE, Region((h, 0), (SHAPE[0] - h, SHAPE[1])), t[h:])]


def _crash_before_commit(eng: CheckpointEngine, monkeypatch) -> None:
    """The next commit fails after every data file is written (the storage's commit raises), as a
    process that dies there: nothing cleans up after it (a commit that raises in a live process now
    removes its temp folder; ``test_a_failed_commit_leaves_no_temp_folder...`` covers that)."""
    storage = eng.storage
    monkeypatch.setattr(storage, "abort", lambda tmp_dir: None)
    if isinstance(storage, RecordingStorage):
        storage.fail_commit = True
        return

    def crash(tmp_dir: str, step: int, text: str) -> str:
        raise OSError(f"simulated crash before the commit of step {step}")
    monkeypatch.setattr(storage, "commit", crash)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_conformance_save_commit_latest_retention_load_and_a_crash_before_commit(tmp_path, backend, monkeypatch):
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, storage=BACKENDS[backend](root), keep=2)
    saved = {}
    for step in (1, 2, 3):
        saved[step] = _value(step)
        eng.save(step, _shards(saved[step].clone()), extra={"iteration": step}, rank_state={"seed": step})
        eng.wait()
    # commit + latest + retention
    assert [s for s, _ in commit_mod.list_committed(root)] == [2, 3]
    assert os.path.basename(commit_mod.resolve(root)) == "step_000000003"
    assert not [n for n in os.listdir(root) if n.startswith(commit_mod.TMP_PREFIX)]
    # load: bitwise, with extra and rank state
    back = torch.zeros(*SHAPE)
    res = eng.load(None, [TensorShard("w", SHAPE, Region.full(SHAPE), back)])
    assert torch.equal(back, saved[3]) and res.step == 3
    assert res.extra == {"iteration": 3} and res.rank_state == {"seed": 3}
    # a save that dies between its data files and its commit: no checkpoint
    with monkeypatch.context() as m:
        _crash_before_commit(eng, m)
        eng.save(4, _shards(_value(4)))
        with pytest.raises(AsyncSaveError, match="simulated crash before the commit of step 4"):
            eng.wait()
    if isinstance(eng.storage, RecordingStorage):
        eng.storage.fail_commit = False
    assert [s for s, _ in commit_mod.list_committed(root)] == [2, 3]
    assert not os.path.exists(os.path.join(root, "step_000000004"))
    assert os.path.basename(commit_mod.resolve(root)) == "step_000000003"
    (tmp4,) = [n for n in os.listdir(root) if n.startswith(commit_mod.TMP_PREFIX)]
    assert commit_mod.step_of(tmp4) == 4 and "data_00000.safetensors" in os.listdir(os.path.join(root, tmp4))
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        commit_mod.resolve(os.path.join(root, tmp4))
    back.zero_()
    res = eng.load(None, [TensorShard("w", SHAPE, Region.full(SHAPE), back)])
    assert torch.equal(back, saved[3]) and res.step == 3
    # the next save commits, and its retention sweeps the dead save's temp dir
    saved[5] = _value(5)
    eng.save(5, _shards(saved[5].clone()))
    eng.finalize()
    assert [s for s, _ in commit_mod.list_committed(root)] == [3, 5]
    assert os.path.basename(commit_mod.resolve(root)) == "step_000000005"
    assert not [n for n in os.listdir(root) if n.startswith(commit_mod.TMP_PREFIX)]
    back.zero_()
    res = CheckpointEngine(root, storage=BACKENDS[backend](root)).load(
        None, [TensorShard("w", SHAPE, Region((0, 0), (SHAPE[0] // 2, SHAPE[1])), back[:SHAPE[0] // 2])])
    assert torch.equal(back[:SHAPE[0] // 2], saved[5][:SHAPE[0] // 2]) and res.step == 5


def test_the_engine_drives_a_new_backend_through_the_interface_only(tmp_path):
    """The recording backend sees the whole save and load protocol, in order."""
    root = str(tmp_path / "ck")
    st = RecordingStorage(root)
    eng = CheckpointEngine(root, storage=st, keep=1, async_save=False)
    assert st.calls == ["set_up"]
    t = _value(1)
    eng.save(1, _shards(t), rank_state={"seed": 1})
    # one data file, then the block-CRC table and the rank state (small files); rank 0 commits, every
    # rank hears of it, the committer runs retention
    assert st.calls[1:] == ["temp_dir", "write_data_file", "write_file", "write_file", "commit", "committed",
                            "retain"]
    del st.calls[:]
    back = torch.zeros(*SHAPE)
    res = eng.load(None, [TensorShard("w", SHAPE, Region.full(SHAPE), back)])
    assert torch.equal(back, t) and res.rank_state == {"seed": 1}
    # the rank state comes through the step's source too (checked against the manifest's CRC32)
    assert st.calls == ["resolve", "read_manifest", "check_files", "source"]
    eng.finalize()
    assert st.calls[-1] == "close"


def _count_fsyncs(monkeypatch) -> list[int]:
    fds: list[int] = []
    real = os.fsync

    def counting(fd):
        fds.append(fd)
        return real(fd)
    monkeypatch.setattr(os, "fsync", counting)
    return fds


def _save_and_retire(root: str, storage: Storage) -> None:
    """Three saves with keep=1 (commits, ``latest`` moves, retention deletes or recycles), then finalize."""
    eng = CheckpointEngine(root, storage=storage, keep=1)
    for step in (1, 2, 3):
        eng.save(step, _shards(_value(step)), rank_state={"step": step})
        eng.wait()
    eng.finalize()
    assert [s for s, _ in commit_mod.list_committed(root)] == [3]


@pytest.mark.parametrize("stage_in_place", [True, False])
def test_the_tmpfs_backend_never_calls_fsync(tmp_path, monkeypatch, stage_in_place):
    fds = _count_fsyncs(monkeypatch)
    root = str(tmp_path / "mem")
    _save_and_retire(root, TmpfsStorage(root, stage_in_place=stage_in_place))
    assert fds == []


def test_the_posix_backend_fsyncs_files_and_directories(tmp_path, monkeypatch):
    """Per save: the data file, its CRC table, the rank state, the manifest and the step dir that
    holds it, the root after the rename, ``latest`` and the root after ``latest``: 8 fsyncs."""
    fds = _count_fsyncs(monkeypatch)
    root = str(tmp_path / "ck")
    _save_and_retire(root, PosixStorage(root))
    assert len(fds) == 3 * 8


def test_a_posix_backend_without_sync_says_it_is_not_durable_and_does_not_fsync(tmp_path, monkeypatch):
    fds = _count_fsyncs(monkeypatch)
    root = str(tmp_path / "ck")
    st = PosixStorage(root, sync=False)
    assert st.caps == Capabilities(durable=False, node_local=False, stages_in_place=False, writes_live=True)
    _save_and_retire(root, st)
    assert fds == []


def test_capabilities_of_the_two_backends(tmp_path):
    assert PosixStorage(str(tmp_path)).caps == Capabilities(durable=True, node_local=False, stages_in_place=False,
                                                            writes_live=True)
    assert TmpfsStorage(str(tmp_path)).caps == Capabilities(durable=False, node_local=True, stages_in_place=True)
    # live writes need the O_DIRECT writer (it reads each piece once, under the fence's lock)
    assert PosixStorage(str(tmp_path), direct_io=False).caps.writes_live is False
    assert TmpfsStorage(str(tmp_path), stage_in_place=False).caps.stages_in_place is False
    # O_DIRECT for data files on storage only: on tmpfs it would add a copy and save nothing
    assert PosixStorage(str(tmp_path)).direct_io and not TmpfsStorage(str(tmp_path)).direct_io


def test_the_engine_and_the_writer_leave_file_system_effects_to_the_storage():
    """The seam holds: engine.py and writer.py neither sync, rename, create nor delete anything, nor
    open files, nor commit or retire steps themselves (a new backend then needs no edit of them)."""
    import ast
    import elastor_ds.checkpoint.engine as engine_mod
    import elastor_ds.checkpoint.writer as writer_mod

    effects = {"fsync", "fdatasync", "sync", "rename", "replace", "makedirs", "mkdir", "unlink", "remove", "rmdir",
               "open", "write", "ftruncate", "posix_fallocate"}
    commit_allowed = {"step_dirname"}   # the name of a committed step dir, no effect
    bad = []
    for mod in (engine_mod, writer_mod):
        tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                base, attr = node.value.id, node.attr
                if (base == "os" and attr in effects) or base == "shutil" or \
                        (base == "commit_mod" and attr not in commit_allowed):
                    bad.append(f"{mod.__name__}:{node.lineno} {base}.{attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                bad.append(f"{mod.__name__}:{node.lineno} open()")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n == "shutil" or n.endswith("file_staging") for n in names) and node.col_offset == 0:
                    bad.append(f"{mod.__name__}:{node.lineno} imports {names}")
    assert bad == []


def test_make_root_counts_only_the_folders_its_own_mkdir_made(tmp_path, monkeypatch):
    """A folder another process makes between this call's look and its mkdir is not counted as
    ours (before, the look alone decided, so a rejected start could rmdir another's empty folder)."""
    from elastor_ds.checkpoint.storage import base
    real_mkdir = os.mkdir
    theirs = str(tmp_path / "a")

    def racing_mkdir(path, *a, **k):
        if path == theirs and not os.path.exists(theirs):
            real_mkdir(theirs)   # the other process wins the race for a/
        return real_mkdir(path, *a, **k)
    monkeypatch.setattr(base.os, "mkdir", racing_mkdir)
    root = str(tmp_path / "a" / "b" / "c")
    assert base.make_root(root) == str(tmp_path / "a" / "b")
    monkeypatch.setattr(base.os, "mkdir", real_mkdir)
    assert os.path.isdir(root)
    assert base.make_root(root) is None                  # all there: nothing made
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        (tmp_path / "f").write_text("x")
        base.make_root(str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="a component of the path is a file"):
        base.make_root(str(tmp_path / "f" / "x"))
