"""One failure, one restart: which node a rendezvous round's failure is charged to.

When a worker dies, its peers on other nodes fail too (their collectives break): every node's
agent sees a failed group. Counted per node, one fault would use a restart on each node and a
node could exhaust ``--max-restarts`` on faults that were all elsewhere. The ledger charges each
failed round once, to the first node that reports it:

- :meth:`FailureLedger.claim` sets ``elastor/failure`` in the round's store (compare-and-set; the
  round's store is shared by exactly the agents of that round). The node that set it is the
  round's *primary*; every other node's failure in that round is *collateral* (recorded with the
  primary's name, never counted, never a reason to stop for the restart budget).
- The primary adds one to ``elastor/<run id>/failures`` in the rendezvous's own store (it outlives rounds):
  the job's failure count, the same number on every node. Only the primary compares it with
  ``--max-restarts``; when it gives up it closes the rendezvous, so the other nodes stop too.

Stores are duck-typed (``compare_set``, or ``add``/``set``/``wait``/``get`` where there is none): no torch import here. Without a usable store
(another rendezvous backend, a store that died with its node) the node counts on its own.

The store is not authenticated (a c10d ``TCPStore`` takes writes from anyone who reaches its
port). With the job's key (``auth``, :mod:`.store_auth`: ``--job-secret-file``, or a random key on
a single node) both values are sealed: the round record binds the run id, the rendezvous round and
the key name (a record of another round or key does not verify), the count binds the run id and
its key. A record whose MAC fails is absent: this node takes its place with its own
(compare-and-set from the forged bytes), so the first genuine reporter is still the one primary; a
count whose MAC fails counts from this node's own knowledge. Neither can make a failure
collateral or lower the count. The count is a compare-and-set of sealed values (``set`` on a store
without it), never below the highest count this node has seen (an older sealed count replayed).

Without a key (a multi-node job without ``--job-secret-file``) what is read back is checked before
it is used: the primary's name must look like a node name (:data:`NODE_NAME_RE`: no control
characters, bounded; it goes into log lines and the decision's reason) and the job's count is never
below this node's own primaries. A forged name is logged (as ``repr``) and the failure is counted
here; a forged count cannot give this node's failures back; but a forged *plausible* name still
makes the failure collateral there.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from .store_auth import Purpose, StoreAuth

log = logging.getLogger("elastor.run")

ROUND_KEY = "elastor/failure"
ROUND_SEQ_KEY = "elastor/failure_seq"   # stores without compare-and-set: the first to add 1 is the primary
NAME_WAIT_S = 30.0                       # how long a collateral node waits for the primary's name there
# a node name as agent.node_name makes it (host:pid): printable, no spaces or control characters, bounded
NODE_NAME_RE = re.compile(r"[A-Za-z0-9._@+:-]{1,300}")


@dataclass(frozen=True)
class Claim:
    primary: bool          # this node's report is the round's failure
    by: str                # the primary node's name
    failures: int          # failures of the job so far, this one included when primary


class FailureLedger:
    def __init__(self, node: str, job_store=None, run_id: str = "none", auth: Optional[StoreAuth] = None):
        self.node = node
        self.job_store = job_store     # the rendezvous's store (persists across rounds), or None
        self.job_key = f"elastor/{run_id}/failures"
        self.local_failures = 0
        self.auth = auth               # seals and opens the values (None: unsigned, checked as below)
        self.seen_failures = 0         # the highest job count this node has read or written (sealed mode)

    def _first_reporter(self, store) -> str:
        """The name of the round's first reporter (this node if it is the first). compare-and-set where
        the store has it; torch's ``EtcdStore`` has not (``RuntimeError: ... Not implemented``): there
        an atomic ``add`` elects the primary, which then writes its name under ``ROUND_KEY``."""
        try:
            return self._name(store.compare_set(ROUND_KEY, "", self.node))
        except RuntimeError as e:
            if "not implemented" not in str(e).lower():
                raise
        if int(store.add(ROUND_SEQ_KEY, 1)) == 1:
            store.set(ROUND_KEY, self.node)
            return self.node
        store.wait([ROUND_KEY], timedelta(seconds=NAME_WAIT_S))
        return self._name(store.get(ROUND_KEY))

    def _name(self, got) -> str:
        """The primary's name read back from the store: this node's, or one shaped like a node name
        (anything else was not written by an agent: :class:`ValueError`, and the failure is counted here)."""
        name = got.decode("utf-8", "replace") if isinstance(got, bytes) else str(got)
        if name != self.node and not NODE_NAME_RE.fullmatch(name):
            raise ValueError(f"the round's failure record is not a node name ({name[:80]!r}, {len(name)} "
                             f"characters): not written by an elastor agent")
        return name

    # ------------------------------------------------------------------ sealed values (a job key)
    def _first_reporter_sealed(self, store, round_id: str) -> str:
        """As :meth:`_first_reporter`, the record sealed: a record that does not verify is taken over."""
        auth = self.auth
        mine = auth.seal(Purpose.FAILURE_RECORD, ROUND_KEY, self.node, round_id)
        expected = b""
        for _ in range(4):
            try:
                got = store.compare_set(ROUND_KEY, expected, mine)
            except RuntimeError as e:
                if "not implemented" not in str(e).lower():
                    raise
                return self._first_reporter_sealed_no_cas(store, round_id, mine)
            got = got.encode() if isinstance(got, str) else bytes(got)
            if got == mine:
                return self.node
            if expected and got == expected:
                expected = b""     # the record was deleted meanwhile (compare_set hands back `expected`)
                continue
            name = auth.open(Purpose.FAILURE_RECORD, ROUND_KEY, got, round_id)
            if name is not None:
                return self._name(name)
            auth.forged("a failure record no agent of this round wrote: this node takes its place (the failure is "
                        "counted)", ROUND_KEY, got, round_id)
            expected = got
        return self.node   # someone keeps rewriting it: count here

    def _first_reporter_sealed_no_cas(self, store, round_id: str, mine: bytes) -> str:
        if int(store.add(ROUND_SEQ_KEY, 1)) == 1:
            store.set(ROUND_KEY, mine)
            return self.node
        store.wait([ROUND_KEY], timedelta(seconds=NAME_WAIT_S))
        got = store.get(ROUND_KEY)
        name = self.auth.open(Purpose.FAILURE_RECORD, ROUND_KEY, got, round_id)
        if name is None:
            self.auth.forged("a failure record no agent of this round wrote: the failure is counted here",
                             ROUND_KEY, got, round_id)
            return self.node
        return self._name(name)

    def _read_count(self, store) -> tuple[bytes, Optional[int]]:
        """The job count's stored bytes (b"" when absent) and its value (None: absent or forged)."""
        raw = store.get(self.job_key) if store.check([self.job_key]) else b""
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        if not raw:
            return raw, None
        v = self.auth.open(Purpose.FAILURE_COUNT, self.job_key, raw)
        if v is None or not v.isdigit() or len(v) > 18:
            self.auth.forged("a failure count this job did not write: counted from this node's own knowledge",
                             self.job_key, raw)
            return raw, None
        return raw, int(v)

    def _count_sealed(self, primary: bool) -> int:
        """The job's failure count, this failure included when ``primary`` (sealed compare-and-set)."""
        store, floor = self.job_store, max(self.local_failures, self.seen_failures)
        if not primary:
            _, n = self._read_count(store)
            return max(n or 0, floor)
        new = floor
        for _ in range(4):
            raw, n = self._read_count(store)
            new = max(max(n or 0, self.seen_failures) + 1, self.local_failures)
            sealed = self.auth.seal(Purpose.FAILURE_COUNT, self.job_key, str(new))
            try:
                got = store.compare_set(self.job_key, raw, sealed)
            except RuntimeError as e:
                if "not implemented" not in str(e).lower():
                    raise
                store.set(self.job_key, sealed)   # failures are one per round: no concurrent primaries
                return new
            if (got.encode() if isinstance(got, str) else bytes(got)) == sealed:
                return new
        log.warning("failure ledger: the job's failure count in the rendezvous store changed under every write; "
                    "counting %d", new)
        return new

    # ------------------------------------------------------------------ the claim
    def claim(self, round_store, round_id: str = "") -> Claim:
        """Charge this node's failure in the round whose store is ``round_store`` (``round_id``: the
        rendezvous round, bound into the sealed record)."""
        by = self.node
        if round_store is not None:
            try:
                by = (self._first_reporter_sealed(round_store, round_id) if self.auth is not None
                      else self._first_reporter(round_store))
            except ValueError as e:   # a record no agent wrote (the store takes anyone's writes)
                log.warning("failure ledger: %s; counting this failure here", e)
                by = self.node
            except Exception as e:  # noqa: BLE001 - a store gone with its node: count here
                log.warning("failure ledger: the round's store is unusable (%s); counting this failure here", e)
                by = self.node
        primary = by == self.node
        if primary:
            self.local_failures += 1
        failures = self.local_failures
        if self.job_store is not None and self.auth is not None:
            try:
                failures = self._count_sealed(primary)
            except Exception as e:  # noqa: BLE001
                log.warning("failure ledger: the rendezvous store is unusable (%s); counting on this node", e)
                self.job_store = None
                failures = max(self.local_failures, self.seen_failures + (1 if primary else 0))
            self.seen_failures = max(self.seen_failures, failures)
            return Claim(primary=primary, by=by, failures=failures)
        if self.job_store is not None:
            try:
                failures = int(self.job_store.add(self.job_key, 1 if primary else 0))
            except Exception as e:  # noqa: BLE001
                log.warning("failure ledger: the rendezvous store is unusable (%s); counting on this node", e)
                self.job_store = None
            if failures < self.local_failures:   # every primary of this node added 1 there: the count was rewritten
                log.warning("failure ledger: the job's failure count in the rendezvous store (%d) is below this "
                            "node's own failures (%d): it was rewritten; counting %d", failures, self.local_failures,
                            self.local_failures)
                failures = self.local_failures
        return Claim(primary=primary, by=by, failures=failures)
