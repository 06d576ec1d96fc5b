"""The "memory_snapshot" config section and the controller's snapshot directory (pure, no processes)."""
from __future__ import annotations

import os
import re
import socket

import pytest

from elastor_ds.elastic import snapshot_dir
from elastor_ds.errors import ConfigError
from elastor_ds.integrations.deepspeed.config import MemorySnapshotConfig, parse_elastor_section


def test_memory_snapshot_section_parses_with_defaults():
    cfg = parse_elastor_section({"checkpoint": {"dir": "/ckpt", "interval_steps": 100},
                                 "memory_snapshot": {"interval_steps": 1, "peer_copies": 1}})
    assert cfg.memory_snapshot == MemorySnapshotConfig(interval_steps=1, keep=1, peer_copies=1)
    assert parse_elastor_section({"checkpoint": {"dir": "/c"}}).memory_snapshot is None


@pytest.mark.parametrize("section, message", [
    ({"interval_steps": 0}, r"interval_steps: expected an integer >= 1, got 0"),
    ({"interval_step": 1}, r"unknown key 'interval_step' \(did you mean 'interval_steps'\?\)"),
    ({"peer_copies": 2}, r"peer_copies: 2 is not supported; use 0 or 1"),
    ({"keep": 0}, r"keep: expected an integer >= 1"),
    ({"max_bytes": -5}, r"max_bytes: expected an integer >= 1"),
    ({"dir": ""}, r"dir: expected a non-empty string"),
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
    # a directory the user already had is kept; only the job's subdirectories go
    d.mkdir()
    (d / "mine.txt").write_text("keep me")
    (d / "local").mkdir()                      # stale: a controller killed before its cleanup
    (d / "local" / "latest").write_text("step_000000009\n")
    sd = snapshot_dir.prepare(str(d), "job-1")
    assert sorted(os.listdir(d)) == ["mine.txt"]   # never restored by the new job
    assert not sd.created
    (d / "local").mkdir()
    (d / "peer").mkdir()
    snapshot_dir.cleanup(sd)
    assert sorted(os.listdir(d)) == ["mine.txt"]


def test_snapshot_dir_refuses_a_file_and_defaults_to_a_unique_memory_path(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        snapshot_dir.prepare(str(f), "job")
    p = snapshot_dir.default_path("job/../x y")
    assert os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)   # this machine (ENV.md): tmpfs
    assert os.path.dirname(p) == "/dev/shm"
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
    assert os.path.basename(p) == f"elastor-job____x_y-{host}-{os.getpid()}"
