"""Memory snapshots (issue 13) side by side in one run: restore from memory vs from storage under a
reshard, host memory vs bytes written, step overhead on the example trainer, lost iterations per failure.

Rows (ratios are within this run):
  restore   ``--world`` gloo ranks save a row-sharded state (``--mib-per-rank`` each) as a memory
            snapshot (node-local engine on /dev/shm, no fsync) and a storage checkpoint (``--storage``,
            fsync); then every rank restores a column-sharded layout (strided reads, every byte
            CRC-checked) from memory (bytes from storage must be 0), from storage cold (its files
            dropped from the page cache with fadvise) and from storage warm. Slowest rank's time.
  memory    per snapshot: bytes written (all ranks), peak bytes under the memory root while
            snapshotting ``--snapshots`` times with keep=1, and growth of the workers' peak RSS
            (the staging buffer) -- both as multiples of the bytes written.
  overhead  the example trainer (torchrun, ``--trainer-procs`` processes, a model sized by
            ``--hidden``) with and without ``--elastor-memory-snapshot-interval 1``, ``--pairs``
            runs each, alternated A/B/A/B; median iteration time after warm-up; goal <= 5 %. Also
            the snapshot's training-thread and background-writer CPU shares of an iteration, the
            snapshots that waited for the previous one and those dropped. Separate runs of the same
            command differ by up to ~15 % here (placement, drift), so the row also times one run of
            ``--paired-iters`` iterations whose snapshots pause in every other ``--block``: with vs
            without on the same processes (``paired_in_one_run``, the figure for the goal).
  writer    the storage writer's cost to training (issue 23: <= 1.3x the idle compute time while
            it writes): the example trainer (``--writer-hidden``, ~270 MiB per rank at 1024) saving to
            ``--storage`` asynchronously every ``--writer-save-every`` iterations, no snapshots; the
            iterations that start while the writer writes against the idle ones of the same run,
            turned into the compute rate while it writes (see ``writer_effect``). ``--writer-live-write``:
            with ``checkpoint.live_write`` (also the fence's time and the share of the bytes it copied).
  peer-read a restore's reads from another node's memory against their floor: runs
            ``bench/peer_read_bench.py --mib --peer-read-mib --reps --peer-read-reps`` (a second
            process serves a snapshot through the real snapshot server; a column half of every
            tensor is loaded from it, every byte MACed and CRC-checked, alternated with the floor:
            the same bytes ``sendfile``d over one loopback TCP connection into preallocated memory)
            and states both as GB/s. The floor of a read from tmpfs is ``bench/ckpt_bench.py``'s.
  lost      ``elastor run`` on the example trainer, a worker SIGKILLed at iteration ``--kill-at``:
            iterations lost (last logged before the kill - step resumed from) with memory snapshots
            every iteration vs storage checkpoints every ``--storage-interval`` only.

    python bench/snapshot_bench.py            # all rows; --rows restore,memory to pick
Writes bench/results/snapshot_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from elastor_ds.elastic.events import EventKind, read_jsonl  # noqa: E402
from elastor_ds.elastic.overhead import paired_overhead, writer_effect  # noqa: E402
from elastor_ds.cli_types import nonnegative_int, positive_int  # noqa: E402

from _args import csv_choices, dir_to_make, output_file  # noqa: E402
# torch and the engine (elastor_ds.checkpoint) are imported where they are used: a bad flag is
# refused before any of them loads
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
COLS = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _evict(path: str) -> None:
    """Drop ``path``'s files from the page cache (fadvise; the rest of the machine is left alone)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------------------------------- engine rows
def _engine_worker(rank: int, world: int, port: int, args, mem_dir: str, storage: str, out: str) -> None:
    import threading

    import torch
    import torch.distributed as dist

    from elastor_ds.checkpoint import CheckpointEngine
    from elastor_ds.checkpoint.storage import TmpfsStorage
    from elastor_ds.checkpoint import commit as commit_mod
    from elastor_ds.checkpoint.shards import TensorShard
    from elastor_ds.checkpoint.snapshot.tier import tree_bytes
    from elastor_ds.checkpoint.sources import LOCAL_MEMORY, STORAGE, DirSource
    from elastor_ds.comm import TorchComm
    from elastor_ds.layout.region import Region

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows_per_rank = max(1, args.mib_per_rank * 2 ** 20 // (4 * COLS * args.tensors))
    rows = rows_per_rank * world
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(rows_per_rank, COLS, generator=g) for _ in range(args.tensors)]
    saved = [TensorShard(f"t{i}", (rows, COLS), Region((rank * rows_per_rank, 0), (rows_per_rank, COLS)), t)
             for i, t in enumerate(local)]
    comm = TorchComm.create(600)
    mem_root = os.path.join(mem_dir, "local")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = CheckpointEngine(mem_root, comm, TmpfsStorage(mem_root), keep=1)
    sto = CheckpointEngine(storage, TorchComm.create(600), keep=1)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_bytes(mem_root))
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True) if rank == 0 else None
    if sampler:
        sampler.start()
    written = 0
    for step in range(1, args.snapshots + 1):
        for t in local:
            t.add_(1.0)          # new values each time
        st = mem.save(step, saved)
        written = st.bytes_written
    mem.finalize()
    if sampler:
        stop.set()
        sampler.join()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sto.save(args.snapshots, saved)
    sto.finalize()
    comm.barrier()
    cols = COLS // world

    def dst():
        ts = [torch.empty(rows, cols) for _ in range(args.tensors)]
        return ts, [TensorShard(f"t{i}", (rows, COLS), Region((0, rank * cols), (rows, cols)), t)
                    for i, t in enumerate(ts)]

    def timed(fn):
        comm.barrier()
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        return res, max(comm.all_gather_object(dt))
    results = {}
    w, sh = dst()
    timed(lambda: sto.load(storage, sh))          # warm-up (allocator, thread pools), not reported
    a, sh = dst()
    res, results["memory_s"] = timed(lambda: mem.load(mem_root, sh, sources=lambda d, m: [DirSource(d, LOCAL_MEMORY)]))
    mem_bytes = res.bytes_by_source
    if rank == 0:
        _evict(storage)
    comm.barrier()
    b, sh = dst()
    res, results["storage_cold_s"] = timed(lambda: sto.load(storage, sh))
    c, sh = dst()
    _, results["storage_warm_s"] = timed(lambda: sto.load(storage, sh))
    _, sh2 = dst()
    _, again = timed(lambda: mem.load(mem_root, sh2, sources=lambda d, m: [DirSource(d, LOCAL_MEMORY)]))
    results["memory_s"] = min(results["memory_s"], again)   # memory measured before and after storage
    same = all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
    agg = comm.all_gather_object({"written": written, "rss_growth": rss1 - rss0, "mem_bytes": mem_bytes,
                                  "storage_bytes": res.bytes_read, "same": same})
    if rank == 0:
        total_written = sum(x["written"] for x in agg)
        doc = {
            "world": world, "mib_per_rank": args.mib_per_rank, "snapshots": args.snapshots,
            "bytes_written_per_snapshot": total_written,
            "restore_memory_s": results["memory_s"], "restore_storage_cold_s": results["storage_cold_s"],
            "restore_storage_warm_s": results["storage_warm_s"],
            "memory_vs_storage_cold": results["memory_s"] / results["storage_cold_s"],
            "memory_vs_storage_warm": results["memory_s"] / results["storage_warm_s"],
            "memory_restore_storage_bytes": sum(x["mem_bytes"].get(STORAGE, 0) for x in agg),
            "memory_restore_memory_bytes": sum(x["mem_bytes"].get(LOCAL_MEMORY, 0) for x in agg),
            "bitwise_equal_memory_vs_storage": all(x["same"] for x in agg),
            "peak_tmpfs_bytes_over_written": peak[0] / total_written,
            "rss_growth_over_rank_written": statistics.median(x["rss_growth"] / max(1, x["written"]) for x in agg),
            "committed_steps_left": len(commit_mod.list_committed(mem_root)),
        }
        with open(out, "w") as f:
            json.dump(doc, f)
    dist.destroy_process_group()


def engine_rows(args) -> dict:
    import torch.multiprocessing as mp
    mem_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                           f"elastor-bench-{uuid.uuid4().hex[:8]}")
    work = tempfile.mkdtemp(prefix="snapshot_bench_", dir=args.storage)
    out = os.path.join(work, "engine.json")
    try:
        mp.start_processes(_engine_worker, args=(args.world, _free_port(), args, mem_dir, os.path.join(work, "ckpt"),
                                                 out), nprocs=args.world, join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)
    finally:
        shutil.rmtree(mem_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- trainer rows
MODEL = ["--num-layers", "4", "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2", "--log-interval", "100"]


def _env(extra=None) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="",
                **(extra or {}))


def _train(args, work: str, name: str, snapshots: bool, iters: int = 0, ab_blocks: int = 0, hidden: int = 0,
           save_interval: int = 0, skip: int = 3, ds_config: "dict | None" = None) -> list[dict]:
    metrics = os.path.join(work, f"{name}.jsonl")
    snap = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"elastor-bench-{uuid.uuid4().hex[:8]}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.trainer_procs}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", TRAINER, *MODEL, "--hidden-size",
           str(hidden or args.hidden), "--train-iters", str(iters or args.iters), "--save",
           os.path.join(work, f"{name}_ckpt"), "--save-interval", str(save_interval), "--profile-iters", "0",
           "--metrics-file", metrics]
    if snapshots:
        cmd += ["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", "0"]
        if getattr(args, "snapshot_live_write", False):
            cmd += ["--elastor-memory-snapshot-live-write"]
    if ab_blocks:
        cmd += ["--elastor-memory-snapshot-ab-blocks", str(ab_blocks)]
    if ds_config is not None:   # the trainer fills in the rest (micro-batches, optimizer, ZeRO stage)
        path = os.path.join(work, f"{name}_ds_config.json")
        with open(path, "w") as f:
            json.dump(ds_config, f)
        cmd += ["--deepspeed_config", path]
    try:
        p = subprocess.run(cmd, env=_env({"ELASTOR_SNAPSHOT_DIR": snap}), capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"trainer failed ({p.returncode}):\n{p.stderr[-3000:]}")
    finally:
        shutil.rmtree(snap, ignore_errors=True)
    return [r for r in read_jsonl(metrics) if r["iteration"] > skip]


def _paired(args, work: str) -> dict:
    """One trainer run whose snapshots pause in every other block of ``--block`` iterations
    (:func:`elastor_ds.elastic.overhead.paired_overhead`: with vs without on the same processes,
    minutes apart at most)."""
    recs = _train(args, work, "paired", True, iters=args.paired_iters, ab_blocks=args.block)
    res = paired_overhead(recs, args.block, skip=0)
    return {"iters": args.paired_iters, **res, **_live_fences(recs, res["median_iter_s_with"])}


def _live_fences(recs: list[dict], iter_s: float) -> dict:
    """memory_snapshot.live_write: the median fence (the optimizer step after a snapshot) over the
    iteration, and the median share of a snapshot's bytes the fence copied (the rest the writer had
    copied on idle cycles before it)."""
    xs = [r for r in recs if r.get("prev_snapshot_fence_bytes") is not None]
    if not xs:
        return {}
    return {"live_snapshots": len(xs),
            "median_snapshot_fence_over_iter": statistics.median(r["prev_snapshot_fence_s"] for r in xs) / iter_s,
            "median_snapshot_fence_share_of_bytes": statistics.median(
                r["prev_snapshot_fence_bytes"] / max(1, r["prev_snapshot_bytes"]) for r in xs)}


def overhead_rows(args) -> dict:
    """``--pairs`` runs without and with snapshots, alternated; the overhead is the ratio of the
    medians over all their iterations (after warm-up), with each pair's ratio listed beside it
    (the spread between pairs is the machine's drift). The snapshot's own costs come from the
    trainer's metrics: the training thread's share (``snapshot_hook_s``: shard list, plan, copy,
    any wait for the previous snapshot) and the background writer's CPU (``snapshot_writer_cpu_s``:
    write to tmpfs, block CRCs, manifest, commit), each over the iteration time."""
    work = tempfile.mkdtemp(prefix="snapshot_bench_train_", dir=args.storage)
    try:
        base, snap, pairs, dropped = [], [], [], []
        for i in range(args.pairs):
            b = _train(args, work, f"base{i}", False)
            s = _train(args, work, f"snap{i}", True)
            base += b
            snap += s
            dropped.append(int(s[-1].get("snapshots_dropped") or 0) if s else 0)
            pairs.append(statistics.median(r["iter_time_s"] for r in s) /
                         statistics.median(r["iter_time_s"] for r in b) - 1)
        tb = statistics.median(r["iter_time_s"] for r in base)
        ts = statistics.median(r["iter_time_s"] for r in snap)
        mb = statistics.fmean(r["iter_time_s"] for r in base)
        ms = statistics.fmean(r["iter_time_s"] for r in snap)

        def share(key: str):
            xs = [r[key] for r in snap if r.get(key) is not None]
            return statistics.median(xs) / ts if xs else None
        paired = _paired(args, work) if args.paired_iters > 0 else None
        return {"trainer_procs": args.trainer_procs, "hidden": args.hidden, "iters_per_run": args.iters,
                "paired_in_one_run": paired, "pairs": args.pairs, "median_iter_s_without": tb, "median_iter_s_with_snapshots": ts,
                "step_overhead": ts / tb - 1, "step_overhead_per_pair": pairs,
                "mean_iter_s_without": mb, "mean_iter_s_with_snapshots": ms, "step_overhead_of_means": ms / mb - 1,
                "snapshots_taken": sum(1 for r in snap if r.get("snapshot_stall_s") is not None),
                "snapshots_dropped": sum(dropped),   # per run: the trainer's running count at its end
                "snapshots_waited_for_previous": sum(1 for r in snap if (r.get("snapshot_wait_s") or 0) > 1e-3),
                "median_snapshot_stall_over_iter": share("snapshot_stall_s"),
                "median_snapshot_training_thread_over_iter": share("snapshot_hook_s"),
                "median_snapshot_writer_cpu_over_iter": share("snapshot_writer_cpu_s"),
                "snapshot_live_write": bool(args.snapshot_live_write), **_live_fences(snap, ts)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def writer_rows(args) -> dict:
    """The storage writer's cost to training: the example trainer (``--writer-hidden``, no
    snapshots) saving to storage asynchronously every ``--writer-save-every`` iterations, with the
    engine's default writer policy (O_DIRECT, idle-priority with its deadline). Iterations that
    start while the writer writes against those that neither save nor overlap a write, in the same
    run (:func:`elastor_ds.elastic.overhead.writer_effect`); the first save's cycle is warm-up (its
    stall allocates the staging buffer)."""
    from elastor_ds.checkpoint.snapshot.tier import tree_bytes
    work = tempfile.mkdtemp(prefix="snapshot_bench_writer_", dir=args.storage)
    try:
        every = args.writer_save_every
        live = {"elastor": {"checkpoint": {"live_write": True}}} if args.writer_live_write else None
        recs = _train(args, work, "writer", False, iters=args.writer_iters, hidden=args.writer_hidden,
                      save_interval=every, skip=0, ds_config=live)
        ckpt = os.path.join(work, "writer_ckpt")
        steps = sorted(n for n in os.listdir(ckpt) if n.startswith("step_")) if os.path.isdir(ckpt) else []
        size = tree_bytes(os.path.join(ckpt, steps[-1])) if steps else 0
        return {"hidden": args.writer_hidden, "save_every": every, "iters": args.writer_iters,
                "live_write": bool(args.writer_live_write),
                "trainer_procs": args.trainer_procs, "checkpoint_bytes": size,
                **writer_effect(recs, skip=every + 1)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _two_node_run(args, work: str, name: str, peer_copies: int, copy_interval: int = 0, block: int = 0) -> dict:
    """One paired run (snapshots every iteration, paused in every other block) of the example
    trainer as two "nodes" on this machine: two torchrun agents (``--nnodes 2``), one rank each,
    each its own snapshot directory, ``ELASTOR_PROCS_PER_NODE=1,1`` and one job secret file, so
    with ``peer_copies`` 1 each snapshot (or every ``copy_interval``-th) goes to the other node's
    memory through the real transport. Rank 0's metrics; load average before and after."""
    from elastor_ds.elastic.protocol import ENV_JOB_SECRET_FILE, ENV_PROCS_PER_NODE, ENV_SNAPSHOT_DIR
    block = block or args.block
    metrics = os.path.join(work, f"{name}.jsonl")
    secret = os.path.join(work, f"{name}.secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    port = _free_port()
    snaps = [os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"elastor-bench-{uuid.uuid4().hex[:8]}")
             for _ in range(2)]
    procs = []
    load0 = os.getloadavg()
    try:
        for node, snap in enumerate(snaps):
            os.makedirs(snap, mode=0o700)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", TRAINER, *MODEL,
                   "--hidden-size", str(args.hidden), "--train-iters", str(args.paired_iters), "--save",
                   os.path.join(work, f"{name}_ckpt"), "--save-interval", "0", "--profile-iters", "0",
                   "--metrics-file", metrics, "--elastor-memory-snapshot-interval", "1",
                   "--elastor-memory-snapshot-peer-copies", str(peer_copies),
                   "--elastor-memory-snapshot-ab-blocks", str(block)]
            if copy_interval:
                cmd += ["--elastor-memory-snapshot-peer-copy-interval", str(copy_interval)]
            if args.snapshot_live_write:
                cmd += ["--elastor-memory-snapshot-live-write"]
            env = _env({ENV_SNAPSHOT_DIR: snap, ENV_PROCS_PER_NODE: "1,1", ENV_JOB_SECRET_FILE: secret})
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=900)[0] for p in procs]
        for p, out in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"two-node trainer {name} failed ({p.returncode}):\n{out[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for snap in snaps:
            shutil.rmtree(snap, ignore_errors=True)
    recs = [r for r in read_jsonl(metrics) if r["iteration"] > 3]
    res = paired_overhead(recs, block, skip=0)
    snap_recs = [r for r in recs if r.get("snapshot_stall_s") is not None]
    iter_s = res["median_iter_s_with"]

    def share(key: str):
        xs = [r[key] for r in snap_recs if r.get(key) is not None]
        return statistics.median(xs) / iter_s if xs else None
    copies = {r["peer_copy_seq"]: r for r in recs if r.get("peer_copy_seq") is not None}
    cpu = [r["peer_copy_cpu_s"] for r in copies.values()]
    snapshots_with = sum(1 for r in snap_recs)
    res.update(peer_copies=peer_copies, peer_copy_interval=copy_interval or (1 if peer_copies else None),
               load_average_before=load0, load_average_after=os.getloadavg(),
               snapshot_training_thread_over_iter=share("snapshot_hook_s"),
               snapshot_writer_cpu_over_iter=share("snapshot_writer_cpu_s"),
               peer_copies_seen=len(copies), peer_copies_failed=sum(1 for r in copies.values() if not r["peer_copy_ok"]),
               peer_copy_s_median=statistics.median(r["peer_copy_s"] for r in copies.values()) if copies else None,
               peer_copy_cpu_per_copy_over_iter=statistics.median(cpu) / iter_s if cpu else None,
               # the copy thread's CPU spread over the snapshots it serves (1 copy per interval snapshots)
               peer_copy_cpu_per_snapshot_over_iter=(statistics.median(cpu) / iter_s / (copy_interval or 1))
               if cpu else None, snapshots=snapshots_with)
    return res


def peer_rows(args) -> dict:
    """The memory tier across two nodes (this machine's two agents): a paired run each of snapshots
    only, a peer copy of every snapshot, and a peer copy every ``--peer-copy-interval`` snapshots.
    "A peer copy adds" = that run's overhead - the snapshots-only run's (each against its own
    iterations without snapshots)."""
    work = tempfile.mkdtemp(prefix="snapshot_bench_peer_", dir=args.storage)
    n = args.peer_copy_interval
    try:
        only = _two_node_run(args, work, "snapshots_only", 0)
        every = _two_node_run(args, work, "copy_every", 1)
        interval = _two_node_run(args, work, f"copy_every_{n}", 1, copy_interval=n, block=n)
        out = {"snapshots_only": only, "peer_copy_every_snapshot": every, f"peer_copy_every_{n}": interval}
        for key, r in (("every_snapshot", every), (f"every_{n}", interval)):
            out[f"peer_copy_adds_{key}"] = {"median": r["step_overhead"] - only["step_overhead"],
                                            "mean": r["step_overhead_of_means"] - only["step_overhead_of_means"]}
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def peer_read_rows(args) -> dict:
    """The peer-read row: ``bench/peer_read_bench.py`` in its own process (it starts the serving peer
    itself), its JSON result kept whole."""
    with tempfile.TemporaryDirectory(prefix="elastor-peer-read-") as tmp:
        out = os.path.join(tmp, "peer_read.json")
        cmd = [sys.executable, os.path.join(HERE, "peer_read_bench.py"), "--mib", str(args.peer_read_mib),
               "--reps", str(args.peer_read_reps), "--out", out]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"peer-read row: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
        with open(out) as f:
            return json.load(f)


def _lost_run(args, work: str, name: str, memory: bool) -> dict:
    metrics = os.path.join(work, f"{name}.jsonl")
    events = os.path.join(work, f"{name}_events.jsonl")
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", "2", "--on-failure", "restart",
           "--max-restarts", "2", "--events", events, TRAINER, *MODEL, "--hidden-size", "64", "--train-iters",
           str(args.kill_at + 3), "--save", os.path.join(work, f"{name}_ckpt"), "--load",
           os.path.join(work, f"{name}_ckpt"), "--save-interval", str(args.storage_interval), "--metrics-file", metrics,
           "--profile-iters", "0", "--log-interval", "1"]
    if memory:
        cmd += ["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", "0"]
    out = open(os.path.join(work, f"{name}.out"), "w")
    proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
    try:
        import psutil
        t_end = time.time() + 600
        while time.time() < t_end:
            recs = read_jsonl(metrics)
            if recs and recs[-1]["iteration"] >= args.kill_at:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"elastor run exited early ({proc.returncode})")
            time.sleep(0.02)
        last = read_jsonl(metrics)[-1]["iteration"]
        launch = [e for e in read_jsonl(events) if e.get("event") == EventKind.LAUNCH.value][-1]   # standby workers: pids from here
        victim = psutil.Process(launch["pids"][0])
        assert victim.ppid() == proc.pid
        victim.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=600)
        if rc != 0:
            raise RuntimeError(f"elastor run failed ({rc})")
        starts = [e for e in read_jsonl(events) if e.get("event") == EventKind.WORKER_STARTED.value]
        restores = [e for e in read_jsonl(events) if e.get("event") == EventKind.RESTORE.value]
        resumed = starts[-1]["resumed_from"]
        return {"last_logged_before_kill": last, "resumed_from": resumed, "lost_iterations": last - resumed,
                "restore": restores[-1] if restores else None}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out.close()


def lost_rows(args) -> dict:
    work = tempfile.mkdtemp(prefix="snapshot_bench_lost_", dir=args.storage)
    try:
        return {"memory_every_iteration": _lost_run(args, work, "mem", True),
                f"storage_every_{args.storage_interval}": _lost_run(args, work, "storage", False)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _share(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def goal_table(doc: dict) -> str:
    """The memory tier's goals (issue 23) as a Markdown table of this run's ratios: wall overheads
    from the paired runs (medians; means beside them) and the CPU shares of an iteration (training
    thread, background writer, peer-copy thread), which are steadier than wall time here."""
    rows = ["| measure | this run | goal | met? |", "|---|---|---|---|"]

    def met(x, goal):
        return "-" if x is None else ("yes" if x <= goal else "no")
    ov = doc.get("overhead")
    if ov and ov.get("paired_in_one_run"):
        p = ov["paired_in_one_run"]
        rows.append(f"| snapshot every iteration, bench row ({ov['trainer_procs']} ranks, one node): step overhead, "
                    f"median (mean; median of block pairs) | {_pct(p['step_overhead'])} ({_pct(p['step_overhead_of_means'])}; "
                    f"{_pct(p['step_overhead_median_of_block_pairs'])}) | <= 2 % | {met(p['step_overhead'], 0.02)} |")
        rows.append(f"| the same: training-thread share / writer CPU share of an iteration; process CPU added "
                    f"(all threads) | {_share(ov['median_snapshot_training_thread_over_iter'])} / "
                    f"{_share(ov['median_snapshot_writer_cpu_over_iter'])}; "
                    f"{_share(p.get('process_cpu_added_over_iter'))} | | |")
    wr = doc.get("writer")
    if wr:
        c = wr["compute_while_writing_over_idle"]
        rows.append(f"| storage writer (example trainer, hidden {wr['hidden']}, a save every {wr['save_every']} "
                    f"iterations, {wr['checkpoint_bytes'] / 2**20:.0f} MiB per checkpoint): compute while it writes / "
                    f"idle, median of {wr['saves_measured']} saves | {'-' if c is None else f'{c:.2f}'} | <= 1.3 | "
                    f"{'-' if c is None else ('yes' if c <= 1.3 else 'no')} |")
        rows.append(f"| the same: iteration that overlaps the write / idle iteration; the write's wall time, save "
                    f"stall, writer CPU per save, each over an idle iteration | {wr['iter_writing_over_idle']:.3f}; "
                    f"{_share(wr['write_s_over_iter'])}, {_share(wr['save_stall_over_iter'])}, "
                    f"{_share(wr['writer_cpu_over_iter'])} | | |")
        if wr.get("live_saves"):
            rows.append(f"| the same with live writes: the fence (next optimizer step) over an idle iteration; the "
                        f"share of the bytes it copied, median of {wr['live_saves']} saves | "
                        f"{_share(wr['live_fence_over_iter'])}; {_share(wr['live_fence_share_of_bytes'])} | | |")
    rd = doc.get("peer_read")
    if rd:
        rows.append(f"| restore's reads from a peer's memory ({rd['bytes_needed'] / 2**20:.0f} MiB, a column half, every "
                    f"byte MACed and CRC-checked): GB/s against the floor (the same bytes sendfile'd over one loopback "
                    f"TCP connection into preallocated memory), medians of {rd['reps']} alternations; load / floor "
                    f"(medians; best of each) | {rd['load_gb_s']:.2f} GB/s vs {rd['floor_gb_s']:.2f} GB/s; "
                    f"{rd['load_over_floor_median']:.2f} ({rd['load_over_floor_best']:.2f}) | stated, no goal | - |")
    pr = doc.get("peer")
    if pr:
        only = pr["snapshots_only"]
        rows.append(f"| snapshot every iteration, two nodes (1 rank each): step overhead, median (mean); process CPU "
                    f"added | {_pct(only['step_overhead'])} ({_pct(only['step_overhead_of_means'])}); "
                    f"{_share(only.get('process_cpu_added_over_iter'))} | <= 2 % | {met(only['step_overhead'], 0.02)} |")
        for key, label, goal in (("every_snapshot", "a peer copy of every snapshot", 0.10),
                                 *((k[len("peer_copy_adds_"):], f"a peer copy every {k.rsplit('_', 1)[-1]} snapshots", 0.05)
                                   for k in pr if k.startswith("peer_copy_adds_every_") and k != "peer_copy_adds_every_snapshot")):
            add = pr[f"peer_copy_adds_{key}"]
            run = pr["peer_copy_every_snapshot" if key == "every_snapshot" else f"peer_copy_{key}"]
            rows.append(f"| {label}: adds to the step, median (mean); that run's overhead | {_pct(add['median'])} "
                        f"({_pct(add['mean'])}); {_pct(run['step_overhead'])} | <= {100 * goal:.0f} % | "
                        f"{met(add['median'], goal)} (mean: {met(add['mean'], goal)}) |")
            rows.append(f"| {label}: process CPU added (all threads, snapshot + copy); copy-thread CPU per snapshot "
                        f"(per copy); training thread / writer, of an iteration | "
                        f"{_share(run.get('process_cpu_added_over_iter'))} (means "
                        f"{_share(run.get('process_cpu_added_over_iter_of_means'))}); "
                        f"{_share(run['peer_copy_cpu_per_snapshot_over_iter'])} "
                        f"({_share(run['peer_copy_cpu_per_copy_over_iter'])}); "
                        f"{_share(run['snapshot_training_thread_over_iter'])} / "
                        f"{_share(run['snapshot_writer_cpu_over_iter'])} | | |")
    return "\n".join(rows)


ROWS = ("restore", "memory", "overhead", "peer", "peer-read", "writer", "lost")   # memory: measured by the restore row
WARMUP = 3   # the trainer rows' first iterations, not measured (``_train``'s skip)


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    """The run's arguments, every one checked here (before torch is imported or a process starts)."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=csv_choices(*ROWS), default="restore,overhead,lost",
                   help="comma-separated: restore (includes memory), overhead, peer, peer-read, writer, lost")
    p.add_argument("--world", type=positive_int, default=4)
    p.add_argument("--mib-per-rank", type=positive_int, default=64)
    p.add_argument("--tensors", type=positive_int, default=4)
    p.add_argument("--snapshots", type=positive_int, default=5)
    p.add_argument("--storage", type=dir_to_make, default=os.path.join(HERE, "results"),
                   help="a directory on the storage disk (made if missing)")
    p.add_argument("--trainer-procs", type=positive_int, default=2)
    p.add_argument("--hidden", type=positive_int, default=256, help="a multiple of 4 (the trainer's attention heads)")
    p.add_argument("--iters", type=positive_int, default=15, help=f"overhead row: iterations per run (> {WARMUP}: "
                   "the first are warm-up)")
    p.add_argument("--pairs", type=positive_int, default=3, help="overhead row: runs without/with snapshots, "
                   "alternated")
    p.add_argument("--paired-iters", type=nonnegative_int, default=200, help="overhead row: iterations of the one "
                   "run that alternates blocks with and without snapshots (0: skip it); also the peer row's runs")
    p.add_argument("--block", type=positive_int, default=4, help="overhead row: iterations per block in that run")
    p.add_argument("--peer-copy-interval", type=positive_int, default=8, help="peer row: the copy interval of its "
                   "third run (also its block length, so each block with snapshots holds one copy)")
    p.add_argument("--peer-read-mib", type=positive_int, default=256, help="peer-read row: MiB in the served "
                   "snapshot (a column half of it is read)")
    p.add_argument("--peer-read-reps", type=positive_int, default=4, help="peer-read row: alternations of the "
                   "floor and the load")
    p.add_argument("--writer-hidden", type=positive_int, default=1024, help="writer row: the trainer's hidden size "
                   "(1024: about 270 MiB of checkpoint per rank with 2 ranks)")
    p.add_argument("--writer-save-every", type=positive_int, default=4, help="writer row: iterations between storage "
                   "saves")
    p.add_argument("--writer-iters", type=positive_int, default=30, help="writer row: iterations of its one run "
                   "(>= 2 x --writer-save-every + 1: a warm-up cycle, then one measured)")
    p.add_argument("--writer-live-write", action="store_true", help="writer row: checkpoint.live_write on (the "
                   "writer reads the live tensors until the next optimizer step's fence, which copies the rest)")
    p.add_argument("--snapshot-live-write", action="store_true", help="overhead and peer rows: "
                   "memory_snapshot.live_write on (the snapshot writer copies the live tensors on idle cycles until "
                   "the next optimizer step's fence, which copies the rest)")
    p.add_argument("--kill-at", type=positive_int, default=7)
    p.add_argument("--storage-interval", type=positive_int, default=5)
    p.add_argument("--out", type=output_file, default=os.path.join(HERE, "results", "snapshot_bench.json"))
    args = p.parse_args(argv)
    rows = set(args.rows)
    for flag in ("hidden", "writer_hidden"):
        if getattr(args, flag) % 4:
            p.error(f"argument --{flag.replace('_', '-')}: {getattr(args, flag)} must be a multiple of 4 (the "
                    f"trainer's 4 attention heads)")
    if "overhead" in rows and args.iters <= WARMUP:
        p.error(f"argument --iters: {args.iters} must be >= {WARMUP + 1} (the first {WARMUP} are warm-up)")
    # a paired run measures after the warm-up, and needs a block with snapshots and one without
    need = {"overhead": args.block if args.paired_iters else 0,
            "peer": max(args.block, args.peer_copy_interval)}
    for row, block in need.items():
        if row in rows and block and args.paired_iters < WARMUP + 2 * block:
            p.error(f"argument --paired-iters: {args.paired_iters} must be >= {WARMUP + 2 * block} for the {row} "
                    f"row ({WARMUP} warm-up iterations, then a block of {block} with snapshots and one without)"
                    + ("; 0 skips the overhead row's paired run" if row == "overhead" else ""))
    if "writer" in rows and args.writer_iters < 2 * args.writer_save_every + 1:
        p.error(f"argument --writer-iters: {args.writer_iters} must be >= {2 * args.writer_save_every + 1} "
                f"(2 x --writer-save-every + 1: a warm-up save cycle, then one measured)")
    return args


def main() -> int:
    args = parse_args()
    os.makedirs(args.storage, exist_ok=True)
    rows = set(args.rows)
    if "memory" in rows:   # the restore row measures the memory figures
        rows.add("restore")
    doc: dict = {"time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "load_average": os.getloadavg()}
    if "restore" in rows:
        doc["restore"] = engine_rows(args)
        print(json.dumps({"restore": doc["restore"]}, indent=1), flush=True)
    if "overhead" in rows:
        doc["overhead"] = overhead_rows(args)
        print(json.dumps({"overhead": doc["overhead"]}, indent=1), flush=True)
    if "peer" in rows:
        doc["peer"] = peer_rows(args)
        print(json.dumps({"peer": doc["peer"]}, indent=1), flush=True)
    if "peer-read" in rows:
        doc["peer_read"] = peer_read_rows(args)
        print(json.dumps({"peer_read": doc["peer_read"]}, indent=1), flush=True)
    if "writer" in rows:
        doc["writer"] = writer_rows(args)
        print(json.dumps({"writer": doc["writer"]}, indent=1), flush=True)
    if "lost" in rows:
        doc["lost"] = lost_rows(args)
        print(json.dumps({"lost": doc["lost"]}, indent=1), flush=True)
    doc["load_average_end"] = os.getloadavg()
    if rows & {"overhead", "peer", "peer-read", "writer"}:
        print(f"\nload average {doc['load_average']} -> {doc['load_average_end']}\n" + goal_table(doc), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
