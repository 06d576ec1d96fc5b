"""A rank that saves a checkpoint every step (launched directly, one process per rank, by tests).

Each step's tensors are a pure function of (step, rank), so any committed checkpoint can be
checked after the job is killed at a random point.
Usage: RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python save_worker.py ROOT STEPS MIB
"""
import datetime
import sys

import torch
import torch.distributed as dist

from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.comm import TorchComm
from elastor_ds.layout.region import Region


def state(step: int, rank: int, world: int, mib: int) -> list[TensorShard]:
    rows = mib * 2**20 // 4 // 256
    shards = []
    for name in ("w", "v"):
        full_rows = rows * world
        t = torch.arange(rows * 256, dtype=torch.float32).view(rows, 256) + step * 1000.0 + rank * rows * 256
        shards.append(TensorShard(name, (full_rows, 256), Region((rank * rows, 0), (rows, 256)), t))
    return shards


def expected(name: str, step: int, world: int, mib: int) -> torch.Tensor:
    return torch.cat([state(step, r, world, mib)[0 if name == "w" else 1].tensor for r in range(world)])


def main() -> None:
    root, steps, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    import os
    live = os.environ.get("ELASTOR_WORKER_LIVENESS")  # the test's knob for this worker (not the library's)
    eng = CheckpointEngine(root, TorchComm.create(120 if live else 20, liveness_s=float(live) if live else None),
                           keep=2)
    for step in range(1, steps + 1):
        eng.save(step, state(step, rank, world, mib), extra={"step": step})
        print(f"SAVING {step}", flush=True)
        eng.wait()
        print(f"COMMITTED {step}", flush=True)
    eng.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
