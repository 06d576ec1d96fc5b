"""Node liveness within a rendezvous round: bounded detection of a silent node loss, and self-fencing.

A node lost to a power cut, a kernel panic or a cut cable sends nothing: no reset reaches the
survivors, whose workers then block in a collective until its timeout (gloo: 30 minutes). The
controllers watch each other through the round's store instead:

1. Every controller adds 1 to ``elastor/alive/<node rank>`` in the round's store every
   ``interval`` seconds (a thread: :class:`Beacon`), for as long as the controller runs; a beat
   not answered within ``interval`` is a missed beat, and the next one is sent on time.
2. Each controller reads its peers' counters every ``interval`` (``check`` then ``get``: no wait, no write)
   and notes, on its own monotonic clock, when each last changed (:class:`PeerBook`, pure). A peer
   whose counter has not changed for ``timeout`` seconds is lost. Detection bound: ``timeout`` +
   ``interval`` (the read period) + one monitor interval after the peer's last beat.
3. A controller that cannot complete a beat for ``fence_after`` (< ``timeout``) seconds is the one
   cut off: its watchdog kills its own workers at once (the :class:`Beacon`'s ``on_fence``), before
   any survivor can declare it lost, so a partitioned node never trains on beside the survivors'
   next round and never commits a checkpoint step there. It then leaves the job (exit 1).

Store calls never block the controller past a bound: torch's TCPStore client waits for a reply
without a deadline (its ``timeout`` covers key waits, not a request whose packets vanish: measured
between two namespaces, an ``add`` after the link was cut had not returned after 25 s with a 5 s
timeout). :func:`bounded` runs a call in a daemon thread and gives up after the deadline, or as
soon as this node is fenced.

Authenticated beats (a job key: ``--job-secret-file``, see :mod:`.store_auth`): a beat is then not
``add`` but a ``set`` of this controller's own beat number, sealed with the run id, the rendezvous
round and the key (so node 1's beats cannot be copied under node 0's key, nor an earlier round's
into this one). A reader takes a value as a beat only when it verifies and is above the last one
it took from that key: anyone who reaches the store can still silence a node (delete its key: a
denial of service, a live node seen as lost), but no longer keep a dead node "alive" with forged
or replayed beats. Without a key the counters stay ``add`` counters, unauthenticated.

``timeout`` = the rendezvous's own dead-node bound (``keep_alive_interval`` x
``keep_alive_max_attempt``: after it torch's rendezvous drops the node too, so the survivors'
next round can complete); ``fence_after`` = ``timeout`` - ``interval``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..threads import NamedThread
from .store_auth import Purpose, StoreAuth

log = logging.getLogger("elastor.run")

KEY = "elastor/alive/{}"


@dataclass(frozen=True)
class LivenessConfig:
    interval: float      # seconds between beats (and between reads of the peers' counters)
    timeout: float       # a peer silent this long is lost

    def __post_init__(self) -> None:
        if not (0 < self.interval < self.timeout):
            raise ValueError(f"liveness: need 0 < interval ({self.interval}) < timeout ({self.timeout}); "
                             f"raise keep_alive_max_attempt in --rdzv-conf")

    @property
    def fence_after(self) -> float:
        return self.timeout - self.interval

    @classmethod
    def from_rdzv_conf(cls, conf: dict) -> "LivenessConfig":
        """torch's keep-alive settings (defaults 5 s x 3) give the bound."""
        interval = float(conf.get("keep_alive_interval", 5))
        attempts = int(conf.get("keep_alive_max_attempt", 3))
        return cls(interval=interval, timeout=interval * max(2, attempts))


@dataclass
class PeerBook:
    """Last counter value and the local (monotonic) time it last changed, per peer node rank."""
    timeout: float
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    forged: set[int] = field(default_factory=set)   # ranks whose key held something else (warned once)

    def observe(self, rank: int, value: int, now: float, increasing: bool = False) -> None:
        """``value`` read from ``rank``'s key at ``now``: a beat when it changed (``increasing``: when
        it rose; a sealed beat replayed from earlier is no beat)."""
        old = self.seen.get(rank)
        if old is None or (value > old[0] if increasing else old[0] != value):
            self.seen[rank] = (value, now)

    def lost(self, now: float) -> list[int]:
        return sorted(r for r, (_, t) in self.seen.items() if now - t > self.timeout)

    def silent_for(self, rank: int, now: float) -> float:
        return now - self.seen[rank][1]


class Beacon:
    """The controller's beat (a thread) and its self-fencing watchdog (another thread: a beat may
    block in the store for the store's read timeout, the watchdog never touches the network)."""

    def __init__(self, cfg: LivenessConfig, on_fence: Callable[[float], None], auth: Optional[StoreAuth] = None):
        self.cfg = cfg
        self.on_fence = on_fence
        self.auth = auth          # sealed beats (None: ``add`` counters)
        self._lock = threading.Lock()
        self._store = None
        self._key = ""
        self._round = ""
        self._seq = 0             # this controller's beat number (sealed beats; never reset)
        self._last_ok = time.monotonic()
        self.fenced_at: Optional[float] = None   # monotonic time of the fence
        self._stop = threading.Event()
        self._disarmed = False
        self._threads: list[threading.Thread] = []

    def retarget(self, store, node_rank: int, round_id: str = "") -> None:
        """Beat into this round's store (rendezvous round ``round_id``) under this node's rank from now
        on (a beat now, synchronously)."""
        with self._lock:
            self._store, self._key, self._round = store, KEY.format(node_rank), round_id
        self._beat()
        if not self._threads:
            for fn, name in ((self._beat_loop, "elastor-beacon"), (self._watch_loop, "elastor-fence")):
                t = NamedThread(target=fn, name=name, daemon=True)
                t.start()
                self._threads.append(t)

    def silence(self) -> None:
        """Stop beating (the node leaves); the watchdog stops too."""
        self._stop.set()

    def disarm(self) -> None:
        """Keep beating, but never fence from now on: this node's workers have all exited 0 (there
        is nothing left to kill, and what they committed stands) while it waits for the other
        nodes at the exit barrier. ci51: a node whose store contact stalled for 3 s there logged
        a fence after its job had finished."""
        self._disarmed = True

    def _beat(self) -> None:
        """One beat, given up after one interval: a request that hangs (an etcd write in flight when
        the cluster's leader was lost waits for etcd's request timeout, 5 s + 2 election timeouts)
        must not hold back the next beat, which a newly elected leader answers."""
        with self._lock:
            store, key = self._store, self._key
            if self.auth is not None:
                self._seq += 1
                sealed = self.auth.seal(Purpose.LIVENESS, key, str(self._seq), self._round)
        if store is None:
            return
        beat = (lambda: store.add(key, 1)) if self.auth is None else (lambda: store.set(key, sealed))
        try:
            bounded(beat, self.cfg.interval, "beat", give_up=self._stop.is_set)
        except Exception as e:  # noqa: BLE001 - the watchdog decides what a missed beat means
            log.debug("liveness beat failed: %s", e)
            return
        self._last_ok = time.monotonic()

    def _beat_loop(self) -> None:
        t_next = time.monotonic()
        while True:   # a fixed cadence: a beat that timed out is followed by the next one at once
            t_next += self.cfg.interval
            if self._stop.wait(max(0.0, t_next - time.monotonic())):
                return
            self._beat()
            t_next = max(t_next, time.monotonic() - self.cfg.interval)

    def _watch_loop(self) -> None:
        while not self._stop.wait(min(0.1, self.cfg.interval / 4)):
            silent = time.monotonic() - self._last_ok
            if self.fenced_at is None and not self._disarmed and silent > self.cfg.fence_after:
                self.fenced_at = time.monotonic()
                try:
                    self.on_fence(silent)
                except Exception:  # noqa: BLE001 - the fence must not die with the callback
                    log.exception("liveness: fencing failed")

    @property
    def fenced(self) -> bool:
        return self.fenced_at is not None


class StoreTimeout(TimeoutError):
    pass


def bounded(fn: Callable[[], object], timeout: float, what: str, give_up: Callable[[], bool] = lambda: False):
    """``fn()`` with a deadline: raises :class:`StoreTimeout` after ``timeout`` s, or at once when
    ``give_up()`` turns true; the call itself is abandoned in its daemon thread."""
    box: dict = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
        done.set()

    NamedThread(target=call, name=f"elastor-store-{what}", daemon=True).start()
    t_end = time.monotonic() + timeout
    while not done.wait(min(0.05, max(0.0, t_end - time.monotonic()))):
        if time.monotonic() >= t_end or give_up():
            raise StoreTimeout(f"{what}: no answer from the store in {time.monotonic() - t_end + timeout:.1f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def read_peers(store, book: PeerBook, ranks, now: float, auth: Optional[StoreAuth] = None,
               round_id: str = "") -> list[int]:
    """One read of every peer's counter into ``book``; returns the peers lost by now. A plain read
    (``check``, then ``get`` of a key that exists: never a wait for a key), not ``add(key, 0)``:
    etcd serves reads from any member at once, while a write waits for a leader (seconds after the
    leader's node was lost, when the counters matter most). With ``auth``: sealed beats of round
    ``round_id``, a beat only when the number rose."""
    for r in ranks:
        key = KEY.format(r)
        if store.check([key]):
            raw = store.get(key)
            value = _counter(raw) if auth is None else _sealed_counter(auth, key, raw, round_id)
            if value is None:   # not a counter (the store takes anyone's writes): as no beat, said once
                if auth is not None:
                    auth.forged(f"counted as no beat from node {r}", key, raw, round_id)
                elif r not in book.forged:
                    book.forged.add(r)
                    log.warning("liveness: the store's %s holds %r, not a beat counter; counted as no beat from "
                                "node %d (someone else writes to the store)", key, bytes(raw[:40]), r)
                value = book.seen.get(r, (0, now))[0]
            book.observe(r, value, now, increasing=auth is not None)
        else:   # no beat yet: counted silent from the first read on (sealed: a deleted key is no beat)
            book.observe(r, 0, now, increasing=auth is not None)
    return book.lost(now)


def _sealed_counter(auth: StoreAuth, key: str, raw, round_id: str) -> "int | None":
    """A sealed beat number of ``key`` in round ``round_id``, or None (forged, another key's or round's)."""
    v = auth.open(Purpose.LIVENESS, key, raw, round_id)
    return _counter(v) if v is not None else None


def _counter(raw: bytes) -> "int | None":
    """A beat counter as the store holds it (``add``'s decimal ASCII), or None for anything else."""
    if not isinstance(raw, (bytes, bytearray)) or not 0 < len(raw) <= 20 or not raw.isdigit():
        return None
    return int(raw)
