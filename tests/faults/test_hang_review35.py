"""Review 35: ``elastor run``'s hang check judges each worker on its own heartbeat.

A worker whose newest heartbeat was its run's last iteration has nothing left that beats (a final
save, an evaluation, finalize, waiting for the other ranks); the check stopped only once *every*
worker's newest beat said ``last``. So a rank that finished more than ``--hang-timeout`` ahead of
another still training was timed from its last beat and killed as hung, and a rank that exited
without a ``last`` record (no hooks: no heartbeat file) made the others' final phase timed. Now a
worker is timed only while its own newest beat is not its last; a worker still training is timed as
before (the third test: a real hang is still found, and only the hung rank is named).

The controller in a subprocess, as a user runs it; small scripts with the real hooks, no collectives."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


def elastor_run(tmp_path, source: str, flags: list[str], args: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``elastor run`` (no standby) on ``source``: the finished process and its events."""
    script = tmp_path / "train.py"
    script.write_text(source)
    ev = tmp_path / "ev.jsonl"
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--monitor-interval", "0.05",
                        "--events", str(ev), *flags, str(script), *args], capture_output=True, text=True,
                       timeout=180, cwd=str(tmp_path), env=ENV)
    return p, [json.loads(x) for x in ev.read_text().splitlines()] if ev.exists() else []


def kinds(evs: list[dict]) -> list[str]:
    return [e["event"] for e in evs]

SKEWED = """
import os, sys, time
# the ranks attach their hooks together (as a trainer's first collective makes them): a slow spawn
# under load must not look like a rank finishing ahead
open(sys.argv[1] + os.environ["RANK"], "w").close()
while not all(os.path.exists(sys.argv[1] + r) for r in "01"):
    time.sleep(0.01)
rank = int(os.environ["RANK"])
iters = int(sys.argv[2 + rank])       # rank r does argv[2 + r] iterations of 0.1 s (-1: no hooks, exits 0 now)
hang_at = int(sys.argv[4])            # rank 1 hangs in this iteration, before its heartbeat (0: never)
final_s = float(sys.argv[5 + rank])   # rank r's final phase after its last beat: no heartbeat
if iters < 0:
    sys.exit(0)
from elastor_ds.elastic.worker import ElasticWorker
ctl = ElasticWorker.from_env()
for it in range(1, iters + 1):
    time.sleep(0.1)
    if rank == 1 and it == hang_at:
        time.sleep(3600)
    ctl.heartbeat(it, last=it == iters)
time.sleep(final_s)
print("finished", flush=True)
"""

FLAGS = ["--nproc-per-node", "2", "--hang-timeout", "2", "--max-restarts", "0"]


def test_a_rank_that_finished_long_before_another_is_not_a_hang(tmp_path):
    # rank 0: 2 iterations, then a 6 s final phase; rank 1 trains on for 8 s. Rank 0's last beat is
    # 6 s old (3 x --hang-timeout) while rank 1 still beats: the job is not hung
    p, evs = elastor_run(tmp_path, SKEWED, FLAGS, [str(tmp_path / "up"), "2", "80", "0", "6", "0"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "failure" not in kinds(evs) and kinds(evs).count("launch") == 1 and "finished" in kinds(evs), kinds(evs)
    assert "[default0]:finished" in p.stdout and "[default1]:finished" in p.stdout, p.stdout[-2000:]


def test_a_rank_that_exited_without_a_heartbeat_does_not_time_the_others_final_phase(tmp_path):
    # rank 0 exits 0 at once without hooks (no heartbeat file); rank 1 beats its last iteration and
    # then spends 6 s in its final phase
    p, evs = elastor_run(tmp_path, SKEWED, FLAGS, [str(tmp_path / "up"), "-1", "3", "0", "0", "6"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "failure" not in kinds(evs) and kinds(evs).count("launch") == 1 and "finished" in kinds(evs), kinds(evs)
    assert "[default1]:finished" in p.stdout, p.stdout[-2000:]


def test_a_rank_hung_mid_training_is_named_not_the_rank_that_finished_ahead(tmp_path):
    # rank 0: 2 iterations, then waits 60 s in its final phase; rank 1 hangs in its 20th iteration
    p, evs = elastor_run(tmp_path, SKEWED, FLAGS, [str(tmp_path / "up"), "2", "80", "20", "60", "0"])
    assert p.returncode == 1, p.stderr[-3000:]
    fail = [e for e in evs if e["event"] == "failure"]
    assert len(fail) == 1 and fail[0]["cause"] == "hang", fail
    assert [(r["global_rank"], r["cause"]) for r in fail[0]["ranks"]] == [(1, "hang")], fail[0]["ranks"]
