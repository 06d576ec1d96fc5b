"""Failure -> resumed training, three ways, in one run: the README's main job (GPT, TP2 x PP2 on 4
CPU processes, gloo) loses a worker (SIGKILL) and continues on 3 under the planner's plan.

- ``torchrun``: the old ``elastic_demo.py`` way: ``torchrun --standalone`` runs the job, the fault
  kills it, and it is relaunched by hand (``torchrun`` on 3 processes with ``--elastor-plan auto``
  and ``--load``).
- ``no-standby``: ``elastor run --no-standby`` (torch's agent spawns fresh workers).
- ``standby``: ``elastor run`` (default): the relaunch takes standby workers that did their
  imports while the job trained.

Time from the kill to the start of the first resumed iteration, from the trainer's metrics file (the
same clock and the same definition for all three: the metrics record's time minus its iteration
time); for the ``elastor run`` variants also the controller's breakdown of it (events). The kill
comes after the same iteration in every run and, for ``standby``, once the standbys are ready
(their imports would otherwise compete with the relaunch: that is the case the refill delay
avoids). Variants run interleaved, ``--repeats`` times each; the table gives medians and ratios.

    python bench/recovery_bench.py [--repeats 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from elastor_ds.cli_types import positive_int  # noqa: E402
from elastor_ds.elastic.events import EventKind, read_jsonl  # noqa: E402

from _args import csv_choices, dir_to_make, output_file  # noqa: E402
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
MODEL = ["--num-layers", "5", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
         "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--log-interval", "25", "--seed", "1234"]
VARIANTS = ("torchrun", "no-standby", "standby")


def pids_by_rank(events: str) -> dict[int, int]:
    launches = [e for e in read_jsonl(events) if e.get("event") == EventKind.LAUNCH.value]
    return dict(zip(launches[-1]["global_ranks"], launches[-1]["pids"])) if launches else {}


def torchrun_worker(job: subprocess.Popen, rank: int) -> int:
    import psutil
    for c in psutil.Process(job.pid).children(recursive=True):
        try:
            if c.environ().get("RANK") == str(rank):
                return c.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise RuntimeError(f"no torchrun worker with RANK={rank}")


def wait(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    t_end = time.time() + timeout
    while time.time() < t_end:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 120) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def one_run(variant: str, d: str, a: argparse.Namespace) -> dict:
    n = a.nproc
    ck, mfile, efile = (os.path.join(d, x) for x in ("ckpt", "metrics.jsonl", "events.jsonl"))
    common = [*MODEL, "--train-iters", str(a.train_iters), "--save", ck, "--load", ck,
              "--save-interval", str(a.save_interval), "--metrics-file", mfile]
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    log = open(os.path.join(d, "job.log"), "w")

    def launch(cmd):
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=d, env=env, start_new_session=True)
    if variant == "torchrun":
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        job = launch([*run, f"--nproc-per-node={n}", TRAINER, *common, "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2"])
    else:
        job = launch([sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", str(n), "--on-failure",
                      "shrink", "--events", efile, "--log-dir", os.path.join(d, "logs"),
                      *(["--no-standby"] if variant == "no-standby" else []), TRAINER, *common,
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--elastor-plan", "on-change"])
    try:
        wait(lambda: (read_jsonl(mfile) or [{}])[-1].get("iteration", 0) >= a.fail_at, 600,
             f"iteration {a.fail_at}", job)
        if variant == "standby":
            slog = os.path.join(d, "logs", "standby", "standby.log")
            wait(lambda: os.path.exists(slog) and open(slog).read().count("ready:") >= 2 * n, 600,
                 "the standbys' imports", job)
        victim = n - 1
        pid = torchrun_worker(job, victim) if variant == "torchrun" else pids_by_rank(efile)[victim]
        it_kill = read_jsonl(mfile)[-1]["iteration"]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        if variant != "torchrun":   # what the controller's breakdown measures detection from
            from elastor_ds.elastic.events import append_line
            append_line(efile, {"event": EventKind.INJECTED.value, "time": t_kill, "node": "bench", "rank": victim,
                                "signal": "SIGKILL"})
        if variant == "torchrun":   # the old demo: wait for torchrun to give up, then relaunch by hand
            job.wait(timeout=300)
            t_down = time.time()
            job = launch([*run, f"--nproc-per-node={n - 1}", TRAINER, *common, "--elastor-plan", "auto"])
        resumed = wait(lambda: next((m for m in read_jsonl(mfile) if m.get("world_size") == n - 1), None), 600,
                       "the first resumed iteration", job)
        t_resumed = resumed["time"] - resumed["iter_time_s"]
        out = {"variant": variant, "recovery_s": t_resumed - t_kill, "killed_after": it_kill,
               "resumed_from": resumed["iteration"] - 1, "first_iter_s": resumed["iter_time_s"]}
        if variant == "torchrun":
            out["parts"] = {"torchrun teardown": t_down - t_kill}
        else:
            from elastor_ds.elastic.events import recoveries
            recs = [r for r in recoveries(read_jsonl(efile), read_jsonl(mfile)) if r.kind == "failure"]
            if recs:
                out["parts"] = {k: round(v, 3) for k, v in recs[0].parts.items()}
                out["launch_mode"] = recs[0].launch_mode
        return out
    finally:
        stop(job)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--variants", type=csv_choices(*VARIANTS), default=",".join(VARIANTS))
    ap.add_argument("--nproc", type=positive_int, default=4, help="processes before the fault: a multiple of 4 "
                    "(the job is TP2 x PP2)")
    ap.add_argument("--fail-at", type=positive_int, default=30, help="the iteration after which a worker is killed")
    ap.add_argument("--save-interval", type=positive_int, default=10)
    ap.add_argument("--train-iters", type=positive_int, default=100000,
                    help="never reached: each run stops after its recovery (> --fail-at)")
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument("--keep", type=dir_to_make, default=None, help="keep the runs' folders here")
    a = ap.parse_args()
    if a.nproc % 4:
        ap.error(f"argument --nproc: {a.nproc} must be a multiple of 4 (the job runs TP2 x PP2)")
    if a.train_iters <= a.fail_at:
        ap.error(f"argument --train-iters: {a.train_iters} must be > --fail-at {a.fail_at} (the job must still be "
                 f"training when the worker is killed)")
    variants = a.variants
    base = a.keep or tempfile.mkdtemp(prefix="recovery_bench_")
    t0 = time.time()
    load0 = os.getloadavg()[0]
    results = []
    for rep in range(a.repeats):
        for v in variants:
            d = os.path.join(base, f"{v}_{rep}")
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            r = one_run(v, d, a)
            r["repeat"] = rep
            results.append(r)
            print(json.dumps(r), flush=True)
    load1 = os.getloadavg()[0]
    med = {v: statistics.median(r["recovery_s"] for r in results if r["variant"] == v) for v in variants}
    print(f"\nfailure -> resumed training (kill -> first resumed iteration starts), {a.nproc} -> {a.nproc - 1} "
          f"processes, median of {a.repeats}; load average {load0:.1f} at start, {load1:.1f} at end, "
          f"{time.time() - t0:.0f} s in all")
    print("| variant | recovery s (each run) | median s | vs torchrun relaunch | vs elastor run --no-standby |")
    print("|---|---|---:|---:|---:|")
    for v in variants:
        runs = ", ".join(f"{r['recovery_s']:.2f}" for r in results if r["variant"] == v)
        rt = f"{med[v] / med['torchrun']:.2f}x" if "torchrun" in med else "-"
        rn = f"{med[v] / med['no-standby']:.2f}x" if "no-standby" in med else "-"
        print(f"| {v} | {runs} | {med[v]:.2f} | {rt} | {rn} |")
    print("\nbreakdown (elastor run's events, seconds):")
    for r in results:
        print(f"  {r['variant']:<11} run {r['repeat']}: {r.get('launch_mode') or ''} "
              + ", ".join(f"{k} {v:.2f}" for k, v in (r.get("parts") or {}).items()))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"results": results, "median_s": med, "load": [load0, load1]}, f, indent=1)
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
