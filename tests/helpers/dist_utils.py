"""Multi-process test helpers: run a function on N gloo ranks (CPU), with timeouts and fresh ports."""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp


# Ports for the stores tests start. A port the kernel picked with bind(0) lies in its ephemeral range,
# which every outgoing connection also draws from (gloo opens dozens per collective group): between
# the pick and the store's bind, another test's connection could take it (ci54: EADDRINUSE). Ports
# below that range are never handed out by the kernel; each xdist worker gets its own slice of them,
# so two tests of one run never pick the same port, and a bind check skips one in use elsewhere.
_SLICE = 1500
_next: dict[str, int] = {}


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range, unique within this test run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 10000 + index * _SLICE
    if base + _SLICE > _ephemeral_low():   # no room below the range: let the kernel pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = _next.get(worker, os.getpid() % _SLICE)
    for k in range(_SLICE):
        port = base + (start + k) % _SLICE
        if _bindable(port):
            _next[worker] = (start + k + 1) % _SLICE
            return port
    raise RuntimeError(f"no free port in {base}..{base + _SLICE - 1}")


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


def job_secret_file(base: str) -> str:
    """The job's secret file under ``base`` (32 fixed bytes, mode 0600), written once, atomically,
    by whichever rank comes first; its path (for ``ELASTOR_JOB_SECRET_FILE``)."""
    secret = os.path.join(base, "job.secret")
    if not os.path.exists(secret):
        fd = os.open(f"{secret}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, bytes(range(32)))
        os.close(fd)
        os.replace(f"{secret}.{os.getpid()}", secret)
    return secret
