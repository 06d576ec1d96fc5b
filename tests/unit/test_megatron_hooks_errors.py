"""Megatron-LM under torchrun (docs/megatron-lm.md's launch): an elastor user error is one line and
exit 2 on each rank, as under ``elastor run``, not a traceback through Megatron-LM's frames
(QA round 6, Q6-6: 3 tracebacks for 2 ranks). The hook is installed by ``add_arguments``, the
first elastor call Megatron-LM's patched argument parsing makes; other exceptions keep theirs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import argparse, sys
    from elastor_ds.integrations.megatron import training_hooks
    from elastor_ds.errors import ConfigError
    training_hooks.add_arguments(argparse.ArgumentParser())
    if sys.argv[1] == "config":
        raise ConfigError("--elastor-plan p.json: Megatron-LM runs one TP x PP for every replica")
    raise ValueError("a bug, not a user error")
""")


@pytest.mark.parametrize("kind, code, want", [
    ("config", 2, "elastor: error (rank 1): --elastor-plan p.json: Megatron-LM runs one TP x PP for every replica\n"),
    ("other", 1, "ValueError: a bug, not a user error")])
def test_a_user_error_is_one_line_and_exit_2(kind, code, want):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTOR_")}
    env.update(PYTHONPATH=ROOT, RANK="1", DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert want in p.stderr, p.stderr[-2000:]
    if kind == "config":
        assert "Traceback" not in p.stderr and p.stderr.count("elastor: error") == 1
    else:
        assert "Traceback" in p.stderr
