"""DeepSpeed bench: checkpoint stall, time to durable and resume under a new layout, elastor vs DeepSpeed.

One spawned 2-rank world (gloo, CPU), one model state, one layout change (PP2 x DP1 -> PP1 x DP2,
ZeRO-1, fp32, Adam), side by side:

* DeepSpeed: synchronous ``save_checkpoint`` stall; universal route = that save + ``ds_to_universal``
  (offline pass, timed as a subprocess) + ``load_checkpoint`` with ``load_universal`` under the new layout;
* elastor: save stall (snapshot; cold = first save, warm = a later save reusing the staging buffer
  and the cached plan), time to durable (background write + commit), load with reshard under the
  new layout (inside ``elastor_ds.deepspeed.initialize``).

Times are the max over ranks. Results are printed as JSON and as ratios; record ratios, not
absolute times (shared, noisy machines). Usage: ``python bench/ds_bench.py [--hidden 512 --blocks 8]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from elastor_ds.cli_types import positive_int  # noqa: E402

from _args import dir_to_make  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _config(pp: int, dp: int, zero: int, elastor=None, universal: bool = False) -> dict:
    gas = 4 // dp
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "train_batch_size": 2 * gas * dp,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": zero}, "steps_per_print": 10 ** 9}
    if elastor is not None:
        cfg["elastor"] = elastor
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _engine(args, pp, dp, elastor=None, universal=False, plain=False):
    import deepspeed
    from elastor_ds import deepspeed as eds
    from elastor_ds.testing import toy_pipe as toy

    model = eds.PipelineModule(toy.layers(hidden=args.hidden, num_blocks=args.blocks), num_stages=pp,
                               loss_fn=toy.loss_fn, boundaries=None)
    cfg = _config(pp, dp, 1, elastor, universal)
    if plain:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    else:
        engine, *_ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


def _max(x: float) -> float:
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return max(out)


def _worker(rank: int, world: int, port: int, args, root: str, result_path: str) -> None:
    import logging

    import torch.distributed as dist
    logging.basicConfig(level=logging.WARNING)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from elastor_ds.testing import toy_pipe as toy

    res: dict = {}
    edir, dsdir = os.path.join(root, "elastor"), os.path.join(root, "ds")
    eng = _engine(args, 2, 1, {"checkpoint": {"dir": edir, "load": "none", "async": True}})
    it = toy.batches(0, 0, 1, 4, 2)
    eng.train_batch(it)
    t0 = time.perf_counter()
    s = eng.elastor.save()
    res["elastor_stall_cold_s"] = _max(time.perf_counter() - t0)
    eng.elastor.wait()
    # alternate DeepSpeed and elastor saves 3 times on the same state; medians (this box is noisy)
    ds_t, warm_t, dur_t = [], [], []
    for rep in range(3):
        eng.train_batch(it)
        tag = f"global_step{eng.global_steps}"
        dist.barrier()
        t0 = time.perf_counter()
        PipelineEngine.save_checkpoint(eng, dsdir, tag=tag, client_state={"universal_checkpoint_info": {}})
        ds_t.append(_max(time.perf_counter() - t0))
        os.sync()  # let DeepSpeed's dirty pages reach the disk before timing elastor
        dist.barrier()
        t0 = time.perf_counter()
        s = eng.elastor.save()
        warm_t.append(_max(time.perf_counter() - t0))
        eng.elastor.wait()
        dur_t.append(_max(time.perf_counter() - t0))
    import statistics
    res["ds_save_stall_s"] = statistics.median(ds_t)
    res["elastor_stall_warm_s"] = statistics.median(warm_t)
    res["elastor_durable_s"] = statistics.median(dur_t)
    res["elastor_snapshot_only_s"] = _max(s.stall_s)
    res["elastor_plan_s"] = _max(s.plan_s)
    res["elastor_collect_shards_s"] = _max(eng.elastor.last_collect_s)
    res["bytes_per_rank"] = _max(float(s.bytes_written))
    eng.elastor.finalize()
    del eng
    dist.barrier()

    if rank == 0:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            os.path.join(dsdir, tag), "--output_folder", os.path.join(dsdir, tag + "_universal"),
                            "--num_extract_workers", "1", "--num_merge_workers", "1"],
                           capture_output=True, text=True)
        res["ds_to_universal_s"] = time.perf_counter() - t0
        res["ds_to_universal_ok"] = p.returncode == 0
        if p.returncode != 0:
            res["ds_to_universal_error"] = p.stderr[-2000:]
    ok = [res.get("ds_to_universal_ok")]
    dist.broadcast_object_list(ok, src=0)
    dist.barrier()

    if ok[0]:
        try:
            eng = _engine(args, 1, 2, universal=True, plain=True)
            dist.barrier()
            t0 = time.perf_counter()
            path, _ = eng.load_checkpoint(dsdir, tag=tag + "_universal")
            res["ds_universal_load_s"] = _max(time.perf_counter() - t0)
            res["ds_universal_load_ok"] = path is not None
            del eng
        except Exception as e:  # noqa: BLE001 - recorded in the results
            res["ds_universal_load_error"] = f"{type(e).__name__}: {e}"[:2000]
    dist.barrier()

    t0 = time.perf_counter()
    eng = _engine(args, 1, 2, {"checkpoint": {"dir": os.path.join(root, "e2"), "load": edir}})
    res["elastor_initialize_with_load_s"] = _max(time.perf_counter() - t0)
    res["elastor_load_reshard_s"] = _max(eng.elastor.loaded.seconds)
    res["elastor_load_step"] = eng.elastor.loaded.step
    eng.elastor.finalize()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=positive_int, default=512, help="the toy pipeline's hidden size")
    ap.add_argument("--blocks", type=positive_int, default=8, help="its MLP blocks (between embedding and head)")
    ap.add_argument("--root", type=dir_to_make, default=None,
                    help="scratch dir, kept (made if missing; default: a temp dir, removed afterwards)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    if args.root:
        os.makedirs(args.root, exist_ok=True)
    root = args.root or tempfile.mkdtemp(prefix="ds_bench_")
    result_path = os.path.join(root, "result.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_worker, args=(2, port, args, root, result_path), nprocs=2, join=True,
                           start_method="spawn")
        with open(result_path) as f:
            r = json.load(f)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    ratios = {"ds_stall / elastor_stall_warm": r["ds_save_stall_s"] / r["elastor_stall_warm_s"],
              "ds_stall / elastor_stall_cold": r["ds_save_stall_s"] / r["elastor_stall_cold_s"],
              "ds_stall / elastor_durable": r["ds_save_stall_s"] / r["elastor_durable_s"]}
    if "ds_universal_load_s" in r:
        uni = r["ds_save_stall_s"] + r["ds_to_universal_s"] + r["ds_universal_load_s"]
        ela = r["elastor_durable_s"] + r["elastor_load_reshard_s"]
        r["universal_route_s"] = uni
        r["elastor_route_s"] = ela
        ratios["universal_route / elastor_route (save+durable+reshard load)"] = uni / ela
        ratios["ds_universal_load / elastor_load_reshard"] = r["ds_universal_load_s"] / r["elastor_load_reshard_s"]
    print(json.dumps({"params": vars(args), "results": r, "ratios": ratios}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
