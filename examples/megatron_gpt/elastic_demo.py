"""The README's main job: ``elastor run`` keeps a GPT training through a lost worker and its return.

1. ``elastor run --snapshot-dir /dev/shm/elastor-demo-<pid>`` launches the trainer on N processes
   (default 4: TP2 x PP2, megatron-core TP layers inside DeepSpeed's pipeline engine) with
   asynchronous elastor checkpoints to storage every ``--save-interval`` iterations and a **memory
   snapshot** every ``--snapshot-interval`` iterations (default 1) into the node's tmpfs directory,
   which outlives a killed worker.
2. After iteration K the demo SIGKILLs one worker, as a lost GPU would. The controller detects it,
   tears the group down and relaunches on the N - 1 processes left (``--on-failure shrink``); the
   trainer asks the planner for the best layout for them (``--elastor-plan on-change``) and restores
   under it from the newest committed step: the memory snapshot (every byte from this node's
   memory, none from storage), so at most ``--snapshot-interval`` iterations are lost.
   ``--snapshot-interval 0``: storage checkpoints only (the loss is then up to ``--save-interval``).
3. Later the device "returns": the demo sends the operator's scale-up signal (``kill -USR1`` to
   ``elastor run``). The workers finish their iteration, checkpoint it durably and exit; the job
   relaunches on N processes (TP2 x PP2 again) and loses nothing.
4. At the end: the controller's summary (phases, lost iterations, recovery times broken down into
   detection, teardown, probe, rendezvous + spawn, start-up, planning, model build + load; per
   recovery the restore tier, step, bytes from local memory / peers / storage and load seconds), a
   loss table, the snapshots' main-thread stall, ``timeline.png`` and ``summary.json``.
   ``--measure-overhead``: before the elastic run, the same model and layout under ``torchrun``
   for ``--overhead-iters`` iterations with a snapshot every iteration, paused in every other
   block of 4: the snapshots' step overhead within one run (median iteration time with vs
   without, the means beside it; adds about 45 seconds).

``--gpus``: the same on a GPU node (NCCL, one process per GPU).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
log = logging.getLogger("elastic_demo")

# --out: the file that marks a folder as this demo's output, and the entries the demo writes there;
# a rerun removes those entries only (a folder of anything else is refused, never emptied)
OUT_MARKER = ".elastor_demo_output"
OUT_ENTRIES = ("ckpt", "logs", "metrics.jsonl", "events.jsonl", "timeline.png", "summary.json", "elastor_run.log")
OUT_TEMP_PREFIX = "overhead_"   # measure_overhead's work folder (removed at its end; a killed run leaves it)


class UsageError(Exception):
    """A bad flag value: one line on stderr, exit 2."""


def prepare_out(out: str) -> None:
    """Make ``out`` ready for a run: create it, or take it as it is when empty, or, when it holds an
    earlier output of this demo (its :data:`OUT_MARKER`), remove the entries the demo writes
    (:data:`OUT_ENTRIES`, leftover ``overhead_*`` folders) and nothing else. Any other non-empty
    folder, or a file, is refused (:class:`UsageError`): the demo never deletes what it did not make.
    The marker is written first, so that a run killed half way can be rerun into the same folder."""
    from elastor_ds.checkpoint.paths import printable
    shown = printable(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {shown} exists and is not a directory; give a new or empty directory")
    if os.path.isdir(out):
        names = os.listdir(out)
        if names and OUT_MARKER not in names:
            raise UsageError(f"--out {shown} is not empty and is not an earlier output of this demo (no {OUT_MARKER} "
                             f"in it; the demo deletes only what it wrote): give a new or empty directory, or empty "
                             f"this one yourself (an output of a demo older than the marker, say)")
        marker = os.path.join(out, OUT_MARKER)
        if names and not (os.path.isfile(marker) and not os.path.islink(marker)):
            raise UsageError(f"--out {shown}: its {OUT_MARKER} is not a regular file; give a new or empty directory")
        for name in names:
            if name in OUT_ENTRIES or (name.startswith(OUT_TEMP_PREFIX) and os.path.isdir(os.path.join(out, name))):
                _remove(os.path.join(out, name))
    else:
        os.makedirs(out)
    with open(os.path.join(out, OUT_MARKER), "w") as f:
        f.write("written by examples/megatron_gpt/elastic_demo.py: a rerun with this --out replaces only "
                + ", ".join(OUT_ENTRIES) + f" and {OUT_TEMP_PREFIX}* folders\n")


def _remove(path: str) -> None:
    """``path`` itself: a link (even to a directory) is unlinked, never followed."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def model_flags(a: argparse.Namespace, train_iters: int | None = None) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", str(a.seq_length), "--micro-batch-size", "2",
            "--global-batch-size", str(a.global_batch_size), "--train-iters", str(train_iters or a.train_iters), "--lr", "3e-3",
            "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--log-interval", "25", "--seed", "1234"]


def read_jsonl(path: str) -> list[dict]:
    from elastor_ds.elastic.events import read_jsonl as rj
    return rj(path)


def direct_worker(events_file: str, rank: int) -> int:
    """The pid of the live worker with global rank ``rank``, from the controller's latest ``launch``
    event (a standby worker's /proc environment is the one it was spawned with, not its rank's)."""
    import psutil
    from elastor_ds.elastic.events import EventKind
    launches = [e for e in read_jsonl(events_file) if e.get("event") == EventKind.LAUNCH.value]
    for r, pid in zip(launches[-1]["global_ranks"], launches[-1]["pids"]) if launches else ():
        if r == rank and psutil.pid_exists(pid):
            return pid
    raise RuntimeError(f"no live worker with rank {rank} in the latest launch of {events_file}")


def measure_overhead(a: argparse.Namespace, env: dict, nproc: int) -> dict:
    """The snapshots' step overhead on the demo's own model and layout, within one ``torchrun``
    run of ``--overhead-iters`` iterations whose snapshots (every iteration) pause in every other
    block of 4 (:func:`elastor_ds.elastic.overhead.paired_overhead`: the same processes with and
    without, so the machine's drift between separate runs does not enter). Storage checkpoints off."""
    from elastor_ds.elastic.overhead import paired_overhead
    from elastor_ds.elastic.protocol import ENV_SNAPSHOT_DIR
    work = tempfile.mkdtemp(prefix="overhead_", dir=a.out)
    mfile = os.path.join(work, "paired.jsonl")
    sdir = tempfile.mkdtemp(prefix="elastor-demo-overhead-",
                            dir="/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    block = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={port}", os.path.join(HERE, "pretrain_gpt.py"),
           *model_flags(a, train_iters=a.overhead_iters), "--tensor-model-parallel-size", str(a.tp),
           "--pipeline-model-parallel-size", str(a.pp), "--save", os.path.join(work, "ckpt"),
           "--save-interval", "0", "--profile-iters", "0", "--metrics-file", mfile,
           "--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", "0",
           "--elastor-memory-snapshot-ab-blocks", str(block)]
    log.info("overhead run: %d iterations, a snapshot every iteration, paused in every other block of %d",
             a.overhead_iters, block)
    try:
        p = subprocess.run(cmd, env={**env, ENV_SNAPSHOT_DIR: sdir}, cwd=ROOT, capture_output=True, text=True,
                           timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"overhead run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        recs = read_jsonl(mfile)
    finally:
        shutil.rmtree(sdir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    res = paired_overhead(recs, block)
    stalls = [m["snapshot_stall_s"] for m in recs if m["iteration"] > 3 and m.get("snapshot_stall_s") is not None]
    return {"iterations": a.overhead_iters, "method": f"one run, snapshots paused in every other block of {block}",
            **res, "snapshots": len(stalls),
            "median_stall_over_iter": statistics.median(stalls) / res["median_iter_s_with"] if stalls else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "elastic_demo"),
                    help="output directory (default runs/elastic_demo): new, empty, or an earlier output of this "
                         f"demo, whose outputs ({', '.join(OUT_ENTRIES)}) are replaced; any other non-empty "
                         "directory is refused")
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
    ap.add_argument("--snapshot-interval", type=int, default=1,
                    help="memory snapshot every N iterations (0: storage checkpoints only)")
    ap.add_argument("--snapshot-dir", default=None,
                    help="the node's snapshot directory given to `elastor run --snapshot-dir` (default "
                         "/dev/shm/elastor-demo-<pid>; removed when the job ends)")
    ap.add_argument("--measure-overhead", action="store_true",
                    help="first measure the snapshots' step overhead (torchrun, same model and layout, one run with "
                         "snapshots paused in every other block of 4 iterations)")
    ap.add_argument("--overhead-iters", type=int, default=200)
    a = ap.parse_args(argv)
    if a.snapshot_interval < 0:
        ap.error(f"--snapshot-interval {a.snapshot_interval}: give 0 (no memory snapshots) or a positive number")
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
    try:
        prepare_out(a.out)
    except UsageError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    ck, mfile, efile = (os.path.join(a.out, x) for x in ("ckpt", "metrics.jsonl", "events.jsonl"))
    png = os.path.join(a.out, "timeline.png")
    overhead = measure_overhead(a, env, n0) if a.measure_overhead and a.snapshot_interval else None
    snap_dir = a.snapshot_dir or os.path.join(
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir(),
        f"elastor-demo-{os.getpid()}")
    snap_existed = os.path.lexists(snap_dir)   # a directory the user had is kept: only local/ and peer/ go
    snap_flags = ["--snapshot-dir", snap_dir] if a.snapshot_interval else []
    snap_args = (["--elastor-memory-snapshot-interval", str(a.snapshot_interval),
                  "--elastor-memory-snapshot-peer-copies", "0"] if a.snapshot_interval else [])
    # shrink on GPUs too: killing a process does not break its GPU, so a probe would keep it
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", str(n0), "--on-failure", "shrink",
           "--events", efile, "--plot", png, "--log-dir", os.path.join(a.out, "logs"), "--hang-timeout", "120",
           *snap_flags, os.path.join(HERE, "pretrain_gpt.py"), *model_flags(a),
           "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
           "--elastor-plan", "on-change", "--save", ck, "--load", ck, "--save-interval", str(a.save_interval),
           "--metrics-file", mfile, *snap_args]
    log.info("launch: elastor run --nproc-per-node %d --on-failure shrink%s ... pretrain_gpt.py (TP%d x PP%d)%s",
             n0, f" --snapshot-dir {snap_dir}" if snap_flags else "", a.tp, a.pp,
             f", memory snapshot every {a.snapshot_interval} iteration(s)" if snap_args else "")
    t_start = time.time()
    ctl_log = open(os.path.join(a.out, "elastor_run.log"), "w")
    ctl = subprocess.Popen(cmd, stdout=ctl_log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    from elastor_ds.elastic.events import EventKind, append_line
    stage = "train"
    n_small = 0
    try:
        while ctl.poll() is None:
            ms = read_jsonl(mfile)
            if stage == "train" and ms and ms[-1]["iteration"] >= a.fail_at:
                victim = n0 - 1
                pid = direct_worker(efile, victim)
                os.kill(pid, signal.SIGKILL)
                append_line(efile, {"event": EventKind.INJECTED.value, "time": time.time(), "node": "demo", "rank": victim,
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

    from elastor_ds.elastic.events import phases, recoveries, restore_bytes
    from elastor_ds.elastic.report import restore_text, summary_table
    events, ms = read_jsonl(efile), read_jsonl(mfile)
    table = summary_table(events, ms)
    phs, recs = phases(events, ms), recoveries(events, ms)
    stalls = [m["save_stall_s"] for m in ms if "save_stall_s" in m]
    snaps = [m["snapshot_stall_s"] / m["iter_time_s"] for m in ms if "snapshot_stall_s" in m and m.get("iter_time_s")]
    summary = {
        "phases": [{"world_size": p.world_size, "layout": p.layout, "iterations": [p.first_iteration, p.last_iteration],
                    "resumed_from": p.resumed_from, "median_iteration_s": p.median_iter_s,
                    "samples_per_s": p.samples_per_s, "ended_by": p.ended_by, "plan": p.plan} for p in phs],
        "recoveries": [{"kind": r.kind, "cause": r.cause, "world": [r.world_before, r.world_after],
                        "lost_iterations": r.lost_iterations, "parts_s": r.parts, "to_training_s": r.total_s,
                        "restore": r.restore, "restore_bytes": restore_bytes(r.restore)}
                       for r in recs],
        "saves": len(stalls), "median_save_stall_ms": statistics.median(stalls) * 1e3 if stalls else None,
        "snapshot_interval": a.snapshot_interval, "snapshot_dir": snap_dir if snap_flags else None,
        "snapshot_dir_removed": (not any(os.path.lexists(os.path.join(snap_dir, d)) for d in ("local", "peer"))
                                 if snap_existed else not os.path.lexists(snap_dir)) if snap_flags else None,
        "snapshots": len(snaps), "median_snapshot_stall_over_iter": statistics.median(snaps) if snaps else None,
        "snapshot_overhead": overhead,
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
        print(f"saves to storage: {len(stalls)} asynchronous, median training stall "
              f"{summary['median_save_stall_ms']:.1f} ms")
    if snaps:
        print(f"memory snapshots: {len(snaps)} (every {a.snapshot_interval} iteration(s)) under {snap_dir}; median "
              f"main-thread stall {summary['median_snapshot_stall_over_iter'] * 100:.1f} % of an iteration; the "
              f"directory was {'removed' if summary['snapshot_dir_removed'] else 'NOT removed'} at the end"
              f"{' (yours: only its local/ and peer/)' if snap_existed else ''}")
    if overhead:
        print(f"snapshot step overhead ({overhead['iterations']} iterations, {overhead['method']}): median "
              f"{overhead['median_iter_s_without'] * 1e3:.0f} -> {overhead['median_iter_s_with'] * 1e3:.0f} ms/iteration, "
              f"{overhead['step_overhead'] * 100:+.1f} % (means {overhead['step_overhead_of_means'] * 100:+.1f} %)")
    for r in recs:
        if r.kind != "failure":
            continue
        bound = (f"at most {a.snapshot_interval} with a memory snapshot every {a.snapshot_interval}" if
                 a.snapshot_interval else f"since the last storage checkpoint, every {a.save_interval}")
        print(f"failure -> resumed training: {_s(r.total_s)} s; lost {r.lost_iterations} iteration(s) ({bound}); "
              f"{restore_text(r) or 'no restore record'}")
    print(f"outputs: {a.out}/ (events.jsonl, metrics.jsonl, summary.json, timeline.png, elastor_run.log, logs/, ckpt/)")
    return 0 if ms[-1]["lm_loss"] < ms[0]["lm_loss"] else 1


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
