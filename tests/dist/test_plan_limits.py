"""`elastor plan` bounds every size it is given (issue 19: `--num-layers 100000` used 24 GB and was
OOM-killed). A size past its bound exits 2 naming the flag and the bound, before any work; the
largest accepted sizes plan in bounded memory. Each case runs the CLI in a subprocess whose address
space is capped with RLIMIT_AS, so a regression fails here instead of taking the machine's memory."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from elastor_ds.plan.cli import LIMITS

ROOT = Path(__file__).resolve().parents[2]
CAP = 3 << 30  # bytes of address space (Python, numpy and torch's imports fit in well under this)
MODEL = ["--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024", "--vocab-size", "32000",
         "--micro-batch-size", "1", "--global-batch-size", "64", "--tensor-model-parallel-size", "8"]


def run_capped(args: list[str]) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    return subprocess.run([sys.executable, "-c", "from elastor_ds.cli import main; raise SystemExit(main())", "plan",
                           *args], capture_output=True, text=True, preexec_fn=cap, cwd=ROOT, timeout=300)


@pytest.mark.timeout(600)
def test_oversized_inputs_exit_2_naming_the_flag_and_the_bound():
    p = run_capped(["--num-layers", "100000", *MODEL, "--gpus-per-node", "8,8"])
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"argument --num-layers: 100000 is out of range: give 1 to {LIMITS['--num-layers']:,}" in p.stderr
    assert "Traceback" not in p.stderr
    p = run_capped(["--num-layers", "32", *MODEL, "--gpus-per-node", ",".join(["65"] * 2)])
    assert p.returncode == 2 and "65 GPUs on a node; at most 64 are supported" in p.stderr, p.stderr[-2000:]
    big = MODEL[:MODEL.index("--global-batch-size") + 1] + ["67108864"] + MODEL[MODEL.index("--global-batch-size") + 2:]
    p = run_capped(["--num-layers", "32", *big, "--gpus-per-node", "8"])
    assert p.returncode == 2 and "micro-batches; at most 4,194,304 are supported" in p.stderr, p.stderr[-2000:]


@pytest.mark.timeout(600)
def test_largest_layer_count_plans_in_bounded_memory():
    p = run_capped(["--num-layers", str(LIMITS["--num-layers"]), *MODEL, "--gpus-per-node", "8,8,8,7"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "plan (" in p.stdout and "predicted iteration" in p.stdout
