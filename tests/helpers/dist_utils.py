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


# Ranks fork from one server process that imported these once per test session (forkserver): a
# rank starts in milliseconds instead of re-importing torch, DeepSpeed and Megatron-core for seconds.
# Nothing in the server initialises a process group, CUDA or a thread pool before the fork.
PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "elastor_ds.checkpoint", "elastor_ds.comm",
           "deepspeed", "megatron.core")


def _start_method() -> str:
    if os.environ.get("ELASTOR_TEST_START_METHOD"):
        return os.environ["ELASTOR_TEST_START_METHOD"]
    import multiprocessing
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def run_world(fn, world_size: int, *args, timeout_s: float = 90.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any fails."""
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, timeout_s), nprocs=world_size,
                       join=True, start_method=_start_method())
