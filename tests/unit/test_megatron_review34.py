"""Review 34 of the Megatron-LM integration (no Megatron-LM checkout, no process group):

1. ``--elastor-memory-snapshot-*``: errors name the flags a Megatron-LM user sets (were the DeepSpeed
   JSON keys, ``--elastor-memory-snapshot-*.interval_steps: ... e.g. "interval_steps": 1``); the
   ``--elastor-memory-snapshot-dir`` flag exists (``memory_config`` read the attribute, no flag set
   it); a launch without a node directory is refused at ``configure`` naming the flag and
   ``ELASTOR_SNAPSHOT_DIR`` (the tier's own refusal spoke only the DeepSpeed config).
2. ``--elastor-memory-snapshot-keep 3`` (or ``-peer-copies 0``) without ``-interval`` is an error (was
   silently ignored: no snapshot taken).
3. Under torchrun a checkpoint whose contents cannot be used (a corrupt newest one under
   ``--no-elastor-fallback``) is one line and exit 1 per rank (was a traceback through Megatron-LM's
   frames); internal errors keep their traceback.
4. ``examples/megatron_lm/cpu_pretrain_gpt.py`` sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` by default
   (Megatron-LM asserts it for TP > 1).
5. A resize agreed on an ``--exit-interval`` iteration ends the job (exit 0), as Megatron-LM's own
   exit check would have (was 75: the relaunch trained on to twice the interval).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import stat
import subprocess
import sys
import textwrap
import types

import pytest

from elastor_ds.elastic.protocol import EXIT_OK, EXIT_RESIZE, StopCode
from elastor_ds.errors import ConfigError
from elastor_ds.integrations.megatron import elastic, training_hooks as th

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--save")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    th.add_arguments(p)
    a = p.parse_args(["--elastor"] + argv)
    a.world_size = 2
    return a


@pytest.fixture
def no_launcher(monkeypatch):
    """Outside ``elastor run``, no node directory exported."""
    for k in list(os.environ):
        if k.startswith("ELASTOR_"):
            monkeypatch.delenv(k)


# ------------------------------------------------------------------ 1, 2: memory snapshot flags
@pytest.mark.parametrize("argv, flag", [
    # out of a flag's own range: argparse's usage error at parse time (review 36: was a ConfigError at configure)
    (["--elastor-memory-snapshot-interval", "0"], "argument --elastor-memory-snapshot-interval: 0: must be at least 1"),
    (["--elastor-memory-snapshot-interval", "-1"], "argument --elastor-memory-snapshot-interval: -1: must be at least 1"),
    (["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", "2"],
     "argument --elastor-memory-snapshot-peer-copies: 2: must be at most 1"),
    (["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-keep", "0"],
     "argument --elastor-memory-snapshot-keep: 0: must be at least 1"),
])
def test_memory_snapshot_flag_out_of_range_is_a_usage_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(argv + ["--save", "ck"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, flag", [
    (["--elastor-memory-snapshot-interval", "2", "--elastor-memory-snapshot-peer-copy-interval", "5"],
     "--elastor-memory-snapshot-peer-copy-interval 5: "),
    (["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copy-interval", "4",
      "--elastor-memory-snapshot-keep", "2"], "--elastor-memory-snapshot-keep 2: "),
    (["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-dir", " /dev/shm/x"],
     "--elastor-memory-snapshot-dir ' /dev/shm/x': "),
    (["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-dir", "/"],
     "--elastor-memory-snapshot-dir /: "),
    # a check of the settings' own (no mirror here): its key comes back as the flag
    (["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copy-interval", "5000"],
     "--elastor-memory-snapshot-peer-copy-interval: 5000 is too large"),
    # 2: ignored before
    (["--elastor-memory-snapshot-keep", "3"], "--elastor-memory-snapshot-keep 3 without --elastor-memory-snapshot-"
                                              "interval N"),
    (["--elastor-memory-snapshot-peer-copies", "0"], "--elastor-memory-snapshot-peer-copies 0 without "
                                                     "--elastor-memory-snapshot-interval N"),
])
def test_memory_snapshot_errors_name_the_flags(argv, flag):
    a = _parse(argv + ["--save", "ck"])
    with pytest.raises(ConfigError) as e:
        th.configure(a)
    msg = str(e.value)
    assert msg.startswith(flag), msg
    assert "\n" not in msg and '": ' not in msg and "_steps" not in msg and "snapshot-*" not in msg, msg


def test_the_flags_together_without_the_interval_name_each_and_the_fix():
    with pytest.raises(ConfigError, match=r"^--elastor-memory-snapshot-keep 3 --elastor-memory-snapshot-peer-copies 0 "
                                          r"without .*add --elastor-memory-snapshot-interval 1 .*or drop them$"):
        th.memory_config(_parse(["--elastor-memory-snapshot-keep", "3", "--elastor-memory-snapshot-peer-copies", "0"]))


def test_the_dir_flag_sets_the_node_directory(tmp_path, no_launcher):
    d = tmp_path / "a" / "shm"
    a = _parse(["--elastor-memory-snapshot-interval", "2", "--elastor-memory-snapshot-dir", str(d),
                "--elastor-memory-snapshot-peer-copies", "0", "--save", str(tmp_path / "ck")])
    th.configure(a)
    mem = th.memory_config(a)
    assert (mem.interval_steps, mem.peer_copies, mem.dir) == (2, 0, str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700   # made at start-up, checked as `elastor run` checks its own
    os.chmod(d, 0o755)
    with pytest.raises(ConfigError, match=r"^--elastor-memory-snapshot-dir .*other users may enter it"):
        th.configure(a)


def test_without_a_node_directory_configure_names_the_flag_and_the_variable(tmp_path, no_launcher, monkeypatch):
    a = _parse(["--elastor-memory-snapshot-interval", "1", "--save", str(tmp_path / "ck")])
    with pytest.raises(ConfigError) as e:
        th.configure(a)
    msg = str(e.value)
    assert msg.startswith("--elastor-memory-snapshot-interval 1: no node directory"), msg
    assert "--elastor-memory-snapshot-dir /dev/shm/<job>" in msg and "ELASTOR_SNAPSHOT_DIR=" in msg, msg
    assert "memory_snapshot" not in msg, msg
    monkeypatch.setenv("ELASTOR_SNAPSHOT_DIR", str(tmp_path / "shm"))   # exported by hand: accepted
    th.configure(a)


def test_the_tiers_refusal_names_every_way_to_give_a_node_directory(no_launcher):
    from elastor_ds.checkpoint.settings import MemorySnapshotConfig
    from elastor_ds.checkpoint.snapshot.tier import node_dir
    with pytest.raises(ConfigError) as e:
        node_dir(MemorySnapshotConfig())
    msg = str(e.value)
    for words in ("`elastor run`", "export ELASTOR_SNAPSHOT_DIR=/dev/shm/<job>",
                  "Megatron-LM: --elastor-memory-snapshot-dir /dev/shm/<job>", '"memory_snapshot": {"dir"'):
        assert words in msg, msg


# ------------------------------------------------------------------ 3: checkpoint errors under torchrun
CHILD = textwrap.dedent("""
    import argparse, sys
    from elastor_ds import errors
    from elastor_ds.integrations.megatron import training_hooks
    training_hooks.add_arguments(argparse.ArgumentParser())
    msg = "storage ck/step_000000020/data_00001.safetensors: block at byte 4096 fails its CRC32 check"
    if sys.argv[1] == "corrupt":
        raise errors.CorruptCheckpointError(msg)
    if sys.argv[1] == "gathered":   # what every rank raises after the load's collective
        failures = [errors.RankFailure.of(r, errors.CorruptCheckpointError(msg)) for r in (0, 1)]
        raise errors.ranks_failed("load of ck/step_000000020", failures, 2)
    raise errors.LiveStateChangedError("a saved tensor changed in place")
""")


@pytest.mark.parametrize("kind, code, want", [
    ("corrupt", 1, "elastor: error (rank 0): CorruptCheckpointError: storage ck/step_000000020/data_00001.safetensors: "
                   "block at byte 4096 fails its CRC32 check\n"),
    ("gathered", 1, "elastor: error (rank 0): CorruptCheckpointError: load of ck/step_000000020 failed on 2 of 2 "
                    "ranks: rank 0: CorruptCheckpointError: storage"),
    ("internal", 1, "LiveStateChangedError: a saved tensor changed in place")])
def test_a_checkpoint_error_is_one_line_under_torchrun(kind, code, want):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTOR_")}
    env.update(PYTHONPATH=ROOT, RANK="0", DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert want in p.stderr, p.stderr[-2000:]
    if kind == "internal":   # not the user's to fix: the traceback stays
        assert "Traceback" in p.stderr
    else:
        assert "Traceback" not in p.stderr and p.stderr.count("elastor: error") == 1, p.stderr[-2000:]


def test_user_error_lines(monkeypatch):
    from elastor_ds import errors
    monkeypatch.delenv("RANK", raising=False)
    assert th.user_error_line(errors.ConfigError("--elastor-keep 0: must be >= 1")) == \
        ("elastor: error: --elastor-keep 0: must be >= 1", 2)
    assert th.user_error_line(errors.CheckpointNotFoundError("no checkpoint under ck")) == \
        ("elastor: error: CheckpointNotFoundError: no checkpoint under ck", 2)
    assert th.user_error_line(errors.IncompleteCheckpointError("ck/step_3: no manifest\nnot committed")) == \
        ("elastor: error: IncompleteCheckpointError: ck/step_3: no manifest | not committed", 1)
    assert th.user_error_line(errors.ManifestError("ck/step_3/manifest.json: bad JSON \x1b[2J")) == \
        ("elastor: error: ManifestError: ck/step_3/manifest.json: bad JSON \\x1b[2J", 1)
    for internal in (errors.AsyncSaveError("background save failed"), errors.ConcurrentWriterError("x"),
                     errors.CollectiveError("x"), ValueError("x")):
        assert th.user_error_line(internal) is None


# ------------------------------------------------------------------ 4: the CPU runner's environment
def _runner():
    spec = importlib.util.spec_from_file_location("cpu_pretrain_gpt_r34",
                                                  os.path.join(ROOT, "examples", "megatron_lm", "cpu_pretrain_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("given, want", [(None, "1"), ("8", "8")])
def test_the_cpu_runner_sets_cuda_device_max_connections(tmp_path, monkeypatch, given, want):
    mod = _runner()
    (tmp_path / "pretrain_gpt.py").write_text("")
    seen = {}
    monkeypatch.setattr(mod, "install", lambda cuda_types: None)
    monkeypatch.setattr(mod, "install_fault", lambda spec: None)
    monkeypatch.setattr(mod.runpy, "run_path",
                        lambda path, run_name: seen.update(v=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if given is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", given)
    monkeypatch.setenv("PYENV_VERSION", "3")
    mod.main(["--megatron-lm", str(tmp_path), "--tensor-model-parallel-size", "2"])
    assert seen == {"v": want}


# ------------------------------------------------------------------ 5: a stop on an exit-interval iteration
class _Hooks:
    """``elastor run``'s worker hooks, with the stop the ranks agree on."""

    def __init__(self, code: StopCode):
        self.code, self.beats = code, []

    def mark(self, name):
        pass

    def heartbeat(self, iteration, last=False):
        self.beats.append((iteration, last))

    def agree_stop(self):
        return self.code

    def report_started(self, rank, **fields):
        pass


@pytest.mark.parametrize("code, iteration, args, want", [
    (StopCode.RESIZE, 16, dict(exit_interval=16), EXIT_OK),          # the job ends at 16, as Megatron-LM's check would
    (StopCode.RESIZE, 32, dict(exit_interval=16), EXIT_OK),
    (StopCode.RESIZE, 15, dict(exit_interval=16), EXIT_RESIZE),      # elsewhere: relaunch on the new world
    (StopCode.RESIZE, 16, dict(exit_interval=None), EXIT_RESIZE),
    (StopCode.RESIZE, 10, dict(phase_transition_iterations=[10, 20]), EXIT_OK),
    (StopCode.PREEMPT, 16, dict(exit_interval=16), EXIT_OK),
])
def test_a_stop_on_an_exit_interval_iteration_ends_the_job(monkeypatch, code, iteration, args, want):
    calls = []
    monkeypatch.setattr(th, "finalize", lambda: calls.append("finalize"))
    monkeypatch.setattr(th, "after_iteration", lambda *a: calls.append("snapshot"))
    hooks = _Hooks(code)
    loop = elastic.ElasticLoop(types.SimpleNamespace(save="/ckpt", train_iters=100, **args), hooks, 0)
    got = elastic.iteration_end(loop, iteration, "model", "optimizer", "scheduler", 1.0, lambda: calls.append("save"))
    assert got == want and calls == ["save", "finalize"]
    assert hooks.beats == [(iteration, want == EXIT_OK)]   # the exit iteration is the last: no standby forked
    nosave = elastic.ElasticLoop(types.SimpleNamespace(save=None, train_iters=100, **args), hooks, 0)
    assert elastic.iteration_end(nosave, iteration, "m", "o", "s", 1.0, lambda: calls.append("save")) == want


def test_no_stop_on_an_exit_interval_iteration_leaves_it_to_megatron(monkeypatch):
    calls = []
    monkeypatch.setattr(th, "after_iteration", lambda it, *a: calls.append(f"snapshot {it}"))
    hooks = _Hooks(StopCode.NONE)
    loop = elastic.ElasticLoop(types.SimpleNamespace(save="/ckpt", train_iters=100, exit_interval=16), hooks, 0)
    assert elastic.iteration_end(loop, 16, "m", "o", "s", 1.0, lambda: calls.append("save")) is None
    assert calls == ["snapshot 16"] and hooks.beats == [(16, True)]
