"""Review 35: the plain-PyTorch example of docs/memory-snapshots.md on two gloo processes started
with ``torch.multiprocessing`` (as a user would): both ranks SIGKILLed right after the snapshot of
step 8 committed; the relaunch restores that snapshot from memory, on one process (the layout
changes: dp 2 -> 1) and on two again, to tensors bit-identical to clones the killed ranks took."""
from __future__ import annotations

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

pytestmark = pytest.mark.timeout(400)
REPO = Path(__file__).resolve().parents[2]


def documented_example() -> str:
    """The python block after the ``plain-loop-example`` marker of docs/memory-snapshots.md."""
    text = (REPO / "docs" / "memory-snapshots.md").read_text()
    m = re.search(r"<!-- plain-loop-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/memory-snapshots.md lost its plain-loop example"
    return m.group(1)

DRIVER = r'''
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
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="elastor-review35-session-", dir=base)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _run(tmp_path: Path, ck, snap, steps: int, kill_at: int, out, world: int) -> subprocess.CompletedProcess:
    (tmp_path / "example.py").write_text(documented_example())
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in [k for k in env if k.startswith("ELASTOR_")]:
        env.pop(k)
    return subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(ck), str(snap), str(steps), str(kill_at),
                           str(out), str(world), str(free_port())], capture_output=True, text=True, env=env,
                          timeout=300)


def _equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_two_gloo_processes_killed_restore_from_memory_on_one_and_on_two(tmp_path, shm):
    ck, snap = tmp_path / "ck", shm / "snap"
    killed = _run(tmp_path, ck, snap, 12, 8, tmp_path / "k", 2)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    clones = [torch.load(tmp_path / f"k.at_kill{r}") for r in range(2)]
    _equal(clones[0], clones[1])   # no gradient all-reduce in the example: the same seed and data on both ranks
    one = _run(tmp_path, ck, snap, 8, 0, tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "(step 8, memory) under tp1.pp1.dp1" in one.stderr and "layout changed" in one.stderr, one.stderr[-3000:]
    _equal(torch.load(tmp_path / "one0"), clones[0])
    # the one-process run saved step 8 to storage at its end (save_final) and snapshotted nothing new
    two = _run(tmp_path, ck, snap, 8, 0, tmp_path / "two", 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "(step 8, memory) under tp1.pp1.dp2" in two.stderr, two.stderr[-3000:]
    for r in range(2):
        _equal(torch.load(tmp_path / f"two{r}"), clones[r])
    assert sorted(os.listdir(snap / "local")) == ["latest", "step_000000008"]
