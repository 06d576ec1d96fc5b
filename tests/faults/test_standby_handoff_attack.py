"""Another local user against `elastor run`'s standby handoff (issue 19, "code injection through the
standby handoff"). Real `elastor run` jobs (root), a real attacker process (uid ``nobody``).

The job's ``--log-dir`` is a shared, world-writable folder. The attacker plants a ``standby``
folder of its own with a ``standby.log`` symlink to a file of the victim's, and swaps every
``assign_*.json`` it can see for an assignment that runs its own script (which would leave a
marker file, written with the job's uid). The job must not run that script, must not write
through the symlink, and must keep what it creates there private (0700, its own).

Oracles: the marker file the attacker's script would write, the victim file's bytes, ``lstat`` of
what the job created."""
from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys

import pytest

from elastic_utils import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ATTACKER = r'''
import json, os, sys, time
shared, evil, victim, plant, seconds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", float(sys.argv[5])
if plant:
    sb = os.path.join(shared, "standby")
    os.mkdir(sb)
    os.chmod(sb, 0o777)
    os.symlink(victim, os.path.join(sb, "standby.log"))
open(os.path.join(shared, "attacker_ready"), "w").close()
evil_job = json.dumps({"argv": [evil], "env": {"PATH": "/usr/bin:/bin"}, "stdout": None, "stderr": None, "cwd": "/"})
swapped = 0
end = time.time() + seconds
while time.time() < end:
    for root, dirs, files in os.walk(shared):
        for f in files:
            if f.startswith("assign_") and f.endswith(".json"):
                tmp = os.path.join(root, ".evil.tmp")
                try:
                    with open(tmp, "w") as fh:
                        fh.write(evil_job)
                    os.replace(tmp, os.path.join(root, f))
                    swapped += 1
                except OSError:
                    pass
    time.sleep(0.002)
print("swapped", swapped)
'''

EVIL = "import os\nopen({marker!r}, 'w').write(str(os.getuid()))\n"
GOOD = "import os\nopen({marker!r}, 'w').write('ok')\n"


@pytest.fixture
def nobody():
    if os.getuid() != 0:
        pytest.skip("needs root to run the attacker as another user (CI runs as root)")
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def _plant_symlink(nobody, target, link):
    """``ln -s target link`` run as the other user (the attacker); returns ``link``."""
    uid, gid = nobody
    r = subprocess.run(["/bin/ln", "-s", str(target), str(link)],
                       preexec_fn=lambda: (os.setgroups([]), os.setgid(gid), os.setuid(uid)))
    assert r.returncode == 0 and os.lstat(link).st_uid == uid
    return link


def _reachable(path: str) -> None:
    """Let other users traverse the folders above ``path`` (pytest's are 0700)."""
    p = os.path.dirname(os.path.abspath(path))
    while p not in ("/", ""):
        os.chmod(p, os.stat(p).st_mode | 0o001)
        p = os.path.dirname(p)


def _setup(tmp_path, mode: int):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    _reachable(str(shared))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    evil_marker, good_marker = shared / "evil_ran", tmp_path / "good_ran"
    evil = shared / "evil.py"
    evil.write_text(EVIL.format(marker=str(evil_marker)))
    os.chmod(evil, 0o644)
    good = tmp_path / "good.py"
    good.write_text(GOOD.format(marker=str(good_marker)))
    return shared, victim, evil, evil_marker, good, good_marker


def _attacker(uid_gid, shared, evil, victim, plant: bool, seconds: float) -> subprocess.Popen:
    uid, gid = uid_gid

    def drop():
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    # the system interpreter: the test's own may live where the attacker cannot go (it needs the stdlib only)
    python = next((x for x in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(x, os.X_OK)), sys.executable)
    p = subprocess.Popen([python, "-c", ATTACKER, str(shared), str(evil), str(victim), "1" if plant else "0",
                          str(seconds)], preexec_fn=drop, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd="/")
    deadline = 30
    import time
    t0 = time.time()
    while not (shared / "attacker_ready").exists():
        assert p.poll() is None and time.time() - t0 < deadline, p.communicate()[0]
        time.sleep(0.05)
    return p


def _run(tmp_path, shared, script, events=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1", "--log-dir",
           str(shared), "--standby-preload", "torch", "--monitor-interval", "0.1", "--snapshot-dir",
           str(tmp_path / "snap")]
    if events:
        cmd += ["--events", str(events)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(cmd + [str(script)], capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))


@pytest.mark.parametrize("mode", [0o1777, 0o777], ids=["sticky", "not-sticky"])
def test_planted_standby_folder_runs_nothing_and_writes_nothing(tmp_path, nobody, mode):
    shared, victim, evil, evil_marker, good, good_marker = _setup(tmp_path, mode)
    att = _attacker(nobody, shared, evil, victim, plant=True, seconds=90)
    try:
        r = _run(tmp_path, shared, good)
    finally:
        att.kill()
        att.wait()
    out = r.stdout + r.stderr
    assert not evil_marker.exists(), f"the attacker's script ran as uid {evil_marker.read_text()}:\n{out[-3000:]}"
    assert victim.read_text() == "precious\n", "the job wrote through the planted standby.log symlink"
    # refused before any worker ran, naming what is wrong, one line, no traceback
    assert r.returncode == 2, out[-3000:]
    named = str(shared) if mode == 0o777 else str(shared / "standby")
    assert named in r.stderr and "Traceback" not in out, out[-3000:]
    assert not good_marker.exists()


def test_shared_sticky_log_dir_keeps_the_handoff_private(tmp_path, nobody):
    """The attacker cannot plant anything (it starts after the job made its folders... or before:
    it plants nothing here) and swaps every assignment file it can see: there is none to see, the
    job's own script runs through a standby, and every folder the job made there is 0700 and ours."""
    shared, victim, evil, evil_marker, good, good_marker = _setup(tmp_path, 0o1777)
    att = _attacker(nobody, shared, evil, victim, plant=False, seconds=90)
    events = tmp_path / "events.jsonl"
    try:
        r = _run(tmp_path, shared, good, events)
    finally:
        att.kill()
        att.wait()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert not evil_marker.exists(), out[-3000:]
    assert good_marker.read_text() == "ok"
    launch = [json.loads(x) for x in events.read_text().splitlines() if '"launch"' in x]
    assert launch and launch[0]["launch_modes"][0].startswith("standby"), launch
    for name in ("standby", "heartbeat", os.path.join("heartbeat", "round0")):
        st = os.lstat(shared / name)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, \
            (name, oct(st.st_mode), st.st_uid)
    assert not [f for _, _, fs in os.walk(shared) for f in fs if f.startswith("assign_")]


def test_assignment_larger_than_a_pipe_buffer_and_a_torn_one(tmp_path):
    """The assignment travels only through the pipe: one of 200 KB (more than a pipe buffer, written
    by a helper thread while the standby still imports) arrives whole; a torn or malformed one makes
    the standby exit 1 (a failed worker), not run anything."""
    from elastor_ds.elastic.standby import StandbyPool
    marker = tmp_path / "big_env"
    script = tmp_path / "w.py"
    script.write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(len(os.environ['BIG'])))\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    pool = StandbyPool(size=1, folder=str(logs / "standby"), preload=("json",))
    try:
        pool.fill()
        env = dict(os.environ, BIG="x" * 200_000, PYTHONPATH=ROOT)
        proc = pool.assign(0, (str(script),), env, str(tmp_path / "out.log"), str(tmp_path / "err.log"))
        assert proc.wait(timeout=120) == 0, (tmp_path / "err.log").read_text()[-2000:]
    finally:
        pool.close()
    assert marker.read_text() == "200000"
    assert not [f for f in os.listdir(logs / "standby") if f.startswith("assign_")]
    env = dict(os.environ, PYTHONPATH=ROOT, ELASTOR_STANDBY_PRELOAD="")
    for torn in (b'{"argv": ["/tmp/x.py"], "env": {', b"/tmp/assign_0_x.json", b'["not", "an", "assignment"]'):
        r = subprocess.run([sys.executable, "-m", "elastor_ds.elastic.standby_main"], input=torn, env=env,
                           capture_output=True, timeout=120)
        assert r.returncode == 1 and b"malformed assignment" in r.stderr, (torn, r.returncode, r.stderr[-500:])


def test_planted_events_symlink_is_not_written_through(tmp_path, nobody):
    """``--events`` in a shared folder (no sticky bit: the kernel's protected_symlinks does not
    apply) where another user planted a symlink to a file of ours: exit 2, the file unchanged."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _reachable(str(shared))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = _plant_symlink(nobody, victim, shared / "events.jsonl")
    good = tmp_path / "good.py"
    good.write_text("pass\n")
    logs = tmp_path / "logs"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1",
                        "--no-standby", "--events", str(link), "--log-dir", str(logs), "--snapshot-dir",
                        str(tmp_path / "snap"), str(good)], capture_output=True, text=True, timeout=180, env=env,
                       cwd=str(tmp_path))
    assert victim.read_text() == "precious\n", "the controller appended events through the planted symlink"
    assert p.returncode == 2 and str(link) in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_log_dir_owned_by_another_user_is_refused(tmp_path, nobody):
    """A ``--log-dir`` owned by another user, mode 0755, then 1777 (the sticky bit stops other users,
    not the folder's owner): its owner may rename or replace what the controller makes there, e.g.
    swap the heartbeat folder for one holding a symlink that a worker's heartbeat writes through.
    Exit 2 naming it both times, before any worker starts or any folder is made in it. (The sticky
    variant was accepted before: the owner's swap overwrote a root-only file.)"""
    uid, _ = nobody
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, uid, -1)
    os.chmod(theirs, 0o755)
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1",
                        "--no-standby", "--log-dir", str(theirs), "--snapshot-dir", str(tmp_path / "snap"),
                        str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert p.returncode == 2 and f"owned by uid {uid}" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert os.listdir(theirs) == [] and not marker.exists()
    os.chmod(theirs, 0o1777)   # the same folder, sticky and writable by all: refused all the same
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1",
                        "--no-standby", "--log-dir", str(theirs), "--snapshot-dir", str(tmp_path / "snap"),
                        str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert p.returncode == 2 and f"owned by uid {uid}" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert os.listdir(theirs) == [] and not marker.exists()


def test_default_log_dir_planted_as_a_symlink_by_another_user_is_refused(tmp_path, nobody):
    """The default log dir sits beside ``--events`` (``<base>_logs``); in a shared sticky folder
    another user plants it as a symlink to a directory of ours: exit 2 naming the link, nothing
    created in its target (QA Q10: the controller made its folders there)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    _reachable(str(shared))
    target = tmp_path / "mine"
    target.mkdir()
    uid, _ = nobody
    link = _plant_symlink(nobody, target, shared / "run_logs")
    good = tmp_path / "good.py"
    good.write_text("pass\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1",
                        "--no-standby", "--events", str(shared / "run.jsonl"), "--snapshot-dir", str(tmp_path / "snap"),
                        str(good)], capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert p.returncode == 2 and f"--log-dir {link}: is a symlink owned by uid {uid}" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and os.listdir(target) == []
