"""Measure the job's collective costs for the planner: an alpha-beta model (latency per call + seconds
per byte) per collective kind and group size, on the job's own backend and world, written as the
``collectives`` field of a profile (:class:`elastor_ds.plan.comm_cost.CommProfile`).

:func:`measure_collectives` is collective over the world: every rank calls it with the same
arguments. For each group size ``g`` the world is cut into ``world // g`` consecutive groups that all
run at once (so the measurement sees the same contention as a job whose groups are busy together;
leftover ranks only take part in the final agreement). Each kind is timed at two buffer sizes
(median of ``reps`` calls after one warm-up); the two medians give ``s_per_byte`` (slope) and
``latency_s`` (intercept), both clamped at 0; every rank then takes the world's maximum, so all ranks
return the same document. p2p is a ping-pong between rank pairs (one-way time = round trip / 2).
``all_reduce`` is measured once and stored as both ``tp_all_reduce`` and ``dp_all_reduce``.

Cost on 7-8 CPU (gloo) processes: well under a second with the defaults.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_SIZES = (4096, 262144)  # bytes: a small and a medium buffer


def _device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_calls(fn, reps: int, dev: torch.device) -> float:  # noqa: ANN001
    fn()  # warm-up (connection set-up)
    _sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _fit(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    beta = max(0.0, (t2 - t1) / (n2 - n1))
    return max(0.0, t1 - beta * n1), beta


def measure_collectives(group_sizes: Sequence[int], sizes_bytes: Sequence[int] = DEFAULT_SIZES, reps: int = 5,
                        p2p: bool = True, zero: bool = True) -> dict:
    """The ``collectives`` profile field for ``group_sizes`` (those between 2 and the world size);
    collective over the world. ``zero``: also reduce-scatter and all-gather (ZeRO-1)."""
    if len(sizes_bytes) != 2 or not 0 < sizes_bytes[0] < sizes_bytes[1]:
        raise ValueError(f"sizes_bytes={sizes_bytes}: two increasing sizes are needed for the fit")
    if reps < 1:
        raise ValueError(f"reps={reps}: must be >= 1")
    world, me = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return {}  # nothing to measure on one process (the planner then uses its defaults)
    dev = _device()
    gs = sorted({int(g) for g in group_sizes if 2 <= int(g) <= world})
    # local medians, in one fixed order on every rank (absent: 0, so the world max is the measurement)
    keys: list[tuple[str, int, int]] = []
    for g in gs:
        for kind in ("all_reduce",) + (("reduce_scatter", "all_gather") if zero else ()):
            keys += [(kind, g, n) for n in sizes_bytes]
    if p2p and world >= 2:
        keys += [("p2p", 2, n) for n in sizes_bytes]
    local = torch.zeros(len(keys), dtype=torch.float64)
    for g in gs:
        groups = [dist.new_group(list(range(i * g, (i + 1) * g))) for i in range(world // g)]
        mine = me // g if me < (world // g) * g else None
        if mine is None:
            continue
        grp = groups[mine]
        for n in sizes_bytes:
            elems = max(g, n // 4 // g * g)  # float32, divisible by the group for reduce-scatter
            buf = torch.ones(elems, dtype=torch.float32, device=dev)
            part = torch.empty(elems // g, dtype=torch.float32, device=dev)
            ops = {"all_reduce": lambda: dist.all_reduce(buf, group=grp),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, buf, group=grp),
                   "all_gather": lambda: dist.all_gather_into_tensor(buf, part, group=grp)}
            for kind, fn in ops.items():
                if (kind, g, n) in keys:
                    local[keys.index((kind, g, n))] = _time_calls(fn, reps, dev)
    if p2p and world >= 2:
        peer = me ^ 1
        if peer < world:
            for n in sizes_bytes:
                buf = torch.ones(max(1, n // 4), dtype=torch.float32, device=dev)

                def ping() -> None:
                    if me % 2 == 0:
                        dist.send(buf, peer)
                        dist.recv(buf, peer)
                    else:
                        dist.recv(buf, peer)
                        dist.send(buf, peer)
                local[keys.index(("p2p", 2, n))] = _time_calls(ping, reps, dev) / 2
    agreed = local.to(dev) if dev.type == "cuda" else local
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    vals = agreed.cpu().tolist()
    out: dict[str, dict[str, dict[str, float]]] = {}
    n1, n2 = sizes_bytes
    names = {"all_reduce": ("tp_all_reduce", "dp_all_reduce"), "reduce_scatter": ("reduce_scatter",),
             "all_gather": ("all_gather",), "p2p": ("p2p",)}
    for kind, g, n in keys:
        if n != n1:
            continue
        t1, t2 = vals[keys.index((kind, g, n1))], vals[keys.index((kind, g, n2))]
        lat, beta = _fit(n1, t1, n2, t2)
        for name in names[kind]:
            out.setdefault(name, {})[str(g)] = {"latency_s": lat, "s_per_byte": beta}
    log.debug("measured collectives: %s", out)
    return out
