"""Review 36: another local user (uid ``nobody``) who reaches a running ``elastor run``'s store
forges the controller's own values there: the failure ledger's round record and the liveness beats.

The store's port is listed in ``/proc/net/tcp`` and the run id is in argv; a c10d ``TCPStore`` takes
anyone's writes. Before :mod:`elastor_ds.elastic.store_auth`:

- a plausible node name written into each round's ``elastor/failure`` made this node's every
  failure "collateral" of that name: never counted, so ``--max-restarts 1`` never stopped a job
  whose worker failed at every launch (the first test saw a third failure, charged to the forged
  name);
- decimal values written (and rewritten) under a frozen node's ``elastor/alive/<rank>`` were beats
  to the other node, which never declared it lost while the attacker wrote (the second test: no
  ``node_lost`` failure until the attacker stopped).

Now both are sealed with the job key (a random one on a single node, ``--job-secret-file`` across
nodes) and bound to the run, the round and the key: the forged values are ignored, named once in a
warning. The attacker is a real process of uid nobody (a fork of the test that drops its uid)
writing through its own ``TCPStore`` client."""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from other_user import as_other_user, nobody_ids  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
PLAUSIBLE = "gpu-node-7.cluster:31337"   # shaped like agent.node_name(): passes NODE_NAME_RE


@pytest.fixture
def nobody():
    return nobody_ids()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _client(port: int):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


def _kill_tree(proc: subprocess.Popen) -> str:
    """SIGKILL ``proc`` and its descendants (stopped ones too); its output."""
    import psutil
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for p in [proc] + kids:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.communicate()[0] or ""


def test_a_forged_plausible_failure_record_neither_makes_failures_collateral_nor_lifts_max_restarts(
        tmp_path, nobody):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")   # every launch fails
    port, run_id = _free_port(), "ledger-forge-36"
    ev = tmp_path / "ev.jsonl"
    server = subprocess.Popen([sys.executable, "-m", "elastor_ds.elastic.store_main", "--host", "127.0.0.1",
                               "--port", str(port)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        assert server.stdout.readline().startswith("ready"), "the store did not start"

        def forge():   # before the job starts: the record of every round it will have
            c = _client(port)
            for r in range(40):
                c.set(f"torch.rendezvous.{run_id}.{r}/elastor/failure", PLAUSIBLE)
        as_other_user(nobody, forge)
        proc = subprocess.Popen([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--nnodes", "1",
                                 "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0", "--rdzv-id", run_id,
                                 "--monitor-interval", "0.1", "--max-restarts", "1", "--events", str(ev), str(script)],
                                cwd=str(tmp_path), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            t0 = time.time()
            # the budget allows 2 failures (1 relaunch): a third failure means the forgery held
            while proc.poll() is None and len([e for e in _events(ev) if e["event"] == "failure"]) < 3:
                assert time.time() - t0 < 200, "neither stopped nor failed a third time"
                time.sleep(0.2)
            fooled = proc.poll() is None
        finally:
            out = _kill_tree(proc)
    finally:
        server.terminate()
        server.communicate()
    failures = [e for e in _events(ev) if e["event"] == "failure"]
    blamed = [e.get("collateral_of") for e in failures]
    assert not fooled, f"--max-restarts 1 never stopped the job: failures charged to {blamed}"
    assert blamed == [None, None], blamed                       # this node's own failures, counted
    assert [e["job_failures"] for e in failures] == [1, 2], failures
    assert proc.returncode == 1 and "--max-restarts 1 exhausted" in out, out[-3000:]
    # said once per forged round record, naming the key, never the forged bytes
    assert "elastor/failure (round 0) holds a value this job did not write" in out, out[-3000:]
    assert PLAUSIBLE not in out, out[-3000:]


def _secret(path) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    return str(path)


def test_forged_beats_do_not_keep_a_frozen_node_alive(tmp_path, nobody):
    """Two controllers as two nodes (one job secret); node B's controller and worker are frozen
    (SIGSTOP: a node that stops answering sends nothing). For 14 s an attacker rewrites every
    liveness key of rounds 0-2 with rising decimals, between replays of B's own last value. Node A
    must declare B lost (keep_alive 1 s x 3: after ~3-5 s) while the attacker is still writing."""
    script = tmp_path / "wait.py"
    script.write_text("import os, sys, time\nt = time.time()\n"
                      "while not os.path.exists(sys.argv[1]) and time.time() - t < 200:\n    time.sleep(0.05)\n")
    go = tmp_path / "go"
    port, run_id = _free_port(), "beat-forge-36"
    secret = _secret(tmp_path / "secret")
    server = subprocess.Popen([sys.executable, "-m", "elastor_ds.elastic.store_main", "--host", "127.0.0.1",
                               "--port", str(port)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    procs: dict[str, subprocess.Popen] = {}
    outs: dict[str, str] = {}
    try:
        assert server.stdout.readline().startswith("ready"), "the store did not start"
        for name in ("a", "b"):
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--nnodes", "2", "--nproc-per-node",
                 "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                 "--rdzv-conf", "is_host=0,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120",
                 "--job-secret-file", secret, "--monitor-interval", "0.2", "--max-restarts", "3",
                 "--log-dir", str(tmp_path / f"logs-{name}"), "--events", str(tmp_path / f"ev-{name}.jsonl"),
                 str(script), str(go)],
                cwd=str(tmp_path), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)
        t0 = time.time()
        while not all(any(e["event"] == "launch" for e in _events(tmp_path / f"ev-{n}.jsonl")) for n in "ab"):
            assert all(p.poll() is None for p in procs.values()) and time.time() - t0 < 150, "no launch on both"
            time.sleep(0.2)
        time.sleep(1.5)   # a few beats of both
        import psutil
        b = psutil.Process(procs["b"].pid)
        for p in [b] + b.children(recursive=True):   # node B stops answering
            p.send_signal(signal.SIGSTOP)
        t_freeze = time.time()
        keys = [f"torch.rendezvous.{run_id}.{r}/elastor/alive/{k}" for r in range(3) for k in range(2)]

        def forge():
            c = _client(port)
            last = {k: c.get(k) for k in keys if c.check([k])}   # each node's last beat, to replay
            assert last, "no liveness key found where the test looks"
            n, t_end = 10 ** 6, time.time() + 14
            while time.time() < t_end:
                n += 1
                for k in keys:
                    c.set(k, str(n) if n % 2 or k not in last else last[k])
                time.sleep(0.25)
        as_other_user(nobody, forge)
        t_attack_end = time.time()
        lost = [e for e in _events(tmp_path / "ev-a.jsonl") if e["event"] == "failure" and e.get("lost_nodes")]
        deadline = time.time() + 20
        while not lost and time.time() < deadline:   # the old code: lost only once the attacker stopped
            time.sleep(0.2)
            lost = [e for e in _events(tmp_path / "ev-a.jsonl") if e["event"] == "failure" and e.get("lost_nodes")]
    finally:
        for name, p in procs.items():
            outs[name] = _kill_tree(p)
        server.terminate()
        server.communicate()
    out_a = outs["a"]
    assert lost, "node A never declared the frozen node lost"
    t_lost = lost[0]["time"]
    assert t_lost < t_attack_end - 3, (f"node A declared the frozen node lost {t_lost - t_freeze:.1f} s after the "
                                       f"freeze, {t_lost - t_attack_end:+.1f} s after the attacker stopped: the "
                                       f"forged beats kept it alive")
    assert t_lost - t_freeze < 10, t_lost - t_freeze
    assert "holds a value this job did not write" in out_a and "elastor/alive/" in out_a, out_a[-3000:]
