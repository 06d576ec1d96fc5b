"""Standby workers forked from the node's template interpreter (``elastor run``'s default): the
standbys are the agent's own children, did none of the imports themselves, and become workers with
the assignment's argv, environment, logs and exit status, as spawned standbys do."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from elastor_ds.elastic.standby import StandbyPool

WORKER = """
import json, os, sys
import numpy as np
with open(sys.argv[1], "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "env": os.environ.get("MY_VAR"),
               "leak": os.environ.get("TEMPLATE_ONLY"), "argv": sys.argv[1:], "rand": float(np.random.random()),
               "torch_preloaded": "torch" in sys.modules, "stdin": sys.stdin.read()}, f)
print("to the rank's stdout log", flush=True)
sys.exit(int(sys.argv[2]))
"""


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds used) of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fill(pool: StandbyPool, timeout: float = 120.0) -> list[int]:
    """The first fill only starts the template (it imports while the rendezvous runs); the
    standbys are forked once it is ready."""
    assert pool.fill() == [] and pool.template is not None and pool.template.state == "importing"
    t_end = time.time() + timeout
    while pool.template.importing() and time.time() < t_end:
        time.sleep(0.05)
    return pool.fill()


def _wait_ready(pool: StandbyPool, n: int, timeout: float = 120.0) -> None:
    t_end = time.time() + timeout
    while pool.ready_count() < n and time.time() < t_end:
        time.sleep(0.05)
    assert pool.ready_count() == n, [s.state for s in pool.idle]


@pytest.fixture
def pool(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPLATE_ONLY", "the agent's environment at the template's start")
    p = StandbyPool(size=2, folder=str(tmp_path / "standby"), preload=("torch", "numpy"))
    yield p
    p.close()


def test_forked_standbys_are_our_children_and_import_nothing(pool, tmp_path):
    pids = _fill(pool)
    assert len(pids) == 2 and pool.template is not None and pool.template.state == "ready"
    _wait_ready(pool, 2)
    template_cpu = _stat(pool.template.proc.pid)[1]
    for pid in pids:
        ppid, cpu = _stat(pid)
        assert ppid == os.getpid(), f"standby {pid} has parent {ppid}, not the agent {os.getpid()}"
        assert pid != pool.template.proc.pid
        # torch's import took the template seconds of CPU; a forked standby spends a fraction of that
        assert cpu < 0.25 * template_cpu, (cpu, template_cpu)
    assert template_cpu > 0.5, template_cpu

    script = tmp_path / "w.py"
    script.write_text(WORKER)
    outs = []
    procs = []
    for rank, code in ((0, 3), (1, 0)):
        out = tmp_path / f"out{rank}.json"
        log_out, log_err = tmp_path / f"{rank}.out", tmp_path / f"{rank}.err"
        env = {"MY_VAR": f"rank{rank}", "PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
        procs.append(pool.assign(rank, (str(script), str(out), str(code)), env, str(log_out), str(log_err)))
        outs.append((out, log_out, code))
    assert [p.pid for p in procs] == pids   # the standbys themselves became the workers
    for p, (out, log_out, code) in zip(procs, outs):
        assert p.wait(timeout=60) == code
        doc = json.loads(out.read_text())
        assert doc["ppid"] == os.getpid() and doc["sid"] == doc["pid"]
        assert doc["env"] == f"rank{out.name[3]}" and doc["leak"] is None   # the assignment's environment only
        assert doc["torch_preloaded"] is True and doc["stdin"] == ""
        assert log_out.read_text().strip().endswith("to the rank's stdout log")
    r0, r1 = (json.loads(o.read_text())["rand"] for o, _, _ in outs)
    assert r0 != r1, "forked standbys share numpy's global random state"


def test_signals_reach_a_forked_standby_and_its_status_comes_back(pool):
    _fill(pool)
    _wait_ready(pool, 2)
    sb = pool.take(None)
    sb.proc.send_signal(signal.SIGTERM)
    assert sb.proc.wait(timeout=30) == -signal.SIGTERM
    sb.retire()


def test_the_first_launch_forks_on_demand_while_the_template_imports(pool, tmp_path):
    """A launch before the template is ready waits for it and forks, instead of spawning
    interpreters that all import at once."""
    assert pool.fill() == []
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "o.json"
    p = pool.assign(0, (str(script), str(out), "0"), {"MY_VAR": "rank0", "PATH": os.environ.get("PATH", "")},
                    str(tmp_path / "o.log"), str(tmp_path / "e.log"))
    assert pool.assigned == {0: "standby-warm"} and pool.template.state == "ready"
    assert p.wait(timeout=60) == 0
    assert json.loads(out.read_text())["torch_preloaded"] is True


def test_a_dead_template_falls_back_to_spawned_standbys(pool):
    _fill(pool)
    _wait_ready(pool, 2)
    os.killpg(pool.template.proc.pid, signal.SIGKILL)
    pool.template.proc.wait(timeout=10)
    gone = pool.take(None)
    gone.retire()
    new = pool.fill()
    assert len(new) == 1 and pool.template.state == "unusable"
    assert _stat(new[0])[0] == os.getpid()
    _wait_ready(pool, 2)
    # read once it is ready: while the child is inside execve its cmdline reads empty (seen under load)
    with open(f"/proc/{new[0]}/cmdline", "rb") as f:   # spawned by the agent: its own interpreter
        assert b"elastor_ds.elastic.standby_main" in f.read()


def test_the_template_has_no_path_another_user_could_connect_to(pool):
    _fill(pool)
    _wait_ready(pool, 2)
    tpid = pool.template.proc.pid
    inodes = set()
    for fd in os.listdir(f"/proc/{tpid}/fd"):
        target = os.readlink(f"/proc/{tpid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    assert inodes, "the template holds no socket at all"
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    named = [r for r in rows if r[6] in inodes and len(r) > 7]
    assert named == [], f"the template's sockets are bound to paths: {named}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_refill_never_blocks_the_agents_loop_while_the_template_imports(tmp_path, monkeypatch):
    """QA round 7, Q7-5: the loop's refill waited for the template's reply, and the template first
    imports the modules the workers learned (seconds for a trainer's own), so a SIGTERM was acted on
    only after that. ``tick`` now sends the fork request and collects the reply at a later tick."""
    slow = tmp_path / "mods"
    slow.mkdir()
    (slow / "slow_trainer_mod.py").write_text("import time\ntime.sleep(3.0)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")]))
    p = StandbyPool(size=1, folder=str(tmp_path / "standby"), preload=("json",))
    try:
        pool_pids = _fill(p)
        assert len(pool_pids) == 1 and p.template.state == "ready"
        p.take(None).retire()   # a launch took it
        # the workers of that launch learned a module that takes the template 3 s to import
        with open(os.path.join(p.folder, "modules.json"), "w") as f:
            json.dump(["slow_trainer_mod"], f)
        p.schedule_refill()
        longest, ticks = 0.0, 0
        t0 = time.monotonic()
        while not p.idle:
            assert time.monotonic() - t0 < 60, "no standby after 60 s"
            t = time.monotonic()
            p.tick(workers_training=True)
            longest = max(longest, time.monotonic() - t)
            ticks += 1
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert took >= 2.5, took           # the template did import the slow module first
        assert longest < 0.5, longest      # and no tick waited for it
        assert ticks > 10 and p.template.state == "ready" and len(p.idle) == 1
        assert _stat(p.idle[0].proc.pid)[0] == os.getpid()   # adopted, as a blocking fork's standby is
        _wait_ready(p, 1)
        p.schedule_refill()   # full: a later refill does nothing
        p.tick(True)
        assert len(p.idle) == 1
    finally:
        p.close()


def test_a_fork_a_refill_left_pending_is_reported_when_a_launch_takes_it(tmp_path):
    """CI of the twenty-seventh session: a refill sent its fork request, then stopped (a worker died:
    no refill while not every worker trains), and the relaunch's ``assign`` collected that fork
    itself. The standby became a worker but was never reported, so the event log missed it.
    Every standby made, by a refill or by an assignment, now reaches ``on_spawn``."""
    reported: list[int] = []
    p = StandbyPool(size=1, folder=str(tmp_path / "standby"), preload=("json",))
    p.on_spawn = reported.extend
    try:
        first = _fill(p)
        assert reported == first and len(first) == 1
        p.take(None).retire()              # the first launch took it
        p.schedule_refill()
        p.tick(workers_training=True)      # the fork request goes out; its reply comes later
        assert p.template._pending is not None and p.idle == []
        # a worker dies here: the agent ticks no refill any more, and the relaunch assigns
        script = tmp_path / "w.py"
        script.write_text("import sys\nsys.exit(0)\n")
        proc = p.assign(0, (str(script),), {"PATH": os.environ.get("PATH", "")}, None, None)
        assert p.assigned == {0: "standby-warm"}
        assert reported == first + [proc.pid]
        assert proc.wait(timeout=60) == 0
    finally:
        p.close()


_ORPHAN = """
import os, sys
from elastor_ds.elastic import standby_template as t
stdin_r, stdin_w = os.pipe()
ready_r, ready_w = os.pipe()
pid = t.fork_standby(agent=os.getpid())   # this process is no subreaper: B is adopted by another
if pid == 0:
    t._become_standby(stdin_r, ready_w, int(sys.argv[1]), t._FORKED_PARENT)
    os._exit(3)
print(pid, flush=True)
"""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_a_forked_standby_adopted_by_another_process_exits_at_once(tmp_path):
    """CI of the thirty-first session: a standby the template forked while the agent gave its request
    up (it closed the pool: the job ended) was adopted by init, not the agent, and waited 10 s for the
    agent before exiting: a process left on the node after ``elastor run`` had exited. It now exits as
    soon as its parent is anyone but the intermediate process or the agent."""
    import subprocess
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as fo, open(err, "w") as fe:   # files, not pipes: B holds them too
        p = subprocess.run([sys.executable, "-c", _ORPHAN, str(os.getpid())], stdout=fo, stderr=fe,
                           timeout=60, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert p.returncode == 0, err.read_text()
    b = int(out.read_text())
    t0 = time.monotonic()
    while _state(b) not in (None, "Z") and time.monotonic() - t0 < 15:
        time.sleep(0.01)
    took = time.monotonic() - t0
    assert _state(b) in (None, "Z"), f"standby {b} still running after {took:.1f} s"
    assert took < 2.0, took   # before: 10 s, the adoption deadline
