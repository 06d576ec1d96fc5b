"""Data pipeline: layout-independent order, exact resume without re-tokenising, replica slices."""
from __future__ import annotations

import numpy as np
import pytest

from elastor_ds.data import CharTokenizer, PrefetchLoader, RecordDataset, replica_sample_indices, write_synthetic_corpus
from elastor_ds.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_synthetic_corpus(str(tmp_path_factory.mktemp("d") / "c.jsonl"), num_records=300, seed=3)


def test_replica_slices_partition_each_global_batch():
    mbs, m = 2, [5, 3]
    got = replica_sample_indices(4, m, mbs, 0) + replica_sample_indices(4, m, mbs, 1)
    assert got == list(range(4 * 16, 5 * 16))
    assert replica_sample_indices(0, [8], 2, 0) == list(range(16))


def test_resume_reproduces_samples_and_skips_tokenising(corpus):
    seq = 64
    with PrefetchLoader(corpus, seq, 7, (3, 1), 2, replica=0) as full:
        ref = [full.next() for _ in range(6)]
    with PrefetchLoader(corpus, seq, 7, (3, 1), 2, replica=0, start_iteration=4) as resumed:
        b4 = resumed.next()
        assert resumed.tokenised == 6  # only iteration 4's samples were tokenised, none of the 24 skipped
        b5 = resumed.next()
    assert np.array_equal(b4, ref[4]) and np.array_equal(b5, ref[5])
    # same global sample -> same tokens whatever the replica split (layout independence)
    ds = RecordDataset(corpus, seq, 7)
    one_replica = np.stack([ds.sample(i) for i in replica_sample_indices(4, [4], 2, 0)])
    assert np.array_equal(one_replica[:6], ref[4])


def test_epochs_reshuffle_and_bad_input(corpus, tmp_path):
    ds = RecordDataset(corpus, 32, 1)
    first = [ds.record_of(i) for i in range(len(ds))]
    second = [ds.record_of(len(ds) + i) for i in range(len(ds))]
    assert sorted(first) == list(range(len(ds))) and first != second
    tok = CharTokenizer()
    assert tok.decode(tok.encode("the cat.")) == "the cat."
    with pytest.raises(ConfigError, match="does not exist"):
        RecordDataset(str(tmp_path / "nope.txt"), 32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        RecordDataset(str(bad), 8).text(1)


ORPHAN_PARENT = """
import os, signal, sys, time
from elastor_ds.data import PrefetchLoader
loader = PrefetchLoader(sys.argv[1], 32, 7, (3, 1), 2, replica=0, prefetch=2)
loader.next()                       # the worker runs and fills its queue

def sems(pid):                      # POSIX named semaphores a process has mapped (/dev/shm/sem.*)
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/sem." in line}
print(loader._proc.pid, *sorted(sems(os.getpid()) | sems(loader._proc.pid)), flush=True)
time.sleep(0.5)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "killpg":         # as elastor run stops a worker: its whole process group
    os.killpg(0, signal.SIGKILL)
os._exit(0)                         # an agreed stop's exit: no close(), no daemon clean-up
"""


@pytest.mark.parametrize("how", ["kill", "killpg", "exit"])
def test_the_data_worker_does_not_outlive_its_trainer(corpus, how):
    """A trainer that dies (SIGKILL) or leaves through os._exit without closing its loader: its
    data worker, blocked on a full queue, exits within seconds instead of running forever, and no
    named semaphore the two processes had mapped is left in /dev/shm (multiprocessing's Queue and
    Event leaked 8 per trainer this way: thousands on a test machine)."""
    import os
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", ORPHAN_PARENT, corpus, how], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=root), start_new_session=True)
    assert p.returncode == (0 if how == "exit" else -9), p.stderr[-2000:]
    child, *mapped = p.stdout.split()
    child = int(child)

    def alive() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False
    t_end = time.time() + 10
    while alive() and time.time() < t_end:
        time.sleep(0.1)
    assert not alive(), f"data worker {child} still running 10 s after its trainer died"
    left = [path for path in mapped if os.path.exists(path)]
    assert not left, f"named semaphores left in /dev/shm after the trainer and its worker died: {left}"
