"""Review 35: ``CheckpointSession`` used directly from a plain PyTorch loop, as
docs/memory-snapshots.md shows it, and the settings and restore paths such a user meets.

- the documented example runs as written in one process (``comm=LocalComm()``, no
  torch.distributed): it failed in the cross-node set-up (``world_size()`` of an uninitialised
  torch.distributed) and in the session's own groups (``TorchComm.create``); a run SIGKILLed after a
  snapshot resumes from memory, in a new process, to tensors bit-identical to an uninterrupted run;
- an existing checkpoint folder this process may not write is refused when the session is set up
  (it was accepted and the first save, ``interval_steps`` later, failed);
- ``peer_copy_interval_steps`` with ``peer_copies`` 0 is said, not silently accepted;
- a memory ``latest`` that cannot be read is said (warning) when the restore falls back to storage.
- the same example on two gloo processes started with ``torch.multiprocessing``, both SIGKILLed after
  the snapshot of step 8: the relaunch restores it from memory on one process (dp 2 -> 1) and on two,
  bit-identical to the killed ranks' clones;
- snapshots left by a run of another ``checkpoint.dir`` in a kept snapshot folder are not restored
  (they were, silently, into a fresh start).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import free_port
from other_user import as_other_user, nobody_ids

from elastor_ds.checkpoint.settings import parse_checkpoint, parse_memory_snapshot
from elastor_ds.errors import ConfigError

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "memory-snapshots.md"

# the child: the documented example, optionally SIGKILLed right after the snapshot of step KILL_AT
# committed (its tensors cloned to a file first); at the end its tensors go to a file
DRIVER = r'''
import logging, os, signal, sys
import torch
logging.basicConfig(level=logging.INFO)   # the restore's tier and step go to stderr
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example
from elastor_ds.checkpoint.session import CheckpointSession
from elastor_ds.comm.collectives import LocalComm

ck, snap, steps, kill_at, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if kill_at:
    plain = CheckpointSession.maybe_save

    def maybe_save(self):
        got = plain(self)
        if self.state.it == kill_at:
            self.wait()   # this step's snapshot (and any storage save) committed
            torch.save({s.name: s.tensor.clone() for s in self.state.tensors()}, out + ".at_kill")
            os.kill(os.getpid(), signal.SIGKILL)
        return got
    CheckpointSession.maybe_save = maybe_save
state = example.train(0, 1, ck, snap, steps, comm=LocalComm())
torch.save({s.name: s.tensor.clone() for s in state.tensors()}, out)
'''


def documented_example() -> str:
    """The python block after the ``plain-loop-example`` marker of docs/memory-snapshots.md."""
    text = DOC.read_text()
    m = re.search(r"<!-- plain-loop-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/memory-snapshots.md lost its plain-loop example"
    return m.group(1)


WORLD_DRIVER = r'''
import logging, os, signal, sys
import torch
import torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example

ck, snap, steps, kill_at, out, world, port = sys.argv[1:8]
steps, kill_at, world = int(steps), int(kill_at), int(world)


def rank_main(rank):
    import torch.distributed as dist
    from elastor_ds.checkpoint.session import CheckpointSession
    logging.basicConfig(level=logging.INFO)
    if kill_at:
        plain = CheckpointSession.maybe_save

        def maybe_save(self):
            got = plain(self)
            if self.state.it == kill_at:
                self.wait()   # this step's snapshot committed on every rank
                torch.save({s.name: s.tensor.clone() for s in self.state.tensors()}, f"{out}.at_kill{rank}")
                os.kill(os.getpid(), signal.SIGKILL)
            return got
        CheckpointSession.maybe_save = maybe_save
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        state = example.train(rank, world, ck, snap, steps)
    else:
        from elastor_ds.comm.collectives import LocalComm
        state = example.train(0, 1, ck, snap, steps, comm=LocalComm())
    torch.save({s.name: s.tensor.clone() for s in state.tensors()}, f"{out}{rank}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    if world > 1:
        mp.spawn(rank_main, nprocs=world)
    else:
        rank_main(0)
'''


@pytest.fixture
def shm():
    """A private folder on /dev/shm (the node memory the docs name), removed after the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="elastor-review35-session-", dir=base)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _run(tmp_path: Path, *args: object) -> subprocess.CompletedProcess:
    (tmp_path / "example.py").write_text(documented_example())
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in [k for k in env if k.startswith("ELASTOR_")]:
        env.pop(k)
    return subprocess.run([sys.executable, str(tmp_path / "driver.py"), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=240)


def _run_world(tmp_path: Path, ck, snap, steps: int, kill_at: int, out, world: int) -> subprocess.CompletedProcess:
    (tmp_path / "example.py").write_text(documented_example())
    (tmp_path / "world_driver.py").write_text(WORLD_DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in [k for k in env if k.startswith("ELASTOR_")]:
        env.pop(k)
    argv = [ck, snap, steps, kill_at, out, world, free_port()]
    return subprocess.run([sys.executable, str(tmp_path / "world_driver.py"), *map(str, argv)], capture_output=True,
                          text=True, env=env, timeout=300)


def _equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_documented_plain_loop_resumes_from_memory_after_sigkill_bit_identical(tmp_path, shm):
    ref = _run(tmp_path, tmp_path / "ref_ck", shm / "ref_snap", 12, 0, tmp_path / "ref.pt")
    assert ref.returncode == 0, ref.stderr[-3000:]
    ck, snap = tmp_path / "ck", shm / "snap"
    killed = _run(tmp_path, ck, snap, 12, 8, tmp_path / "never.pt")
    assert killed.returncode == -9, killed.stderr[-3000:]
    at_kill = torch.load(str(tmp_path / "never.pt") + ".at_kill")
    # storage holds step 5 only (interval 5); memory holds step 8
    again = _run(tmp_path, ck, snap, 8, 0, tmp_path / "restored.pt")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 8, memory)" in again.stderr
    _equal(torch.load(tmp_path / "restored.pt"), at_kill)   # the restore: what the killed run held
    final = _run(tmp_path, ck, snap, 12, 0, tmp_path / "final.pt")
    assert final.returncode == 0, final.stderr[-3000:]
    _equal(torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "ref.pt"))   # as if never killed
    # a normal end leaves in the node folder the newest snapshot and nothing else of ours
    assert sorted(os.listdir(snap)) == ["local"]
    assert sorted(os.listdir(snap / "local")) == [".storage-root", "latest", "step_000000012"]


def test_two_gloo_processes_killed_restore_from_memory_on_one_and_on_two(tmp_path, shm):
    ck, snap = tmp_path / "ck", shm / "snap"
    killed = _run_world(tmp_path, ck, snap, 12, 8, tmp_path / "k", 2)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    clones = [torch.load(tmp_path / f"k.at_kill{r}") for r in range(2)]
    _equal(clones[0], clones[1])   # no gradient all-reduce in the example: the same seed and data on both ranks
    one = _run_world(tmp_path, ck, snap, 8, 0, tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "(step 8, memory) under tp1.pp1.dp1" in one.stderr and "layout changed" in one.stderr, one.stderr[-3000:]
    _equal(torch.load(tmp_path / "one0"), clones[0])
    # the one-process run saved step 8 to storage at its end (save_final) and snapshotted nothing new
    two = _run_world(tmp_path, ck, snap, 8, 0, tmp_path / "two", 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "(step 8, memory) under tp1.pp1.dp2" in two.stderr, two.stderr[-3000:]
    for r in range(2):
        _equal(torch.load(tmp_path / f"two{r}"), clones[r])
    assert sorted(os.listdir(snap / "local")) == [".storage-root", "latest", "step_000000008"]


class _State:
    """The smallest TrainerState: one tensor, no optimizer."""

    def __init__(self):
        from elastor_ds.checkpoint.shards import full_shard
        self.t = torch.arange(6.0)
        self.shards = [full_shard("w", self.t)]

    def step(self):
        return 1

    def layout(self):
        from elastor_ds.layout import Layout
        return Layout.uniform(1, 1, 1, 1)

    def collect(self):
        from elastor_ds.checkpoint.session import Collected
        return Collected(self.shards, {})

    def shards_for(self, manifest):
        return self.shards

    def restore(self, result, same_layout):
        pass

    def snapshot_bytes(self, comm):
        return 24

    def fence_optimizer(self):
        return None


def test_one_process_without_torch_distributed_needs_only_comm(tmp_path):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    cfg = parse_checkpoint({"dir": str(tmp_path / "ck"), "interval_steps": 1})
    mem = parse_memory_snapshot({"dir": str(tmp_path / "snap"), "peer_copies": 0})
    with pytest.raises(ConfigError, match=r"torch.distributed is not initialised; call "
                                          r"torch.distributed.init_process_group first .* or pass comm=LocalComm\(\)"):
        CheckpointSession(_State(), cfg, mem)
    s = CheckpointSession(_State(), cfg, mem, comm=LocalComm())
    try:
        assert s.maybe_save().step == 1
        s.wait()
    finally:
        s.finalize()
    assert [n for n in os.listdir(tmp_path / "snap" / "local") if n.startswith("step_")] == ["step_000000001"]
    assert os.path.isdir(tmp_path / "ck" / "step_000000001")


@pytest.fixture
def nobody():
    return nobody_ids()


_as_user = as_other_user


def test_read_only_checkpoint_dir_refused_at_set_up(nobody):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    import elastor_ds.checkpoint.engine  # noqa: F401 - imported before the uid changes (torch's lazy imports)
    d = Path(tempfile.mkdtemp(prefix="elastor-review35-ro-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        ro = d / "ro"
        ro.mkdir()
        os.chown(ro, *nobody)
        os.chmod(ro, 0o500)   # nobody's own folder, which nobody may not write

        def child() -> None:
            cfg = parse_checkpoint({"dir": str(ro), "interval_steps": 100})
            try:
                CheckpointSession(_State(), cfg, comm=LocalComm(), policy_comm=LocalComm())
            except ConfigError as e:
                assert str(e) == (f"checkpoint.dir {ro}: this process cannot write there (no write permission for "
                                  f"this user), so the first save would fail; give a directory you may write, or "
                                  f"fix its permissions"), str(e)
            else:
                raise AssertionError("a read-only checkpoint.dir was accepted")
            assert os.listdir(ro) == []
        _as_user(nobody, child)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_peer_copy_interval_without_peer_copies_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.settings"):
        cfg = parse_memory_snapshot({"peer_copies": 0, "peer_copy_interval_steps": 4})
    assert cfg.peer_copies == 0 and cfg.keep == 1
    assert [r.getMessage() for r in caplog.records] == [
        'elastor.memory_snapshot.peer_copy_interval_steps 4 does nothing with peer_copies 0 (no copy is made); set '
        '"peer_copies": 1 to copy one snapshot every 4 steps to the next node, or drop it']
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.settings"):
        parse_memory_snapshot({"peer_copies": 1, "peer_copy_interval_steps": 4})
        parse_memory_snapshot({"peer_copies": 0})
    assert caplog.records == []


def test_unreadable_memory_latest_is_said_and_storage_restored(tmp_path, caplog):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    cfg = parse_checkpoint({"dir": str(tmp_path / "ck"), "interval_steps": 1})
    mem = parse_memory_snapshot({"dir": str(tmp_path / "snap"), "peer_copies": 0})
    st = _State()
    comms = {"comm": LocalComm(), "policy_comm": LocalComm(), "memory_comm": LocalComm(), "cross_node": False}
    s = CheckpointSession(st, cfg, mem, **comms)
    s.maybe_save()
    s.finalize()
    (tmp_path / "snap" / "local" / "latest").write_text("garbage/../x")
    st.t.zero_()
    s = CheckpointSession(st, cfg, mem, **comms)
    with caplog.at_level(logging.INFO):
        res = s.load()
    s.finalize()
    assert res.step == 1 and s.restore["tier"] == "storage"
    assert torch.equal(st.t, torch.arange(6.0))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith(
        f"memory snapshots of step(s) 1 under {tmp_path / 'snap' / 'local'} are not used: "), said
    assert said[0].endswith("restoring from another node's copy or storage instead")


def test_snapshots_of_another_checkpoint_dir_are_not_restored(tmp_path, caplog):
    """A new run (a new checkpoint.dir) that keeps the snapshot folder of an earlier one restored the
    earlier run's weights from memory, silently, into what should have been a fresh start."""
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    mem = parse_memory_snapshot({"dir": str(tmp_path / "snap"), "peer_copies": 0})
    comms = {"comm": LocalComm(), "policy_comm": LocalComm(), "memory_comm": LocalComm(), "cross_node": False}
    run_a = _State()
    s = CheckpointSession(run_a, parse_checkpoint({"dir": str(tmp_path / "a"), "interval_steps": 100}), mem, **comms)
    s.maybe_save()   # a memory snapshot of step 1, nothing in storage (interval 100)
    s.finalize()
    run_b = _State()
    run_b.t.fill_(-1.0)
    s = CheckpointSession(run_b, parse_checkpoint({"dir": str(tmp_path / "b"), "interval_steps": 100}), mem, **comms)
    with caplog.at_level(logging.WARNING):
        assert s.load() is None   # a fresh start: run a's weights stay out
    s.finalize()
    assert torch.equal(run_b.t, torch.full((6,), -1.0))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"memory snapshots of step(s) 1 under {tmp_path / 'snap' / 'local'} are not used: they belong to the run "
        f"whose checkpoint.dir is {tmp_path / 'a'}, not this run's {tmp_path / 'b'}; restoring from storage instead "
        f"(give each run a snapshot folder of its own, or \"load\": \"none\" to start fresh)"]
    # the run the snapshots belong to still restores them
    again = _State()
    again.t.fill_(-1.0)
    s = CheckpointSession(again, parse_checkpoint({"dir": str(tmp_path / "a"), "interval_steps": 100}), mem, **comms)
    res = s.load()
    s.finalize()
    assert res.step == 1 and s.restore["tier"] == "memory" and torch.equal(again.t, torch.arange(6.0))
    assert (tmp_path / "snap" / "local" / ".storage-root").read_text() == f"{tmp_path / 'a'}\n"


def test_a_failed_memory_restore_without_storage_is_an_error_not_a_fresh_start(tmp_path, caplog):
    """Memory holds step 1, storage nothing, and a byte of the snapshot is flipped: the load fails its
    CRC check after writing into the tensor (the unverified bytes are zeroed). Before, the session
    then said "starting fresh" and training went on from that tensor (neither the initial values
    nor the snapshot's); now every rank raises, and the message says how to start fresh."""
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    from elastor_ds.errors import CorruptCheckpointError
    mem = parse_memory_snapshot({"dir": str(tmp_path / "snap"), "peer_copies": 0})
    cfg = parse_checkpoint({"dir": str(tmp_path / "ck"), "interval_steps": 100})   # nothing in storage
    comms = {"comm": LocalComm(), "policy_comm": LocalComm(), "memory_comm": LocalComm(), "cross_node": False}
    st = _State()
    st.t.copy_(torch.arange(6.0) + 100)
    s = CheckpointSession(st, cfg, mem, **comms)
    s.maybe_save()   # the memory snapshot of step 1: 100..105
    s.finalize()
    (data,) = [p for p in (tmp_path / "snap" / "local" / "step_000000001").iterdir() if p.suffix == ".safetensors"]
    raw = bytearray(data.read_bytes())
    raw[-8] ^= 0xFF   # inside the tensor's bytes (the last of the file)
    data.write_bytes(bytes(raw))
    fresh = _State()
    fresh.t.fill_(-1.0)
    s = CheckpointSession(fresh, cfg, mem, **comms)
    with pytest.raises(CorruptCheckpointError, match=r"no usable memory snapshot \(step\(s\) 1 failed their checks") as ei:
        s.load()
    s.finalize()
    assert f"no storage checkpoint under {tmp_path / 'ck'}" in str(ei.value)
    assert f"Remove the unusable snapshots under {tmp_path / 'snap' / 'local'} to start fresh" in str(ei.value)
    # why it must not start fresh: the failed load wrote into the tensor (verified bytes, zeroes)
    assert not torch.equal(fresh.t, torch.full((6,), -1.0)), fresh.t
