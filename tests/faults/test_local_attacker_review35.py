"""Review 35: another local user (uid ``nobody``) against what ``elastor run`` keeps in, and reads
back from, the rendezvous store and the files it creates.

The c10d store (``TCPStore``) takes writes from anyone who reaches its port. The failure ledger
read the round's failure record and the job's failure count back unchecked: a record of
terminal escapes and newlines went into the decision's reason (a log line on the operator's
terminal), and a rewritten count (-10**12) made every relaunch "collateral" or never reach
``--max-restarts``: the job restarted without end. Now a record that is not a node name is
logged (``repr``) and the failure counted here, and the count is never below this node's own
failures.

The attacker is a real process of uid ``nobody`` (a fork of the test that drops its uid) writing
through its own ``TCPStore`` client to the real store the ledger reads."""
from __future__ import annotations

import os
import stat
from datetime import timedelta

import pytest

from other_user import as_other_user, nobody_ids  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nobody():
    return nobody_ids()


@pytest.fixture
def shared():
    """A /tmp-like folder (world-writable, sticky, root's) that the other user can reach (pytest's
    own tmp_path sits under a 0700 folder)."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="elastor-review35-", dir="/tmp")
    os.chmod(d, 0o1777)
    from pathlib import Path
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


_as_other_user = as_other_user


FORGED = "\x1b]0;owned\x07\x1b[2J\nFAKE LOG LINE " + "x" * 100


def test_forged_ledger_records_in_the_store_neither_reach_the_log_nor_lift_the_restart_budget(nobody, caplog):
    import torch.distributed as dist

    from elastor_ds.elastic.ledger import FailureLedger
    from elastor_ds.elastic.policy import Action, DeviceBook, OnFailure, decide_after_failure

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def forge():
        c = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        for r in (1, 2, 3):   # the record of every round the job will have
            dist.PrefixStore(f"round{r}", c).set("elastor/failure", FORGED)
        c.set("elastor/run/failures", str(-10 ** 12))
    _as_other_user(nobody, forge)
    assert server.get("elastor/run/failures") == str(-10 ** 12).encode()   # the attacker's writes landed

    node = "victim-host:4242"
    ledger = FailureLedger(node, server, "run")
    max_restarts = 2
    book = DeviceBook((0, 1))
    actions, reasons = [], []
    for r in (1, 2, 3):
        claim = ledger.claim(dist.PrefixStore(f"round{r}", server))
        # nobody else failed in these rounds: each failure is this node's, counted 1, 2, 3
        assert (claim.primary, claim.by, claim.failures) == (True, node, r)
        used = claim.failures - 1 if claim.primary else claim.failures
        dec = decide_after_failure(OnFailure.SHRINK, book, [], used, max_restarts,
                                   collateral_of=None if claim.primary else claim.by)
        actions.append(dec.action)
        reasons.append(dec.reason)
    assert actions == [Action.RELAUNCH, Action.RELAUNCH, Action.STOP]   # the budget ends the job as without the attacker
    assert reasons[2] == "--max-restarts 2 exhausted (2 relaunches after failures); raise --max-restarts to keep going"
    assert not any("\x1b" in m or "FAKE LOG LINE" in m for m in reasons)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "\x1b" not in logged and "\x07" not in logged and "\nFAKE" not in logged
    assert "not a node name" in logged and "is below this node's own failures" in logged


def test_a_real_collateral_record_is_still_honoured():
    """The check lets an agent's own name through: a failure first reported by another node is
    collateral here (not counted), as before."""
    import torch.distributed as dist

    from elastor_ds.elastic.ledger import FailureLedger

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    a, b = FailureLedger("node-a.cluster:101", server, "run"), FailureLedger("node-b.cluster:202", server, "run")
    r1 = dist.PrefixStore("round1", server)
    ca, cb = a.claim(r1), b.claim(r1)
    assert (ca.primary, ca.by, ca.failures) == (True, "node-a.cluster:101", 1)
    assert (cb.primary, cb.by, cb.failures) == (False, "node-a.cluster:101", 1)


FORGED_RECORDS = ('{"event": "start", "time": 1.0, "node": "x", "pid": 1}\n'
                  '{"event": "worker_started", "time": 2.0, "node": "workers", "metrics_file": "/etc/shadow"}\n')


def test_events_file_in_a_shared_sticky_folder_is_ours_from_the_start(tmp_path, nobody, shared):
    """``--events`` in a shared ``/tmp``-like folder: the name was checked at start, but the file
    was created only by the first event, so another user could plant a symlink (or a file) there
    in between: the job's events were lost (every append refused) and the run's report was read
    through the link, from the attacker's records (a metrics file of its choosing included). Now
    the EventLog creates the file, ours, 0600, when it is made, and the report reads only a regular
    file of ours that nobody else may write, never through a link."""
    from elastor_ds.elastic.events import EventKind, EventLog, read_jsonl

    uid, _ = nobody
    forged = shared / "forged.jsonl"
    path = shared / "events.jsonl"
    events = EventLog(str(path), node="n0")   # the controller's log, after its start-up checks

    def plant():
        with open(forged, "w") as f:
            f.write(FORGED_RECORDS)
        os.chmod(forged, 0o644)
        try:
            os.unlink(path)          # ours already: the sticky bit refuses another user's removal
        except FileNotFoundError:
            pass                     # not created yet: the name is free to take
        except PermissionError:
            return
        os.symlink(forged, path)
    _as_other_user(nobody, plant)

    st = os.lstat(path)
    assert (stat.S_ISREG(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode)) == (True, os.getuid(), 0o600)
    start = events.emit(EventKind.START, pid=os.getpid())
    recs = read_jsonl(str(path))
    assert recs == [start]                        # our record, read back from our file
    assert os.stat(forged).st_uid == uid


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_report_never_reads_another_users_records(tmp_path, nobody, shared, planted, caplog):
    """What the report reads (the events file, the metrics file named in it) is never another
    user's: not through a symlink that user planted, not a file that user owns."""
    from elastor_ds.elastic.events import read_jsonl

    uid, _ = nobody
    name = shared / "events.jsonl"

    def plant():
        src = shared / "forged.jsonl"
        with open(src, "w") as f:
            f.write(FORGED_RECORDS)
        os.chmod(src, 0o644)
        if planted == "symlink":
            os.symlink(src, name)
        else:
            os.rename(src, name)
    _as_other_user(nobody, plant)
    assert os.lstat(name).st_uid == uid
    assert read_jsonl(str(name)) == []
    assert "not reading" in caplog.text or "symlink is never followed" in caplog.text
    ours = tmp_path / "ours.jsonl"
    ours.write_text(FORGED_RECORDS)
    assert [r["event"] for r in read_jsonl(str(ours))] == ["start", "worker_started"]   # ours is read as before
