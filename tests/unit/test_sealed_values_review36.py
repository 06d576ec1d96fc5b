"""The sealed store values of ``elastor run`` (:mod:`elastor_ds.elastic.store_auth`): their format
against an HMAC computed here from the documented construction, and what the failure ledger and
the liveness reader make of forged, replayed, moved and deleted values (a forger can write any
bytes under any key of the store; it has no job key). The real-process attack (uid nobody against a
running ``elastor run``) is tests/faults/test_store_auth_review36.py."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os

import pytest
from elastic_utils import no_cas_store

pytestmark = pytest.mark.unit

K = bytes(range(32))
RUN = "job-36"


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "big") + b


def _expected(key: bytes, purpose: str, run: str, round_id: str, name: str, value: bytes) -> bytes:
    """The sealed bytes as docs/elastic.md and the module docstring define them, computed here."""
    sub = hmac.new(key, b"elastor store value v1\0" + purpose.encode(), hashlib.sha256).digest()
    msg = _field(run.encode()) + _field(round_id.encode()) + _field(name.encode()) + value
    return b"ELSV1." + hmac.new(sub, msg, hashlib.sha256).hexdigest().encode() + b"." + value


def test_sealed_value_is_the_documented_hmac_and_opens_only_in_its_place():
    from elastor_ds.elastic.store_auth import Purpose, StoreAuth
    a = StoreAuth(K, RUN)
    sealed = a.seal(Purpose.FAILURE_RECORD, "elastor/failure", "host-a:17", "3")
    assert sealed == _expected(K, "failure-record", RUN, "3", "elastor/failure", b"host-a:17")
    assert a.open(Purpose.FAILURE_RECORD, "elastor/failure", sealed, "3") == b"host-a:17"
    assert a.open(Purpose.FAILURE_RECORD, "elastor/failure", sealed.decode(), "3") == b"host-a:17"   # str from a store
    # every other place, job, or a changed byte: None
    assert a.open(Purpose.LIVENESS, "elastor/failure", sealed, "3") is None              # another purpose
    assert a.open(Purpose.FAILURE_RECORD, "elastor/failure", sealed, "4") is None        # another round
    assert a.open(Purpose.FAILURE_RECORD, "elastor/alive/0", sealed, "3") is None        # another key
    assert StoreAuth(K, "job-37").open(Purpose.FAILURE_RECORD, "elastor/failure", sealed, "3") is None   # another run
    assert StoreAuth(b"x" * 32, RUN).open(Purpose.FAILURE_RECORD, "elastor/failure", sealed, "3") is None
    # the fields are length-prefixed: moving a byte between round and key does not verify either
    assert a.open(Purpose.FAILURE_RECORD, "/elastor/failure", a.seal(Purpose.FAILURE_RECORD, "elastor/failure",
                                                                      "h:1", "3/"), "3") is None
    for bad in (sealed[:-1] + b"8",                          # the value changed
                sealed[:10] + (b"0" if sealed[10:11] != b"0" else b"1") + sealed[11:],   # the tag changed
                sealed[:40], b"host-a:17", b"", None, 17, b"ELSV1." + b"0" * 64 + b".host-a:17"):
        assert a.open(Purpose.FAILURE_RECORD, "elastor/failure", bad, "3") is None, bad
    # the beat and the count have their own subkeys: the same bytes sealed for one purpose differ
    assert a.seal(Purpose.LIVENESS, "k", "5", "1") == _expected(K, "liveness", RUN, "1", "k", b"5")
    assert a.seal(Purpose.FAILURE_COUNT, "k", "5", "1") != a.seal(Purpose.LIVENESS, "k", "5", "1")


def test_every_node_derives_the_same_store_key_from_the_secret_file(tmp_path):
    from elastor_ds.elastic.rdzv_auth import rendezvous_key
    from elastor_ds.elastic.store_auth import Purpose, StoreAuth
    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"s" * 32)
    os.close(fd)
    node_a, node_b = StoreAuth(rendezvous_key(str(secret), True), RUN), StoreAuth(rendezvous_key(str(secret), True), RUN)
    beat = node_a.seal(Purpose.LIVENESS, "elastor/alive/0", "9", "2")
    assert node_b.open(Purpose.LIVENESS, "elastor/alive/0", beat, "2") == b"9"
    # a single node's random key: another job on the same run id and store cannot write for it
    one, other = StoreAuth(rendezvous_key(None, False), RUN), StoreAuth(rendezvous_key(None, False), RUN)
    assert other.open(Purpose.LIVENESS, "elastor/alive/0", one.seal(Purpose.LIVENESS, "elastor/alive/0", "9", "2"),
                      "2") is None


def _store():
    import torch.distributed as dist
    return dist.HashStore()


def _round(store, r: int):
    import torch.distributed as dist
    return dist.PrefixStore(f"torch.rendezvous.{RUN}.{r}", store)


def test_a_forged_plausible_round_record_is_taken_over_by_the_first_real_reporter(caplog):
    from elastor_ds.elastic.ledger import ROUND_KEY, FailureLedger
    from elastor_ds.elastic.store_auth import StoreAuth
    job = _store()
    auth = StoreAuth(K, RUN)
    a = FailureLedger("node-a.cluster:101", job, RUN, auth=StoreAuth(K, RUN))
    b = FailureLedger("node-b.cluster:202", job, RUN, auth=StoreAuth(K, RUN))
    r0 = _round(job, 0)
    r0.set(ROUND_KEY, "gpu-node-7.cluster:31337")             # the forger's plausible name, unsealed
    with caplog.at_level(logging.WARNING, logger="elastor.run"):
        ca = a.claim(r0, "0")
        cb = b.claim(r0, "0")
    assert (ca.primary, ca.by, ca.failures) == (True, "node-a.cluster:101", 1)   # counted: not collateral
    assert (cb.primary, cb.by, cb.failures) == (False, "node-a.cluster:101", 1)  # one fault, one count
    warned = [r.getMessage() for r in caplog.records if "did not write" in r.getMessage()]
    assert len(warned) == 1 and "elastor/failure (round 0)" in warned[0], warned
    assert "gpu-node-7" not in "\n".join(r.getMessage() for r in caplog.records)   # never echoed
    # a genuine record of round 0 copied into round 1 (naming a node that may have left) binds round 0
    r1 = _round(job, 1)
    r1.set(ROUND_KEY, r0.get(ROUND_KEY))
    cb1 = b.claim(r1, "1")
    assert (cb1.primary, cb1.by, cb1.failures) == (True, "node-b.cluster:202", 2)
    assert auth.open("failure-record", ROUND_KEY, r1.get(ROUND_KEY), "1") == b"node-b.cluster:202"
    # a record sealed for another key (a beat of this round) does not pass for a record either
    r2 = _round(job, 2)
    r2.set(ROUND_KEY, auth.seal("liveness", "elastor/alive/0", "node-a.cluster:101", "2"))
    assert a.claim(r2, "2").primary is True


def test_the_job_count_is_not_lowered_or_raised_by_forged_replayed_or_deleted_values():
    """The job's count, sealed: a value that does not verify counts from this node's own knowledge
    (its own failures, the highest count it has read), so a forger can neither lower it (the budget
    never reached) nor raise it (the job stopped early, blaming --max-restarts)."""
    from elastor_ds.elastic.ledger import FailureLedger
    from elastor_ds.elastic.store_auth import StoreAuth
    job = _store()
    a = FailureLedger("node-a:1", job, RUN, auth=StoreAuth(K, RUN))
    b = FailureLedger("node-b:2", job, RUN, auth=StoreAuth(K, RUN))
    key = f"elastor/{RUN}/failures"

    def claim(who, r):
        return who.claim(_round(job, r), str(r))
    assert [claim(a, 0).failures, claim(a, 1).failures] == [1, 2]
    older = job.get(key)
    assert older == _expected(K, "failure-count", RUN, "", key, b"2")
    assert claim(b, 2).failures == 3 and claim(a, 2).failures == 3       # b's fault; a is collateral, reads 3
    forgeries = [str(-10 ** 12).encode(),                                # unsealed, low (the review-35 forgery)
                 older,                                                  # a sealed count of this job, replayed
                 StoreAuth(b"x" * 32, RUN).seal("failure-count", key, "0"),   # sealed with another key
                 str(10 ** 9).encode(),                                  # unsealed, high
                 None]                                                   # deleted
    for i, f in enumerate(forgeries):
        if f is None:
            job.delete_key(key)
        else:
            job.set(key, f)
        c = claim(b, 3 + i)
        assert (c.primary, c.failures) == (True, 4 + i), (f, c)
        assert claim(a, 3 + i) == type(c)(primary=False, by="node-b:2", failures=4 + i)   # the same count on a


def test_unsigned_mode_is_kept_without_a_key():
    """No key (a multi-node job without --job-secret-file): the values are the old unsealed ones."""
    from elastor_ds.elastic.ledger import ROUND_KEY, FailureLedger
    job = _store()
    a = FailureLedger("A", job, RUN)
    assert a.claim(_round(job, 0)).failures == 1
    assert _round(job, 0).get(ROUND_KEY) == b"A" and job.get(f"elastor/{RUN}/failures") == b"1"


def test_sealed_beats_forged_replayed_moved_or_deleted_are_no_beat(caplog):
    from elastor_ds.elastic.liveness import KEY, Beacon, LivenessConfig, PeerBook, read_peers
    from elastor_ds.elastic.store_auth import StoreAuth
    job = _store()
    r3 = _round(job, 3)
    auth = StoreAuth(K, RUN)
    beacon = Beacon(LivenessConfig(interval=60, timeout=120), lambda s: None, auth=StoreAuth(K, RUN))
    beacon.retarget(r3, 1, "3")   # one beat now (the thread's next is a minute away)
    beacon.silence()
    first = r3.get(KEY.format(1))
    assert first == _expected(K, "liveness", RUN, "3", "elastor/alive/1", b"1")
    book = PeerBook(timeout=2.0)
    with caplog.at_level(logging.WARNING, logger="elastor.run"):
        assert read_peers(r3, book, [1], now=0.0, auth=auth, round_id="3") == [] and book.seen[1] == (1, 0.0)
        beacon._beat()                                             # node 1 beats again: 2
        assert read_peers(r3, book, [1], now=1.0, auth=auth, round_id="3") == [] and book.seen[1] == (2, 1.0)
        # node 1 is gone now; the forger writes, each read, something else
        forgeries = [b"100",                                       # an old-style counter
                     first,                                        # node 1's own earlier beat, replayed
                     None,                                         # the key deleted (then the replay again)
                     first,
                     auth.seal("liveness", KEY.format(0), "999", "3"),   # node 0's beat moved to node 1's key
                     auth.seal("liveness", KEY.format(1), "999", "2"),   # node 1's beat of round 2
                     auth.seal("failure-count", KEY.format(1), "999", "3")]   # another purpose
        for i, f in enumerate(forgeries):
            if f is None:
                r3.delete_key(KEY.format(1))
            else:
                r3.set(KEY.format(1), f)
            read_peers(r3, book, [1], now=1.5 + 0.1 * i, auth=auth, round_id="3")
        assert book.seen[1] == (2, 1.0)                            # none was a beat
        assert read_peers(r3, book, [1], now=3.5, auth=auth, round_id="3") == [1]   # lost on time
    warned = [r.getMessage() for r in caplog.records if "did not write" in r.getMessage()]
    assert len(warned) == 1 and "elastor/alive/1 (round 3)" in warned[0], warned
    # a genuine later beat is one
    r3.set(KEY.format(1), auth.seal("liveness", KEY.format(1), "3", "3"))
    assert read_peers(r3, book, [1], now=4.0, auth=auth, round_id="3") == [] and book.seen[1] == (3, 4.0)


def test_snapshot_server_addresses_are_sealed_and_a_forged_one_reads_as_none(tmp_path):
    from elastor_ds.checkpoint.snapshot.server import NodeSnapshots
    from elastor_ds.elastic.store_auth import Purpose, SealedStore, StoreAuth
    job = _store()
    r = _round(job, 0)
    view = SealedStore(r, StoreAuth(K, RUN), Purpose.SNAPSHOT_SERVER, "0", "read as no server")
    r.set("elastor/snapshot_server/1", "10.0.0.66:4444")        # the forger's address for node 1
    snaps = NodeSnapshots(None, "127.0.0.1:1")
    assert snaps.publish(view, 0, 2) == ["", ""]                 # node 0 serves nothing; node 1's is forged
    view.set("elastor/snapshot_server/1", "10.0.0.2:5555")
    assert snaps.publish(view, 0, 2) == ["", "10.0.0.2:5555"]
    assert r.get("elastor/snapshot_server/1") == _expected(K, "snapshot-server", RUN, "0",
                                                            "elastor/snapshot_server/1", b"10.0.0.2:5555")


def test_sealed_ledger_on_a_store_without_compare_set():
    """torch's EtcdStore (etcd-v2) has no compare_set: the first ``add`` elects the primary, which
    writes its sealed name over whatever the forger put there; the job count is a sealed ``set``."""
    import torch.distributed as dist

    from elastor_ds.elastic.ledger import ROUND_KEY, FailureLedger
    from elastor_ds.elastic.store_auth import StoreAuth

    job = no_cas_store()
    a = FailureLedger("node-a:1", job, RUN, auth=StoreAuth(K, RUN))
    b = FailureLedger("node-b:2", job, RUN, auth=StoreAuth(K, RUN))
    r0 = dist.PrefixStore("round0", job)
    r0.set(ROUND_KEY, "gpu-node-7.cluster:31337")
    job.set(f"elastor/{RUN}/failures", str(-10 ** 12))
    ca, cb = a.claim(r0, "0"), b.claim(r0, "0")
    assert (ca.primary, ca.by, ca.failures) == (True, "node-a:1", 1)
    assert (cb.primary, cb.by, cb.failures) == (False, "node-a:1", 1)
    r1 = dist.PrefixStore("round1", job)
    r1.set(ROUND_KEY, r0.get(ROUND_KEY))                   # round 0's genuine record, replayed
    r1.add("elastor/failure_seq", 1)                       # and the election taken: b must read the record
    cb1 = b.claim(r1, "1")
    assert (cb1.primary, cb1.failures) == (True, 2), cb1
