"""Review 36: a memory-snapshot folder this process may not write is refused when the session is set up,
naming the setting the user gave and its value (the error named ``<dir>/local``, a folder the user never
named; with ``local/`` already there and read-only the folder was accepted and every snapshot failed).
Run as user nobody (root passes every permission check)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from other_user import as_other_user, nobody_ids

from elastor_ds.checkpoint.settings import parse_checkpoint, parse_memory_snapshot
from elastor_ds.errors import ConfigError
from test_session_review35 import _State

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("case", ["dir", "local", "env"])
def test_read_only_memory_snapshot_dir_is_refused_naming_the_setting_and_its_value(case, monkeypatch):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    import elastor_ds.checkpoint.engine  # noqa: F401 - imported before the uid changes (torch's lazy imports)
    import elastor_ds.checkpoint.snapshot.tier  # noqa: F401

    nobody = nobody_ids()
    d = Path(tempfile.mkdtemp(prefix="elastor-review36-ro-", dir="/tmp"))
    monkeypatch.delenv("ELASTOR_SNAPSHOT_DIR", raising=False)
    try:
        os.chmod(d, 0o755)
        snap, ck = d / "snap", d / "ck"
        for p in (snap, ck):
            p.mkdir()
            os.chown(p, *nobody)
        os.chmod(snap, 0o700)
        if case == "local":   # the folder may be written, its local/ (kept from an earlier run) may not
            (snap / "local").mkdir()
            os.chown(snap / "local", *nobody)
            os.chmod(snap / "local", 0o500)
        else:
            os.chmod(snap, 0o500)   # nobody's own folder, which nobody may not write
        before = sorted(os.listdir(snap))

        def child() -> None:
            os.chdir(d)   # the user gives a relative folder: the error shows it as given
            cfg = parse_checkpoint({"dir": str(ck), "interval_steps": 100})
            if case == "env":
                os.environ["ELASTOR_SNAPSHOT_DIR"] = str(snap)
                mem = parse_memory_snapshot({"peer_copies": 0})
                want = f"ELASTOR_SNAPSHOT_DIR {snap}: this process cannot write there (no write permission for this user)"
            else:
                mem = parse_memory_snapshot({"dir": "snap", "peer_copies": 0})
                why = ("no write permission for this user" if case == "dir" else
                       f"its snapshot folder {snap}/local allows no writes: no write permission for this user")
                want = f"elastor.memory_snapshot.dir snap: this process cannot write there ({why})"
            try:
                CheckpointSession(_State(), cfg, mem, comm=LocalComm(), policy_comm=LocalComm(),
                                  memory_comm=LocalComm())
            except ConfigError as e:
                assert str(e) == (f"{want}, so no memory snapshot could be taken; give a directory you may write "
                                  f"(one per node, in memory: /dev/shm/<job>), or fix its permissions"), str(e)
            else:
                raise AssertionError("a read-only memory-snapshot folder was accepted")
            assert sorted(os.listdir(snap)) == before
        as_other_user(nobody, child)
    finally:
        shutil.rmtree(d, ignore_errors=True)
