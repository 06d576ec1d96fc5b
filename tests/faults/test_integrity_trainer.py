"""The example trainer (megatron-core layers in DeepSpeed's pipeline, elastor checkpoints): a
checkpoint saved at TP1 with one flipped byte is never resumed from at TP2. With an older checkpoint
the run falls back to it and reproduces the uninterrupted run's losses; without one it fails with a
one-line message naming the file, exit 1."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from trainer_utils import fork_launch

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
          "--lr-warmup-iters", "2", "--log-interval", "100", "--save-interval", "3"]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """The ranks fork from the test session's forkserver (tests/helpers/trainer_utils.fork_launch)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return fork_launch(nproc, TRAINER, [*COMMON, *args], env, ROOT, timeout=300)


def test_flipped_byte_at_tp1_never_resumes_at_tp2(tmp_path):
    ck = tmp_path / "ck"
    p = torchrun(1, "--save", str(ck), "--metrics-file", str(tmp_path / "ref.jsonl"))
    assert p.returncode == 0, p.stderr[-3000:]
    ref = {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(tmp_path / "ref.jsonl"))}
    newest = ck / "step_000000006"
    man = json.load(open(newest / "manifest.json"))
    # the biggest weight matrix: TP2 splits it, so a TP2 rank reads a part of it (row or column half)
    name, t = max(((n, t) for n, t in man["tensors"].items() if len(t["shape"]) == 2 and "weight" in n),
                  key=lambda kv: kv[1]["chunks"][0]["length"])
    ch = t["chunks"][0]
    with open(newest / ch["file"], "r+b") as f:
        f.seek(ch["offset"] + ch["length"] // 2 + 1)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    # resume at TP2 from the root: step 6 fails its block CRCs, the run falls back to step 3
    p = torchrun(2, "--tensor-model-parallel-size", "2", "--load", str(ck), "--save", str(tmp_path / "ck2"),
                 "--metrics-file", str(tmp_path / "res.jsonl"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step_000000006" in p.stderr and "CRC32" in p.stderr and name in p.stderr, p.stderr[-3000:]
    got = {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(tmp_path / "res.jsonl"))}
    assert sorted(got) == [4, 5, 6], "resumed from the corrupt step 6 instead of falling back to step 3"
    for it in got:
        assert got[it] == pytest.approx(ref[it], rel=2e-5), (it, got[it], ref[it])
    # without an older checkpoint: a clear failure, exit 1, no traceback
    shutil.rmtree(ck / "step_000000003")
    p = torchrun(2, "--tensor-model-parallel-size", "2", "--load", str(ck), "--save", str(tmp_path / "ck3"))
    assert p.returncode != 0
    assert "CorruptCheckpointError" in p.stderr and ch["file"] in p.stderr, p.stderr[-3000:]
    assert "pretrain_gpt.py: checkpoint error: CorruptCheckpointError" in p.stderr
    # (torchrun prints its own ChildFailedError traceback; the trainer's processes print none)
    assert 'elastor_ds/' not in "".join(l for l in p.stderr.splitlines(True) if l.lstrip().startswith("File ")), \
        p.stderr[-3000:]
    assert not os.path.exists(tmp_path / "ck3" / "latest")
