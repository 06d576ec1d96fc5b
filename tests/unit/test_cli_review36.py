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


def test_max_restarts_exhausted_names_the_failure():
    """The job's last line names what failed, as torchrun's summary names its root cause."""
    import signal

    from elastor_ds.elastic.policy import Action, DeviceBook, OnFailure, WorkerOutcome, decide_after_failure

    outs = [WorkerOutcome(0, 0, global_rank=4, exitcode=1), WorkerOutcome(1, 1, global_rank=5, exitcode=-signal.SIGKILL)]
    d = decide_after_failure(OnFailure.SHRINK, DeviceBook((0, 1)), outs, 1, 1)
    assert d.action is Action.STOP
    assert d.reason == ("--max-restarts 1 exhausted (1 relaunches after failures); the last failure: local rank 1 "
                        "(rank 5) killed by SIGKILL (and 1 other worker(s) of this node); raise --max-restarts to "
                        "keep going")
    d = decide_after_failure(OnFailure.SHRINK, DeviceBook((0, 1)), [WorkerOutcome(0, 0, exitcode=3)], 0, 0)
    assert d.reason == ("--max-restarts 0 exhausted (0 relaunches after failures); the last failure: local rank 0 "
                        "exited with code 3; raise --max-restarts to keep going")


@pytest.mark.parametrize("command", [["run", "-v", "--nproc-per-node", "1", "x.py"], ["verify", "-v", "ckpt"]])
def test_verbose_after_the_command_says_where_it_goes(command):
    r = subprocess.run([sys.executable, "-m", "elastor_ds.cli", *command], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"-v/--verbose is elastor's own option: it goes before the command (elastor -v {command[0]} ...)" in r.stderr
    assert "Traceback" not in r.stderr
