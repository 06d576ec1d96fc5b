"""GPU rows of the snapshot benchmark (one process, one GPU; run by ``scripts/gpu_check.sh``).

    python bench/gpu_snapshot_bench.py --mib 1024 [--root /dev/shm] [--json out.json]

State: fp32 CUDA tensors of ``--mib`` MiB in total. Measured in one run, medians of ``--reps``:
  floor    device-to-host copy of the same bytes into a pinned buffer (non_blocking + synchronize)
  memory   the memory tier's engine: stall of a snapshot staged into its page-locked mapped tmpfs
           file with the D2H copy deferred (overlapping compute), time to committed, compute beside it
  elastor  save stall (snapshot into the pinned staging buffer on a side stream), time to committed
           on ``--root`` (a memory root: tmpfs, no fsync), load back into CUDA tensors under a
           column reshard; the training step overlapped with the writer (matmul loop, idle vs busy)
  DCP      torch.distributed.checkpoint save (sync) and async_save stall / durable of the same
           tensors, load of the same tensors (no reshard: plain tensors)
Prints ratios; exits 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from elastor_ds.cli_types import positive_int  # noqa: E402

from _args import output_file, writable_dir  # noqa: E402

COLS = 4096


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    """The run's arguments, checked before torch is imported."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=positive_int, default=1024, help="MiB of fp32 state on the GPU")
    ap.add_argument("--tensors", type=positive_int, default=16,
                    help=f"tensors of {COLS} fp32 columns (at most 64 per MiB: a tensor holds whole rows)")
    ap.add_argument("--reps", type=positive_int, default=5, help="measurements of each figure (medians)")
    ap.add_argument("--root", type=writable_dir, default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="an existing writable directory (a memory root: tmpfs; default /dev/shm)")
    ap.add_argument("--json", type=output_file, default=None)
    a = ap.parse_args(argv)
    if a.tensors > a.mib * 2 ** 20 // 4 // COLS:
        ap.error(f"argument --tensors: {a.tensors} tensors of {COLS} fp32 columns need --mib >= "
                 f"{-(-a.tensors // 64)} (a tensor holds at least one row, 64 rows per MiB)")
    return a


def main() -> int:
    a = parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_snapshot_bench: no CUDA device visible to torch; nothing measured", file=sys.stderr)
        return 2
    from elastor_ds.checkpoint import CheckpointEngine, TensorShard
    from elastor_ds.checkpoint.storage import PosixStorage, TmpfsStorage
    from elastor_ds.layout.region import Region

    cols = COLS
    rows = a.mib * 2 ** 20 // 4 // cols // a.tensors
    ts = [torch.randn(rows, cols, device="cuda") for _ in range(a.tensors)]
    nbytes = sum(t.numel() * 4 for t in ts)
    res: dict = {"bytes": nbytes, "device": torch.cuda.get_device_name(0), "reps": a.reps}

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.zero_()

    def d2h() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pos = 0
        for t in ts:
            n = t.numel() * 4
            pinned[pos:pos + n].view(torch.float32).view(t.shape).copy_(t, non_blocking=True)
            pos += n
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    d2h()
    res["d2h_floor_s"] = statistics.median(d2h() for _ in range(a.reps))

    work = tempfile.mkdtemp(prefix="elastor-gpu-bench-", dir=a.root)
    try:
        el_root = os.path.join(work, "elastor")
        eng = CheckpointEngine(el_root, storage=PosixStorage(el_root, sync=False), keep=1)
        shards = [TensorShard(f"t{i}", (rows, cols), Region((0, 0), (rows, cols)), t) for i, t in enumerate(ts)]
        stalls, durable = [], []
        for step in range(a.reps + 1):
            torch.cuda.synchronize()
            st = eng.save(step, shards)
            done = eng.wait()
            if step:   # the first save allocates and pre-faults the staging buffer
                stalls.append(st.stall_s + st.plan_s)
                durable.append(done.durable_s)
        res["elastor_stall_s"] = statistics.median(stalls)
        res["elastor_durable_s"] = statistics.median(durable)
        res["staging_pinned"] = bool(eng.staging.buf is not None and eng.staging.buf.is_pinned())
        x = torch.randn(4096, 4096, device="cuda")

        def step_time(n: int = 20) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                x.copy_(torch.tanh(x @ x) * 0.5)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        step_time(3)
        idle = min(step_time() for _ in range(3))
        t0 = time.perf_counter()
        eng.save(a.reps + 1, shards)
        res["compute_with_writer_over_idle"] = step_time() / idle
        eng.wait()
        half = cols // 2
        dst = [torch.zeros(rows, half, device="cuda") for _ in ts]
        dsh = [TensorShard(f"t{i}", (rows, cols), Region((0, half), (rows, half)), d) for i, d in enumerate(dst)]
        loads = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.load(None, dsh)
            torch.cuda.synchronize()
            loads.append(time.perf_counter() - t0)
        assert all(torch.equal(d, t[:, half:]) for d, t in zip(dst, ts))
        res["elastor_load_half_s"] = statistics.median(loads)
        eng.finalize()

        # the memory tier's engine: node-local, staged straight into its page-locked mapped tmpfs
        # file, device-to-host copies deferred (fence() stands for the optimizer pre-step hook)
        mem = CheckpointEngine(os.path.join(work, "mem"), storage=TmpfsStorage(os.path.join(work, "mem")), keep=1,
                               optimistic_plan=True)
        mem.defer_device_copies = True
        mstalls, mdur = [], []
        for step in range(a.reps + 2):
            torch.cuda.synchronize()
            st = mem.save(step, shards)
            mem.fence()
            done = mem.wait()
            if step >= 2:   # the first two saves create, allocate and register the two files
                mstalls.append(st.stall_s + st.plan_s)
                mdur.append(done.durable_s)
        res["memory_stall_s"] = statistics.median(mstalls)
        res["memory_durable_s"] = statistics.median(mdur)
        files = mem.storage.files
        res["memory_mapping_pinned"] = bool(files is not None and all(m.pinned for m in files._maps.values()))
        torch.cuda.synchronize()
        mem.save(a.reps + 3, shards)
        res["compute_with_deferred_copy_over_idle"] = step_time() / idle
        mem.fence()
        mem.wait()
        mem.finalize()

        import torch.distributed.checkpoint as dcp
        sd = {f"t{i}": t for i, t in enumerate(ts)}
        sync_s, astall, adur = [], [], []
        for r in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=os.path.join(work, f"dcp_sync{r}"))
            sync_s.append(time.perf_counter() - t0)
            shutil.rmtree(os.path.join(work, f"dcp_sync{r}"), ignore_errors=r == 0)
        for r in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=os.path.join(work, f"dcp_async{r}"))
            astall.append(time.perf_counter() - t0)
            fut.result()
            adur.append(time.perf_counter() - t0)
        dcp.save(sd, checkpoint_id=os.path.join(work, "dcp_load"))
        lsd = {f"t{i}": torch.zeros_like(t) for i, t in enumerate(ts)}
        dl = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.load(lsd, checkpoint_id=os.path.join(work, "dcp_load"))
            torch.cuda.synchronize()
            dl.append(time.perf_counter() - t0)
        res.update(dcp_sync_s=statistics.median(sync_s), dcp_async_stall_s=statistics.median(astall),
                   dcp_async_durable_s=statistics.median(adur), dcp_load_full_s=statistics.median(dl))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {
        "elastor stall / D2H floor": res["elastor_stall_s"] / res["d2h_floor_s"],
        "elastor time to committed (tmpfs) / D2H floor": res["elastor_durable_s"] / res["d2h_floor_s"],
        "GPU step time while the writer writes / idle": res["compute_with_writer_over_idle"],
        "memory snapshot stall (mapped file, deferred D2H) / D2H floor": res["memory_stall_s"] / res["d2h_floor_s"],
        "memory snapshot time to committed / D2H floor": res["memory_durable_s"] / res["d2h_floor_s"],
        "GPU step time beside a deferred snapshot copy / idle": res["compute_with_deferred_copy_over_idle"],
        "DCP sync save / elastor stall": res["dcp_sync_s"] / res["elastor_stall_s"],
        "DCP async_save stall / elastor stall": res["dcp_async_stall_s"] / res["elastor_stall_s"],
        "DCP async durable / elastor time to committed": res["dcp_async_durable_s"] / res["elastor_durable_s"],
        "DCP load (all bytes) / elastor load (column half, reshard)": res["dcp_load_full_s"] / res["elastor_load_half_s"],
    }
    res["ratios"] = ratios
    print(f"{res['device']}: {nbytes / 2 ** 20:.0f} MiB fp32 on the GPU, staging pinned: {res['staging_pinned']}, "
          f"memory-tier mappings page-locked: {res['memory_mapping_pinned']}")
    for k, v in ratios.items():
        print(f"  {k:<62} {v:7.2f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
