"""Checkpoint benchmark: elastor vs PyTorch DCP vs the physical floors, side by side in one run.

Every rank holds a Shard(0) half (by rows) of each global fp32 tensor. Measured per rank:
  floors  memcpy of this rank's bytes into a warm buffer (all ranks at once, median of 5);
          sequential write + fsync (median of measurements interleaved with the saves); cold read
  elastor stall per save (steady state, warm staging buffer), time to durable, load with reshard
          to a Shard(1) (column) layout, peak RSS and staging bytes vs bytes written
  DCP     dcp.save (sync), dcp.async_save (stall + durable), dcp.load with the same reshard
Prints ratios and writes JSON (bench/results/ckpt_bench.json).

    python bench/ckpt_bench.py --world 2 --mib-per-rank 256
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastor_ds.checkpoint.engine import CheckpointEngine  # noqa: E402
from elastor_ds.checkpoint.shards import TensorShard  # noqa: E402
from elastor_ds.comm import TorchComm  # noqa: E402
from elastor_ds.layout.region import Region  # noqa: E402

COLS = 8192


def evict(path: str) -> None:
    """Drop ``path`` from the page cache: all caches when root may (cold reads), else fadvise."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return
    except OSError:
        pass
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(rank: int, world: int, port: int, args, out_path: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(rank)
    ntensors = args.tensors
    wfloors: list[float] = []
    rows_local = args.mib_per_rank * 2**20 // 4 // COLS // ntensors
    rows = rows_local * world
    local = [torch.randn(rows_local, COLS) for _ in range(ntensors)]
    nbytes = sum(t.numel() * 4 for t in local)
    res: dict = {"rank": rank, "bytes": nbytes}

    # ---- floors
    warm = torch.empty(nbytes // 4)
    src = torch.cat([t.reshape(-1) for t in local])
    warm.copy_(src)
    ts = []
    for _ in range(5):
        dist.barrier()  # all ranks copy at once, as they do in a save (they share memory bandwidth)
        t0 = time.perf_counter()
        warm.copy_(src)
        ts.append(time.perf_counter() - t0)
    res["memcpy_s"] = statistics.median(ts)
    fpath = os.path.join(tmp, f"floor_{rank}.bin")

    def write_floor() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        with open(fpath, "wb", buffering=0) as f:
            mv = memoryview(src_bytes).cast("B")
            for i in range(0, len(mv), 32 << 20):
                f.write(mv[i:i + (32 << 20)])
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    src_bytes = src.numpy().copy()
    wfloors.append(write_floor())
    dist.barrier()
    evict(fpath)
    dist.barrier()
    t0 = time.perf_counter()
    with open(fpath, "rb", buffering=0) as f:
        mv = memoryview(warm.numpy()).cast("B")
        pos = 0
        while pos < len(mv):
            n = f.readinto(mv[pos:pos + (32 << 20)])
            if not n:
                break
            pos += n
    res["read_s"] = time.perf_counter() - t0
    del src

    # ---- elastor
    comm = TorchComm.create(600)
    root = os.path.join(tmp, "elastor")
    eng = CheckpointEngine(root, comm, keep=2)
    shards = [TensorShard(f"t{i}", (rows, COLS), Region((rank * rows_local, 0), (rows_local, COLS)), t)
              for i, t in enumerate(local)]
    stalls, durables, writes, snaps, plans = [], [], [], [], []
    for step in range(1, args.saves + 1):
        dist.barrier()
        st = eng.save(step, shards)
        done = eng.wait()
        wfloors.append(write_floor())  # the floor, measured between saves (disk speed drifts)
        if step > 1:  # steady state: the staging buffer is warm
            stalls.append(st.stall_s + st.plan_s)
            snaps.append(st.stall_s)
            plans.append(st.plan_s)
            durables.append(done.durable_s)
            writes.append(done.write_s)
    # training slowdown while the writer thread runs (the thread-vs-process question)
    a = torch.randn(384, 384)

    def compute(n: int = 30) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            (a @ a).sum().item()
        return time.perf_counter() - t0
    compute(5)
    idle = min(compute() for _ in range(3))
    dist.barrier()
    eng.save(args.saves + 1, shards)
    busy = compute()
    eng.wait()
    res["compute_slowdown_during_write"] = busy / idle
    res["elastor_stall_s"] = statistics.median(stalls)
    res["write_s"] = statistics.median(wfloors)
    os.remove(fpath)
    res["elastor_durable_s"] = statistics.median(durables)
    res["elastor_write_s"] = statistics.median(writes)
    res["elastor_snapshot_s"] = statistics.median(snaps)
    res["elastor_plan_agree_s"] = statistics.median(plans)
    res["elastor_staging_bytes"] = eng.staging.capacity
    res["elastor_written_bytes"] = done.bytes_written
    res["rss_after_elastor_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.barrier()
    evict(root)
    dist.barrier()
    cols_local = COLS // world
    dst = [torch.zeros(rows, cols_local) for _ in range(ntensors)]  # touched, like real params
    dshards = [TensorShard(f"t{i}", (rows, COLS), Region((0, rank * cols_local), (rows, cols_local)), d)
               for i, d in enumerate(dst)]
    t0 = time.perf_counter()
    lr = eng.load(None, dshards)
    res["elastor_load_s"] = time.perf_counter() - t0
    res["elastor_load_bytes_needed"] = lr.bytes_needed
    res["elastor_load_bytes_read"] = lr.bytes_read
    # correctness spot-check of the reshard: column half of this rank's own rows
    for i in range(ntensors):
        assert torch.equal(dst[i][rank * rows_local:(rank + 1) * rows_local],
                           local[i][:, rank * cols_local:(rank + 1) * cols_local])
    del dst, dshards

    # ---- PyTorch DCP
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(rows, COLS),
                                      stride=(COLS, 1)) for i, t in enumerate(local)}
    dpath = os.path.join(tmp, "dcp")
    sync_s, astall, adur = [], [], []
    for step in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=os.path.join(dpath, f"sync{step}"))
        sync_s.append(time.perf_counter() - t0)
    for step in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=os.path.join(dpath, f"async{step}"))
        astall.append(time.perf_counter() - t0)
        fut.result()
        adur.append(time.perf_counter() - t0)
    res["dcp_sync_s"] = statistics.median(sync_s[1:] or sync_s)
    res["dcp_async_stall_s"] = statistics.median(astall[1:] or astall)
    res["dcp_async_durable_s"] = statistics.median(adur[1:] or adur)
    dist.barrier()
    evict(dpath)
    dist.barrier()
    lsd = {f"t{i}": DTensor.from_local(torch.zeros(rows, cols_local), mesh, [Shard(1)], run_check=False,
                                       shape=(rows, COLS), stride=(COLS, 1)) for i in range(ntensors)}
    t0 = time.perf_counter()
    dcp.load(lsd, checkpoint_id=os.path.join(dpath, "sync0"))
    res["dcp_load_s"] = time.perf_counter() - t0
    res["rss_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    allres = comm.all_gather_object(res)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"args": vars(args), "ranks": allres}, f, indent=1)
    eng.finalize()
    dist.destroy_process_group()


def report(path: str) -> None:
    d = json.load(open(path))
    rs = d["ranks"]

    def worst(k):
        return max(r[k] for r in rs)
    mib = rs[0]["bytes"] / 2**20
    print(f"\nworld={len(rs)} ranks, {mib:.0f} MiB per rank (fp32), tensors={d['args']['tensors']}, "
          f"saves={d['args']['saves']}; slowest rank shown; ratios are measured in this run\n")
    rows = [
        ("elastor stall / memcpy floor", worst("elastor_stall_s") / worst("memcpy_s")),
        ("  of which the snapshot copy / memcpy floor", worst("elastor_snapshot_s") / worst("memcpy_s")),
        ("  of which plan agreement (all-reduce) / memcpy floor", worst("elastor_plan_agree_s") / worst("memcpy_s")),
        ("elastor persist: write floor / time-to-durable (bandwidth fraction)",
         worst("write_s") / worst("elastor_durable_s")),
        ("elastor write+fsync of its file / write floor", worst("elastor_write_s") / worst("write_s")),
        ("elastor load with reshard / read floor (bytes needed)",
         worst("elastor_load_s") / (worst("read_s") * rs[0]["elastor_load_bytes_needed"] / rs[0]["bytes"])),
        ("elastor bytes read / bytes needed", rs[0]["elastor_load_bytes_read"] / rs[0]["elastor_load_bytes_needed"]),
        ("elastor staging bytes / bytes written", rs[0]["elastor_staging_bytes"] / rs[0]["elastor_written_bytes"]),
        ("compute time while the writer thread writes / idle compute time",
         max(r["compute_slowdown_during_write"] for r in rs)),
        ("DCP sync save / elastor stall", worst("dcp_sync_s") / worst("elastor_stall_s")),
        ("DCP async_save stall / elastor stall", worst("dcp_async_stall_s") / worst("elastor_stall_s")),
        ("DCP async durable / elastor durable", worst("dcp_async_durable_s") / worst("elastor_durable_s")),
        ("DCP load (same reshard) / elastor load", worst("dcp_load_s") / worst("elastor_load_s")),
    ]
    for name, v in rows:
        print(f"  {name:<70} {v:6.2f}")
    print(f"\n  peak RSS after elastor phase: {max(r['rss_after_elastor_mib'] for r in rs):.0f} MiB per rank "
          f"(state {mib:.0f} MiB + staging {rs[0]['elastor_staging_bytes'] / 2**20:.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib-per-rank", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ckpt_bench.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(dir=args.dir)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(worker, args=(args.world, port, args, args.out, tmp), nprocs=args.world,
                           start_method="spawn")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args.out)

if __name__ == "__main__":
    main()
