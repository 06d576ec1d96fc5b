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
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("elastor.run")

ROUND_KEY = "elastor/failure"
ROUND_SEQ_KEY = "elastor/failure_seq"   # stores without compare-and-set: the first to add 1 is the primary
NAME_WAIT_S = 30.0                       # how long a collateral node waits for the primary's name there


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
            got = store.compare_set(ROUND_KEY, "", self.node)
            return got.decode() if isinstance(got, bytes) else str(got)
        except RuntimeError as e:
            if "not implemented" not in str(e).lower():
                raise
        if int(store.add(ROUND_SEQ_KEY, 1)) == 1:
            store.set(ROUND_KEY, self.node)
            return self.node
        store.wait([ROUND_KEY], timedelta(seconds=NAME_WAIT_S))
        got = store.get(ROUND_KEY)
        return got.decode() if isinstance(got, bytes) else str(got)

    def claim(self, round_store) -> Claim:
        by = self.node
        if round_store is not None:
            try:
                by = self._first_reporter(round_store)
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
        return Claim(primary=primary, by=by, failures=failures)
