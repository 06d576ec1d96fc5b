"""The memory-snapshot fast path: staging into the mapped data file, lean results, rank 0's template.

Oracles: the storage path's own writer and manifest builder (``write_rank_files`` +
``build_manifest``, a separate code path) for the template's manifest; the ``safetensors`` library
for the data files; the tensors saved for the loads; the kernel's inode numbers for file reuse.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.planning.manifest import Manifest
from elastor_ds.checkpoint.planning.save_plan import ShardMeta, plan_save
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.checkpoint.storage import PosixStorage, TmpfsStorage
from elastor_ds.checkpoint.verify import verify
from elastor_ds.checkpoint.writer import ManifestTemplate, build_manifest, write_rank_files
from elastor_ds.layout.region import Region


def _metas_three_ranks():
    """Rank 0/1 split w's rows (TP2 rows), rank 2 holds all of w (another replica), every rank holds
    the bias (replicated), rank 1 alone an int64 counter, rank 2 alone a bf16 tensor; an empty
    region nowhere (the plan must place every byte once)."""
    w = (96, 40)
    return [
        [ShardMeta("w", w, "float32", Region((0, 0), (48, 40))), ShardMeta("b", (40,), "float32", Region.full((40,)))],
        [ShardMeta("w", w, "float32", Region((48, 0), (48, 40))), ShardMeta("b", (40,), "float32", Region.full((40,))),
         ShardMeta("n", (3,), "int64", Region.full((3,)))],
        [ShardMeta("w", w, "float32", Region.full(w)), ShardMeta("b", (40,), "float32", Region.full((40,))),
         ShardMeta("h", (8, 9), "bfloat16", Region.full((8, 9)))],
    ]


@pytest.mark.parametrize("block_size", [4096, 64 * 1024, 100])
def test_template_manifest_equals_the_storage_paths_manifest(tmp_path, block_size):
    plan = plan_save(_metas_three_ranks())
    g = torch.Generator().manual_seed(block_size)
    tmpl = ManifestTemplate(plan, block_size)
    for step in (5, 6):   # the template is rendered twice: values of the first must not leak into the second
        full, lean = [], []
        for r, items in enumerate(plan.items):
            views = [torch.randint(0, 256, (it.nbytes,), dtype=torch.uint8, generator=g).numpy() for it in items]
            state = {"rng": [r, step]}
            res = write_rank_files(r, items, views, str(tmp_path / f"s{step}"), state,
                                   PosixStorage(str(tmp_path), sync=False), block_size=block_size)
            full.append(res)
            lean.append({"rank": r, "crcs": [c[5] for c in res["chunks"]], "files": res["files"],
                         "state": res["state"]})
        extra = {"global_steps": step, "lr": 0.1 * step}
        want = build_manifest(step, plan, full, extra, {"m": 1}, {"l": [1, 2]}).to_json()
        text = tmpl.render(step, lean, extra, {"m": 1}, {"l": [1, 2]})
        got = json.loads(text)
        assert got.pop("checksum").startswith("sha256:")
        got.pop("created_unix")
        want.pop("created_unix")
        assert got == want
        man = Manifest.loads(text, where="rendered")   # schema and checksum validation
        assert man.step == step and man.files == Manifest.from_json(json.loads(text)).files


def test_template_rejects_a_result_that_does_not_match_the_plan(tmp_path):
    from elastor_ds.errors import CheckpointError
    plan = plan_save(_metas_three_ranks())
    tmpl = ManifestTemplate(plan, 4096)
    lean = []
    for r, items in enumerate(plan.items):
        views = [bytes(it.nbytes) for it in items]
        res = write_rank_files(r, items, views, str(tmp_path), None, PosixStorage(str(tmp_path), sync=False))
        lean.append({"rank": r, "crcs": [c[5] for c in res["chunks"]], "files": res["files"], "state": None})
    lean[1]["crcs"] = lean[1]["crcs"][:-1]
    with pytest.raises(CheckpointError, match="rank 1's snapshot result does not match the save plan"):
        tmpl.render(1, lean, {}, None, None)


def _data_inode(root: str, step: int) -> int:
    return os.stat(os.path.join(root, commit_mod.step_dirname(step), "data_00000.safetensors")).st_ino


def test_file_staging_reuses_two_files_and_never_writes_a_committed_one(tmp_path):
    """keep=1: after warm-up every snapshot goes into one of two files, through one of two
    mappings made once; while save N+1 runs, step N (the newest committed) is intact and loads
    the values of step N exactly; every committed step reads back through the safetensors library."""
    root = str(tmp_path / "mem")
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, optimistic_plan=True, block_size=64 * 1024)
    assert eng.storage.files is not None
    w = torch.randn(512, 300)          # 600 KiB: 10 blocks of 64 KiB, the last one short
    flat = torch.randn(1000)
    shards = [full_shard("w", w), TensorShard("f", (1000,), Region((0,), (1000,)), flat)]
    import threading
    gate = threading.Event()
    write_and_commit = eng._write_and_commit

    def gated(*args):   # the writer starts only when the test lets it
        gate.wait(60)
        write_and_commit(*args)
    eng._write_and_commit = gated
    inodes, values = [], {}
    for step in range(1, 8):
        w.add_(1.0)
        flat.mul_(-1.0)
        values[step] = (w.clone(), flat.clone())
        gate.clear()
        eng.save(step, shards, rank_state={"step": step})
        if step > 1:   # step's snapshot copy is done, its writer held: the newest committed step is untouched
            prev = os.path.join(root, commit_mod.step_dirname(step - 1))
            assert verify(prev) == []
            loaded = load_file(os.path.join(prev, "data_00000.safetensors"))
            assert torch.equal(loaded["w#0,0"], values[step - 1][0]) and torch.equal(loaded["f#0"], values[step - 1][1])
        gate.set()
        eng.wait()
        inodes.append(_data_inode(root, step))
    assert len(set(inodes)) == 2 and inodes[2:] == inodes[:2] * 2 + inodes[:1]   # A B A B A B A
    assert eng.storage.files.new_files == 2 and eng.storage.files.new_mappings == 2
    last = os.path.join(root, commit_mod.step_dirname(7))
    man = commit_mod.read_manifest(last)
    assert {c.blocks.size for t in man.tensors.values() for c in t.chunks} == {64 * 1024}
    out_w, out_f = torch.zeros_like(w), torch.zeros_like(flat)
    # a reshard: column halves of w, read against the 64 KiB block CRCs
    left = torch.zeros(512, 150)
    eng.load(None, [TensorShard("w", (512, 300), Region((0, 0), (512, 150)), left),
                    TensorShard("w", (512, 300), Region((0, 150), (512, 150)), out_w[:, 150:]),
                    full_shard("f", out_f)])
    assert torch.equal(left, values[7][0][:, :150]) and torch.equal(out_w[:, 150:], values[7][0][:, 150:])
    assert torch.equal(out_f, values[7][1])
    eng.finalize()
    del loaded   # the safetensors library maps the file it loads: its tensors would show up below
    with open("/proc/self/maps") as f:   # the kernel's list: no mapping of a snapshot file is left
        assert not [ln for ln in f if root in ln]


def test_file_staging_follows_a_plan_change_and_a_flipped_byte_is_caught(tmp_path):
    root = str(tmp_path / "mem")
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, optimistic_plan=True)
    a = torch.randn(200, 64)
    eng.save(1, [full_shard("a", a)])
    eng.wait()
    b = torch.randn(3000)               # a new plan: another size, the retired file is cut and re-mapped
    eng.save(2, [full_shard("b", b)])   # dropped (optimistic plan: the shard list changed)
    eng.wait()
    assert eng.saves_dropped == 1
    eng.save(3, [full_shard("b", b)])
    eng.wait()
    eng.save(4, [full_shard("b", b * 2)])
    eng.wait()
    d4 = os.path.join(root, commit_mod.step_dirname(4))
    assert torch.equal(load_file(os.path.join(d4, "data_00000.safetensors"))["b#0"], b * 2)
    assert verify(d4) == []
    path = os.path.join(d4, "data_00000.safetensors")
    with open(path, "r+b") as f:        # flip one byte of the data section on "disk" (tmpfs)
        f.seek(os.path.getsize(path) - 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    assert verify(d4) != []
    from elastor_ds.errors import RanksFailedError
    with pytest.raises(RanksFailedError, match="(?i)crc"):
        eng.load(None, [full_shard("b", torch.zeros(3000))])
    eng.finalize()


FULL_TMPFS_CHILD = textwrap.dedent("""
    import os, sys, torch
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    from elastor_ds.checkpoint import commit as commit_mod
    from elastor_ds.checkpoint.storage import TmpfsStorage
    from elastor_ds.errors import AsyncSaveError
    root = sys.argv[1]
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, optimistic_plan=True)
    eng.save(1, [full_shard("t", torch.ones(1000))])
    eng.wait()
    big = [full_shard("t", torch.ones(1000)), full_shard("big", torch.ones(512, 1024))]  # 2 MiB > the tmpfs
    eng._plan = None                     # plan again (not a dropped save): this save must fail cleanly
    eng.save(2, big)
    try:
        eng.wait()
        print("NO ERROR")
    except AsyncSaveError as e:
        print("ERROR:", e)
    print("COMMITTED:", [s for s, _ in commit_mod.list_committed(root)])
    eng._plan = None
    eng.save(3, [full_shard("t", torch.full((1000,), 3.0))])
    eng.wait()
    print("COMMITTED:", [s for s, _ in commit_mod.list_committed(root)])
""")


def test_a_snapshot_into_a_full_tmpfs_is_an_error_on_the_save_not_a_sigbus(tiny_tmpfs):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", FULL_TMPFS_CHILD, str(tiny_tmpfs / "mem")], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0, p.stderr[-2000:]        # a SIGBUS would be -7
    lines = p.stdout.splitlines()
    err = next(ln for ln in lines if ln.startswith(("ERROR:", "NO ERROR")))
    assert err.startswith("ERROR:") and "No space left on device" in err, p.stdout
    assert lines[-2] == "COMMITTED: [1]" and lines[-1] == "COMMITTED: [3]", p.stdout


def test_which_engines_stage_into_files(tmp_path):
    """Storage roots keep the staging buffer (their files are written and fsynced); node-local roots
    stage into the mapped file unless told not to; a block size must be positive; a storage rooted
    elsewhere than the engine is refused."""
    from elastor_ds.errors import ConfigError
    a, b, c = (str(tmp_path / n) for n in "abc")
    assert not CheckpointEngine(a).in_place and not hasattr(CheckpointEngine(a).storage, "files")
    eng_b = CheckpointEngine(b, storage=TmpfsStorage(b))
    assert eng_b.in_place and eng_b.storage.files is not None
    eng_c = CheckpointEngine(c, storage=TmpfsStorage(c, stage_in_place=False))
    assert not eng_c.in_place and eng_c.storage.files is None
    with pytest.raises(ValueError, match="block_size=0"):
        CheckpointEngine(str(tmp_path / "d"), block_size=0)
    with pytest.raises(ConfigError, match="rooted at"):
        CheckpointEngine(str(tmp_path / "e"), storage=TmpfsStorage(a))


def _two_rank_failure(rank: int, world: int, root: str) -> None:
    import errno

    from elastor_ds.checkpoint.snapshot import file_staging
    from elastor_ds.comm import TorchComm
    from elastor_ds.errors import AsyncSaveError

    eng = CheckpointEngine(root, TorchComm.create(60, liveness_s=20), TmpfsStorage(root), keep=1,
                           optimistic_plan=True)
    t = torch.full((64, 64), float(rank))
    shards = [TensorShard("t", (128, 64), Region((64 * rank, 0), (64, 64)), t)]
    eng.save(1, shards)
    eng.wait()
    real_take = file_staging.FileStaging.take
    if rank == 1:   # rank 1's tmpfs is "full" for step 2 only
        def full(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        file_staging.FileStaging.take = full
    eng.save(2, shards)
    try:
        eng.wait()
        raise AssertionError("step 2 committed although rank 1 could not stage it")
    except AsyncSaveError as e:
        assert "rank 1" in str(e) and "No space left on device" in str(e), str(e)
    file_staging.FileStaging.take = real_take
    assert [s for s, _ in commit_mod.list_committed(root)] == [1]
    t.add_(10.0)
    eng.save(3, shards)
    eng.wait()
    if rank == 0:   # rank 0 applied retention before its wait() returned; rank 1 may still see step 1
        assert [s for s, _ in commit_mod.list_committed(root)] == [3]
    back = torch.zeros(128, 64)
    eng.load(None, [full_shard("t", back)])
    assert torch.equal(back[:64], torch.full((64, 64), 10.0)) and torch.equal(back[64:], torch.full((64, 64), 11.0))
    eng.finalize()


def test_two_ranks_a_staging_failure_on_one_rank_fails_the_snapshot_on_both(tmp_path):
    """The int-row outcome exchange: rank 1's ENOSPC while staging reaches rank 0 as well (through
    the object route errors take), nothing is committed for that step, the next one commits and
    reads back exactly on both ranks."""
    from dist_utils import run_world
    run_world(_two_rank_failure, 2, str(tmp_path / "mem"), timeout_s=90)


def test_retention_keeps_only_this_jobs_ranks_files_for_reuse(tmp_path):
    """After a shrink (here: a 1-rank job on a root a 4-rank job used), the spare data files of the
    ranks that are gone are deleted by retention, not kept in ``.recycle`` holding memory."""
    root = tmp_path / "mem"
    spare = root / ".recycle"
    spare.mkdir(parents=True)
    for r in (0, 3):
        (spare / f"data_{r:05d}.safetensors").write_bytes(b"x" * 4096)
    eng = CheckpointEngine(str(root), storage=TmpfsStorage(str(root)), keep=1, optimistic_plan=True)
    t = torch.randn(100, 10)
    for step in (1, 2, 3):
        eng.save(step, [full_shard("t", t)])
        eng.wait()
    assert sorted(os.listdir(spare)) == ["data_00000.safetensors"]   # step 2's file, retired by step 3
    eng.finalize()


def _different_steps(rank: int, world: int, root: str, kind: str) -> None:
    from elastor_ds.comm import TorchComm
    from elastor_ds.errors import AsyncSaveError

    storage = TmpfsStorage(root) if kind == "tmpfs" else None
    eng = CheckpointEngine(root, TorchComm.create(60, liveness_s=20), storage, keep=2)
    t = torch.full((64, 64), float(rank))
    shards = [TensorShard("t", (128, 64), Region((64 * rank, 0), (64, 64)), t)]
    for step in (1, 2):
        eng.save(step, shards)
        eng.wait()
    eng.save(5 + rank, shards)   # the caller's bug: rank 0 says 5, rank 1 says 6
    try:
        eng.wait()
        raise AssertionError("a save whose ranks disagree on the step was committed")
    except AsyncSaveError as e:
        assert "the ranks saved different steps in one save (rank 0: 5, rank 1: 6)" in str(e), str(e)
    if rank == 0:
        assert [s for s, _ in commit_mod.list_committed(root)] == [1, 2]
        assert commit_mod.resolve(root).endswith(commit_mod.step_dirname(2))
        assert verify(commit_mod.resolve(root)) == []
    eng.save(7, shards)   # the next agreed save commits
    eng.wait()
    back = torch.zeros(128, 64)
    eng.load(None, [full_shard("t", back)])
    assert torch.equal(back[:64], torch.zeros(64, 64)) and torch.equal(back[64:], torch.ones(64, 64))
    eng.finalize()


@pytest.mark.parametrize("kind", ["posix", "tmpfs"])
def test_ranks_that_save_different_steps_commit_nothing(tmp_path, kind):
    """QA round 5, Q5-1: rank 0 saving step 5 while rank 1 saved step 6 committed step 5 without
    rank 1's files (they sat in another temp dir), moved ``latest`` to it and told both ranks the
    save succeeded; retention had dropped a good step. Now the outcome exchange carries each rank's
    step: an AsyncSaveError naming both steps on every rank, nothing committed, ``latest`` and the
    good steps kept, and the next agreed save commits and reads back."""
    from dist_utils import run_world
    run_world(_different_steps, 2, str(tmp_path / "ck"), kind, timeout_s=120)


def test_a_failed_commit_leaves_no_temp_folder_and_the_next_snapshot_commits(tmp_path, monkeypatch):
    """QA round 9, N1: on a full tmpfs the commit itself failed (the manifest or ``latest`` could not
    be written); that save's temp folder stayed, and retention removes only temp folders older than
    the newest committed step, so each failed commit kept its data files: after the filler was
    removed the tmpfs stayed full and snapshots never came back. Now the failed save's folder goes at
    once and the error is the memory tier's SnapshotSpaceError (``latest``'s temp file: below)."""
    import errno

    from elastor_ds.checkpoint.storage import tmpfs as tmpfs_mod
    from elastor_ds.errors import AsyncSaveError, SnapshotSpaceError
    root = str(tmp_path / "mem")
    eng = CheckpointEngine(root, storage=TmpfsStorage(root), keep=1, optimistic_plan=True)
    t = torch.randn(256, 64)
    eng.save(1, [full_shard("t", t)])
    eng.wait()
    real = tmpfs_mod.commit_mod.commit_text
    calls = []

    def full(root_, tmp_dir, step, text, sync=True):
        calls.append(tmp_dir)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tmpfs_mod.commit_mod, "commit_text", full)
    for step in (2, 3):
        eng.save(step, [full_shard("t", t + step)])
        with pytest.raises(AsyncSaveError) as ei:
            eng.wait()
        assert ei.value.all_are(SnapshotSpaceError), str(ei.value)
        assert not os.path.exists(calls[-1])   # the failed save's folder is gone
    monkeypatch.setattr(tmpfs_mod.commit_mod, "commit_text", real)
    eng.save(4, [full_shard("t", t + 4)])
    eng.wait()
    assert [s for s, _ in commit_mod.list_committed(root)] == [4]
    left = [n for n in os.listdir(root) if n.startswith(".tmp_step_")]
    assert left == [], left
    eng.finalize()


def test_atomic_write_text_leaves_no_temp_file_and_never_follows_a_link(tmp_path, monkeypatch):
    from elastor_ds.checkpoint import fileformat
    target = tmp_path / "latest"
    real_replace = os.replace

    def failing(a, b):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fileformat.os, "replace", failing)
    with pytest.raises(OSError):
        fileformat.atomic_write_text(str(target), "step_000000001\n", sync=False)
    monkeypatch.setattr(fileformat.os, "replace", real_replace)
    assert os.listdir(tmp_path) == []
    elsewhere = tmp_path / "elsewhere"
    os.symlink(elsewhere, f"{target}.tmp.{os.getpid()}")   # planted under the temp name
    with pytest.raises(OSError):
        fileformat.atomic_write_text(str(target), "step_000000001\n", sync=False)
    assert not elsewhere.exists() and not target.exists()


def _merge_ranks(extra: dict, values: list) -> dict:
    return {**extra, "by_rank": values}


def _rank_extra_worker(rank: int, world: int, root: str, kind: str) -> None:
    from elastor_ds.checkpoint.engine import RankExtra
    from elastor_ds.comm import TorchComm
    from elastor_ds.errors import AsyncSaveError

    storage = TmpfsStorage(root) if kind == "tmpfs" else PosixStorage(root, sync=False)
    eng = CheckpointEngine(root, TorchComm.create(60, liveness_s=20), storage, keep=3)
    t = torch.full((64, 64), float(rank))
    shards = [TensorShard("t", (128, 64), Region((64 * rank, 0), (64, 64)), t)]
    for step in (1, 2):
        # a tuple and a tensor: the writer's gather carries them as JSON (a list, a number)
        eng.save(step, shards, extra={"step": step},
                 rank_extra=RankExtra({"rank": rank, "pair": (rank, step), "x": torch.tensor(2.5 * rank)}, _merge_ranks))
        eng.wait()
    man = commit_mod.read_manifest(commit_mod.resolve(root))
    assert man.extra == {"step": 2, "by_rank": [{"rank": r, "pair": [r, 2], "x": 2.5 * r} for r in range(world)]}, man.extra

    def broken(extra, values):
        raise ValueError("merge failed")
    eng.save(3, shards, extra={"step": 3}, rank_extra=RankExtra({"rank": rank}, broken))
    try:
        eng.wait()
        raise AssertionError("a save whose merge failed was committed")
    except AsyncSaveError as e:
        assert "merge failed" in str(e), str(e)
    assert commit_mod.resolve(root).endswith(commit_mod.step_dirname(2))
    eng.save(4, shards, extra={"step": 4})   # without: extra as given
    eng.wait()
    assert commit_mod.read_manifest(commit_mod.resolve(root)).extra == {"step": 4}
    eng.finalize()


@pytest.mark.parametrize("kind", ["posix", "tmpfs"])
def test_each_ranks_part_of_extra_is_gathered_by_the_writer(tmp_path, kind):
    """``RankExtra``: what differs per rank (a DeepSpeed pipeline stage's param groups) reaches rank
    0's manifest through the writer's gather (no collective on the training thread); a merge that
    raises fails that save on every rank and commits nothing, and the next save commits."""
    from dist_utils import run_world
    run_world(_rank_extra_worker, 2, str(tmp_path / "ck"), kind, timeout_s=120)
