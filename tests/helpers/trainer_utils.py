"""The example trainer under torchrun, for tests: its path, a tiny GPT's flags, a launcher that
asserts success, and the losses from a metrics file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
sys.path.insert(0, os.path.join(ROOT, "examples", "megatron_gpt"))
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
          "--lr-warmup-iters", "2", "--log-interval", "100"]


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    from dist_utils import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", TRAINER, *COMMON, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def losses(path: str) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(path))}
