"""``elastor run`` defects of review 33, each through a real controller subprocess on a tiny script
(no model): the exit code, the message and the events a user sees."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def elastor_run(tmp_path, source: str, flags: list[str], args: list[str] = (), env: dict | None = None,
                timeout: float = 60, events: bool = True) -> tuple[subprocess.CompletedProcess, list[dict]]:
    script = tmp_path / "train.py"
    script.write_text(source)
    ev = tmp_path / "ev.jsonl"
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--monitor-interval", "0.05",
           *(["--events", str(ev)] if events else []), *flags, str(script), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path),
                       env=dict(ENV, **(env or {})))
    evs = [json.loads(x) for x in ev.read_text().splitlines()] if ev.exists() else []
    return p, evs


def kinds(evs: list[dict]) -> list[str]:
    return [e["event"] for e in evs]


# ---------------------------------------------------------------- F1: the end of a run is not a hang
FINISHING = """
import os, sys, time
# the ranks start together, as a trainer's do (its first collective waits for all): the hooks attach
# once both interpreters run. Under load one rank's spawn can come a second after the other's, and a
# rank that had beaten its last iteration then waited more than the 1 s hang timeout for the other
# rank's last beat (the test's start, not the final phase it checks)
open(sys.argv[2] + os.environ["RANK"], "w").close()
while not all(os.path.exists(sys.argv[2] + r) for r in "01"):
    time.sleep(0.01)
from elastor_ds.elastic.worker import ElasticWorker
ctl = ElasticWorker.from_env()
for it in range(1, 4):
    time.sleep(0.05)
    ctl.heartbeat(it, last=it == 3)
time.sleep(float(sys.argv[1]))   # the final save / evaluation / finalize: no heartbeat
print("finished", flush=True)
"""


def test_a_final_phase_longer_than_the_hang_timeout_after_the_last_beat_is_not_a_hang(tmp_path):
    p, evs = elastor_run(tmp_path, FINISHING, ["--nproc-per-node", "2", "--hang-timeout", "1", "--max-restarts", "0"],
                         ["3", str(tmp_path / "up")])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "failure" not in kinds(evs) and kinds(evs).count("launch") == 1 and "finished" in kinds(evs), kinds(evs)
    assert "[default0]:finished" in p.stdout and "[default1]:finished" in p.stdout, p.stdout[-2000:]


# ---------------------------------------------------------------- F2: sys.exit("message")
def test_a_script_that_exits_with_a_message_shows_it_and_fails(tmp_path):
    p, evs = elastor_run(tmp_path, "import sys\nsys.exit('fatal: the data set is missing')\n", ["--max-restarts", "0"])
    assert p.returncode == 1, p.stderr[-3000:]
    assert "[default0]:fatal: the data set is missing" in p.stderr, p.stderr[-3000:]
    logs = list((tmp_path / "ev_logs").glob("*/attempt_0/0/stderr.log"))
    assert len(logs) == 1 and logs[0].read_text() == "fatal: the data set is missing\n", logs
    fail = [e for e in evs if e["event"] == "failure"]
    assert len(fail) == 1 and [(r["cause"], r["exitcode"]) for r in fail[0]["ranks"]] == [("exit", 1)], fail


# ---------------------------------------------------------------- usage errors: exit 2, one line, nothing made
@pytest.mark.parametrize("flags, message", [
    # F4: the id names torch's log folder (mkdtemp(prefix=id + "_", dir=log_dir)): a path escaped --log-dir
    (["--rdzv-id", "../../ESCAPED"], "--rdzv-id '../../ESCAPED': expected a job name of letters, digits"),
    (["--rdzv-id", "/tmp/ABSOLUTE"], "--rdzv-id '/tmp/ABSOLUTE': expected a job name"),
    (["--rdzv-id", ""], "--rdzv-id '': expected a job name"),
    (["--rdzv-id", "a" * 129], "at most 128 characters"),
    # F7: static cannot work without --node-rank; etcd with no endpoint used localhost:0
    (["--rdzv-backend", "static"], "--rdzv-backend 'static': torchrun's static rendezvous needs --node-rank"),
    (["--rdzv-backend", "etcd", "--nnodes", "2"], "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2 needs --rdzv-endpoint HOST:PORT"),
    # F8: no upper bound: OverflowError deep in the loop, a torch traceback with exit 0
    (["--monitor-interval", "1e300"], "--monitor-interval 1e+300: more than a year (31536000 s)"),
    (["--exit-barrier-timeout", "1e300"], "--exit-barrier-timeout 1e+300: more than a year"),
    (["--hang-timeout", "1e10"], "--hang-timeout 1e+10: more than a year"),
    (["--shutdown-timeout", "4e7"], "--shutdown-timeout 4e+07: more than a year"),
    # F9: --standalone silently replaced these
    (["--standalone", "--nnodes", "2", "--rdzv-endpoint", "foo:1"], "--standalone with --nnodes 2"),
    (["--standalone", "--rdzv-endpoint", "127.0.0.1:29400"], "--standalone with --rdzv-endpoint 127.0.0.1:29400"),
    (["--standalone", "--rdzv-backend", "etcd-v2"], "--standalone with --rdzv-backend etcd-v2"),
    # F10: --plot without --events did nothing
    (["--plot", "t.png"], "--plot t.png: the timeline is drawn from the event log; add --events FILE"),
])
def test_bad_values_exit_2_naming_the_flag(tmp_path, flags, message):
    marker = tmp_path / "ran"
    (tmp_path / "sub").mkdir()
    p, _ = elastor_run(tmp_path, f"open({str(marker)!r}, 'w').close()\n", ["--log-dir", "sub/logs", *flags],
                       events=False)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert message in p.stderr and "Traceback" not in p.stderr and "unexpected" not in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not marker.exists()
    assert sorted(os.listdir(tmp_path)) == ["sub", "train.py"] and os.listdir(tmp_path / "sub") == [], \
        os.listdir(tmp_path)


def test_a_valid_rdzv_id_names_the_log_folder(tmp_path):
    p, _ = elastor_run(tmp_path, "print('ok')\n", ["--standalone", "--rdzv-id", "job-1.a_B"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert [d.name.startswith("job-1.a_B_") for d in (tmp_path / "ev_logs").iterdir() if d.name != "heartbeat"] == \
        [True], os.listdir(tmp_path / "ev_logs")


# ---------------------------------------------------------------- F3: an events file given again
REPORTING = """
import os, sys, time
from elastor_ds.elastic.worker import ElasticWorker
ctl = ElasticWorker.from_env()
ctl.report_started(int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), resumed_from=0, layout="dp1")
for it in range(1, 4):
    time.sleep(0.05)
    if it == 2 and os.environ["ELASTOR_ROUND"] == "0" and os.environ.get("FAIL") == "1":
        sys.exit(7)
    ctl.heartbeat(it, last=it == 3)
"""


def test_a_reused_events_file_reports_only_this_runs_recoveries_and_phases(tmp_path):
    p1, evs1 = elastor_run(tmp_path, REPORTING, ["--max-restarts", "1"], env={"FAIL": "1"})
    assert p1.returncode == 0, p1.stderr[-3000:]
    assert kinds(evs1).count("recovery") == 1 and "recoveries (seconds)" in p1.stdout, kinds(evs1)
    p2, evs2 = elastor_run(tmp_path, REPORTING, ["--max-restarts", "1"], env={"FAIL": "0"})
    assert p2.returncode == 0, p2.stderr[-3000:]
    second = evs2[len(evs1):]                     # appended: the first run's records stay above
    assert evs2[:len(evs1)] == evs1 and kinds(second)[0] == "start", kinds(evs2)
    assert "recovery" not in kinds(second) and "failure" not in kinds(second), kinds(second)
    assert "recoveries (seconds)" not in p2.stdout, p2.stdout[-3000:]
    table = p2.stdout.split("elastor run: phases")[1]
    assert [ln.split()[0] for ln in table.splitlines()[2:] if ln[:1].isdigit()] == ["0"], table   # one phase


# ---------------------------------------------------------------- F14: a script's own exit 75 after training
RESIZING = """
import os, signal, sys, time
from elastor_ds.elastic.worker import ElasticWorker
ctl = ElasticWorker.from_env()
rnd = int(os.environ["ELASTOR_ROUND"])
for it in range(1, 4):
    time.sleep(0.05)
    ctl.heartbeat(it, last=it == 3)
    if it == 2 and os.environ["MODE"] == "own":
        sys.exit(75)                                  # the script's own EX_TEMPFAIL, after iterations
    if it == 2 and rnd == 0 and os.environ["MODE"] == "asked":
        os.kill(os.getpid(), signal.SIGUSR1)          # as another node's resize request reaches a rank
    code = ctl.agree_stop()
    if code:
        sys.exit(code.exit_code())
"""


def test_a_script_exiting_75_on_its_own_after_iterations_is_charged_to_max_restarts(tmp_path):
    p, evs = elastor_run(tmp_path, RESIZING, ["--nproc-per-node", "2", "--max-restarts", "1"], env={"MODE": "own"},
                         timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "elastor run: the workers exited 75 (elastor's resize code) 2 times though no resize was asked for" \
        in p.stderr, p.stderr[-3000:]
    assert kinds(evs).count("launch") == 2 and kinds(evs)[-1] == "stopped", kinds(evs)


def test_an_agreed_resize_is_still_relaunched_without_counting(tmp_path):
    p, evs = elastor_run(tmp_path, RESIZING, ["--nproc-per-node", "2", "--max-restarts", "0"], env={"MODE": "asked"},
                         timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert kinds(evs).count("launch") == 2 and "failure" not in kinds(evs) and kinds(evs)[-1] == "finished", kinds(evs)


# ---------------------------------------------------------------- F5: a hookless worker and a scale-up
HOOKLESS = """
import os, sys, time
rnd = int(os.environ["ELASTOR_ROUND"])
if rnd == 0 and os.environ["RANK"] == "1":
    os.kill(os.getpid(), 9)            # round 0: rank 1's device fails, shrink to one worker
if rnd == 1:
    open(sys.argv[1], "w").close()     # round 1 runs (its signal handlers are installed by now)
    time.sleep(120)                    # past the --shutdown-timeout: only the scale-up's signal ends it
elif rnd == 0:
    time.sleep(30)                     # killed with the failed round
print("round", rnd, "done", flush=True)
"""


def test_a_worker_without_hooks_ends_at_once_on_a_scale_up(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOOKLESS)
    up, ev = tmp_path / "round1_up", tmp_path / "ev.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--monitor-interval", "0.05",
                          "--nproc-per-node", "2", "--on-failure", "shrink", "--shutdown-timeout", "60",
                          "--events", str(ev), str(script), str(up)], cwd=str(tmp_path), env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t_end = time.monotonic() + 120   # the controller's imports and two launches: seconds under load
        while not up.exists() and time.monotonic() < t_end and p.poll() is None:
            time.sleep(0.05)
        assert up.exists(), "round 1 never started"
        t0 = time.monotonic()
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    evs = [json.loads(x) for x in ev.read_text().splitlines()]
    assert p.returncode == 0, err[-3000:]
    assert time.monotonic() - t0 < 30, err[-3000:]     # not the 60 s --shutdown-timeout
    assert [k for k in kinds(evs) if k in ("launch", "failure", "scale_up", "finished")] == \
        ["launch", "failure", "launch", "scale_up", "launch", "finished"], kinds(evs)
    assert "[default0]:elastor worker: no hooks: relaunching without a checkpoint" in err, err[-3000:]
    assert "[default0]:round 2 done" in out and "[default1]:round 2 done" in out, out[-2000:]


def test_an_unreachable_etcd_v1_server_is_one_line_naming_the_endpoint(tmp_path):
    import socket
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p, _ = elastor_run(tmp_path, "print('ran')\n", ["--rdzv-backend", "etcd", "--nnodes", "2", "--rdzv-endpoint",
                                                     f"127.0.0.1:{port}"], timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"elastor run: error: --rdzv-endpoint 127.0.0.1:{port}: cannot reach the rendezvous store "
                           f"(RendezvousConnectionError: the etcd server did not answer: EtcdException:"), last
    assert "Traceback" not in p.stderr and "unexpected" not in p.stderr and "ran" not in p.stdout, p.stderr[-3000:]


# ---------------------------------------------------------------- F11: a preempted job is not a finished one
PREEMPTIBLE = """
import os, sys, time
from elastor_ds.elastic.worker import ElasticWorker
ctl = ElasticWorker.from_env()
for it in range(1, 601):
    time.sleep(0.05)
    ctl.heartbeat(it, last=it == 600)
    if it == 2:
        open(sys.argv[1], "w").close()
    code = ctl.agree_stop()
    if code:
        open(sys.argv[1] + ".saved", "w").write(str(it))   # (a trainer checkpoints here)
        sys.exit(code.exit_code())
"""


def test_a_preempted_job_exits_143_after_its_workers_saved(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PREEMPTIBLE)
    up, ev = tmp_path / "training", tmp_path / "ev.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--monitor-interval", "0.05",
                          "--events", str(ev), str(script), str(up)], cwd=str(tmp_path), env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t_end = time.monotonic() + 120   # the controller's imports and the launch: seconds under load
        while not up.exists() and time.monotonic() < t_end and p.poll() is None:
            time.sleep(0.05)
        assert up.exists(), "the worker never trained"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, err[-3000:]
    assert "elastor run: preempted: state saved, rerun to resume" in err.splitlines(), err[-2000:]
    assert 2 <= int((tmp_path / "training.saved").read_text()) < 600
    evs = [json.loads(x) for x in ev.read_text().splitlines()]
    assert kinds(evs)[-1] == "preempted" and "finished" not in kinds(evs) and "stopped" not in kinds(evs), kinds(evs)


# ---------------------------------------------------------------- F13: the workers' PYTHONPATH
SHOWS_PATH = "import os\nprint('PYTHONPATH=' + os.environ.get('PYTHONPATH', '<unset>'), flush=True)\n"


def test_the_package_folder_is_not_put_first_on_the_workers_pythonpath(tmp_path):
    # found through PYTHONPATH already: left as it is (it was put first a second time)
    p, _ = elastor_run(tmp_path, SHOWS_PATH, [], env={"PYTHONPATH": ROOT})
    assert p.returncode == 0 and f"[default0]:PYTHONPATH={ROOT}\n" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    # found only through the current folder (a checkout): appended after the user's entries, not before
    other = str(tmp_path / "mine")
    script = tmp_path / "train.py"
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--log-dir",
                        str(tmp_path / "logs"), str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(ENV, PYTHONPATH=other))
    assert p.returncode == 0 and f"[default0]:PYTHONPATH={other}{os.pathsep}{ROOT}\n" in p.stdout, \
        p.stdout[-2000:] + p.stderr[-2000:]


# ---------------------------------------------------------------- docs: --help names the real folders
def test_the_help_names_the_snapshot_and_log_folders_as_they_are_made(tmp_path):
    import re
    h = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--help"], capture_output=True, text=True,
                       timeout=60, env=dict(ENV, COLUMNS="400"))
    assert "(default a new /dev/shm/elastor-<rdzv id>-<host>-<pid>-<random>)" in h.stdout, h.stdout
    assert "(in DIR/<rdzv id>_<random>/attempt_<launch>/<local rank>/)" in h.stdout, h.stdout
    p, _ = elastor_run(tmp_path, "print('ok')\n", ["--rdzv-id", "j7", "--standalone"])
    assert p.returncode == 0, p.stderr[-2000:]
    made = re.search(r"memory snapshots of this node: (\S+) \(created\)", p.stderr).group(1)
    assert re.fullmatch(r"/dev/shm/elastor-j7-[^/]+-\d+-[0-9a-f]+", made), made
    logs = tmp_path / "ev_logs"
    assert [x.relative_to(logs).parts[1:] for x in logs.glob("j7_*/*/*/stdout.log")] == [("attempt_0", "0", "stdout.log")]
