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
port), so what is read back is checked before it is used: the primary's name must look like a node
name (:data:`NODE_NAME_RE`: no control characters, bounded; it goes into log lines and the
decision's reason) and the job's count is never below this node's own primaries. A forged name is
logged (as ``repr``) and the failure is counted here; a forged count cannot give this node's
failures back.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import timedelta

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
    def __init__(self, node: str, job_store=None, run_id: str = "none"):
        self.node = node
        self.job_store = job_store     # the rendezvous's store (persists across rounds), or None
        self.job_key = f"elastor/{run_id}/failures"
        self.local_failures = 0

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

    def claim(self, round_store) -> Claim:
        by = self.node
        if round_store is not None:
            try:
                by = self._first_reporter(round_store)
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
