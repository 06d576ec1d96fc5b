"""Injected failures: SIGKILL mid-save, a dead peer, a failing writer, flipped and truncated bytes."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import free_port, run_world
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.layout.region import Region
from elastor_ds.checkpoint.verify import verify
from elastor_ds.cli import main as cli_main
from elastor_ds.comm import TorchComm
from elastor_ds.errors import AsyncSaveError, CorruptCheckpointError, FormatVersionError, IncompleteCheckpointError

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "..", "helpers", "save_worker.py")
sys.path.insert(0, os.path.join(HERE, "..", "helpers"))
import save_worker  # noqa: E402


def launch(root: str, world: int, steps: int, mib: int):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, WORKER, root, str(steps), str(mib)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_for_line(proc, prefix: str, timeout: float = 180.0) -> str:
    t0 = time.time()
    while time.time() - t0 < timeout:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}) before {prefix!r}: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"no {prefix!r} within {timeout}s")


def check_root(root: str, world: int, mib: int) -> int:
    """latest points at a committed, verifiable checkpoint whose tensors are exactly its step's."""
    step_dir = commit_mod.resolve(root)
    assert commit_mod.is_committed(step_dir)
    assert verify(step_dir) == []
    man = commit_mod.read_manifest(step_dir)
    step = man.extra["step"]
    for name in ("w", "v"):
        want = save_worker.expected(name, step, world, mib)
        got = torch.empty_like(want)
        CheckpointEngine(root).load(None, [full_shard(name, got)])
        assert torch.equal(got, want), f"{name} of step {step} differs"
    return step


def test_sigkill_whole_job_mid_save_keeps_last_commit(tmp_path):
    rng = random.Random(7)
    steps_seen = []
    mid_save = 0
    for trial in range(5):
        root = str(tmp_path / f"t{trial}")
        procs = launch(root, 2, steps=50, mib=16)
        wait_for_line(procs[0], "COMMITTED 1")
        # "SAVING k" is printed when save() returned: the background writers are in flight
        wait_for_line(procs[0], f"SAVING {rng.randint(2, 4)}")
        time.sleep(rng.uniform(0.0, 0.03))
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        mid_save += any(n.startswith(commit_mod.TMP_PREFIX) for n in os.listdir(root))
        steps_seen.append(check_root(root, 2, 16))
    assert all(s >= 1 for s in steps_seen)
    assert mid_save >= 2, f"only {mid_save} of 5 kills landed during a save; the test lost its teeth"


def _survivor_error(proc, timeout: float) -> tuple[int, float, str]:
    t0 = time.time()
    rc = proc.wait(timeout=timeout)
    return rc, time.time() - t0, proc.stderr.read()


def launch_live(root: str, world: int, liveness_s: float):
    env_extra = {"ELASTOR_WORKER_LIVENESS": str(liveness_s)}
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env_extra)
        procs.append(subprocess.Popen([sys.executable, WORKER, root, "400", "8"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_dead_or_stopped_peer_gives_a_typed_error_within_the_liveness_bound(tmp_path, sig):
    """A peer killed (SIGKILL) or frozen (SIGSTOP) mid-run: the survivor raises PeerFailedError (inside
    AsyncSaveError when the writer notices first) naming the silent rank within the configured
    liveness bound (3 s here; the gloo timeout is 120 s), and the last commit stays loadable."""
    root = str(tmp_path / "ck")
    procs = launch_live(root, 2, 3.0)
    try:
        wait_for_line(procs[0], "COMMITTED 2")
        procs[1].send_signal(getattr(signal, sig))
        rc, elapsed, err = _survivor_error(procs[0], 90)
        assert rc != 0, "survivor must fail, not continue silently"
        assert elapsed < 25, f"survivor took {elapsed:.1f}s to notice (liveness bound 3 s, gloo timeout 120 s)"
        assert "PeerFailedError" in err, err[-2000:]
        if sig == "SIGSTOP":
            assert "rank(s) [1] stopped answering" in err, err[-2000:]
        check_root(root, 2, 8)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)


def _rank_0_writes_first(rank: int, root: str) -> None:
    """Order the two ranks' writes of the next save on the full tmpfs: rank 1 starts writing only
    after rank 0's files are written, so only rank 1 can meet ENOSPC (otherwise rank 0's small file
    races rank 1's 2 MiB for the last free pages and either rank may fail)."""
    from elastor_ds.checkpoint import engine as engine_mod

    marker = os.path.join(os.path.dirname(os.path.dirname(root)), "rank0_wrote")  # outside the tmpfs
    original = engine_mod.write_rank_files

    def ordered(*args, **kwargs):
        if rank == 1:
            t_end = time.time() + 30
            while not os.path.exists(marker):
                assert time.time() < t_end, "rank 0 never finished writing"
                time.sleep(0.01)
        out = original(*args, **kwargs)
        if rank == 0:
            open(marker, "w").close()
        return out
    engine_mod.write_rank_files = ordered


def _failing_writer(rank: int, world: int, root: str, how: str) -> None:
    """Rank 1's write of step 2 fails for real: RLIMIT_FSIZE (EFBIG from write(2)) or a full tmpfs
    (ENOSPC); every rank raises AsyncSaveError naming rank 1 and the OS error; nothing half-written."""
    import resource

    eng = CheckpointEngine(root, TorchComm.create(30, liveness_s=10), keep=2)
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.layout.region import Region

    def shards(rows1: int):  # rank 1 holds rows1 rows of 64 floats, rank 0 holds 8
        rows = (8, rows1)
        t = torch.full((rows[rank], 64), float(rank))
        return [TensorShard("t", (8 + rows1, 64), Region((0 if rank == 0 else 8, 0), (rows[rank], 64)), t)]
    eng.save(1, shards(8))
    eng.wait()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1 and how == "efbig":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) then fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    if how == "enospc":
        _rank_0_writes_first(rank, root)
    t0 = time.time()
    eng.save(2, shards(8192))  # rank 1 writes 2 MiB: over the limit / more than the tmpfs holds
    want = "File too large" if how == "efbig" else "No space left"
    with pytest.raises(AsyncSaveError, match=f"rank 1: OSError: .*{want}") as ei:
        eng.wait()
    assert [f.rank for f in ei.value.failures] == [1] and ei.value.failures[0].type_name == "OSError"
    assert time.time() - t0 < 20
    if rank == 1 and how == "efbig":
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    dist.barrier()
    assert os.path.basename(commit_mod.resolve(root)) == "step_000000001"
    assert not [n for n in os.listdir(root) if n.startswith(commit_mod.TMP_PREFIX)]
    eng.save(3, shards(8))  # the engine keeps working after a failed save
    eng.wait()
    assert os.path.basename(commit_mod.resolve(root)) == "step_000000003"


def test_writer_failure_raises_on_every_rank_efbig(tmp_path):
    run_world(_failing_writer, 2, str(tmp_path / "ck"), "efbig", timeout_s=60)


def test_writer_failure_raises_on_every_rank_enospc(tiny_tmpfs):
    run_world(_failing_writer, 2, str(tiny_tmpfs / "ck"), "enospc", timeout_s=60)


def _make_two_steps(root: str):
    eng = CheckpointEngine(root, keep=3)
    a = torch.randn(300, 40)
    eng.save(1, [full_shard("a", a)], extra={"step": 1})
    eng.wait()
    b = a + 1
    eng.save(2, [full_shard("a", b)], extra={"step": 2})
    eng.wait()
    return a, b


def _data_file(root: str) -> str:
    d = commit_mod.resolve(root)
    return os.path.join(d, "data_00000.safetensors")


def test_flipped_byte_detected_named_and_fallback(tmp_path, capsys):
    root = str(tmp_path / "ck")
    a, b = _make_two_steps(root)
    path = _data_file(root)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    assert cli_main(["verify", root]) == 1
    assert "data_00000.safetensors" in capsys.readouterr().err
    got = torch.empty_like(a)
    with pytest.raises(CorruptCheckpointError, match="data_00000.safetensors"):
        CheckpointEngine(root).load(None, [full_shard("a", got)])
    res = CheckpointEngine(root).load(None, [full_shard("a", got)], fallback=True)
    assert res.step == 1 and res.fell_back and torch.equal(got, a)


def test_retention_after_a_fallback_keeps_the_good_step_not_the_corrupt_one(tmp_path):
    """QA round 8, F8.9: a resume fell back past a corrupt step 6 to step 3 (keep 2), trained on and
    saved step 8; retention then deleted the good step 3 and kept the corrupt 6, so one more damaged
    step would leave no good checkpoint. A step a load fell back past no longer counts among those
    kept: after step 8, steps 3 and 8 are the two kept (6 stays, newer than 3, for a look); after
    step 10, 8 and 10, and 3 and 6 go."""
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, keep=2)
    vals = {}
    for step in (3, 6):
        vals[step] = torch.full((256, 64), float(step))
        eng.save(step, [full_shard("a", vals[step])])
    eng.finalize()
    six = os.path.join(root, "step_000000006")
    data = os.path.join(six, next(f for f in os.listdir(six) if f.startswith("data_") and f.endswith(".safetensors")))
    with open(data, "r+b") as f:   # one flipped byte in step 6's tensor bytes
        f.seek(os.path.getsize(data) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    eng = CheckpointEngine(root, keep=2)
    got = torch.empty(256, 64)
    res = eng.load(None, [full_shard("a", got)], fallback=True)
    assert res.step == 3 and res.fell_back and torch.equal(got, vals[3])
    eng.save(8, [full_shard("a", got + 5)])
    eng.wait()
    assert [s for s, _ in commit_mod.list_committed(root)] == [3, 6, 8]
    eng.save(10, [full_shard("a", got + 7)])
    eng.finalize()
    assert [s for s, _ in commit_mod.list_committed(root)] == [8, 10]


def test_truncated_file_detected(tmp_path, capsys):
    root = str(tmp_path / "ck")
    _make_two_steps(root)
    path = _data_file(root)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert cli_main(["verify", root]) == 1
    err = capsys.readouterr().err
    assert "data_00000.safetensors" in err and "truncated" in err
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        CheckpointEngine(root).load(None, [full_shard("a", torch.empty(300, 40))])


def test_uncommitted_and_unknown_version(tmp_path):
    root = str(tmp_path / "ck")
    _make_two_steps(root)
    d = commit_mod.resolve(root)
    man = json.load(open(os.path.join(d, "manifest.json")))
    man["format_version"] = 99
    json.dump(man, open(os.path.join(d, "manifest.json"), "w"))
    with pytest.raises(FormatVersionError, match="99"):
        commit_mod.read_manifest(d)
    os.remove(os.path.join(d, "manifest.json"))
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        commit_mod.resolve(root)
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        commit_mod.resolve(d)
    # with fallback the previous committed step loads
    got = torch.empty(300, 40)
    res = CheckpointEngine(root).load(None, [full_shard("a", got)], fallback=True)
    assert res.step == 1


@pytest.mark.parametrize("edit, says", [
    (('"F32"', '"F16"'), "hold 19200 bytes, but a F16 tensor of shape [150, 32] has 9600"),
    (('"shape":[150,32]', '"shape":[150,16]'), "but a F32 tensor of shape [150, 16] has 9600"),
    (('"data_offsets":[0,19200]', '"data_offsets":[0,19196]'), "hold 19196 bytes"),
    (('"a#0,0"', '"b#0,0"'), "has no entry 'a#0,0', which the manifest names"),
    (('"a#150,0"', '"a#150,1"'), "has no entry 'a#150,0'"),
])
def test_verify_without_checksums_checks_headers_as_safetensors_and_the_manifest_do(tmp_path, capsys, edit, says):
    """QA round 8, F3: an edited safetensors header of the same length (a dtype, a shape, an offset,
    a tensor's name) passed ``verify --no-checksums`` although safetensors' own loader refuses the
    first three ("invalid shape, data type, or offset") and the last reads as another tensor. Each
    is now named, exit 1, and the full verify names it too (not only as a CRC mismatch)."""
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, keep=1)
    eng.save(1, [TensorShard("a", (300, 40), Region((0, 0), (150, 32)), torch.randn(150, 32)),
                 TensorShard("a", (300, 40), Region((150, 0), (150, 40)), torch.randn(150, 40)),
                 TensorShard("a", (300, 40), Region((0, 32), (150, 8)), torch.randn(150, 8))])
    eng.finalize()
    path = _data_file(root)
    from safetensors import safe_open
    with safe_open(path, "pt") as f:   # the untouched file opens (the oracle: safetensors itself)
        assert sorted(f.keys()) == ["a#0,0", "a#0,32", "a#150,0"]
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode()
    compact = header.replace(" ", "")
    assert edit[0] in compact, compact[:400]
    new = compact.replace(edit[0], edit[1], 1)
    new = new + " " * (n - len(new))   # the same header length: only the edit differs
    raw[8:8 + n] = new.encode()
    with open(path, "wb") as f:
        f.write(raw)
    assert cli_main(["verify", "--no-checksums", root]) == 1
    err = capsys.readouterr().err
    assert says in err and "data_00000.safetensors" in err, err
    assert cli_main(["verify", root]) == 1
    assert says in capsys.readouterr().err


def test_verify_notes_entries_the_manifest_does_not_list(tmp_path, capsys):
    """QA round 8, F8.7: a step folder with extra files or folders verified OK without a word (they
    are never read, but a merged or hand-edited folder is worth a look). Still exit 0, with a note."""
    root = str(tmp_path / "ck")
    _make_two_steps(root)
    assert cli_main(["verify", root]) == 0
    assert "note:" not in capsys.readouterr().err   # a checkpoint as written: nothing to note
    step = commit_mod.resolve(root)
    with open(os.path.join(step, "extra.bin"), "wb") as f:
        f.write(b"x")
    os.mkdir(os.path.join(step, "extradir"))
    assert cli_main(["verify", root]) == 0
    err = capsys.readouterr().err
    assert "note: 2 entries" in err and "extra.bin, extradir" in err and "never read" in err, err
