"""The README's main job: ``elastor run`` keeps a GPT training through a lost worker and its return.

1. ``elastor run`` launches the trainer on N processes (default 4: TP2 x PP2, megatron-core TP
   layers inside DeepSpeed's pipeline engine) with asynchronous elastor checkpoints.
2. After iteration K the demo SIGKILLs one worker, as a lost GPU would. The controller detects it,
   tears the group down and relaunches on the N - 1 processes left (``--on-failure shrink``); the
   trainer asks the planner for the best layout for them (``--elastor-plan on-change``) and resumes
   from the last committed checkpoint under it (no conversion step).
3. Later the device "returns": the demo sends the operator's scale-up signal (``kill -USR1`` to
   ``elastor run``). The workers finish their iteration, checkpoint it durably and exit; the job
   relaunches on N processes (TP2 x PP2 again) and loses nothing.
4. At the end: the controller's summary (phases, lost iterations, recovery times broken down into
   detection, teardown, probe, rendezvous + spawn, start-up, planning, model build + load), a loss
   table, ``timeline.png`` (loss and throughput over wall time, events marked) and ``summary.json``.

``--gpus``: the same on a GPU node (NCCL, one process per GPU).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
log = logging.getLogger("elastic_demo")


def model_flags(a: argparse.Namespace) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", str(a.seq_length), "--micro-batch-size", "2",
            "--global-batch-size", str(a.global_batch_size), "--train-iters", str(a.train_iters), "--lr", "3e-3",
            "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--log-interval", "25", "--seed", "1234"]


def read_jsonl(path: str) -> list[dict]:
    from elastor_ds.elastic.events import read_jsonl as rj
    return rj(path)


def direct_worker(events_file: str, rank: int) -> int:
    """The pid of the live worker with global rank ``rank``, from the controller's latest ``launch``
    event (a standby worker's /proc environment is the one it was spawned with, not its rank's)."""
    import psutil
    launches = [e for e in read_jsonl(events_file) if e.get("event") == "launch"]
    for r, pid in zip(launches[-1]["global_ranks"], launches[-1]["pids"]) if launches else ():
        if r == rank and psutil.pid_exists(pid):
            return pid
    raise RuntimeError(f"no live worker with rank {rank} in the latest launch of {events_file}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "elastic_demo"))
    ap.add_argument("--gpus", action="store_true", help="run on this node's GPUs (NCCL) instead of CPU processes")
    ap.add_argument("--nproc", type=int, default=None, help="processes before the failure (default 4, or #GPUs)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--train-iters", type=int, default=240)
    ap.add_argument("--fail-at", type=int, default=110, help="kill a worker after this iteration")
    ap.add_argument("--return-after", type=int, default=50,
                    help="iterations on the smaller world before the device returns (scale-up)")
    ap.add_argument("--save-interval", type=int, default=20)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if a.gpus:
        import torch
        n_gpu = torch.cuda.device_count()
        if n_gpu < 2:
            raise SystemExit(f"--gpus needs at least 2 GPUs on this node, found {n_gpu}")
        a.nproc = a.nproc or n_gpu
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("DS_ACCELERATOR", "cpu")
    n0 = a.nproc or a.tp * a.pp
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    ck, mfile, efile = (os.path.join(a.out, x) for x in ("ckpt", "metrics.jsonl", "events.jsonl"))
    png = os.path.join(a.out, "timeline.png")
    # shrink on GPUs too: killing a process does not break its GPU, so a probe would keep it
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", str(n0), "--on-failure", "shrink",
           "--events", efile, "--plot", png, "--log-dir", os.path.join(a.out, "logs"), "--hang-timeout", "120",
           os.path.join(HERE, "pretrain_gpt.py"), *model_flags(a),
           "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
           "--elastor-plan", "on-change", "--save", ck, "--load", ck, "--save-interval", str(a.save_interval),
           "--metrics-file", mfile]
    log.info("launch: elastor run --nproc-per-node %d --on-failure shrink ... pretrain_gpt.py (TP%d x PP%d)", n0,
             a.tp, a.pp)
    t_start = time.time()
    ctl_log = open(os.path.join(a.out, "elastor_run.log"), "w")
    ctl = subprocess.Popen(cmd, stdout=ctl_log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    from elastor_ds.elastic.events import append_line
    stage = "train"
    n_small = 0
    try:
        while ctl.poll() is None:
            ms = read_jsonl(mfile)
            if stage == "train" and ms and ms[-1]["iteration"] >= a.fail_at:
                victim = n0 - 1
                pid = direct_worker(efile, victim)
                os.kill(pid, signal.SIGKILL)
                append_line(efile, {"event": "injected", "time": time.time(), "node": "demo", "rank": victim,
                                    "signal": "SIGKILL"})
                log.info("killed worker rank %d (pid %d) after iteration %d: a lost GPU", victim, pid,
                         ms[-1]["iteration"])
                stage = "shrunk"
            elif stage == "shrunk":
                n_small = sum(1 for m in ms if m["world_size"] < n0)
                if n_small >= a.return_after:
                    log.info("the device is back after %d iterations on %d processes: kill -USR1 %d (scale-up)",
                             n_small, ms[-1]["world_size"], ctl.pid)
                    os.kill(ctl.pid, signal.SIGUSR1)
                    stage = "returned"
            time.sleep(0.1)
    finally:
        if ctl.poll() is None:
            ctl.wait()
    rc = ctl.returncode
    if rc != 0:
        print(open(ctl_log.name).read()[-4000:])
        raise SystemExit(f"elastor run failed (exit {rc}); see {a.out}/elastor_run.log and {a.out}/logs/")
    if stage != "returned":
        raise SystemExit(f"the job finished before the demo could {'kill a worker' if stage == 'train' else 'scale up'}"
                         f" (stage {stage}); lower --fail-at / --return-after")

    from elastor_ds.elastic.events import phases, recoveries
    from elastor_ds.elastic.report import summary_table
    events, ms = read_jsonl(efile), read_jsonl(mfile)
    table = summary_table(events, ms)
    phs, recs = phases(events, ms), recoveries(events, ms)
    stalls = [m["save_stall_s"] for m in ms if "save_stall_s" in m]
    summary = {
        "phases": [{"world_size": p.world_size, "layout": p.layout, "iterations": [p.first_iteration, p.last_iteration],
                    "resumed_from": p.resumed_from, "median_iteration_s": p.median_iter_s,
                    "samples_per_s": p.samples_per_s, "ended_by": p.ended_by, "plan": p.plan} for p in phs],
        "recoveries": [{"kind": r.kind, "cause": r.cause, "world": [r.world_before, r.world_after],
                        "lost_iterations": r.lost_iterations, "parts_s": r.parts, "to_training_s": r.total_s}
                       for r in recs],
        "saves": len(stalls), "median_save_stall_ms": statistics.median(stalls) * 1e3 if stalls else None,
        "loss_start": ms[0]["lm_loss"], "loss_end": ms[-1]["lm_loss"], "total_s": time.time() - t_start,
    }
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n" + table)
    print("lm loss by phase: " + " | ".join(
        f"phase {p.index} ({p.world_size} procs): "
        + (f"{p.loss_first:.3f} -> {p.loss_last:.3f}" if p.loss_first is not None else "-")
        for p in phs))
    if stalls:
        print(f"saves: {len(stalls)} asynchronous, median training stall {summary['median_save_stall_ms']:.1f} ms")
    fail = next((r for r in recs if r.kind == "failure"), None)
    if fail and fail.total_s is not None:
        print(f"failure -> resumed training: {fail.total_s:.1f} s; lost {fail.lost_iterations} iterations "
              f"(since the last committed checkpoint)")
    print(f"outputs: {a.out}/ (events.jsonl, metrics.jsonl, summary.json, timeline.png, elastor_run.log, logs/, ckpt/)")
    return 0 if ms[-1]["lm_loss"] < ms[0]["lm_loss"] else 1


if __name__ == "__main__":
    sys.exit(main())
