"""Process groups of the default world: created in one order on every rank.

``torch.distributed.new_group`` is collective over the *whole* default world, members or not:
every rank must create the same groups in the same order, or the job hangs at the first group one
rank skipped. The callers compute that order as a pure value (``runtime/groups.py``'s
``creation_order``, a peer-copy plan) and hand it here; this module only walks it.

* :func:`new_group`: one group (members get it, the other ranks get ``None``);
* :func:`create_groups`: every group of an order, in that order; this rank's groups by rank tuple;
* :func:`world_rank`, :func:`world_size`: the default world, with a typed error when there is none;
* :func:`destroy_group`: release a group this module made; :func:`world_barrier` before that;
* :func:`all_gather_world_ints`, :func:`all_gather_world_bytes`: every rank's few integers or bytes
  over the default world, as tensors (no pickling), e.g. to agree on a plan before creating groups;
  :func:`all_gather_int_rows`: the same integers over any group (the checkpoint comm's too).
"""
from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

from ..errors import CollectiveError

__all__ = ["all_gather_int_rows", "all_gather_world_bytes", "all_gather_world_ints", "create_groups", "destroy_group",
           "new_group", "world_barrier", "world_rank", "world_size"]


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


def world_barrier() -> None:
    """A barrier over the default world (on this process's GPU when the world is NCCL alone)."""
    dist = _dist()
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[_world_device(dist).index])
    else:
        dist.barrier()


def _world_device(dist: Any) -> Any:
    """Where the default world's collectives take tensors: CPU, unless its backend is NCCL alone
    (then this process's GPU: LOCAL_RANK's, as DeepSpeed's engine picks it, else the current one)."""
    import os

    import torch

    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None and local.isdigit() else torch.cuda.current_device())


def all_gather_int_rows(values: Sequence[int], group: Any = None, device: Any = None) -> list[list[int]]:
    """Every member's ``values`` (signed 64-bit; every member passes the same number), in group rank
    order: one all-gather of a fixed-size int64 tensor, no pickling. ``group``: ``None`` for the
    default world (on its device, :func:`_world_device`), else a group of this module's (gloo: CPU
    unless ``device`` says otherwise). The one implementation behind :func:`all_gather_world_ints`
    and :meth:`~.collectives.TorchComm.all_gather_ints`."""
    import torch

    from .tensors import all_gather_into

    dist = _dist()
    dev = device if device is not None else (_world_device(dist) if group is None else torch.device("cpu"))
    size = dist.get_world_size(group)
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=dev)
    n = mine.numel()
    out = torch.empty(size * n, dtype=torch.int64, device=dev)
    all_gather_into(out, mine, group)
    rows = out.cpu().tolist()
    return [rows[r * n:(r + 1) * n] for r in range(size)]


def all_gather_world_ints(values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (signed 64-bit; every rank passes the same number), in rank order.
    Collective over the default world: one all-gather of a fixed-size int64 tensor."""
    return all_gather_int_rows(values)


def all_gather_world_bytes(data: bytes, limit: int = 4096) -> list[bytes]:
    """Every rank's ``data`` (at most ``limit`` bytes kept), in rank order. Collective over the
    default world: the lengths, then the bytes padded to the longest (no pickling)."""
    import torch

    from .tensors import all_gather_into

    dist = _dist()
    data = bytes(data[:limit])
    lens = [row[0] for row in all_gather_world_ints([len(data)])]
    width = max(max(lens), 1)
    dev = _world_device(dist)
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    if data:
        mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=dev)
    out = torch.empty(dist.get_world_size() * width, dtype=torch.uint8, device=dev)
    all_gather_into(out, mine, None)
    raw = bytes(out.cpu().tolist())
    return [raw[r * width:r * width + n] for r, n in enumerate(lens)]
