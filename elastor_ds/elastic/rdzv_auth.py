"""The rendezvous state, authenticated: torch's dynamic rendezvous keeps its state in the store as a
pickle and unpickles whatever it reads there on every keep-alive, so anyone who can write to the
store (a c10d ``TCPStore`` takes writes from any process that reaches its port; the port is listed
in ``/proc/net/tcp`` and the run id is in every agent's argv) could run code as the job's user in
every agent. :class:`SignedBackend` wraps the store's backend: every state it writes carries an
HMAC-SHA256 of the run id and the state under a key of the job, and a state read back whose MAC does
not verify is refused (:class:`RendezvousStateError`) before torch unpickles a byte of it.

The key: derived from ``--job-secret-file`` (the same file on every node); a single-node job without
one makes a random key for its lifetime (only its own agent joins). A multi-node job without a
secret file cannot agree on a key: its state stays unsigned, and the controller says so once.

The same key seals elastor's own values in the store (the failure ledger, the liveness beats, the
snapshot servers' addresses: :mod:`.store_auth`, per purpose, run, round and key).

What it does not cover (see docs/security.md): the store's other keys (the gloo and NCCL bootstrap
addresses, torch's own), which torch reads unauthenticated; replay of an older state this job wrote
(the store keeps only the newest, and a stale one fails torch's own round checks); and an attacker
who deletes or overwrites the state (the rendezvous then fails: a denial of service, not code).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from typing import Optional

from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from ..checkpoint.auth import load_key

log = logging.getLogger(__name__)

MAGIC = b"ELRDZV1\0"
_LABEL = b"elastor rendezvous state v1"
_TAG = hashlib.sha256().digest_size


def rendezvous_key(secret_file: Optional[str], multi_node: bool) -> Optional[bytes]:
    """The key of the rendezvous state's MACs: from the job's secret file, else a random one for a
    single-node job, else None (multi-node without a secret: unsigned, logged once)."""
    if secret_file:
        return hmac.new(load_key(secret_file), _LABEL, hashlib.sha256).digest()
    if not multi_node:
        return os.urandom(32)
    log.warning("the rendezvous state is not authenticated: torch unpickles it from the store, so anyone who can "
                "reach the store can run code in every agent of this job (and forge the failure ledger and the "
                "liveness beats); give every node the same --job-secret-file (or keep the store's port "
                "reachable only by the job's nodes)")
    return None


class ForgedStateError(RendezvousStateError):
    """The store holds a rendezvous state whose MAC does not verify with the job's key."""


class SignedBackend(RendezvousBackend):
    """A :class:`RendezvousBackend` whose states carry a MAC under ``key`` (see the module docstring);
    ``inner`` stores them (torch's c10d or etcd backend)."""

    def __init__(self, inner: RendezvousBackend, key: bytes, run_id: str):
        self.inner, self._key, self._run_id = inner, key, run_id

    @property
    def name(self) -> str:
        return self.inner.name

    def _tag(self, state: bytes) -> bytes:
        mac = hmac.new(self._key, MAGIC, hashlib.sha256)
        mac.update(self._run_id.encode("utf-8", "surrogateescape") + b"\0")
        mac.update(state)
        return mac.digest()

    def _sign(self, state: bytes) -> bytes:
        return MAGIC + self._tag(state) + state

    def _open(self, blob: bytes) -> bytes:
        """The state inside ``blob`` if its MAC verifies; RendezvousStateError otherwise (nothing of it
        is parsed beyond the MAC)."""
        if isinstance(blob, bytes) and blob.startswith(MAGIC) and len(blob) >= len(MAGIC) + _TAG:
            tag, state = blob[len(MAGIC):len(MAGIC) + _TAG], blob[len(MAGIC) + _TAG:]
            if hmac.compare_digest(tag, self._tag(state)):
                return state
        raise ForgedStateError(
            f"the rendezvous state of run {self._run_id!r} in the store was not written by this job (its MAC does "
            f"not verify with the job's key, {len(blob) if isinstance(blob, bytes) else '?'} bytes): another job "
            f"uses the same --rdzv-id on this store, a node was given another --job-secret-file, or someone "
            f"wrote it; it is not read. Use a new --rdzv-id, the same secret file on every node, and a store "
            f"only the job's nodes reach")

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        got = self.inner.get_state()
        if got is None:
            return None
        blob, token = got
        return self._open(blob), token

    def set_state(self, state: bytes, token: Optional[Token] = None) -> Optional[tuple[bytes, Token, bool]]:
        signed = self._sign(state)
        got = self.inner.set_state(signed, token)
        if got is None:
            return None
        blob, new_token, _ = got
        # the store's answer is its current value: ours when the write won (the same bytes), else
        # another writer's, which must verify too
        if blob == signed:
            return state, new_token, True
        return self._open(blob), new_token, False


def signed_handler(params: RendezvousParameters, key: Optional[bytes], store=None, backend=None):
    """A dynamic rendezvous handler for ``params`` whose state is signed with ``key`` (None: torch's,
    unsigned). c10d: torch's own store and backend (``create_backend``, as its registry does);
    etcd-v2: the ``store`` and ``backend`` given."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    if backend is None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        backend, store = create_backend(params)
    if key is not None:
        backend = SignedBackend(backend, key, params.run_id)
    return create_handler(store, backend, params)
