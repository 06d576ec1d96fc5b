"""Review 34 of the checkpoint engine: a load into the tensors of a live save in flight, a failed
save reported at exit and by the next ``save()``, and the argument checks of the engine, shards,
JSON state and load destinations. Oracles: clones of the tensors taken at ``save()``, the committed
steps on disk, a child process's stderr and exit status, and the typed error with the value named."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import engine as engine_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.errors import AsyncSaveError, ConfigError, LiveStateChangedError, ShardingError
from elastor_ds.layout.region import Region

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 4 << 20   # 16 MiB per tensor: more than the writer's bounce buffers hold while its disk is held


def committed(root):
    return [s for s, _ in commit_mod.list_committed(root)]


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))


# ---------------------------------------------------------------- finding 1: load during a live save
def test_a_load_into_the_tensors_of_a_live_save_keeps_the_state_at_save(tmp_path, monkeypatch):
    """A load writes the destination's memory without bumping its version counter, so the live
    guard cannot see it: the load fences the live save first, and the step holds the state at
    ``save()`` (it committed the loaded bytes, or a mix, before)."""
    other = str(tmp_path / "other")
    src = CheckpointEngine(other, async_save=False)
    src.save(1, [full_shard("p", torch.full((N,), 5.0)), full_shard("m", torch.full((N,), 6.0))])
    src.finalize()
    g = torch.Generator().manual_seed(1)
    p, m = torch.randn(N, generator=g), torch.randn(N, generator=g)
    want = (p.clone(), m.clone())
    entered, release = threading.Event(), threading.Event()
    real = os.writev

    def held(fd, bufs):
        entered.set()
        assert release.wait(30)
        return real(fd, bufs)
    monkeypatch.setattr(os, "writev", held)
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, live_write=True, writer_sched="nice")
    st = eng.save(2, [full_shard("p", p), full_shard("m", m)])
    assert st.live
    assert entered.wait(30)
    eng.load(other, [full_shard("p", p), full_shard("m", m)])   # into the live tensors, no fence()
    assert float(p[0]) == 5.0 and float(m[-1]) == 6.0
    release.set()
    done = eng.wait()
    eng.finalize()
    monkeypatch.setattr(os, "writev", real)
    assert done.fence_bytes > 0   # the load's fence copied what the writer had not read
    a, b = torch.zeros(N), torch.zeros(N)
    res = CheckpointEngine(root).load(None, [full_shard("p", a), full_shard("m", b)])
    assert res.step == 2 and torch.equal(a, want[0]) and torch.equal(b, want[1])


# ---------------------------------------------------------------- finding 3: a failed save at exit
FAILS_AT_EXIT = """
    import sys, torch
    import elastor_ds.checkpoint.engine as E
    from elastor_ds.checkpoint.shards import full_shard
    eng = E.CheckpointEngine(sys.argv[1])
    eng.save(2, [full_shard("w", torch.ones(1024))])
    eng.wait()
    def full(*a, **k):
        raise OSError(28, "No space left on device")
    E.write_rank_files = full
    eng.save(3, [full_shard("w", torch.ones(1024))])
    print("exiting", flush=True)                      # no wait(), no finalize()
"""


def test_a_failed_save_that_nothing_waited_for_is_reported_at_exit(tmp_path):
    root = str(tmp_path / "ck")
    p = run_child(FAILS_AT_EXIT, root)
    assert p.returncode == 0 and p.stdout.strip() == "exiting", (p.returncode, p.stderr[-2000:])   # unchanged
    line = next((ln for ln in p.stderr.splitlines() if "FAILED" in ln), "")
    assert "checkpoint save of step 3 FAILED and nothing was committed for it" in line, p.stderr[-2000:]
    assert "No space left on device" in line and "step_000000002" in line
    assert committed(root) == [2]


STILL_WRITING_AT_EXIT = """
    import sys, time, torch
    import elastor_ds.checkpoint.engine as E
    from elastor_ds.checkpoint.shards import full_shard
    E.EXIT_SAVE_WAIT_S = 0.5
    def slow(*a, **k):
        time.sleep(20)
    E.write_rank_files = slow
    eng = E.CheckpointEngine(sys.argv[1])
    eng.save(4, [full_shard("w", torch.ones(1024))])
    print("exiting", flush=True)
"""


def test_a_save_still_being_written_when_the_exit_wait_ends_is_reported(tmp_path):
    p = run_child(STILL_WRITING_AT_EXIT, str(tmp_path / "ck"))
    assert p.stdout.strip() == "exiting", p.stderr[-2000:]
    assert "checkpoint save of step 4 FAILED: the program exited before it was written" in p.stderr, p.stderr[-2000:]
    assert "no step is committed under" in p.stderr


# ---------------------------------------------------------------- finding 4: the next save raises
@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), LiveStateChangedError("moved")])
def test_the_save_that_raises_the_previous_failure_says_its_step_was_not_saved(tmp_path, monkeypatch, error):
    root = str(tmp_path / "ck")
    real = engine_mod.write_rank_files
    calls = []

    def write(*a, **k):   # the second save's write fails (a full disk, a tensor changed under a live save)
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*a, **k)
    monkeypatch.setattr(engine_mod, "write_rank_files", write)
    eng = CheckpointEngine(root, keep=5)
    t = torch.ones(1024)
    eng.save(10, [full_shard("w", t)])
    eng.wait()
    eng.save(20, [full_shard("w", t)])
    eng._job.done.wait(30)
    with pytest.raises(AsyncSaveError) as ei:
        eng.save(30, [full_shard("w", t)])
    msg = str(ei.value)
    assert "step 20" in msg and "save(30) did not start: step 30 was not saved; call save(30, ...) again" in msg
    assert ei.value.failures[0].type_name == type(error).__name__
    # an elastor error class of the failure is kept (except LiveStateChangedError still matches)
    assert isinstance(ei.value, LiveStateChangedError) == isinstance(error, LiveStateChangedError)
    assert eng.local_idle() and committed(root) == [10]   # nothing of 30 is in flight or on disk
    eng.save(30, [full_shard("w", t)])                     # saved again, as the message says
    eng.finalize()
    assert committed(root) == [10, 30]


# ---------------------------------------------------------------- finding 5: argument checks
@pytest.mark.parametrize("kw,named", [({"writer_nice": "3"}, "writer_nice='3'"),
                                      ({"writer_nice": 2.5}, "writer_nice=2.5"),
                                      ({"async_save": "no"}, "async_save='no'"),
                                      ({"live_write": "yes"}, "live_write='yes'")])
def test_engine_arguments_of_the_wrong_type_are_config_errors_naming_the_value(tmp_path, kw, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
        CheckpointEngine(str(tmp_path / "ck"), **kw)
    assert CheckpointEngine(str(tmp_path / "ok"), writer_nice=np.int64(3), async_save=False).writer_nice == 3


def test_a_shard_whose_region_and_shape_differ_in_rank_or_whose_shape_is_not_integral_is_refused():
    with pytest.raises(ShardingError, match=r"shard w: region \[0:4\] has 1 dimension\(s\), the global shape \(4, 2\)"):
        TensorShard("w", (4, 2), Region((0,), (4,)), torch.zeros(4))
    with pytest.raises(ShardingError, match=r"shard v: global shape \(4\.7,\) must be a sequence of integers"):
        TensorShard("v", (4.7,), Region((0,), (4,)), torch.zeros(4))
    with pytest.raises(ShardingError, match="shard u: global shape"):
        TensorShard("u", 4, Region((0,), (4,)), torch.zeros(4))
    ok = TensorShard("w", torch.Size([np.int64(8)]), Region((0,), (4,)), torch.zeros(4))
    assert ok.shape == (8,) and type(ok.shape[0]) is int


def test_extra_with_two_keys_that_are_one_json_key_is_refused(tmp_path):
    eng = CheckpointEngine(str(tmp_path / "ck"))
    with pytest.raises(ConfigError, match=r"extra\.sched: keys 1 \(int\) and '1' \(str\) are both the JSON key '1'"):
        eng.save(1, [full_shard("w", torch.ones(2))], extra={"sched": {1: "a", "1": "b"}})
    eng.save(1, [full_shard("w", torch.ones(2))], extra={"sched": {1: "a", 2: "b"}})   # no collision: as before
    eng.wait()
    assert eng.load(None, [full_shard("w", torch.zeros(2))]).extra == {"sched": {"1": "a", "2": "b"}}
    eng.finalize()


def test_a_shards_for_function_that_returns_no_list_is_a_config_error_naming_the_contract(tmp_path):
    eng = CheckpointEngine(str(tmp_path / "ck"))
    eng.save(1, [full_shard("w", torch.ones(2))])
    eng.wait()

    def shards_for(manifest):
        return None
    with pytest.raises(ConfigError, match=r"shards_for\(manifest\) returned NoneType; a shards_for function must "
                                          r"return a list of TensorShard"):
        eng.load(None, shards_for)
    with pytest.raises(ConfigError, match="returned a list holding a Tensor"):
        eng.load(None, lambda man: [torch.zeros(2)])
    out = torch.zeros(2)
    eng.load(None, lambda man: (full_shard("w", out) for _ in range(1)))   # any iterable of shards still loads
    assert torch.equal(out, torch.ones(2))
    eng.finalize()


def readonly(n: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch warns that the buffer is not writable: that is the point
        return torch.frombuffer(mmap.mmap(-1, 4 * n, prot=mmap.PROT_READ), dtype=torch.float32)


def test_a_load_into_read_only_memory_is_a_sharding_error_naming_the_shard(tmp_path):
    eng = CheckpointEngine(str(tmp_path / "ck"))
    eng.save(1, [full_shard("w", torch.arange(1 << 16, dtype=torch.float32))])
    eng.wait()
    with pytest.raises(ShardingError, match=r"destination shard w \[0:65536\] lies in read-only memory"):
        eng.load(None, [full_shard("w", readonly(1 << 16))])
    out = torch.full((1 << 16,), 7.0)   # writable: the probe leaves its bytes as they were, the load fills it
    eng.load(None, [full_shard("w", out)])
    assert torch.equal(out, torch.arange(1 << 16, dtype=torch.float32))
    eng.finalize()


READ_ONLY_STRIDED = """
    import mmap, sys, warnings, torch
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    from elastor_ds.errors import ShardingError
    warnings.simplefilter("ignore")
    eng = CheckpointEngine(sys.argv[1])
    eng.save(1, [full_shard("m", torch.ones(64, 64))])
    eng.wait()
    ro = torch.frombuffer(mmap.mmap(-1, 4 * 64 * 128, prot=mmap.PROT_READ), dtype=torch.float32)
    try:
        eng.load(None, [full_shard("m", ro.view(64, 128)[:, :64])])   # strided: copied by numpy, not read into
    except ShardingError as e:
        print("refused:", e)
"""


def test_a_strided_read_only_destination_is_refused_not_a_segfault(tmp_path):
    p = run_child(READ_ONLY_STRIDED, str(tmp_path / "ck"))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])   # was -11 (SIGSEGV in the copy)
    assert "refused:" in p.stdout and "destination shard m [0:64, 0:64] lies in read-only memory" in p.stdout
