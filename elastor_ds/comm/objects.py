"""Object collectives over any process group through the restricted codec (:mod:`.wire`), never pickle.

Its one job: move small Python values (plain data: see :mod:`.wire`) between the members of a group
for :class:`~.collectives.TorchComm`, :class:`~.transport.GlooTransport` and the integrations that
agree on a value over the default world. ``torch.distributed.all_gather_object`` and
``broadcast_object_list`` unpickle what peers send, so whoever can join or impersonate a peer of the
group (its bootstrap addresses are read from the rendezvous store) could run code in every rank.

:func:`all_gather_object`, in order:

1. encode this rank's value (:func:`.wire.encode`); a value the codec refuses is not sent: the rank
   announces a failure report instead (its error's class names and message, JSON, at most
   :data:`FAILURE_BYTES`), so that no rank waits for it;
2. all-gather the lengths (one int64 each; a negative length announces a report);
3. check every length against the limits (a peer announcing more is refused before any buffer is
   allocated: :class:`.wire.WireFormatError` on every rank, step 4 skipped on every rank);
4. all-gather the bytes, each padded to the longest;
5. a rank that refused its value raises its own :class:`.wire.WireTypeError`; the others raise a
   :class:`~elastor_ds.errors.RanksFailedError` naming it (its report is read as JSON text only);
6. decode every rank's bytes (:func:`.wire.decode`): a payload that is not valid raises
   :class:`.wire.WireFormatError` naming the rank it came from.

:func:`broadcast_object` is the same with a broadcast from ``src``: the lengths, then the bytes.
``run`` wraps steps 2 to 4 (the group's own operations): the caller's translation of a backend
failure (a :class:`~elastor_ds.errors.PeerFailedError`, a transport error) and its liveness check
happen there, once per collective; the codec's errors are raised outside it, never translated.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional, TypeVar

from ..errors import RankFailure
from . import wire

__all__ = ["FAILURE_BYTES", "all_gather_object", "broadcast_object"]

T = TypeVar("T")

#: bytes of one rank's failure report (its class names and message, as JSON)
FAILURE_BYTES = 2048


def _failure_bytes(rank: int, e: BaseException) -> bytes:
    """``e`` as JSON ``[class name, message, class names]``, at most :data:`FAILURE_BYTES` (the
    message cut shorter until it fits)."""
    f = RankFailure.of(rank, e)
    mro = [n[:80] for n in f.mro[:12]]
    for cut in (1000, 300, 60, 0):
        data = json.dumps([f.type_name[:80], f.message[:cut], mro]).encode()
        if len(data) <= FAILURE_BYTES:
            return data
    return json.dumps([f.type_name[:80], "", []]).encode()


def _failure_of(rank: int, data: bytes) -> RankFailure:
    try:
        name, message, mro = json.loads(data.decode("utf-8"))
        return RankFailure(rank, str(name), str(message), tuple(str(n) for n in mro))
    except (ValueError, TypeError, UnicodeDecodeError):
        return RankFailure(rank, "Error", f"(undecodable failure report: {data[:60]!r})")


def _direct(fn: Callable[[], T]) -> T:
    return fn()


def _outgoing(obj: Any, rank: int, max_bytes: int) -> tuple[int, bytes, Optional[BaseException]]:
    """(the length to announce, the bytes to send, the codec's refusal or None): step 1."""
    try:
        data = wire.encode(obj, max_bytes)
        return len(data), data, None
    except (wire.WireTypeError, wire.WireLimitError) as e:
        report = _failure_bytes(rank, e)
        return -1 - len(report), report, e


def _check_length(n: int, src: int, max_bytes: int, what: str) -> None:
    if not -1 - FAILURE_BYTES <= n <= max_bytes:
        raise wire.WireFormatError(f"{what}: rank {src} announced {n} bytes (a value is at most {max_bytes}, a "
                                   f"failure report at most {FAILURE_BYTES}): refused, nothing received")


def _size(n: int) -> int:
    return n if n >= 0 else -1 - n


def _device(dist: Any, group: Any, device: Any) -> Any:
    import torch

    from .groups import _world_device
    if device is not None:
        return torch.device(device)
    return _world_device(dist) if group is None else torch.device("cpu")


def _buffer(data: bytes, width: int, dev: Any) -> tuple[Any, bytearray, Any]:
    """(a uint8 tensor of ``width`` bytes on ``dev`` holding ``data`` then zeros, its host bytes,
    the host tensor over them)."""
    import torch

    buf = bytearray(max(width, 1))
    buf[:len(data)] = data
    host = torch.frombuffer(buf, dtype=torch.uint8)
    return (host if dev.type == "cpu" else host.to(dev)), buf, host


def _read(t: Any, buf: bytearray, host: Any) -> bytes:
    """The bytes of ``t`` (made by :func:`_buffer`) after a collective wrote into it."""
    if t is not host:
        host.copy_(t)
    return bytes(buf)


def _verdict(failed: list[tuple[int, bytes]], local: Optional[BaseException], world: int, what: str) -> None:
    """Step 5: this rank's own refusal, else one typed error naming the ranks that refused."""
    if not failed:
        return
    if local is not None:
        raise local
    from .collectives import raise_failures
    raise_failures([_failure_of(r, b) for r, b in failed], world, None, what)


def _decoded(src: int, data: bytes, max_bytes: int, what: str) -> Any:
    try:
        return wire.decode(data, max_bytes)
    except wire.WireFormatError as e:
        raise wire.WireFormatError(f"{what}: the value from rank {src} is not a valid wire payload ({e}): refused, "
                                   f"nothing of it was used") from None


def all_gather_object(obj: Any, group: Any = None, *, what: str = "all_gather_object",
                      run: Optional[Callable[[Callable[[], Any]], Any]] = None, device: Any = None,
                      max_bytes: int = wire.MAX_BYTES) -> list[Any]:
    """Every member's ``obj``, decoded, in group rank order (see the module docstring). Collective
    over ``group`` (``None``: the default world, on its device). ``obj`` must be plain data
    (:mod:`.wire`): anything else raises :class:`.wire.WireTypeError` here and a
    :class:`~elastor_ds.errors.RanksFailedError` on the other members."""
    import torch.distributed as dist

    from .groups import all_gather_int_rows
    from .tensors import all_gather_into

    run = run or _direct
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n, data, local = _outgoing(obj, rank, max_bytes)
    if world == 1:
        if local is not None:
            raise local
        return [wire.decode(data, max_bytes)]
    dev = _device(dist, group, device)

    def exchange() -> tuple[list[int], Optional[bytes]]:
        lens = [row[0] for row in all_gather_int_rows([n], group=group, device=dev)]
        if any(not -1 - FAILURE_BYTES <= m <= max_bytes for m in lens):
            return lens, None   # step 3: every rank sees the same lengths and stops here
        width = max(max(_size(m) for m in lens), 1)
        out = _buffer(b"", world * width, dev)
        all_gather_into(out[0], _buffer(data, width, dev)[0], group)
        return lens, _read(*out)

    lens, raw = run(exchange)
    for r, m in enumerate(lens):
        _check_length(m, r, max_bytes, what)
    assert raw is not None
    width = len(raw) // world
    rows = [raw[r * width:r * width + _size(m)] for r, m in enumerate(lens)]
    _verdict([(r, rows[r]) for r, m in enumerate(lens) if m < 0], local, world, what)
    return [_decoded(r, row, max_bytes, what) for r, row in enumerate(rows)]


def broadcast_object(obj: Any, src: int = 0, group: Any = None, *, what: str = "broadcast_object",
                     run: Optional[Callable[[Callable[[], Any]], Any]] = None, device: Any = None,
                     max_bytes: int = wire.MAX_BYTES) -> Any:
    """``obj`` of member ``src`` (its rank in ``group``; ``None``: the default world) on every member:
    ``src`` gets its own ``obj`` back, the others a decoded copy. Only ``src``'s ``obj`` is read.
    Refusals and malformed payloads as in :func:`all_gather_object`."""
    import torch
    import torch.distributed as dist

    run = run or _direct
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if not 0 <= src < world:
        raise ValueError(f"{what}: src={src} is not a rank of the group (ranks 0..{world - 1})")
    n, data, local = _outgoing(obj, rank, max_bytes) if rank == src else (0, b"", None)
    if world == 1:
        if local is not None:
            raise local
        return obj
    dev = _device(dist, group, device)
    kw: dict[str, Any] = {"src": src} if group is None else {"group": group, "group_src": src}

    def exchange() -> tuple[int, Optional[bytes]]:
        t = torch.tensor([n], dtype=torch.int64, device=dev)
        dist.broadcast(t, **kw)
        m = int(t[0])
        if not -1 - FAILURE_BYTES <= m <= max_bytes:
            return m, None
        buf = _buffer(data, _size(m), dev)
        dist.broadcast(buf[0], **kw)
        return m, _read(*buf)[:_size(m)]

    m, raw = run(exchange)
    _check_length(m, src, max_bytes, what)
    assert raw is not None
    _verdict([(src, raw)] if m < 0 else [], local, world, what)
    if rank == src:
        return obj
    return _decoded(src, raw, max_bytes, what)
