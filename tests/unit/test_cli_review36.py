"""User-facing errors found in the thirty-sixth session's walk through the CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from elastor_ds.errors import ConfigError
from elastor_ds.plan.cluster import Cluster

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "8"]


def test_unknown_cluster_keys_are_bounded_not_echoed_whole():
    # a file named by mistake (here: 200 lines of "secret-N: x") must not come back whole in the error
    d = {f"secret-{i:03d}": "x" for i in range(200)}
    d["gpus_per_node"] = [2]
    with pytest.raises(ConfigError) as ei:
        Cluster.from_dict(d)
    msg = str(ei.value)
    assert "'secret-000', 'secret-001', 'secret-002', 'secret-003', 'secret-004' and 195 more" in msg
    assert "secret-005" not in msg and "secret-199" not in msg
    assert "gpus_per_node or nodes" in msg


def test_unknown_node_keys_are_bounded():
    d = {"nodes": [{"name": "a", "gpus": [0], **{f"k{i:02d}": 1 for i in range(30)}}]}
    with pytest.raises(ConfigError) as ei:
        Cluster.from_dict(d)
    assert "'k00', 'k01', 'k02', 'k03', 'k04' and 25 more; a node has name, gpus and speed" in str(ei.value)


def test_cli_cluster_file_of_many_unknown_lines_exit_2_short_message(tmp_path):
    f = tmp_path / "not_a_cluster.yaml"
    f.write_text("".join(f"user{i}: '*:20228:0:99999:7::'\n" for i in range(500)))
    r = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "plan", *MODEL, "--cluster", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "and 495 more" in r.stderr and "user499" not in r.stderr
    assert len(r.stderr) < 1000
