"""Checkpoint benchmark: elastor vs PyTorch DCP vs the physical floors, side by side in one run.

Every rank holds a Shard(0) half (by rows) of each global fp32 tensor. Phases, per rank (each phase
frees what the previous one allocated, so a rank holds at most its state + one more copy):
  floors  memcpy of this rank's bytes into a warm buffer (all ranks at once, median of 5);
          sequential write + fsync, buffered and O_DIRECT, the faster of the two (median of
          measurements interleaved with the saves); cold read
  elastor stall per save (steady state, warm staging buffer), time to durable, the writer's CPU
          time, the compute slowdown while the writer runs, peak host memory; then (staging freed)
          load with reshard to a Shard(1) (column) layout, every byte CRC-checked (best of
          ``--load-tries``, each right after one try of the cold-read floor: as many tries of
          each, alternating; DCP's load gets as many tries); the same load
          from a copy of the checkpoint in /dev/shm through a local-memory source (as the memory
          tier reads a snapshot) against the cached-read floor (``--no-tmpfs-load`` skips it)
  DCP     dcp.save (sync), dcp.async_save (stall + durable), dcp.load with the same reshard
          (``--dcp-saves 0`` skips the saves and the DCP load ratio)
Prints every ratio of issue 23's goal list with its goal and met / not met, and writes JSON
(bench/results/ckpt_bench.json). One run of the default size takes about a minute on an idle
2-core machine.

    python bench/ckpt_bench.py --world 2 --mib-per-rank 256 --saves 5
    python bench/ckpt_bench.py --world 2 --mib-per-rank 2048 --saves 3 --dcp-saves 1
    python bench/ckpt_bench.py --world 4 --mib-per-rank 256 --saves 5
    python bench/ckpt_bench.py --world 2 --mib-per-rank 256 --saves 9 --live-write [--live-fence-after 0.15]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastor_ds.cli_types import nonnegative_float, nonnegative_int, positive_int  # noqa: E402

from _args import output_file, writable_dir  # noqa: E402
# torch, numpy and the engine are imported where they are used (worker, main after the argument
# checks): a bad flag is refused in a fraction of a second, before any process starts

COLS = 8192
PIECE = 32 << 20


def read_into(f, mv: memoryview) -> None:
    """Fill ``mv`` from the unbuffered file ``f`` in PIECE-sized reads (stops early at end of file)."""
    p = 0
    while p < len(mv):
        n = f.readinto(mv[p:p + PIECE])
        if not n:
            break
        p += n


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


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS since the last :func:`reset_peak`) in MiB, from /proc/self/status."""
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")   # Linux: reset the peak RSS (VmHWM) to the current RSS
    except OSError:
        pass


def worker(rank: int, world: int, port: int, args, out_path: str, tmp: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from elastor_ds.checkpoint.direct_write import private_buffer
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.checkpoint.storage.posix import PosixStorage
    from elastor_ds.comm import TorchComm
    from elastor_ds.layout.region import Region

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    # one rank per core share, as torchrun runs workers (it sets OMP_NUM_THREADS=1 for nproc > 1):
    # ranks whose intra-op threads outnumber the cores make every timing of compute noise
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(rank)
    ntensors = args.tensors
    wfloors: list[float] = []     # per measurement: the faster of the buffered and the O_DIRECT write
    wfloors_buffered: list[float] = []
    wfloors_direct: list[float] = []
    rows_local = args.mib_per_rank * 2**20 // 4 // COLS // ntensors
    rows = rows_local * world
    base_rss = rss_mib()[0]
    local = [torch.randn(rows_local, COLS) for _ in range(ntensors)]
    nbytes = sum(t.numel() * 4 for t in local)
    res: dict = {"rank": rank, "bytes": nbytes}

    # ---- floors (one warm buffer of the rank's bytes; freed before the elastor phase)
    # page-aligned private memory on huge pages, like the engine's staging buffer: the memcpy floor
    # copies into the same kind of memory, and the O_DIRECT floor writes these bytes from it
    warm_map = private_buffer(nbytes + (-nbytes) % 4096)
    warm = torch.frombuffer(warm_map, dtype=torch.float32, count=nbytes // 4)
    views = []
    pos = 0
    for t in local:   # byte views: numpy's copyto is the fastest memcpy here (torch's copy_ is slower)
        views.append((warm[pos:pos + t.numel()].view(torch.uint8).numpy(), t.reshape(-1).view(torch.uint8).numpy()))
        pos += t.numel()

    def memcpy() -> None:
        for v, t in views:
            np.copyto(v, t)
    memcpy()
    ts = []
    for _ in range(5):
        dist.barrier()  # all ranks copy at once, as they do in a save (they share memory bandwidth)
        t0 = time.perf_counter()
        memcpy()
        ts.append(time.perf_counter() - t0)
    res["memcpy_s"] = statistics.median(ts)
    fpath = os.path.join(tmp, f"floor_{rank}.bin")
    wmv = memoryview(warm.numpy()).cast("B")

    def write_floor() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        with open(fpath, "wb", buffering=0) as f:
            for i in range(0, len(wmv), PIECE):
                f.write(wmv[i:i + PIECE])
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    floor_pair(write_floor(), direct_write_floor(fpath, nbytes, dist, memoryview(warm_map)), wfloors,
               wfloors_buffered, wfloors_direct)
    dist.barrier()
    evict(fpath)
    dist.barrier()
    def read_floor() -> float:
        t0 = time.perf_counter()
        with open(fpath, "rb", buffering=0) as f:
            read_into(f, wmv)
        return time.perf_counter() - t0
    res["read_s"] = read_floor()
    # the floor of a read from memory (tmpfs, a memory snapshot): the kernel's copy out of the page cache
    res["read_cached_s"] = read_floor()

    # ---- elastor save
    comm = TorchComm.create(900)
    root = os.path.join(tmp, "elastor")
    eng = CheckpointEngine(root, comm, keep=2, storage=PosixStorage(root, direct_io=not args.buffered_writer),
                           live_write=args.live_write,
                           **({} if args.writer_nice is None else {"writer_nice": args.writer_nice}),
                           **({} if args.writer_sched is None else {"writer_sched": args.writer_sched}))
    shards = [TensorShard(f"t{i}", (rows, COLS), Region((rank * rows_local, 0), (rows_local, COLS)), t)
              for i, t in enumerate(local)]
    stalls, durables, writes, snaps, plans, cpus, memcpys = [], [], [], [], [], [], []
    durables_fenced: list[float] = []   # live_write: saves fenced right after save()
    fence_fracs: list[float] = []       # live_write: the share of the state those fences copied
    live_unfenced: list[bool] = []      # live_write: the unfenced saves read only the live tensors
    a = torch.randn(384, 384)

    def compute(n: int = 10) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            (a @ a).sum().item()
        return time.perf_counter() - t0
    compute(5)
    idle = statistics.median(compute() for _ in range(5))
    busy_per, idle_per, busy_dur, durables_busy, escalations = [], [], [], [], []
    del views
    del warm, wmv
    warm_map.close()
    gc.collect()
    res["rss_before_saves_mib"] = rss_mib()[0]   # the process + its state, the floors' buffer freed
    reset_peak()
    stall_ratios, stall_cpu_ratios = [], []
    for step in range(1, args.saves + 1):
        mc = mc_cpu = None
        if eng.staging.buf is not None:
            # the memcpy floor, right before each save (the machine drifts): the same bytes into the
            # same memory (the staging buffer, idle between saves), all ranks at once
            dst = eng.staging.buf.numpy()
            pairs, p = [], 0
            for t in local:
                src = t.reshape(-1).view(torch.uint8).numpy()
                pairs.append((dst[p:p + len(src)], src))
                p += len(src)
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            for d_, s_ in pairs:
                np.copyto(d_, s_)
            mc, mc_cpu = time.perf_counter() - t0, time.thread_time() - c0
            memcpys.append(mc)
            del pairs, dst, d_, s_   # views of the staging buffer: they would keep it alive after the engine
        dist.barrier()
        c0 = time.thread_time()
        st = eng.save(step, shards)
        # live_write: odd saves fence at once (the optimizer step right after the save: the whole
        # state is still to copy, the stall's worst case); even ones wait for durable first (the
        # optimizer step after the write: nothing left to copy)
        fenced = args.live_write and step % 2 == 1
        st_cpu = time.thread_time() - c0
        if fenced:
            # --live-fence-after S: training computes for S seconds first (forward and backward),
            # then the optimizer step's fence copies what the writer has not read by then
            t_end = time.perf_counter() + args.live_fence_after
            while time.perf_counter() < t_end:
                compute(1)
            c1 = time.thread_time()
            eng.fence()
            st_cpu += time.thread_time() - c1
        done = eng.wait()
        # the floor, between saves (disk speed drifts)
        # (the O_DIRECT floor from the staging buffer: this rank's bytes, in the memory they are written from)
        sbuf = memoryview(eng.staging.buf.numpy()) if eng.staging.buf is not None and nbytes % 4096 == 0 else None
        floor_pair(write_floor_from(fpath, local, dist), direct_write_floor(fpath, nbytes, dist, sbuf), wfloors,
                   wfloors_buffered, wfloors_direct)
        if step > 1 and args.live_write and not fenced:
            durables.append(done.durable_s)   # persist: the write from the live tensors alone
            writes.append(done.write_s)
            cpus.append(done.writer_cpu_s)
            live_unfenced.append(done.live and done.fence_bytes == 0)
        elif step > 1:  # steady state: the staging buffer is warm
            stalls.append(st.stall_s + st.plan_s + st.fence_s)
            snaps.append(st.stall_s + st.fence_s)
            plans.append(st.plan_s)
            if args.live_write:
                durables_fenced.append(done.durable_s)
                fence_fracs.append(st.fence_bytes / max(1, st.bytes_written))
            else:
                durables.append(done.durable_s)
                writes.append(done.write_s)
                cpus.append(done.writer_cpu_s)
            if mc:
                stall_ratios.append((st.stall_s + st.plan_s + st.fence_s) / mc)
                stall_cpu_ratios.append(st_cpu / max(mc_cpu, 1e-9))
    res["stall_ratios"] = stall_ratios
    res["stall_cpu_ratios"] = stall_cpu_ratios
    # training slowdown while the writer thread runs: compute in slices for as long as it writes,
    # against idle slices measured just before and just after
    for rep in range(args.slowdown_reps):
        dist.barrier()
        i0 = statistics.median(compute() for _ in range(3))
        dist.barrier()
        st = eng.save(args.saves + 1 + rep, shards)
        t0 = time.perf_counter()
        n = 0
        # compute while the writer runs, for at most --slowdown-window seconds (a writer at a low
        # priority under a trainer that keeps every core busy runs on idle cycles only)
        while (not eng.local_idle() and time.perf_counter() - t0 < args.slowdown_window) or n == 0:
            compute(1)
            n += 1
        busy = (time.perf_counter() - t0) / n
        busy_dur.append(time.perf_counter() - t0)
        done = eng.wait()
        durables_busy.append(done.durable_s)
        escalations.append(done.writer_escalated)
        i1 = statistics.median(compute() for _ in range(3))
        busy_per.append(busy)
        idle_per.append((i0 + i1) / 2 / 10)   # idle just before and just after (the machine drifts)
    # the same measurement with no save (the noise of this machine: other load, drift)
    ctrl = []
    for rep in range(args.slowdown_reps):
        dist.barrier()
        i0 = statistics.median(compute() for _ in range(3))
        dist.barrier()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < busy_dur[rep] or n == 0:   # as long as that write took
            compute(1)
            n += 1
        busy = (time.perf_counter() - t0) / n
        i1 = statistics.median(compute() for _ in range(3))
        ctrl.append(busy / ((i0 + i1) / 2 / 10))
    res["compute_slowdown_no_write"] = max(ctrl)
    res["elastor_durable_busy_s"] = max(durables_busy)
    res["compute_slowdown_during_write"] = max(b / i for b, i in zip(busy_per, idle_per))
    res["compute_slowdowns"] = [b / i for b, i in zip(busy_per, idle_per)]
    res["slowdown_escalations"] = escalations
    res["elastor_stall_s"] = statistics.median(stalls)
    res["elastor_stalls_s"] = stalls
    res["write_s"] = statistics.median(wfloors)
    res["write_buffered_s"] = statistics.median(wfloors_buffered)
    res["write_direct_s"] = statistics.median(wfloors_direct)
    res["memcpy_interleaved_s"] = statistics.median(memcpys) if memcpys else res["memcpy_s"]
    res["elastor_durable_s"] = statistics.median(durables)
    if durables_fenced:
        res["elastor_durable_fenced_s"] = statistics.median(durables_fenced)
        res["elastor_live_unfenced"] = live_unfenced
        res["elastor_fence_fracs"] = fence_fracs
    res["elastor_write_s"] = statistics.median(writes)
    res["elastor_snapshot_s"] = statistics.median(snaps)
    res["elastor_plan_agree_s"] = statistics.median(plans)
    res["elastor_writer_cpu_s"] = statistics.median(cpus)
    res["elastor_staging_bytes"] = eng.staging.capacity
    res["elastor_written_bytes"] = done.bytes_written
    cur, peak = rss_mib()
    res["rss_base_mib"] = base_rss
    res["rss_peak_elastor_mib"] = peak
    eng.finalize()
    del eng, st, done
    gc.collect()

    # ---- elastor load with reshard (a fresh engine: no staging buffer, as after a restart)
    dist.barrier()
    evict(root)
    dist.barrier()
    eng = CheckpointEngine(root, comm, keep=2)
    cols_local = COLS // world
    # the destinations: page-aligned private memory (huge pages), so that the O_DIRECT read floor
    # can read the bytes straight into them; zeroed (touched, like real parameters)
    per = rows * cols_local * 4
    dst_map = private_buffer(per * ntensors + (-(per * ntensors)) % 4096)
    dst = [torch.frombuffer(dst_map, dtype=torch.float32, count=rows * cols_local, offset=i * per).view(rows, cols_local)
           for i in range(ntensors)]
    for d in dst:
        d.zero_()
    dshards = [TensorShard(f"t{i}", (rows, COLS), Region((0, rank * cols_local), (rows, cols_local)), d)
               for i, d in enumerate(dst)]
    reset_peak()

    def cold_read_floor() -> float:
        """Cold sequential read of the rank's bytes (32 MiB reads into one of the load's buffers)."""
        dist.barrier()
        evict(fpath)
        dist.barrier()
        t0 = time.perf_counter()
        with open(fpath, "rb", buffering=0) as f:
            for d in dst:   # dst holds exactly the rank's bytes
                read_into(f, memoryview(d.numpy()).cast("B"))
        return time.perf_counter() - t0
    def cold_read_floor_direct() -> float | None:
        """The same bytes read with O_DIRECT straight into the destinations (no page cache, no
        copy); None where the file system refuses it or the pieces are not page-aligned."""
        if per % 4096:
            return None
        dist.barrier()
        evict(fpath)
        dist.barrier()
        try:
            fd = os.open(fpath, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return None
        try:
            t0 = time.perf_counter()
            off = 0
            for d in dst:
                mv = memoryview(d.numpy()).cast("B")
                for a in range(0, len(mv), PIECE):
                    off += os.preadv(fd, [mv[a:a + PIECE]], off)
            return time.perf_counter() - t0
        except OSError:
            return None
        finally:
            os.close(fd)
    # the floor and the load alternate, as many tries of each (the disk drifts by +-20 % between
    # reads seconds apart; a best-of-4 floor against a best-of-2 load, as before, favoured the
    # floor); the floor's tries alternate its two ways to read, buffered and O_DIRECT
    bufs, directs, loads = [], [], []
    for i in range(args.load_tries):
        if i % 2 == 0:
            bufs.append(cold_read_floor())
        else:
            t = cold_read_floor_direct()
            (directs if t is not None else bufs).append(t if t is not None else cold_read_floor())
        for d in dst:
            d.zero_()
        dist.barrier()
        evict(root)
        dist.barrier()
        t0 = time.perf_counter()
        lr = eng.load(None, dshards)
        loads.append(time.perf_counter() - t0)
    res["elastor_load_s"] = min(loads)
    res["elastor_load_tries_s"] = loads
    res["read_buffered_s"] = min(bufs)
    res["read_direct_s"] = min(directs) if directs else None
    res["read_s"] = min(bufs + directs)
    res["read_tries_s"] = bufs + directs
    os.remove(fpath)
    res["rss_peak_load_mib"] = rss_mib()[1]
    res["elastor_load_bytes_needed"] = lr.bytes_needed
    res["elastor_load_bytes_read"] = lr.bytes_read
    def spot_check() -> None:
        """Correctness spot-check of the reshard: the column slice of this rank's own rows."""
        for i in range(ntensors):
            assert torch.equal(dst[i][rank * rows_local:(rank + 1) * rows_local],
                               local[i][:, rank * cols_local:(rank + 1) * cols_local])
    spot_check()
    # the same load from memory, as the memory tier reads a snapshot: the step directory copied to
    # tmpfs and read through a local-memory source (page-cache reads, no O_DIRECT); its floor is a
    # read of the rank's bytes out of the page cache (read_cached_s). (A storage load of files that
    # sit in the page cache is no such measure: the engine reads storage with O_DIRECT, from the disk.)
    tm = load_from_tmpfs(eng, root, dshards, dist, rank, 2 * nbytes * world, memoryview(dst_map)) \
        if args.tmpfs_load else None
    res["elastor_load_tmpfs_s"], res["read_cached_beside_s"] = tm if tm is not None else (None, None)
    if res["elastor_load_tmpfs_s"] is not None:
        spot_check()
    eng.finalize()
    del dst, dshards, eng, lr, d
    gc.collect()
    try:
        dst_map.close()   # (the destinations' memory, before the DCP phase allocates its own)
    except BufferError:
        pass
    del dst_map

    # ---- PyTorch DCP
    if args.dcp_saves:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        sd = {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(rows, COLS),
                                          stride=(COLS, 1)) for i, t in enumerate(local)}
        dpath = os.path.join(tmp, "dcp")
        sync_s, astall, adur = [], [], []
        for step in range(args.dcp_saves):
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=os.path.join(dpath, f"sync{step}"))
            sync_s.append(time.perf_counter() - t0)
            dist.barrier()
            if step and rank == 0:   # sync0 is loaded below; the others only take disk space
                shutil.rmtree(os.path.join(dpath, f"sync{step}"), ignore_errors=True)
        for step in range(args.dcp_saves):
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=os.path.join(dpath, f"async{step}"))
            astall.append(time.perf_counter() - t0)
            fut.result()
            adur.append(time.perf_counter() - t0)
            del fut
            gc.collect()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(dpath, f"async{step}"), ignore_errors=True)
        res["dcp_sync_s"] = statistics.median(sync_s[1:] or sync_s)
        res["dcp_async_stall_s"] = statistics.median(astall[1:] or astall)
        res["dcp_async_durable_s"] = statistics.median(adur[1:] or adur)
        dist.barrier()
        evict(dpath)
        dist.barrier()
        lsd = {f"t{i}": DTensor.from_local(torch.zeros(rows, cols_local), mesh, [Shard(1)], run_check=False,
                                           shape=(rows, COLS), stride=(COLS, 1)) for i in range(ntensors)}
        dcp_loads = []
        for _ in range(args.load_tries):   # as many tries as elastor's load had
            dist.barrier()
            evict(dpath)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(lsd, checkpoint_id=os.path.join(dpath, "sync0"))
            dcp_loads.append(time.perf_counter() - t0)
        res["dcp_load_s"] = min(dcp_loads)
        del lsd, sd
    res["rss_peak_mib"] = rss_mib()[1]
    allres = comm.all_gather_object(res)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"args": vars(args), "ranks": allres}, f, indent=1)
    dist.destroy_process_group()


def load_from_tmpfs(eng, root: str, dshards, dist, rank: int, room: int,
                    dmv: memoryview) -> tuple[float, float] | None:
    """The committed checkpoint under ``root`` copied to a fresh directory in /dev/shm (rank 0) and
    loaded into ``dshards`` from there through a local-memory source, three times, each right after
    the cached-read floor: this rank's data file of that copy read out of the page cache into the
    destinations' memory ``dmv`` (as many bytes as it holds), all ranks at once. Returns the
    fastest load's and the fastest floor's seconds (the report takes the slowest rank's; the floor
    measured once at the start of the run swung from 7 to 15 GB/s between runs). None where
    /dev/shm lacks ``room`` bytes."""
    from elastor_ds.checkpoint.commit import resolve
    from elastor_ds.checkpoint.sources import LOCAL_MEMORY, DirSource
    shm = None
    if rank == 0 and os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > room:
        made = tempfile.mkdtemp(dir="/dev/shm", prefix="ckpt_bench_")   # 0700, ours: removed below
        try:
            step = resolve(root)
            shm = os.path.join(made, os.path.basename(step))
            shutil.copytree(step, shm)
        except Exception as e:  # noqa: BLE001 - the row is skipped (n/a), not a hang of the other ranks
            print(f"  the tmpfs load is skipped: copying the checkpoint to {made} failed ({e})", file=sys.stderr)
            shutil.rmtree(made, ignore_errors=True)
            shm = None
    box = [shm]
    dist.broadcast_object_list(box, src=0)
    shm = box[0]
    if shm is None:
        return None
    try:
        from elastor_ds.checkpoint.writer import data_file_name
        mine = os.path.join(shm, data_file_name(rank))
        best = floor = None
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            with open(mine, "rb", buffering=0) as f:
                n = min(len(dmv), os.fstat(f.fileno()).st_size)
                read_into(f, dmv[:n])
            fl = (time.perf_counter() - t0) * len(dmv) / n   # scaled to the destinations' bytes
            floor = fl if floor is None else min(floor, fl)
            for d in dshards:
                d.tensor.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            eng.load(shm, dshards, sources=lambda step_dir, man: [DirSource(step_dir, LOCAL_MEMORY)])
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        return best, floor
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.dirname(shm), ignore_errors=True)


def floor_pair(buffered: float, direct: float | None, both: list, bufs: list, directs: list) -> None:
    """One write-floor measurement: the faster way to put the bytes on the disk, buffered (write +
    fsync through the page cache) or O_DIRECT (where the file system takes it)."""
    bufs.append(buffered)
    if direct is not None:
        directs.append(direct)
    both.append(min(buffered, direct) if direct is not None else buffered)


_ALIGNED: list = []


def direct_write_floor(fpath: str, nbytes: int, dist, src: memoryview | None = None) -> float | None:
    """Sequential O_DIRECT write + fsync of ``nbytes`` (rounded up to 4 KiB) in 32 MiB writes: the
    disk's own write floor, no page cache. From ``src`` (page-aligned, at least that long: the
    rank's own bytes) when given, else from one aligned 32 MiB buffer of random bytes written over
    and over (at 2 GiB per rank that repeated buffer wrote 10-20 % faster than distinct bytes here,
    which would flatter the floor). None where the file system refuses O_DIRECT."""
    if src is None:
        if not _ALIGNED:
            from elastor_ds.checkpoint.direct_write import private_buffer
            # private memory on huge pages where the kernel allows (the writer's own bounce buffers):
            # an O_DIRECT write from 4 KiB pages was about 1.4x slower here, which would flatter the ratio
            m = private_buffer(PIECE)
            m.write(os.urandom(PIECE))
            _ALIGNED.append(m)
        rep = memoryview(_ALIGNED[0])
    end = nbytes + (-nbytes) % 4096
    dist.barrier()
    try:
        fd = os.open(fpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return None
    try:
        t0 = time.perf_counter()
        for a in range(0, end, PIECE):
            n = min(end, a + PIECE) - a
            os.write(fd, src[a:a + n] if src is not None else rep[:n])
        os.fsync(fd)
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)


def write_floor_from(fpath: str, tensors, dist) -> float:
    """Sequential write + fsync of the rank's bytes (its tensors in turn, 32 MiB writes)."""
    dist.barrier()
    t0 = time.perf_counter()
    with open(fpath, "wb", buffering=0) as f:
        for t in tensors:
            mv = memoryview(t.numpy()).cast("B")
            for i in range(0, len(mv), PIECE):
                f.write(mv[i:i + PIECE])
        os.fsync(f.fileno())
    return time.perf_counter() - t0


GOALS = {  # issue 23: (comparator, bound)
    "stall": ("<=", 1.1), "persist": (">=", 0.95), "load": ("<=", 1.2), "dcp_load": (">=", 1.5),
    "slowdown": ("<=", 1.3), "memory": ("<=", 1.0), "bytes": ("<=", 1.01), "staging": ("<=", 1.0),
}


def report(path: str) -> bool:
    d = json.load(open(path))
    rs = d["ranks"]

    def worst(k):
        return max(r[k] for r in rs)
    mib = rs[0]["bytes"] / 2**20
    staging = rs[0]["elastor_staging_bytes"]
    need_frac = rs[0]["elastor_load_bytes_needed"] / rs[0]["bytes"]
    print(f"\nworld={len(rs)} ranks, {mib:.0f} MiB per rank (fp32), tensors={d['args']['tensors']}, "
          f"saves={d['args']['saves']}, dcp saves={d['args']['dcp_saves']}, "
          f"{'buffered' if d['args'].get('buffered_writer') else 'O_DIRECT'} writer, writer nice="
          f"{d['args'].get('writer_nice') if d['args'].get('writer_nice') is not None else 'default'}, writer sched="
          f"{d['args'].get('writer_sched') or 'default'}; the slowest rank of each figure; "
          f"ratios are measured in this run\n")
    # what the save phase adds to the process holding its state, plus the state, over state + staging
    # the cached-read floor beside the tmpfs loads (older result files: the one at the run's start)
    tmpfs_floor = "read_cached_beside_s" if all(r.get("read_cached_beside_s") for r in rs) else "read_cached_s"
    ratio = max(statistics.median(r["stall_ratios"]) for r in rs)
    ratio_cpu = max(statistics.median(r["stall_cpu_ratios"]) for r in rs)
    mem = max(((r["rss_peak_elastor_mib"] - r["rss_before_saves_mib"]) * 2**20 + r["bytes"]) / (r["bytes"] + staging)
              for r in rs)
    rows = [
        ("save stall / memcpy floor (median of the saves, each against the floor just before it)", "stall", ratio),
        ("  the same in CPU time of the training thread", None, ratio_cpu),
        ("  of which the snapshot copy / memcpy floor", None,
         worst("elastor_snapshot_s") / worst("memcpy_interleaved_s")),
        ("  of which plan agreement (all-reduce) / memcpy floor", None,
         worst("elastor_plan_agree_s") / worst("memcpy_interleaved_s")),
        ("persist: write floor / time to durable", "persist", worst("write_s") / worst("elastor_durable_s")),
        ("  write + fsync of its file / write floor", None, worst("elastor_write_s") / worst("write_s")),
        ("  live_write: persist of the fenced saves (at once, or after --live-fence-after)", None,
         worst("write_s") / worst("elastor_durable_fenced_s") if all(r.get("elastor_durable_fenced_s") for r in rs)
         else None),
        ("  live_write: share of the state the fence copied (median, slowest rank)", None,
         max(statistics.median(r["elastor_fence_fracs"]) for r in rs) if all(r.get("elastor_fence_fracs") for r in rs)
         else None),
        # the most persist can be while the write starts when the copy ends: the write at its floor,
        # after the stall, plus what the save spends outside both (commit, collectives)
        ("  bound with the write at its floor: floor / (stall + floor + the rest)", None,
         worst("write_s") / (worst("elastor_stall_s") + worst("write_s")
                             + max(0.0, worst("elastor_durable_s") - worst("elastor_stall_s") - worst("elastor_write_s")))),
        ("  write floor: buffered write + fsync / O_DIRECT write + fsync", None,
         worst("write_buffered_s") / worst("write_direct_s") if all(r.get("write_direct_s") for r in rs) else None),
        ("  writer CPU seconds per GiB written", None, worst("elastor_writer_cpu_s") / (rs[0]["bytes"] / 2**30)),
        ("load with reshard / cold-read floor of the bytes needed", "load",
         worst("elastor_load_s") / (worst("read_s") * need_frac)),
        ("  the same, median try / median try (load tries against the floor's, slowest rank)", None,
         max(statistics.median(r["elastor_load_tries_s"]) for r in rs)
         / (max(statistics.median(r["read_tries_s"]) for r in rs) * need_frac)
         if all(r.get("elastor_load_tries_s") and r.get("read_tries_s") for r in rs) else None),
        ("  cold-read floor: buffered read / O_DIRECT read into the destination", None,
         worst("read_buffered_s") / worst("read_direct_s") if all(r.get("read_direct_s") for r in rs) else None),
        ("load with reshard from tmpfs (a local-memory source) / cached-read floor", None,
         worst("elastor_load_tmpfs_s") / (worst(tmpfs_floor) * need_frac)
         if all(r.get("elastor_load_tmpfs_s") for r in rs) else None),
        ("  cached-read floor, GB/s per rank (the floor of a tmpfs read, beside those loads)", None,
         rs[0]["bytes"] / 1e9 / worst(tmpfs_floor)),
        ("  load from tmpfs, GB/s per rank (bytes needed)", None,
         rs[0]["elastor_load_bytes_needed"] / 1e9 / worst("elastor_load_tmpfs_s")
         if all(r.get("elastor_load_tmpfs_s") for r in rs) else None),
        ("bytes read / bytes needed (CRC tables included)", "bytes",
         max(r["elastor_load_bytes_read"] / r["elastor_load_bytes_needed"] for r in rs)),
        ("staging bytes / bytes written", "staging", staging / rs[0]["elastor_written_bytes"]),
        ("peak host memory of the saves / (state + staging)", "memory", mem),
        ("compute time while the writer writes / idle compute time", "slowdown",
         max(r["compute_slowdown_during_write"] for r in rs)),
        ("  the same measurement with no save running (this machine's noise)", None,
         max(r["compute_slowdown_no_write"] for r in rs)),
        ("  time to durable while training computes / while it waits", None,
         worst("elastor_durable_busy_s") / worst("elastor_durable_s")),
    ]
    if d["args"]["dcp_saves"]:
        rows += [
            ("DCP sync save / elastor stall", None, worst("dcp_sync_s") / worst("elastor_stall_s")),
            ("DCP async_save stall / elastor stall", None, worst("dcp_async_stall_s") / worst("elastor_stall_s")),
            ("DCP async durable / elastor durable", None, worst("dcp_async_durable_s") / worst("elastor_durable_s")),
            ("DCP load (same reshard) / elastor load", "dcp_load", worst("dcp_load_s") / worst("elastor_load_s")),
        ]
    all_met = True
    for name, goal, v in rows:
        if goal is None:
            print(f"  {name:<64} {v:7.2f}" if v is not None else f"  {name:<64}     n/a")
            continue
        op, bound = GOALS[goal]
        met = v <= bound if op == "<=" else v >= bound
        all_met &= met
        print(f"  {name:<64} {v:7.2f}   goal {op} {bound:<5} {'met' if met else 'NOT MET'}")
    print(f"\n  peak RSS per rank: elastor phase {max(r['rss_peak_elastor_mib'] for r in rs):.0f} MiB, load "
          f"{max(r['rss_peak_load_mib'] for r in rs):.0f} MiB (base {max(r['rss_base_mib'] for r in rs):.0f} MiB, "
          f"state {mib:.0f} MiB, staging {staging / 2**20:.0f} MiB); compute slowdowns "
          f"{[round(x, 2) for r in rs for x in r['compute_slowdowns']]}; stalls/memcpy "
          f"{[round(x, 2) for r in rs for x in r['stall_ratios']]}")
    print(f"  the slowdown saves: the writer escalated from idle-only scheduling by "
          f"{[e or '-' for r in rs for e in r.get('slowdown_escalations', [])]} ('-': finished on idle cycles "
          f"or not idle-scheduled); time to durable while training computes: "
          f"{worst('elastor_durable_busy_s'):.2f} s")
    print(f"  every goal {'met' if all_met else 'NOT met'} in this run")
    return all_met


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's arguments, every one checked here (before torch is imported or a rank starts)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=positive_int, default=2, help="gloo ranks (processes)")
    ap.add_argument("--mib-per-rank", type=positive_int, default=256)
    ap.add_argument("--tensors", type=positive_int, default=16,
                    help=f"tensors per rank (at most 32 per MiB: a tensor holds whole rows of {COLS} fp32 columns)")
    ap.add_argument("--saves", type=positive_int, default=5,
                    help="saves (>= 2: the first warms the staging buffer and is not measured; >= 3 with --live-write)")
    ap.add_argument("--dcp-saves", type=nonnegative_int, default=3, help="DCP saves of each kind (0: no DCP phase)")
    ap.add_argument("--slowdown-reps", type=positive_int, default=2, help="saves measured for the compute slowdown")
    ap.add_argument("--load-tries", type=positive_int, default=4,
                    help="cold resharded loads, each after a cold-read floor (the best of each is compared), and "
                         "DCP loads of the same reshard (the floor's O_DIRECT read needs 2)")
    ap.add_argument("--buffered-writer", action="store_true",
                    help="write the data files through the page cache (PosixStorage(direct_io=False)), for an A/B")
    ap.add_argument("--writer-nice", type=nonnegative_int, default=None,
                    help="the engine's writer_nice, 0..19 (default: its default)")
    ap.add_argument("--writer-sched", choices=["idle", "nice"], default=None,
                    help="the engine's writer_sched (default: its default, idle)")
    ap.add_argument("--live-write", action="store_true",
                    help="CheckpointEngine(live_write=True): the writer reads the live tensors until fence(); odd "
                         "saves fence at once (their stall is the stall figure), even ones after durable (their "
                         "time to durable is the persist figure)")
    ap.add_argument("--live-fence-after", type=nonnegative_float, default=0.0,
                    help="with --live-write: the fenced saves compute this many seconds before the fence (the "
                         "forward and backward before an optimizer step); their stall is save + fence")
    ap.add_argument("--slowdown-window", type=nonnegative_float, default=3.0,
                    help="compute for at most this many seconds of each of those saves")
    ap.add_argument("--no-tmpfs-load", dest="tmpfs_load", action="store_false",
                    help="skip the load from a copy of the checkpoint in /dev/shm")
    ap.add_argument("--dir", type=writable_dir, default=None,
                    help="an existing writable directory to write in (default: a temp dir on the same disk as /tmp)")
    ap.add_argument("--out", type=output_file,
                    default=os.path.join(os.path.dirname(__file__), "results", "ckpt_bench.json"))
    args = ap.parse_args(argv)
    least = 3 if args.live_write else 2
    if args.saves < least:
        ap.error(f"argument --saves: {args.saves} must be >= {least} (the first save warms the staging buffer and "
                 f"is not measured" + ("; with --live-write odd saves give the stall, even ones persist)"
                                       if args.live_write else ")"))
    if args.tensors > args.mib_per_rank * 2**20 // 4 // COLS:
        ap.error(f"argument --tensors: {args.tensors} tensors of {COLS} fp32 columns need --mib-per-rank >= "
                 f"{-(-args.tensors // 32)} (a tensor holds at least one row per rank, 32 rows per MiB)")
    if args.writer_nice is not None and args.writer_nice > 19:
        ap.error(f"argument --writer-nice: {args.writer_nice} must be 0..19")
    return args


def main() -> None:
    args = parse_args()
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(dir=args.dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    try:
        mp.start_processes(worker, args=(args.world, port, args, args.out, tmp), nprocs=args.world,
                           start_method="spawn")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args.out)
    print(f"  wall time of the run: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
