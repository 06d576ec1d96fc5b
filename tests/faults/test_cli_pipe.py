"""A reader that leaves early (`elastor plan ... --json | head`): the command stops quietly with
the shell's broken-pipe status, no 'ERROR' line and no traceback. The CLI in a subprocess, its
stdout a real pipe closed after the first bytes."""
from __future__ import annotations

import os
import subprocess
import sys

PLAN = ["plan", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--seq-length", "4096", "--vocab-size", "32000", "--micro-batch-size", "1",
        "--global-batch-size", "1024", "--gpus-per-node", ",".join(["8"] * 512), "--json"]


def test_a_closed_pipe_ends_the_command_quietly():
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "elastor_ds.cli", *PLAN], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    first = p.stdout.read(16)        # the document is ~2 MB: far more than the pipe holds
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert first.startswith(b"{"), first
    assert rc == 141, (rc, err[-2000:])
    assert "Traceback" not in err and "ERROR" not in err and "Broken pipe" not in err, err[-2000:]
