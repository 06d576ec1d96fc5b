"""Small object collectives over a process group, with failures raised on every rank.

:class:`Comm` is the one interface the checkpoint engine talks to: ``rank``, ``world_size``,
``all_gather_object``, ``broadcast_object``, ``barrier``. :class:`TorchComm` implements it over a
dedicated gloo group (created once, collectively, with its own timeout, so checkpoint traffic
never mixes with training collectives and works from a background thread). :class:`LocalComm`
is the single-process version used by the CLI and unit tests.

:func:`agree` runs a local function on every rank and gathers the outcome: if it raised anywhere,
every rank raises :class:`CollectiveError` naming the failing ranks and their errors.
"""
from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Protocol, TypeVar

from ..errors import CollectiveError, RankFailure, ranks_failed

log = logging.getLogger(__name__)
T = TypeVar("T")


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def barrier(self) -> None: ...
    def duplicate(self) -> "Comm": ...
    def all_equal(self, value: int) -> bool: ...


class LocalComm:
    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def duplicate(self) -> "LocalComm":
        return self

    def all_equal(self, value: int) -> bool:
        return True


class TorchComm:
    """Object collectives on a dedicated gloo group of the default world."""

    def __init__(self, group: Any, rank: int, world_size: int, ranks: Any = None, timeout_s: float = 600.0,
                 writer_group: Any = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))
        self.timeout_s = timeout_s
        self.writer_group = writer_group

    @staticmethod
    def create(timeout_s: float = 600.0) -> "TorchComm":
        """Collective: every rank must call it, in the same order relative to other group creations."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialised: call init_process_group (or "
                                  "deepspeed.init_distributed) first, or use LocalComm for one process")
        td = datetime.timedelta(seconds=timeout_s)
        group = dist.new_group(backend="gloo", timeout=td)
        writer = dist.new_group(backend="gloo", timeout=td)
        return TorchComm(group, dist.get_rank(), dist.get_world_size(), timeout_s=timeout_s, writer_group=writer)

    def duplicate(self) -> "TorchComm":
        """The same ranks on a second group, for the checkpoint writer thread: two threads must never
        run collectives on one group (their order could differ per rank and hang). Uses the
        ``writer_group`` made with this comm; without one, creates a group now, which every rank of
        the default world must call in the same order."""
        import torch.distributed as dist

        group = self.writer_group
        if group is None:
            group = dist.new_group(ranks=self.ranks, backend="gloo",
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        return TorchComm(group, self.rank, self.world_size, self.ranks, self.timeout_s)

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=src)  # src: rank within this group
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def all_equal(self, value: int) -> bool:
        """True on every rank iff every rank passed the same 62-bit ``value`` (one tiny all-reduce,
        much cheaper than an object all-gather)."""
        import torch
        import torch.distributed as dist

        v = int(value) & ((1 << 62) - 1)
        t = torch.tensor([v, -v], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]) == v and -int(t[1]) == v


def agree(comm: Comm, fn: Callable[[], T], what: str = "operation") -> T:
    """Run ``fn`` locally; if it raised on any rank, raise one typed error on all ranks.

    Only the outcome is gathered (ok, or the exception's class names and message as plain
    strings), never the result. The error raised is a :class:`RanksFailedError` listing every
    failing rank's class and message, and also an instance of the most specific elastor error
    class they share (e.g. CorruptCheckpointError), so callers decide by type. Returns the local
    result."""
    local: BaseException | None = None
    try:
        result: Any = fn()
        status: tuple = ("ok",)
    except BaseException as e:  # noqa: BLE001 - re-raised on every rank below
        local = e
        status = ("error", RankFailure.of(comm.rank, e).to_wire())
        result = None
    statuses = comm.all_gather_object(status)
    failures = [RankFailure.from_wire(s[1]) for s in statuses if s[0] != "ok"]
    if failures:
        err = ranks_failed(what, failures, comm.world_size)
        if local is not None:
            raise err from local
        raise err
    return result
