"""elastor's own values in the rendezvous store, authenticated with the job's key.

A c10d ``TCPStore`` takes reads and writes from any process that reaches its port (listed in
``/proc/net/tcp``; the run id is in every agent's argv). The controller keeps its own values there:
the failure ledger's round record and job count (:mod:`.ledger`), the liveness beats
(:mod:`.liveness`) and the snapshot servers' addresses (:mod:`.agent`). Unauthenticated, a forged
round record naming another node made every node's failure "collateral" (never counted:
``--max-restarts`` never stopped the job) and forged beats kept a dead node "alive".

Every such value is written sealed and read back opened (:class:`StoreAuth`)::

    sealed = b"ELSV1." + hex(tag) + b"." + value
    tag    = HMAC-SHA256(subkey(purpose), field(run id) + field(round) + field(key name) + value)
    subkey(purpose) = HMAC-SHA256(job key, b"elastor store value v1\\0" + purpose)
    field(b) = len(b) as 4 bytes big-endian + b

- the job key is the rendezvous state's (:func:`.rdzv_auth.rendezvous_key`: from
  ``--job-secret-file``, or random per job on a single node); the subkey derivation's label is not
  a prefix of the rendezvous MAC's input (``ELRDZV1\\0``), so the two never share a message;
- ``purpose`` (:class:`Purpose`) separates the kinds of value: a beat cannot pass for a count;
- the run id, the rendezvous round (its store's prefix is ``torch.rendezvous.<run id>.<round>``:
  the same key name in every round) and the key name bind a value to its place: a record of round 3
  copied into round 5, or node 1's beat copied under node 0's key, does not verify.

A value that does not verify is absent for the reader (:meth:`StoreAuth.open` returns None, and
:meth:`StoreAuth.forged` warns once per key, naming the key and the value's length, never its
bytes). What each reader then does is its own (the ledger counts the failure; a beat is no beat).

Not covered: replay of an older value of the same key in the same round (the readers refuse to go
back: beats must increase, the job count never drops below what this node has seen); deletion or
overwrite (a denial of service: the job then counts a failure more, or sees a live node as lost).
Without a key (a multi-node job without ``--job-secret-file``) the values stay unsigned (the
rendezvous key's warning says so).
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import threading
from typing import Optional, Union

log = logging.getLogger("elastor.run")

MAGIC = b"ELSV1."
_SUBKEY_LABEL = b"elastor store value v1\0"
_TAG_HEX = 2 * hashlib.sha256().digest_size


class Purpose(str, enum.Enum):
    """What a sealed value is (its MAC's domain)."""
    FAILURE_RECORD = "failure-record"     # the name of a round's first failure reporter (ledger)
    FAILURE_COUNT = "failure-count"       # the job's failure count (ledger)
    LIVENESS = "liveness"                 # a node's beat counter in a round (liveness)
    SNAPSHOT_SERVER = "snapshot-server"   # a node's snapshot server address in a round (agent)


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "big") + b


def _b(x: Union[str, bytes]) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode("utf-8", "surrogateescape")


class StoreAuth:
    """Seals and opens elastor's store values under the job key ``key`` for run ``run_id``."""

    def __init__(self, key: bytes, run_id: str):
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("StoreAuth needs the job key (>= 16 bytes)")
        self._run = _b(run_id)
        self._subkeys = {p: hmac.new(key, _SUBKEY_LABEL + p.value.encode(), hashlib.sha256).digest() for p in Purpose}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _tag(self, purpose: Purpose, key_name: str, value: bytes, round_id: str) -> bytes:
        mac = hmac.new(self._subkeys[Purpose(purpose)], digestmod=hashlib.sha256)
        for f in (self._run, _b(round_id), _b(key_name)):
            mac.update(_field(f))
        mac.update(value)
        return mac.hexdigest().encode()

    def seal(self, purpose: Purpose, key_name: str, value: Union[str, bytes], round_id: str = "") -> bytes:
        """The bytes to store under ``key_name`` (in round ``round_id``; "" for a key outside rounds)."""
        v = _b(value)
        return MAGIC + self._tag(purpose, key_name, v, round_id) + b"." + v

    def open(self, purpose: Purpose, key_name: str, blob, round_id: str = "") -> Optional[bytes]:
        """The value inside ``blob`` when its MAC verifies for this purpose, run, round and key; else
        None (nothing of it is parsed beyond the MAC)."""
        if isinstance(blob, str):
            blob = blob.encode("utf-8", "surrogateescape")
        if not isinstance(blob, (bytes, bytearray)):
            return None
        blob = bytes(blob)
        head = len(MAGIC) + _TAG_HEX
        if not blob.startswith(MAGIC) or len(blob) < head + 1 or blob[head:head + 1] != b".":
            return None
        tag, value = blob[len(MAGIC):head], blob[head + 1:]
        if not hmac.compare_digest(tag, self._tag(purpose, key_name, value, round_id)):
            return None
        return value

    def forged(self, what: str, key_name: str, blob, round_id: str = "") -> None:
        """Warn (once per key and round) that ``key_name`` holds a value this job did not write."""
        where = f"{key_name} (round {round_id})" if round_id else key_name
        with self._lock:
            if where in self._warned:
                return
            self._warned.add(where)
        n = len(blob) if isinstance(blob, (bytes, bytearray, str)) else "?"
        log.warning("the rendezvous store's %s holds a value this job did not write (%s bytes; its MAC does not "
                    "verify with the job's key): %s; it is ignored. Someone else writes to the store: keep its "
                    "port reachable only by the job's nodes", where, n, what)


class SealedStore:
    """A view of ``store`` for a reader and writer that knows only ``set`` and ``multi_get``
    (:meth:`~elastor_ds.checkpoint.snapshot.server.NodeSnapshots.publish`): values are sealed for
    ``purpose`` in round ``round_id``, and one that does not verify reads as ``b""`` (absent)."""

    def __init__(self, store, auth: StoreAuth, purpose: Purpose, round_id: str, absent: str):
        self.store, self.auth, self.purpose, self.round_id, self.absent = store, auth, purpose, round_id, absent

    def set(self, key: str, value) -> None:
        self.store.set(key, self.auth.seal(self.purpose, key, value, self.round_id))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out = []
        for k, raw in zip(keys, self.store.multi_get(keys)):
            v = self.auth.open(self.purpose, k, raw, self.round_id)
            if v is None:
                self.auth.forged(self.absent, k, raw, self.round_id)
                v = b""
            out.append(v)
        return out
