"""Process groups of the default world: created in one order on every rank.

``torch.distributed.new_group`` is collective over the *whole* default world, members or not:
every rank must create the same groups in the same order, or the job hangs at the first group one
rank skipped. The callers compute that order as a pure value (``runtime/groups.py``'s
``creation_order``, a peer-copy plan) and hand it here; this module only walks it.

* :func:`new_group`: one group (members get it, the other ranks get ``None``);
* :func:`create_groups`: every group of an order, in that order; this rank's groups by rank tuple;
* :func:`world_rank`, :func:`world_size`: the default world, with a typed error when there is none;
* :func:`destroy_group`: release a group this module made.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

from ..errors import CollectiveError

__all__ = ["create_groups", "destroy_group", "new_group", "world_rank", "world_size"]


def _dist() -> Any:
    """``torch.distributed``, initialised; else a CollectiveError that says what to call first."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError("torch.distributed is not initialised: call init_process_group (or "
                              "deepspeed.init_distributed) before creating groups")
    return dist


def world_rank() -> int:
    """This process's rank in the default world."""
    return int(_dist().get_rank())


def world_size() -> int:
    """The number of processes of the default world."""
    return int(_dist().get_world_size())


def new_group(ranks: Optional[Sequence[int]] = None, backend: Optional[str] = None,
              timeout_s: Optional[float] = None) -> Any:
    """A group over ``ranks`` (global ranks; ``None``: the whole world). Collective over the whole
    default world: every rank calls it, at the same point of its group creations. Returns the group
    on its members and ``None`` on every other rank. ``timeout_s``: the group's own timeout (its
    backend's default when ``None``)."""
    dist = _dist()
    world = dist.get_world_size()
    members = None if ranks is None else [int(r) for r in ranks]
    if members is not None:
        bad = [r for r in members if not 0 <= r < world]
        if bad or len(set(members)) != len(members) or not members:
            raise CollectiveError(f"group ranks {members}: need distinct ranks in [0, {world}) (the world has {world} "
                                  f"processes)")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: a group's timeout must be > 0 seconds")
    kw: dict[str, Any] = {"ranks": members, "backend": backend}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=float(timeout_s))
    g = dist.new_group(**kw)
    if members is not None and dist.get_rank() not in members:
        return None
    return g


def create_groups(order: Sequence[Sequence[int]], backend: Optional[str] = None,
                  timeout_s: Optional[float] = None) -> dict[tuple[int, ...], Any]:
    """Create every group of ``order`` (the same order on every rank). Returns rank tuple -> group
    for the groups this rank belongs to (the others are created, as they must be, but not kept)."""
    out: dict[tuple[int, ...], Any] = {}
    for ranks in order:
        g = new_group(ranks, backend=backend, timeout_s=timeout_s)
        if g is not None:
            out[tuple(ranks)] = g
    return out


def destroy_group(group: Any) -> None:
    """Release ``group`` (a group of this process made by :func:`new_group`)."""
    _dist().destroy_process_group(group)
