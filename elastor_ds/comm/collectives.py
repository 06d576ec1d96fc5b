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

from ..errors import CollectiveError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def barrier(self) -> None: ...


class LocalComm:
    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None


class TorchComm:
    """Object collectives on a dedicated gloo group of the default world."""

    def __init__(self, group: Any, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @staticmethod
    def create(timeout_s: float = 600.0) -> "TorchComm":
        """Collective: every rank must call it, in the same order relative to other group creations."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialised: call init_process_group (or "
                                  "deepspeed.init_distributed) first, or use LocalComm for one process")
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return TorchComm(group, dist.get_rank(), dist.get_world_size())

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


def agree(comm: Comm, fn: Callable[[], T], what: str = "operation") -> tuple[T, list[Any]]:
    """Run ``fn`` locally; if it raised on any rank, raise CollectiveError on all ranks.

    Returns (local result, every rank's result)."""
    try:
        result: Any = fn()
        status = ("ok", result)
    except BaseException as e:  # noqa: BLE001 - re-raised on every rank below
        status = ("error", f"{type(e).__name__}: {e}")
        result = e
    statuses = comm.all_gather_object(status)
    failed = [(r, s[1]) for r, s in enumerate(statuses) if s[0] != "ok"]
    if failed:
        msg = "; ".join(f"rank {r}: {m}" for r, m in failed[:8])
        err = CollectiveError(f"{what} failed on {len(failed)} of {comm.world_size} ranks: {msg}")
        if isinstance(result, BaseException):
            raise err from result
        raise err
    return result, [s[1] for s in statuses]
