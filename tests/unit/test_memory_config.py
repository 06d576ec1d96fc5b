"""The "memory_snapshot" config section and the controller's snapshot directory (pure, no processes)."""
from __future__ import annotations

import os
import re
import socket
import stat

import pytest

from elastor_ds.elastic import snapshot_dir
from elastor_ds.errors import ConfigError
from elastor_ds.integrations.deepspeed.config import MemorySnapshotConfig, parse_elastor_section


def test_memory_snapshot_section_parses_with_defaults():
    cfg = parse_elastor_section({"checkpoint": {"dir": "/ckpt", "interval_steps": 100},
                                 "memory_snapshot": {"interval_steps": 1, "peer_copies": 1}})
    assert cfg.memory_snapshot == MemorySnapshotConfig(interval_steps=1, keep=1, peer_copies=1)
    assert parse_elastor_section({"checkpoint": {"dir": "/c"}}).memory_snapshot is None
    live = parse_elastor_section({"checkpoint": {"dir": "/c"}, "memory_snapshot": {"live_write": True}})
    assert live.memory_snapshot.live_write and not live.checkpoint.live_write


@pytest.mark.parametrize("section, message", [
    ({"interval_steps": 0}, r"interval_steps: expected an integer >= 1, got 0"),
    ({"interval_step": 1}, r"unknown key 'interval_step' \(did you mean 'interval_steps'\?\)"),
    ({"peer_copies": 2}, r"peer_copies: 2 is not supported; use 0 or 1"),
    ({"keep": 0}, r"keep: expected an integer >= 1"),
    ({"max_bytes": -5}, r"max_bytes: expected an integer >= 1"),
    ({"dir": ""}, r"dir: expected a non-empty string"),
    ({"live_write": "yes"}, r"memory_snapshot.live_write: expected true or false, got 'yes'"),
    ("fast", r"memory_snapshot: expected an object"),
])
def test_bad_memory_snapshot_values_name_the_key_and_the_fix(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_elastor_section({"checkpoint": {"dir": "/ckpt"}, "memory_snapshot": section})


def test_memory_snapshot_needs_a_storage_checkpoint():
    with pytest.raises(ConfigError, match=r"memory_snapshot needs elastor.checkpoint"):
        parse_elastor_section({"memory_snapshot": {"interval_steps": 1}})


def test_snapshot_dir_created_exported_and_removed(tmp_path, monkeypatch):
    monkeypatch.delenv(snapshot_dir.ENV_SNAPSHOT_DIR, raising=False)
    d = tmp_path / "node"
    sd = snapshot_dir.prepare(str(d), "job-1")
    assert sd.created and d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    assert os.environ[snapshot_dir.ENV_SNAPSHOT_DIR] == str(d)
    (d / "local").mkdir()
    (d / "local" / "x").write_text("1")
    snapshot_dir.cleanup(sd)
    assert not d.exists()
    # an empty directory the user already had is kept; only what the job put there goes
    d.mkdir(mode=0o700)
    sd = snapshot_dir.prepare(str(d), "job-1")
    assert not sd.created and sorted(os.listdir(d)) == [".elastor-owner"]
    (d / "local").mkdir()
    (d / "peer").mkdir()
    snapshot_dir.cleanup(sd)
    assert d.is_dir() and os.listdir(d) == []


def test_snapshot_dir_refuses_a_file_and_defaults_to_a_unique_memory_path(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        snapshot_dir.prepare(str(f), "job")
    p = snapshot_dir.default_path("job/../x y")
    assert os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)   # this machine (ENV.md): tmpfs
    assert os.path.dirname(p) == "/dev/shm"
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
    assert re.fullmatch(rf"elastor-job____x_y-{re.escape(host)}-{os.getpid()}-[0-9a-f]{{12}}", os.path.basename(p)), p
    assert snapshot_dir.default_path("job") != snapshot_dir.default_path("job")   # unpredictable: nobody can squat it


@pytest.mark.parametrize("section, message", [
    ({"dir": "/"}, r"memory_snapshot.dir: '/' is the root directory"),
    ({"dir": "/tmp/.."}, r"memory_snapshot.dir: '/tmp/..' is the root directory"),
    ({"interval_steps": 10 ** 30}, r"memory_snapshot.interval_steps: 1000000000000000000000000000000 is too large "
                                   r"\(at most 1000000000\)"),
    ({"interval_steps": 1e30}, r"memory_snapshot.interval_steps: expected an integer >= 1, got 1e\+30"),
    ({"keep": 10 ** 6}, r"memory_snapshot.keep: 1000000 is too large \(at most 1000\)"),
    ({"max_bytes": 10 ** 40}, r"memory_snapshot.max_bytes: 10+ is too large"),
])
def test_memory_snapshot_sizes_and_directories_are_bounded(section, message):
    """Issue 19: ``"dir": "/"`` and an interval of 1e30 used to be accepted."""
    with pytest.raises(ConfigError, match=message):
        parse_elastor_section({"checkpoint": {"dir": "/ckpt"}, "memory_snapshot": section})


def test_memory_snapshot_dir_expands_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_elastor_section({"checkpoint": {"dir": "~/ckpt"}, "memory_snapshot": {"dir": "~/snap"}})
    assert cfg.memory_snapshot.dir == str(tmp_path / "snap") and cfg.checkpoint.dir == str(tmp_path / "ckpt")


def _mem(**kw):
    return parse_elastor_section({"checkpoint": {"dir": "/tmp/x"}, "memory_snapshot": kw}).memory_snapshot


def test_peer_copy_interval_copies_every_nth_step_and_keeps_enough():
    m = _mem(peer_copy_interval_steps=4, interval_steps=2)
    assert m.peer_copy_interval_steps == 4 and m.keep == 3           # 4 / 2 + 1: the default follows
    assert [s for s in range(1, 13) if m.copies_step(s)] == [4, 8, 12]
    every = _mem()                                                    # no interval: every snapshot
    assert every.keep == 1 and [s for s in range(1, 5) if every.copies_step(s)] == [1, 2, 3, 4]
    assert not any(_mem(peer_copies=0, peer_copy_interval_steps=3).copies_step(s) for s in range(1, 10))
    assert _mem(peer_copies=0, peer_copy_interval_steps=3).keep == 1  # no copies: nothing to keep for
    assert _mem(peer_copy_interval_steps=3, keep=5).keep == 5


@pytest.mark.parametrize("section, message", [
    ({"peer_copy_interval_steps": 3, "interval_steps": 2}, "not a multiple of the snapshot interval 2"),
    ({"peer_copy_interval_steps": 0}, "peer_copy_interval_steps: expected an integer >= 1"),
    ({"peer_copy_interval_steps": 4, "keep": 2}, "keep: 2 snapshot(s) per node, but with a peer copy every 4 steps"),
])
def test_bad_peer_copy_intervals_name_the_fix(section, message):
    with pytest.raises(ConfigError) as e:
        _mem(**section)
    assert message in str(e.value)


def test_restore_candidates_are_common_steps_not_older_than_storage():
    from elastor_ds.checkpoint.session import restore_candidates

    assert restore_candidates([[5, 6, 7], [6, 7], [5, 6, 7]], -1) == [7, 6]
    assert restore_candidates([[5, 6, 7], [5, 6, 7]], 6) == [7, 6]     # storage's step ties: memory first
    assert restore_candidates([[5, 6, 7], [5, 6, 8]], 7) == []          # storage is newer than the common steps
    assert restore_candidates([[3], []], -1) == []                      # one node holds nothing
    assert restore_candidates([], -1) == []


def test_a_configured_snapshot_dir_is_checked_as_elastor_run_checks_its_own(tmp_path):
    """``"memory_snapshot": {"dir": ...}`` without ``elastor run``: a symlink, a directory others may
    enter, /dev/shm itself, or one under a folder others may write were all accepted (snapshots
    written through the link, ``local/`` left in /dev/shm). A new path is made 0700."""
    from elastor_ds.checkpoint.settings import MemorySnapshotConfig
    from elastor_ds.checkpoint.snapshot.tier import node_dir
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for d, words in [(tmp_path / "link", "is a symlink"), (open_dir, "other users may enter it (mode 0755)"),
                     ("/dev/shm", "other users may enter it"), (shared / "snap", "may be written by other users")]:
        with pytest.raises(ConfigError, match=re.escape(f"elastor.memory_snapshot.dir {d}: ") + ".*" + re.escape(words)):
            node_dir(MemorySnapshotConfig(dir=str(d)))
    assert not (shared / "snap").exists() and os.listdir(real) == []
    fresh = tmp_path / "a" / "b" / "snap"
    assert node_dir(MemorySnapshotConfig(dir=str(fresh))) == str(fresh)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700 and stat.S_IMODE(os.stat(fresh.parent).st_mode) == 0o700


def test_roots_inside_a_checkpoint_step_are_refused_before_anything_is_made(tmp_path):
    """A checkpoint directory in another run's committed step (its retention would delete it with
    the step) was accepted: the run wrote ``latest`` and ``step_*`` inside it."""
    from elastor_ds.checkpoint.session import check_root_placement
    from elastor_ds.checkpoint.settings import MemorySnapshotConfig
    step = tmp_path / "other" / "step_000000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    for root in (step, step / "nested"):
        with pytest.raises(ConfigError, match="lies in the checkpoint step directory .*step_000000002"):
            check_root_placement(str(root), None)
    with pytest.raises(ConfigError, match="memory-snapshot directory .* lies in the checkpoint step"):
        check_root_placement(str(tmp_path / "ck"), MemorySnapshotConfig(dir=str(step / "snap")))
    with pytest.raises(ConfigError, match="overlap"):
        check_root_placement(str(tmp_path / "ck"), MemorySnapshotConfig(dir=str(tmp_path / "ck" / "snap")))
    check_root_placement(str(tmp_path / "other" / "sibling"), MemorySnapshotConfig(dir=str(tmp_path / "snap")))
    assert sorted(os.listdir(tmp_path)) == ["other"] and not (step / "nested").exists()
