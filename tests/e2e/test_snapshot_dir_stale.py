"""A SIGKILLed ``elastor run`` leaves its snapshot directory behind; the next ``elastor run`` on the
node removes it (logged) and nothing else: not a live job's, not one without our owner marker, not
one outside our naming, not a link, not another host's. Real controllers, real SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(600)\n"


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")


def _controller(snap: str, script: str, *script_args: str, out, cwd) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1", "--no-standby",
           "--max-restarts", "0", "--monitor-interval", "0.1", "--log-dir", os.path.join(cwd, "logs"),
           "--snapshot-dir", snap, script, *script_args]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=cwd, start_new_session=True)


PIDNS = os.readlink("/proc/self/ns/pid")


def _marker(path: str, **rec) -> None:
    rec.setdefault("pidns", PIDNS)
    os.makedirs(path)
    with open(os.path.join(path, ".elastor-owner"), "w") as f:
        json.dump(rec, f)


def test_next_elastor_run_removes_a_killed_controllers_snapshot_dir_and_nothing_else(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(SLEEPER)
    started = tmp_path / "started"
    dead_dir = str(base / "elastor-job1-node-111")
    with open(tmp_path / "first.out", "w") as out:
        first = _controller(dead_dir, str(sleeper), str(started), out=out, cwd=str(tmp_path))
        try:
            t_end = time.time() + 120
            while not started.exists():
                assert first.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
                assert time.time() < t_end, "the first job's worker never started"
                time.sleep(0.1)
            # a snapshot lands in the directory, then the node's controller and its worker are SIGKILLed
            os.makedirs(os.path.join(dead_dir, "local", "step_000000003"))
            with open(os.path.join(dead_dir, "local", "latest"), "w") as f:
                f.write("step_000000003\n")
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
                first.wait()
    dead_pid = first.pid
    assert os.path.isdir(os.path.join(dead_dir, "local")), "SIGKILL must leave the directory behind (the bug)"
    with open(os.path.join(dead_dir, ".elastor-owner")) as f:
        owner = json.load(f)
    assert owner["pid"] == dead_pid and owner["host"] == socket.gethostname() and owner["pidns"] == PIDNS

    host = socket.gethostname()
    live = subprocess.Popen(["sleep", "300"])
    try:
        keep = {
            "live job": str(base / "elastor-live-222"),
            "no marker": str(base / "elastor-nomarker-333"),
            "not our naming": str(base / "other-job-444"),
            "other host": str(base / "elastor-otherhost-555"),
            "corrupt marker": str(base / "elastor-corrupt-666"),
            "other pid namespace": str(base / "elastor-otherns-321"),
        }
        _marker(keep["live job"], host=host, pid=live.pid, start=None)
        os.makedirs(keep["no marker"])
        _marker(keep["not our naming"], host=host, pid=dead_pid, start=None)
        _marker(keep["other host"], host=host + "-elsewhere", pid=dead_pid, start=None)
        _marker(keep["other pid namespace"], host=host, pid=dead_pid, start=None, pidns="pid:[1]")
        os.makedirs(keep["corrupt marker"])
        (base / "elastor-corrupt-666" / ".elastor-owner").write_text('{"host": "%s", "pid": "%d"}' % (host, dead_pid))
        target = tmp_path / "target"
        _marker(str(target), host=host, pid=dead_pid, start=None)
        os.symlink(target, base / "elastor-link-777")
        # a live pid whose recorded start time is not the process's: the pid was reused, the owner is gone
        reused = str(base / "elastor-reused-888")
        _marker(reused, host=host, pid=live.pid, start="1")

        new_dir = str(base / "elastor-job2-node-999")
        ok = tmp_path / "ok.py"
        ok.write_text("import os\nassert os.path.isdir(os.environ['ELASTOR_SNAPSHOT_DIR'])\n")
        with open(tmp_path / "second.out", "w") as out:
            second = _controller(new_dir, str(ok), out=out, cwd=str(tmp_path))
            try:
                rc = second.wait(timeout=180)
            finally:
                if second.poll() is None:
                    os.killpg(second.pid, signal.SIGKILL)
        log = (tmp_path / "second.out").read_text()
        assert rc == 0, log[-3000:]
        assert not os.path.lexists(dead_dir)
        assert not os.path.lexists(reused)
        assert f"removing the stale memory-snapshot directory {dead_dir}: its elastor run (pid {dead_pid}" in log
        assert f"removing the stale memory-snapshot directory {reused}" in log
        for why, p in keep.items():
            assert os.path.isdir(p), f"{why}: {p} must be kept"
        assert os.path.islink(base / "elastor-link-777") and (target / ".elastor-owner").is_file()
        assert not os.path.lexists(new_dir)   # the second job's own directory: removed when it ended
        assert sorted(os.listdir(base)) == sorted([os.path.basename(p) for p in keep.values()] + ["elastor-link-777"])
    finally:
        live.kill()
        live.wait()
