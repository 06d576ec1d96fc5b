"""``--snapshot-dir`` never deletes what elastor run did not create, and another local user cannot
squat or redirect it (issue 19). Each test reproduces a finding as a careless user or an attacker
(the unprivileged user ``nobody``) would; each failed on the old code (it deleted ``local/`` of any
directory with a warning, shared a live job's directory, and accepted any existing directory
whatever its owner or mode).

Real ``elastor run`` controllers for the CLI findings (exit code, message, files left intact); the
directory logic in-process for the rest."""
from __future__ import annotations

import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from tmpfs_utils import fill, small_tmpfs
from elastor_ds.elastic import snapshot_dir
from elastor_ds.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(600)\n"
pytestmark = pytest.mark.timeout(300)


def _run(snap: str, script: str, *args: str, cwd: str, wait: bool = True):
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node", "1", "--no-standby",
           "--max-restarts", "0", "--monitor-interval", "0.1", "--log-dir", os.path.join(cwd, "logs"),
           "--snapshot-dir", snap, script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=180)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd,
                            start_new_session=True)


def _tree(path) -> dict[str, str]:
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for f in files:
            q = os.path.join(dirpath, f)
            with open(q) as fh:
                out[os.path.relpath(q, path)] = fh.read()
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), path) + "/"] = ""
    return out


def test_a_users_directory_holding_local_is_refused_with_exit_2_and_left_intact(tmp_path):
    """``--snapshot-dir $HOME`` (any non-empty directory that is not ours) deleted ``$HOME/local``."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "local").mkdir()
    (home / "local" / "thesis.tex").write_text("years of work")
    (home / ".bashrc").write_text("export X=1\n")
    before = _tree(home)
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    r = _run(str(home), str(ok), cwd=str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--snapshot-dir {home}: is not empty" in r.stderr and "name an empty or new directory" in r.stderr
    assert "Traceback" not in r.stderr
    assert _tree(home) == before


def test_a_live_jobs_snapshot_directory_is_refused_and_its_snapshots_survive(tmp_path):
    snap = str(tmp_path / "snap")
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(SLEEPER)
    started = tmp_path / "started"
    first = _run(snap, str(sleeper), str(started), cwd=str(tmp_path), wait=False)
    try:
        t_end = time.time() + 120
        while not started.exists():
            assert first.poll() is None and time.time() < t_end, "the first job's worker never started"
            time.sleep(0.1)
        os.makedirs(os.path.join(snap, "local", "step_000000007"))
        with open(os.path.join(snap, "local", "latest"), "w") as f:
            f.write("step_000000007\n")
        before = _tree(snap)
        ok = tmp_path / "ok.py"
        ok.write_text("pass\n")
        r = _run(snap, str(ok), cwd=str(tmp_path))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"belongs to a live elastor run (pid {first.pid} on {socket.gethostname()})" in r.stderr, r.stderr
        assert _tree(snap) == before             # the first job's snapshots are untouched
        assert first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def _nobody() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.fail("the user nobody is needed to play the other local user")
    return pw.pw_uid, pw.pw_gid


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root (CI runs as root)")
def test_a_squatted_world_writable_directory_with_a_symlink_is_refused(tmp_path):
    """Another user pre-creates the directory 0777 with a ``local`` symlink to a folder of theirs:
    we used to accept it and write our snapshots (model weights) through the link."""
    uid, gid = _nobody()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    squat = os.path.join(shm, f"elastor-squat-{os.getpid()}")
    loot = tmp_path / "loot"
    loot.mkdir()
    os.chown(loot, uid, gid)
    try:
        os.mkdir(squat)
        os.chmod(squat, 0o777)
        os.symlink(str(loot), os.path.join(squat, "local"))
        os.lchown(os.path.join(squat, "local"), uid, gid)
        os.chown(squat, uid, gid)
        with pytest.raises(ConfigError, match=r"belongs to uid \d+, not to you"):
            snapshot_dir.prepare(squat, "job")
        os.chown(squat, 0, 0)       # even ours: open to others is refused, the link never followed
        with pytest.raises(ConfigError, match=r"other users may enter it \(mode 0777\)"):
            snapshot_dir.prepare(squat, "job")
        assert os.listdir(loot) == [] and os.path.islink(os.path.join(squat, "local"))
    finally:
        if os.path.islink(os.path.join(squat, "local")):
            os.unlink(os.path.join(squat, "local"))
        if os.path.isdir(squat):
            os.rmdir(squat)


def test_the_default_directory_is_fresh_private_and_unpredictable(tmp_path, monkeypatch):
    monkeypatch.delenv(snapshot_dir.ENV_SNAPSHOT_DIR, raising=False)
    a = snapshot_dir.prepare(None, "job")
    b = snapshot_dir.prepare(None, "job")
    try:
        assert a.path != b.path and a.created and b.created
        for sd in (a, b):
            st = os.lstat(sd.path)
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
            # the old predictable name (elastor-<id>-<host>-<pid>) is not what we use: a squatter cannot guess it
            assert sd.path.rsplit("-", 1)[0].endswith(f"-{os.getpid()}") and len(sd.path.rsplit("-", 1)[1]) == 12
    finally:
        snapshot_dir.cleanup(a)
        snapshot_dir.cleanup(b)
    assert not os.path.lexists(a.path) and not os.path.lexists(b.path)


def test_a_folder_others_may_write_without_the_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)          # no sticky bit: another user could rename our directory away
    with pytest.raises(ConfigError, match=r"shared may be written by other users \(mode 0777, no sticky bit\)"):
        snapshot_dir.prepare(str(shared / "snap"), "job")
    assert os.listdir(shared) == []
    os.chmod(shared, 0o1777)         # /tmp-like: fine
    sd = snapshot_dir.prepare(str(shared / "snap"), "job")
    snapshot_dir.cleanup(sd)
    assert os.listdir(shared) == []


def test_an_existing_private_empty_directory_is_used_and_only_our_entries_go(tmp_path, monkeypatch):
    monkeypatch.delenv(snapshot_dir.ENV_SNAPSHOT_DIR, raising=False)
    d = tmp_path / "mine"
    d.mkdir(mode=0o700)
    sd = snapshot_dir.prepare(str(d), "job")
    assert not sd.created
    (d / "local" / "step_000000001").mkdir(parents=True)
    (d / "peer").mkdir()
    snapshot_dir.cleanup(sd)
    assert d.is_dir() and os.listdir(d) == []
    d.chmod(0o755)                   # readable by others: the snapshots are model weights
    with pytest.raises(ConfigError, match=r"run chmod 700"):
        snapshot_dir.prepare(str(d), "job")


def test_cleanup_of_a_directory_swapped_for_a_symlink_deletes_nothing(tmp_path):
    d = tmp_path / "snap"
    sd = snapshot_dir.prepare(str(d), "job")
    victim = tmp_path / "victim"
    (victim / "local").mkdir(parents=True)
    (victim / "local" / "data").write_text("keep")
    os.rename(d, tmp_path / "moved")
    os.symlink(victim, d)
    snapshot_dir.cleanup(sd)
    assert (victim / "local" / "data").read_text() == "keep"


def test_a_stale_marker_in_a_users_own_directory_removes_only_the_jobs_entries(tmp_path):
    """The sweep of a dead job's directory that the user had made (marker ``created: false``) keeps
    the directory and anything the user put there later."""
    base = tmp_path / "base"
    base.mkdir()
    d = base / "elastor-users-own"
    d.mkdir(mode=0o700)
    sd = snapshot_dir.prepare(str(d), "job")
    (d / "local").mkdir()
    (d / "notes.txt").write_text("mine")
    dead = subprocess.Popen(["true"])
    dead.wait()
    import json
    rec = json.loads((d / ".elastor-owner").read_text())
    rec.update(pid=dead.pid, start=None)
    (d / ".elastor-owner").write_text(json.dumps(rec))
    assert snapshot_dir.sweep_stale(str(base)) == []
    assert sorted(os.listdir(d)) == ["notes.txt"]
    del sd


def test_a_hand_set_snapshot_dir_variable_is_checked_like_the_config_key(tmp_path, monkeypatch):
    """QA round 6, Q6-2: ``ELASTOR_SNAPSHOT_DIR`` set by hand (torchrun instead of elastor run)
    skipped every check: a 0755 folder holding other files was used, and the model's snapshots
    landed in it readable by every user. Now it is checked like ``memory_snapshot.dir``."""
    from elastor_ds.checkpoint.settings import MemorySnapshotConfig
    from elastor_ds.checkpoint.snapshot.tier import node_dir
    from elastor_ds.elastic.protocol import ENV_SNAPSHOT_DIR
    open_dir = tmp_path / "victim"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    (open_dir / "vfile").write_text("V")
    monkeypatch.setenv(ENV_SNAPSHOT_DIR, str(open_dir))
    with pytest.raises(ConfigError, match=f"{ENV_SNAPSHOT_DIR} {open_dir}: .*other users"):
        node_dir(MemorySnapshotConfig(interval_steps=1))
    assert sorted(os.listdir(open_dir)) == ["vfile"]
    fresh = tmp_path / "mine"   # absent: made private, as the config key's directory is
    monkeypatch.setenv(ENV_SNAPSHOT_DIR, str(fresh))
    assert node_dir(MemorySnapshotConfig(interval_steps=1)) == str(fresh)
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700


def test_a_snapshot_dir_on_a_full_tmpfs_is_a_clear_start_up_error_and_leaves_nothing(tmp_path):
    """QA round 10: on a tmpfs full to the last byte the controller's owner marker cannot be written;
    `elastor run` ended with a bare "OSError: [Errno 28] No space left on device" (exit 1). It is now a
    usage error (exit 2) naming the folder, its free space and the fixes, and the folder it made is
    gone. (A tmpfs with room for that marker but not the snapshots is a warning: training goes on,
    test_a_snapshot_tmpfs_full_at_start_drops_snapshots_and_training_goes_on.)"""
    mnt = tmp_path / "shm"
    with small_tmpfs(mnt, "1m"):
        fill(mnt / "filler")   # every byte
        ok = tmp_path / "ok.py"
        ok.write_text("pass\n")
        res = _run(str(mnt / "snap"), str(ok), cwd=str(tmp_path))
        left = sorted(os.listdir(mnt))
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr
    assert f"--snapshot-dir {mnt / 'snap'}: its file system is full" in err and f"df -h {mnt}" in err, err
    assert "Traceback" not in err and "Errno" not in err, err
    assert left == ["filler"], left
