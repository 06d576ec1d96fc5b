"""Transport conformance: one scenario, run against every :class:`elastor_ds.comm.transport.Transport`
implementation on three real processes.

The scenario (every expected byte is written by this file's ``_payload``, never by the transport):

1. a transport over the whole world: its rank, size and global ranks; a ring where every rank sends
   buffers of 0, 1, 3, 4097 and 1 MiB + 3 bytes to the next rank while receiving from the previous
   one (all posted at once: a ring must not deadlock), as bytes, bytearrays and tensors; a float32
   tensor (its bytes move); two messages with one tag arrive in posting order; blocking send/recv;
   an object all-gather and a barrier; wrong peers, tags and buffers are refused before anything is
   posted (ValueError / TypeError naming the value);
2. a transport over a subset (global ranks 0 and 2): the others get None; members address each other
   by their rank in the transport (0, 1), and global rank 2 is not a peer there;
3. a receive whose peer never sends raises TransportTimeoutError after the transport's timeout (and
   after a per-call ``wait(timeout_s=...)``), not a hang; the failed transport then refuses every
   call at once with TransportError.

A new backend is one entry in ``BACKENDS`` (with its skip marks, e.g. ``pytest.mark.gpu``) and one
line in ``_factory``.
"""
from __future__ import annotations

import time

import pytest

from dist_utils import run_world

BACKENDS = [pytest.param("gloo", id="gloo")]
SIZES = (0, 1, 3, 4097, (1 << 20) + 3)
TIMEOUT_S = 5.0        # the timed-out transport's own timeout
WAIT_S = 1.0           # a per-call wait(timeout_s=...)


def _factory(name: str):
    """``create(ranks, timeout_s)`` of backend ``name`` (collective; None on non-members)."""
    if name == "gloo":
        from elastor_ds.comm.transport import GlooTransport
        return GlooTransport.create
    raise AssertionError(f"no factory for transport backend {name!r}: add it to _factory")


def _payload(src: int, n: int, salt: int) -> bytes:
    """``n`` bytes that differ by sender, size and salt (period 251: a shifted or truncated copy differs)."""
    return bytes((i * 7 + src * 31 + salt * 13) % 251 for i in range(n))


def _bytes_of(buf) -> bytes:
    return bytes(buf) if isinstance(buf, (bytes, bytearray)) else bytes(buf.numpy().tobytes())


def _world_transport(t, rank: int) -> None:
    import torch

    assert (t.rank, t.world_size, tuple(t.ranks)) == (rank, 3, (0, 1, 2))
    nxt, prv = (rank + 1) % 3, (rank - 1) % 3
    # ring of every size, mixed buffer kinds, all posted before any wait
    works, inbox = [], []
    for k, n in enumerate(SIZES):
        out = _payload(rank, n, k)
        works.append(t.isend(out if k % 2 else torch.tensor(list(out), dtype=torch.uint8), nxt, tag=k))
        buf = bytearray(n) if k % 2 == 0 else torch.zeros(n, dtype=torch.uint8)
        inbox.append(buf)
        works.append(t.irecv(buf, prv, tag=k))
    for w in works:
        w.wait()
    for k, (n, buf) in enumerate(zip(SIZES, inbox)):
        got = _bytes_of(buf)
        assert len(got) == n and got == _payload(prv, n, k), (k, n, got[:16], _payload(prv, n, k)[:16])
    # a float32 tensor: its bytes move
    f = torch.arange(6, dtype=torch.float32) * (rank + 1) + 0.5
    fin = torch.zeros(6, dtype=torch.float32)
    ws = [t.isend(f, nxt, tag=20), t.irecv(fin, prv, tag=20)]
    for w in ws:
        w.wait()
    assert fin.tolist() == [i * (prv + 1) + 0.5 for i in range(6)]
    # two messages, one tag: posting order
    a, b = _payload(rank, 64, 100), _payload(rank, 64, 101)
    ra, rb = bytearray(64), bytearray(64)
    ws = [t.isend(a, nxt, tag=30), t.isend(b, nxt, tag=30), t.irecv(ra, prv, tag=30), t.irecv(rb, prv, tag=30)]
    for w in ws:
        w.wait()
    assert bytes(ra) == _payload(prv, 64, 100) and bytes(rb) == _payload(prv, 64, 101)
    # blocking send/recv: 0 -> 2, an odd size
    if rank == 0:
        t.send(_payload(0, 999, 7), 2, tag=40)
    elif rank == 2:
        got = bytearray(999)
        t.recv(got, 0, tag=40)
        assert bytes(got) == _payload(0, 999, 7)
    # small agreements
    assert t.all_gather_object({"rank": rank, "tag": f"r{rank}"}) == [{"rank": r, "tag": f"r{r}"} for r in range(3)]
    t.barrier()
    # refused before anything is posted
    with pytest.raises(ValueError, match="that is this rank"):
        t.isend(b"x", rank)
    with pytest.raises(ValueError, match=r"transport rank 3.*ranks 0\.\.2"):
        t.isend(b"x", 3)
    with pytest.raises(ValueError, match="tags are non-negative"):
        t.irecv(bytearray(1), prv, tag=-1)
    with pytest.raises(TypeError, match="read-only"):
        t.irecv(b"abc", prv)
    with pytest.raises(ValueError, match="not contiguous"):
        t.isend(torch.zeros(4, 4, dtype=torch.uint8).t(), nxt)
    t.barrier()   # nothing of the refused calls is in flight: the transport still works


def _subset_transport(make, rank: int) -> None:
    sub = make([0, 2], 60.0)
    if rank == 1:
        assert sub is None
        return
    me = {0: 0, 2: 1}[rank]
    assert (sub.rank, sub.world_size, tuple(sub.ranks)) == (me, 2, (0, 2))
    with pytest.raises(ValueError, match="transport rank 2"):
        sub.isend(b"x", 2)            # global rank 2 is transport rank 1 here
    other = 1 - me
    out = _payload(rank, 513, 50)
    got = bytearray(513)
    ws = [sub.isend(out, other, tag=1), sub.irecv(got, other, tag=1)]
    for w in ws:
        w.wait()
    assert bytes(got) == _payload(2 - rank, 513, 50)
    assert sub.all_gather_object(rank) == [0, 2]
    sub.close()


def _timeouts(make, rank: int, t) -> None:
    from elastor_ds.errors import TransportError, TransportTimeoutError

    slow = make(None, TIMEOUT_S)      # rank 1 waits on rank 0, which never sends
    fast = make(None, 60.0)           # rank 2 waits WAIT_S on rank 1, which never sends
    if rank == 1:
        w = slow.irecv(bytearray(16), 0, tag=7)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError, match=r"from transport rank 0.*within 5 s") as e:
            w.wait()
        took = time.monotonic() - t0
        assert TIMEOUT_S * 0.8 <= took <= TIMEOUT_S + 20, took
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, TransportError)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="failed earlier"):
            slow.isend(b"x", 2)
        with pytest.raises(TransportError, match="failed earlier"):
            slow.barrier()
        assert time.monotonic() - t0 < 2.0
    if rank == 2:
        w = fast.irecv(bytearray(8), 1, tag=3)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError, match=r"within 1 s"):
            w.wait(timeout_s=WAIT_S)
        took = time.monotonic() - t0
        assert WAIT_S * 0.8 <= took <= WAIT_S + 20, took
    t.barrier()                       # another transport is unaffected; nobody leaves before the timeouts
    slow.close()
    fast.close()
    with pytest.raises(TransportError, match="closed"):
        fast.isend(b"x", (rank + 1) % 3)


def _scenario(rank: int, world: int, backend: str) -> None:
    make = _factory(backend)
    t = make(None, 60.0)
    _world_transport(t, rank)
    _subset_transport(make, rank)
    _timeouts(make, rank, t)
    t.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_transport_conformance(backend):
    run_world(_scenario, 3, backend, timeout_s=60)
