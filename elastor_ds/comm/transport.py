"""Moving bytes between ranks: the :class:`Transport` seam, and :class:`GlooTransport` over gloo.

A transport is a dedicated group over a set of ranks with its own timeout. Peers are addressed by
their rank *in the transport* (``0 .. world_size - 1``; ``ranks[i]`` is the global rank of transport
rank ``i``). What it offers is what peer copies of memory snapshots need
(:mod:`elastor_ds.checkpoint.snapshot.peer_copy`):

* :meth:`Transport.isend` / :meth:`Transport.irecv`: non-blocking, so a ring (A sends to B while B
  sends to A) cannot deadlock; each returns a :class:`Work` to ``wait()`` on. A receive matches
  the send with the same (peer, tag); between one pair, messages of one tag arrive in the order
  they were posted. Both sides post in the same order (a backend without tags relies on that);
* buffers: a contiguous tensor (its bytes move: the receiver's buffer has the same byte size) or
  a bytes-like object (writable for a receive). Zero-byte buffers are allowed;
* :meth:`Transport.all_gather_object`, :meth:`Transport.barrier`: small agreements among the members
  (plain data through :mod:`.wire`, never pickled);
* errors: a transfer that does not complete within the timeout raises
  :class:`~elastor_ds.errors.TransportTimeoutError`, any other failure
  :class:`~elastor_ds.errors.TransportError`, on the rank that waited. A failed transport stays
  failed (gloo closes the connection): later calls raise ``TransportError`` at once; make a new one.

Creation (``GlooTransport.create(ranks, timeout_s)``) is collective over the whole default world,
at the same point of every rank's group creations (see :mod:`.groups`); non-members get ``None``.
:mod:`tests.dist.test_transport` is the conformance scenario every implementation passes.

A new backend is a new file. An NCCL transport (``comm/nccl_transport.py``, ``NcclTransport``)
would implement the same protocol:

1. ``create``: a dedicated ``new_group(backend="nccl", ranks, timeout)`` through :mod:`.groups`,
   plus a small gloo side group for ``all_gather_object`` / ``barrier`` (object collectives need no
   device round trip);
2. buffers: device tensors move as they are; host buffers (the memory-mapped snapshot files) are
   staged through a pinned host buffer and a device bounce buffer, in pieces, on a side stream;
3. ``isend`` / ``irecv``: ``batch_isend_irecv`` of the posted operations (NCCL has no tags: it
   matches by peer and posting order, which the contract above already requires);
4. ``Work.wait``: the stream event with the timeout; a timeout or an NCCL async error (watchdog)
   becomes ``TransportTimeoutError`` / ``TransportError`` and aborts the communicator;
5. one parametrize entry in the conformance test, skipped without two GPUs.
"""
from __future__ import annotations

import datetime
import logging
import warnings
from typing import Any, Optional, Protocol, Sequence

from ..errors import TransportError, TransportTimeoutError
from .groups import destroy_group, new_group
from .objects import all_gather_object

log = logging.getLogger(__name__)

__all__ = ["GlooTransport", "Transport", "Work"]


class Work(Protocol):
    """One posted send or receive."""

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until the transfer completed (``timeout_s``: the transport's timeout when None)."""
        ...


class Transport(Protocol):
    """Point-to-point bytes among a fixed set of ranks (see the module docstring)."""

    rank: int                   # this process's rank in the transport
    world_size: int             # members of the transport
    ranks: tuple[int, ...]      # global rank of each transport rank
    timeout_s: float

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work: ...
    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work: ...
    def send(self, buf: Any, dst: int, tag: int = 0) -> None: ...
    def recv(self, buf: Any, src: int, tag: int = 0) -> None: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


def as_byte_tensor(buf: Any, writable: bool) -> Any:
    """``buf`` as a tensor over the same memory: a contiguous tensor as it is, a bytes-like object
    as a uint8 tensor (zero bytes: an empty one). Raises ValueError / TypeError naming the fix."""
    import torch

    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError(f"transport buffer of shape {tuple(buf.shape)} is not contiguous: pass .contiguous() "
                             f"(a receive must write into the tensor you read afterwards)")
        return buf
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"transport buffer of type {type(buf).__name__}: pass a tensor or a bytes-like object "
                        f"(bytes, bytearray, memoryview)") from None
    if writable and view.readonly:
        raise TypeError(f"cannot receive into a read-only {type(buf).__name__}: pass a bytearray or a tensor")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():   # a read-only buffer is only ever sent, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


class _GlooWork:
    def __init__(self, owner: "GlooTransport", work: Any, tensor: Any, what: str):
        self._owner, self._work, self._tensor, self._what = owner, work, tensor, what
        self._done = False

    def wait(self, timeout_s: Optional[float] = None) -> None:
        if self._done:
            return
        limit = self._owner.timeout_s if timeout_s is None else float(timeout_s)
        try:
            if timeout_s is None:
                self._work.wait()
            else:
                self._work.wait(timeout=datetime.timedelta(seconds=limit))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for every failure
            raise self._owner._failed(self._what, limit, e) from e
        self._done = True
        self._tensor = None


class GlooTransport:
    """:class:`Transport` over a dedicated gloo group (CPU tensors and host memory)."""

    def __init__(self, group: Any, ranks: Sequence[int], rank: int, timeout_s: float):
        self.group = group
        self.ranks = tuple(int(r) for r in ranks)
        self.world_size = len(self.ranks)
        self.rank = int(rank)
        self.timeout_s = float(timeout_s)
        self._broken: Optional[str] = None

    @staticmethod
    def create(ranks: Optional[Sequence[int]] = None, timeout_s: float = 600.0) -> Optional["GlooTransport"]:
        """Collective over the default world: a transport over ``ranks`` (global ranks, ``None``: all)
        on its members, ``None`` on the other ranks."""
        import torch.distributed as dist

        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: a transport's timeout must be > 0 seconds")
        g = new_group(ranks, backend="gloo", timeout_s=timeout_s)
        if g is None:
            return None
        members = dist.get_process_group_ranks(g)
        return GlooTransport(g, members, members.index(dist.get_rank()), timeout_s)

    # ------------------------------------------------------------------ point to point
    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work:
        import torch.distributed as dist

        t = as_byte_tensor(buf, writable=False)
        peer = self._peer(dst, tag, "send to")
        what = f"send of {t.nbytes} bytes to transport rank {dst} (global {peer}), tag {tag}"
        return _GlooWork(self, self._post(what, lambda: dist.isend(t, peer, group=self.group, tag=tag)), t, what)

    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        import torch.distributed as dist

        t = as_byte_tensor(buf, writable=True)
        peer = self._peer(src, tag, "receive from")
        what = f"receive of {t.nbytes} bytes from transport rank {src} (global {peer}), tag {tag}"
        return _GlooWork(self, self._post(what, lambda: dist.irecv(t, peer, group=self.group, tag=tag)), t, what)

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        self.isend(buf, dst, tag).wait()

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        self.irecv(buf, src, tag).wait()

    # ------------------------------------------------------------------ small agreements
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's ``obj`` (plain data, never pickled: :mod:`.objects`), in transport rank order."""
        self._check()
        return all_gather_object(obj, self.group, what="all_gather_object",
                                 run=lambda fn: self._call("all_gather_object", fn))

    def barrier(self) -> None:
        import torch.distributed as dist

        self._call("barrier", lambda: dist.barrier(group=self.group))

    def close(self) -> None:
        """Release the group (idempotent). Peers still sending to this rank see their transfers fail."""
        g, self.group = self.group, None
        if self._broken is None:
            self._broken = "closed"
        if g is not None:
            try:
                destroy_group(g)
            except Exception as e:  # noqa: BLE001 - the world may be gone already (teardown)
                log.debug("closing a gloo transport: %s", e)

    # ------------------------------------------------------------------ internals
    def _peer(self, other: int, tag: int, verb: str) -> int:
        if isinstance(other, bool) or not isinstance(other, int) or not 0 <= other < self.world_size:
            raise ValueError(f"cannot {verb} transport rank {other!r}: the transport has ranks 0..{self.world_size - 1} "
                             f"(global ranks {list(self.ranks)}); address peers by their rank in the transport")
        if other == self.rank:
            raise ValueError(f"cannot {verb} transport rank {other}: that is this rank (copy the bytes locally)")
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise ValueError(f"tag={tag!r}: tags are non-negative integers")
        return self.ranks[other]

    def _check(self) -> None:
        if self._broken == "closed":
            raise TransportError(f"this gloo transport (global ranks {list(self.ranks)}) is closed: create a new one")
        if self._broken is not None:
            raise TransportError(f"this gloo transport (global ranks {list(self.ranks)}) failed earlier ({self._broken}): "
                                 f"its connections are closed; create a new transport")

    def _post(self, what: str, fn: Any) -> Any:
        self._check()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for every failure
            raise self._failed(what, self.timeout_s, e) from e

    def _call(self, what: str, fn: Any) -> Any:
        self._check()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            raise self._failed(what, self.timeout_s, e) from e

    def _failed(self, what: str, limit: float, e: BaseException) -> TransportError:
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
        self._broken = self._broken or f"{what}: {msg}"
        if timed_out:
            return TransportTimeoutError(f"{what} did not complete within {limit:g} s: the peer never posted the "
                                         f"matching transfer, or is gone ({msg})")
        return TransportError(f"{what} failed: the peer left or the connection broke ({type(e).__name__}: {msg})")
