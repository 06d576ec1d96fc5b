"""Multi-process test helpers: run a function on N gloo ranks (CPU), with timeouts and fresh ports."""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_world(fn, world_size: int, *args, timeout_s: float = 90.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; raise if any fails."""
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, timeout_s), nprocs=world_size,
                       join=True, start_method="spawn")
