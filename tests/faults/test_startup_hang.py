"""A worker that hangs before its first iteration (in its set-up, its restore or its first step) is
found by ``elastor run``: its hooks write a ``started`` heartbeat when they attach, and a worker with
no iteration done ``--startup-timeout`` s after that is hung. Before, only a worker that had beaten
once could be hung: one stuck in set-up was waited for until its peers' collectives timed out
(2 x ``--hang-timeout``), and then the peers were blamed. The controller in a subprocess, as a user
runs it; small scripts with the real hooks, no collectives (the peers are not held up)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOOKED = """
import os, sys, time
from elastor_ds.elastic.worker import ElasticWorker
ctl = ElasticWorker.from_env()
rank = int(os.environ["RANK"])
setup_s = float(sys.argv[1 + rank])
time.sleep(setup_s)                    # set-up: rank r takes argv[1 + r] seconds before its first iteration
for it in range(1, 31):
    time.sleep(0.1)
    ctl.heartbeat(it, last=it == 30)
"""

PLAIN = """
import time
time.sleep(float(__import__("sys").argv[1]))   # no hooks: nothing tells the controller it started
"""


def run(tmp_path, source: str, args: list[str], flags: list[str], nproc: int) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    script = tmp_path / "train.py"
    script.write_text(source)
    events = tmp_path / "ev.jsonl"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", str(nproc),
                        "--no-standby", "--monitor-interval", "0.05", "--events", str(events), *flags, str(script),
                        *args], capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES=""))
    took = time.monotonic() - t0
    evs = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    return p, evs, took


def test_a_worker_hung_in_its_set_up_is_named_after_the_startup_timeout(tmp_path):
    # rank 1 never reaches its first iteration (an hour of "set-up"); rank 0 trains
    p, evs, took = run(tmp_path, HOOKED, ["0", "3600"], ["--startup-timeout", "3", "--hang-timeout", "60",
                                                           "--max-restarts", "0", "--on-failure", "shrink"], 2)
    assert p.returncode == 1, p.stderr[-3000:]
    fail = [e for e in evs if e["event"] == "failure"]
    assert len(fail) == 1 and fail[0]["cause"] == "hang", fail
    assert [r["global_rank"] for r in fail[0]["ranks"] if r["cause"] == "hang"] == [1], fail[0]["ranks"]
    assert took < 60, took   # 3 s of allowance, not the 60 s hang timeout, not for ever
    assert "Traceback" not in p.stderr.split("elastor run: phases")[-1]


def test_a_slow_start_within_the_startup_timeout_is_not_a_hang(tmp_path):
    # 3 s of set-up on both ranks, a hang timeout of 1 s: the start-up has its own allowance (8 s)
    p, evs, _ = run(tmp_path, HOOKED, ["3", "3"], ["--startup-timeout", "8", "--hang-timeout", "1",
                                                   "--max-restarts", "0"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    kinds = [e["event"] for e in evs]
    assert "failure" not in kinds and "finished" in kinds, kinds


def test_a_script_without_hooks_is_never_a_startup_hang(tmp_path):
    # nothing says it started: 4 s of work with a 1 s allowance ends normally
    p, evs, took = run(tmp_path, PLAIN, ["4"], ["--startup-timeout", "1", "--hang-timeout", "1"], 1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not [e for e in evs if e["event"] == "failure"] and took >= 4
