"""The bench scripts refuse a bad argument before they start: argparse's usage error (exit 2) whose
one error line names the flag, no traceback, no result file written or overwritten.

Each script runs as a subprocess with a ``torch`` on its path that fails to import: the checks must
come before torch (and the processes that load it), so a bad flag costs a fraction of a second."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
BENCH = ROOT / "bench"
MISSING = "/nonexistent-elastor-bench-dir"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))

# (script, arguments, the flag the error must name, the script's result-file flag or None)
CASES = [
    ("ckpt_bench.py", ["--saves", "1"], "--saves", "--out"),
    ("ckpt_bench.py", ["--saves", "2", "--live-write"], "--saves", "--out"),
    ("ckpt_bench.py", ["--world", "0"], "--world", "--out"),
    ("ckpt_bench.py", ["--tensors", "0"], "--tensors", "--out"),
    ("ckpt_bench.py", ["--tensors", "33", "--mib-per-rank", "1"], "--tensors", "--out"),
    ("ckpt_bench.py", ["--load-tries", "0"], "--load-tries", "--out"),
    ("ckpt_bench.py", ["--slowdown-reps", "0"], "--slowdown-reps", "--out"),
    ("ckpt_bench.py", ["--dcp-saves", "-1"], "--dcp-saves", "--out"),
    ("ckpt_bench.py", ["--writer-nice", "20"], "--writer-nice", "--out"),
    ("ckpt_bench.py", ["--slowdown-window", "nan"], "--slowdown-window", "--out"),
    ("ckpt_bench.py", ["--dir", MISSING], "--dir", "--out"),
    ("ckpt_bench.py", ["--save", "3"], "--save", "--out"),   # a prefix of --saves is not taken for it
    ("snapshot_bench.py", ["--rows", "restor"], "--rows", "--out"),
    ("snapshot_bench.py", ["--rows", ","], "--rows", "--out"),
    ("snapshot_bench.py", ["--world", "0"], "--world", "--out"),
    ("snapshot_bench.py", ["--snapshots", "0"], "--snapshots", "--out"),
    ("snapshot_bench.py", ["--tensors", "0"], "--tensors", "--out"),
    ("snapshot_bench.py", ["--storage", "/dev/null/x"], "--storage", "--out"),
    ("snapshot_bench.py", ["--hidden", "30"], "--hidden", "--out"),
    ("snapshot_bench.py", ["--rows", "overhead", "--iters", "3"], "--iters", "--out"),
    ("snapshot_bench.py", ["--rows", "overhead", "--paired-iters", "5"], "--paired-iters", "--out"),
    ("snapshot_bench.py", ["--rows", "writer", "--writer-iters", "8"], "--writer-iters", "--out"),
    ("plan_bench.py", ["--sections", "bogus"], "--sections", None),
    ("docload_bench.py", ["bogus", "/tmp"], "{gen,time,ab,profile}", None),
    ("docload_bench.py", ["time", MISSING, "70B-1"], "DIR", None),
    ("docload_bench.py", ["gen", "/dev/null/x"], "DIR", None),
    ("peer_read_bench.py", ["--reps", "0"], "--reps", "--out"),
    ("peer_read_bench.py", ["--mib", "0"], "--mib", "--out"),
    ("recovery_bench.py", ["--repeats", "0"], "--repeats", "--json"),
    ("recovery_bench.py", ["--variants", "standby,bogus"], "--variants", "--json"),
    ("recovery_bench.py", ["--nproc", "3"], "--nproc", "--json"),
    ("recovery_bench.py", ["--fail-at", "30", "--train-iters", "30"], "--train-iters", "--json"),
    ("split_allreduce_bench.py", ["--world", "0"], "--world", None),
    ("split_allreduce_bench.py", ["--world", "8"], "--world", None),
    ("split_allreduce_bench.py", ["--reps", "0"], "--reps", None),
    ("ds_bench.py", ["--hidden", "0"], "--hidden", None),
    ("ds_bench.py", ["--blocks", "0"], "--blocks", None),
    ("megatron_bench.py", ["--hidden", "12"], "--hidden", None),
    ("megatron_bench.py", ["--layers", "1"], "--layers", None),
    ("peer_bench.py", ["--steps", "0"], "--steps", "--json"),
    ("peer_bench.py", ["--storage-dir", MISSING], "--storage-dir", "--json"),
    ("hetero_bench.py", ["--iters", "0"], "--iters", "--out"),
    ("hetero_bench.py", ["--sizes", "8,x"], "--sizes", "--out"),
    ("gpu_snapshot_bench.py", ["--reps", "0"], "--reps", "--json"),
    ("gpu_snapshot_bench.py", ["--mib", "1", "--tensors", "100"], "--tensors", "--json"),
    ("gpu_snapshot_bench.py", ["--root", MISSING], "--root", "--json"),
    ("crc_block_bench.py", ["--bogus"], "--bogus", None),
    ("hetero_trace.py", ["--summarize", MISSING], "--summarize", None),
]


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict:
    """An environment whose ``torch`` (and ``deepspeed``) fail to import, loudly."""
    d = tmp_path_factory.mktemp("no_torch")
    for mod in ("torch", "deepspeed"):
        (d / mod).mkdir()
        (d / mod / "__init__.py").write_text(f"raise ImportError('{mod} imported before the arguments were checked')\n")
    env = {k: v for k, v in os.environ.items() if k != "ELASTOR_TRACE_OUT"}
    env["PYTHONPATH"] = os.pathsep.join([str(d), str(ROOT)])
    return env


def run(script: str, args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=60)


@pytest.mark.parametrize("script,args,flag,out_flag", CASES, ids=[f"{c[0]}{' '.join(c[1])}" for c in CASES])
def test_a_bad_argument_is_a_usage_error(script, args, flag, out_flag, no_torch, tmp_path):
    out = tmp_path / "result.json"
    out.write_text('{"previous": "record"}\n')
    before = sorted(os.listdir(tmp_path))
    argv = [*args, out_flag, str(out)] if out_flag else args
    p = run(script, argv, no_torch, tmp_path)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    errors = [line for line in p.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and p.stderr.rstrip().endswith(errors[0]), p.stderr
    assert errors[0].startswith(script) and flag in errors[0], errors[0]
    assert out.read_text() == '{"previous": "record"}\n'
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_printed_without_torch(script, no_torch, tmp_path):
    """``--help`` of every script (docload_bench.py gave an IndexError, crc_block_bench.py ran the
    bench, hetero_trace.py ran the trainer)."""
    p = run(script, ["--help"], no_torch, tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("usage: "), (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    assert os.listdir(tmp_path) == []


def test_every_script_is_covered():
    """A new bench script gets its bad-argument case here (crc_block_bench.py has no options)."""
    assert {c[0] for c in CASES} == set(SCRIPTS)


def test_a_trace_without_its_folder_is_refused(no_torch, tmp_path):
    """hetero_trace.py without ELASTOR_TRACE_OUT would run the trainer and record nothing."""
    p = run("hetero_trace.py", ["--num-layers", "2"], no_torch, tmp_path)
    assert p.returncode == 2 and "ELASTOR_TRACE_OUT" in p.stderr and "Traceback" not in p.stderr, p.stderr
