"""The README's main job: train, checkpoint asynchronously, lose a worker, re-plan, resume, keep learning.

1. Launch the trainer on N processes (default 4, TP2 x PP2) with asynchronous elastor saves.
2. At iteration K, SIGKILL one worker process (as a GPU loss would); torchrun tears the job down.
3. Ask the planner for the best layout for the N - 1 processes left that the trainer can execute
   (a uniform TP x PP x DP grid with uneven stages) and write it as a plan JSON.
4. Relaunch that many processes with ``--load`` and ``--elastor-plan``: they resume from the last
   committed checkpoint under the new layout (no conversion) and train on.
5. Print a table (iterations, losses, layouts, save stalls, time from failure to resumed training)
   and write ``loss.png`` (loss vs iteration, failure and restart marked) and ``summary.json``.

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


def launch(nproc: int, args: list[str], out: str, tag: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(HERE, "pretrain_gpt.py"), *args]
    log.info("launch (%s): %s", tag, " ".join(cmd[3:]))
    logf = open(os.path.join(out, f"{tag}.log"), "w")
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return out


def kill_one_worker(job: subprocess.Popen, rank: int) -> int:
    import psutil
    for child in psutil.Process(job.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                child.send_signal(signal.SIGKILL)
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise RuntimeError(f"no worker with RANK={rank} under pid {job.pid}")


def plan_for(n: int, a: argparse.Namespace, out: str) -> tuple[str, int, str]:
    """Run the planner (restricted to layouts the trainer runs) for ``n`` processes; return (file, nproc, text)."""
    from elastor_ds.cli import main as elastor
    path = os.path.join(out, f"plan_{n}.json")
    argv = ["plan", "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", str(a.seq_length),
            "--vocab-size", "97", "--micro-batch-size", "2", "--global-batch-size", str(a.global_batch_size),
            "--tensor-model-parallel-size", str(a.tp), "--gpus-per-node", str(n), "--layouts", "uniform",
            "--swiglu", "--json"]
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = elastor(argv)
    if rc != 0:
        raise SystemExit(f"planner failed for {n} processes (exit {rc})")
    doc = json.loads(buf.getvalue())
    reps = doc["replicas"]
    if len({r["micro_batches"] for r in reps}) != 1:
        raise SystemExit(f"planner returned unequal micro-batches {[r['micro_batches'] for r in reps]}; "
                         f"the DeepSpeed runtime needs equal ones")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path, int(doc["num_gpus"]), doc.get("description", "")


def plot(metrics: list[dict], fail_it: int, resume_it: int, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for layout in dict.fromkeys(m["layout"] for m in metrics):
        pts = [(m["iteration"], m["lm_loss"]) for m in metrics if m["layout"] == layout]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{layout} ({pts[0][0]}-{pts[-1][0]})", lw=1.2)
    ax.axvline(fail_it, color="red", ls="--", lw=1, label=f"worker killed after iteration {fail_it}")
    ax.axvline(resume_it, color="green", ls=":", lw=1, label=f"resumed from checkpoint at {resume_it}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("elastor: lose a worker, re-plan, resume under a new layout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


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
    ap.add_argument("--fail-at", type=int, default=130, help="kill a worker after this iteration")
    ap.add_argument("--save-interval", type=int, default=20)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if a.gpus:
        import torch
        n_gpu = torch.cuda.device_count()
        if n_gpu < 2:
            raise SystemExit(f"--gpus needs at least 2 GPUs on this node, found {n_gpu}")
        a.nproc = a.nproc or n_gpu
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    n0 = a.nproc or a.tp * a.pp
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    ck, mfile = os.path.join(a.out, "ckpt"), os.path.join(a.out, "metrics.jsonl")
    flags = model_flags(a) + ["--save", ck, "--save-interval", str(a.save_interval), "--metrics-file", mfile]

    # 1. train on n0 processes
    t_start = time.time()
    job = launch(n0, flags + ["--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size",
                              str(a.pp)], a.out, "phase1")
    fail_time = None
    while job.poll() is None:
        ms = read_metrics(mfile)
        if ms and ms[-1]["iteration"] >= a.fail_at:
            victim = n0 - 1
            pid = kill_one_worker(job, victim)
            fail_time = time.time()
            log.info("killed worker rank %d (pid %d) after iteration %d: simulating a lost GPU",
                     victim, pid, ms[-1]["iteration"])
            break
        time.sleep(0.2)
    if fail_time is None:
        raise SystemExit(f"phase 1 ended (exit {job.returncode}) before iteration {a.fail_at}; see {a.out}/phase1.log")
    job.wait(timeout=120)
    log.info("torchrun tore the job down (exit %s)", job.returncode)
    before = read_metrics(mfile)
    fail_it = before[-1]["iteration"]

    # 2. re-plan for the processes left
    t_plan = time.time()
    plan_path, n1, desc = plan_for(n0 - 1, a, a.out)
    log.info("planner: best layout the trainer can run on %d processes: %s (uses %d)", n0 - 1, desc, n1)
    plan_s = time.time() - t_plan

    # 3. relaunch and resume
    job2 = launch(n1, flags + ["--load", ck, "--elastor-plan", plan_path], a.out, "phase2")
    rc = job2.wait()
    if rc != 0:
        raise SystemExit(f"phase 2 failed (exit {rc}); see {a.out}/phase2.log")
    ms = read_metrics(mfile)
    after = ms[len(before):]
    resume_it = after[0]["iteration"] - 1
    first_after = after[0]["time"] - after[0]["iter_time_s"]
    stalls = [m["save_stall_s"] for m in ms if "save_stall_s" in m]
    iters = [m["iter_time_s"] for m in before[5:]]
    summary = {
        "layout_before": before[-1]["layout"], "world_before": n0,
        "layout_after": after[0]["layout"], "world_after": n1,
        "failed_after_iteration": fail_it, "resumed_from_iteration": resume_it,
        "iterations_lost": fail_it - resume_it,
        "loss_start": ms[0]["lm_loss"], "loss_at_failure": before[-1]["lm_loss"],
        "loss_after_restart": after[0]["lm_loss"], "loss_end": after[-1]["lm_loss"],
        "saves": len(stalls), "median_save_stall_ms": statistics.median(stalls) * 1e3 if stalls else None,
        "median_iteration_ms": statistics.median(iters) * 1e3 if iters else None,
        "failure_to_resumed_training_s": first_after - fail_time, "planner_s": plan_s,
        "total_s": time.time() - t_start,
    }
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.join(a.out, "loss.png")
    plotted = plot(ms, fail_it, resume_it, png)
    s = summary
    rows = [
        ("layout", f"{s['layout_before']} on {n0} procs", f"{s['layout_after']} on {n1} procs"),
        ("iterations", f"1-{fail_it} (killed)", f"{resume_it + 1}-{after[-1]['iteration']}"),
        ("lm loss", f"{s['loss_start']:.3f} -> {s['loss_at_failure']:.3f}",
         f"{s['loss_after_restart']:.3f} -> {s['loss_end']:.3f}"),
    ]
    print("\n" + "=" * 78)
    print(f"{'':<14}{'before the failure':<32}{'after the restart':<32}")
    for name, b, c in rows:
        print(f"{name:<14}{b:<32}{c:<32}")
    print("-" * 78)
    print(f"saves: {s['saves']} asynchronous, median training stall {s['median_save_stall_ms']:.1f} ms "
          f"(median iteration {s['median_iteration_ms']:.0f} ms)")
    print(f"lost work: {s['iterations_lost']} iterations (since the last committed checkpoint)")
    print(f"failure -> resumed training: {s['failure_to_resumed_training_s']:.1f} s "
          f"(planner {s['planner_s']:.2f} s; the rest is process start-up and the resharding load)")
    print(f"outputs: {a.out}/ (metrics.jsonl, summary.json{', loss.png' if plotted else ''}, phase logs, ckpt/)")
    print("=" * 78)
    return 0 if s["loss_end"] < s["loss_at_failure"] else 1


if __name__ == "__main__":
    sys.exit(main())
