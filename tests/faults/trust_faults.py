"""Fault-campaign classes for issue 19's data-loss and careless-user findings (loaded by
fault_campaign.py on first use). Each trial does what a careless user, a crash or another local
user did by hand, and counts it as detected only when the exact refusal (exit code and message)
happened and nothing was lost:

- ``final-save``: a worker SIGKILLed after the final memory snapshot committed and before the final
  storage save; the relaunch must leave the final step in storage (lost: it does not);
- ``snapshot-dir``: ``--snapshot-dir`` given a user's non-empty directory, a live job's directory,
  a squatted world-writable one with a symlink, or one under a folder others may write: exit 2
  and every byte there unchanged;
- ``overlap-roots``: the trainer's ``--save`` inside the snapshot directory and the reverse: exit 2,
  nothing written;
- ``convert-into-ckpt``: ``elastor convert`` into a committed step, a root or the source: exit 2,
  both checkpoints unchanged;
- ``non-regular``: a FIFO as ``latest`` or as a data file: verify and inspect answer at once (exit
  1) instead of blocking;
- ``run-flags``: bad ``elastor run`` launcher values: exit 2 naming the flag.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

from fault_campaign import HANG, Outcome, Row, cli, fingerprint, save_ckpt, write

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
MODEL = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--elastor-plan", "auto"]


def _env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="",
                **extra)


def _proc(argv: list[str], timeout_s: float, env: dict, cwd: str) -> Outcome:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        return Outcome(HANG, str(e.stdout or ""), str(e.stderr or ""))
    return Outcome(p.returncode, p.stdout, p.stderr)


def _free_port() -> int:
    helpers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    if helpers not in sys.path:   # run as a script (fault_campaign.py), not under pytest
        sys.path.insert(0, helpers)
    from dist_utils import free_port   # below the ephemeral range, unique within the run
    return free_port()


def _latest_step(root: str):
    try:
        with open(os.path.join(root, "latest")) as f:
            return int(f.read().strip().split("_")[-1])
    except (OSError, ValueError):
        return None


def run_final_save(work: str, rng: random.Random, reps: int) -> Row:
    row = Row()
    iters = 4
    for i in range(max(1, reps)):
        d = os.path.join(work, f"job{i}")
        os.makedirs(d, exist_ok=True)
        ckpt, snap = os.path.join(d, "ckpt"), os.path.join(d, "snap")
        victim = rng.randrange(2)
        argv = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", "2", "--on-failure", "restart",
                "--max-restarts", "2", "--monitor-interval", "0.1", "--snapshot-dir", snap, "--events",
                os.path.join(d, "events.jsonl"), TRAINER, *MODEL, "--train-iters", str(iters), "--save", ckpt,
                "--load", ckpt, "--save-interval", "0", "--elastor-memory-snapshot-interval", "1",
                "--elastor-memory-snapshot-peer-copies", "0"]
        o = _proc(argv, 300, _env(ELASTOR_EXAMPLE_FAULT=f"before-final-save:{victim}"), d)
        step = _latest_step(ckpt)
        lost = step != iters
        row.add(f"kill rank {victim} before the final save (rc {o.rc}, storage step {step})", o.rc == 0 and not lost,
                lost, o.hang, o.traceback)
    return row


def _snapshot_dir_cases(work: str, i: int):
    """(name, directory given, paths that must not change, expected stderr piece, setup, teardown)."""
    from elastor_ds.elastic import snapshot_dir
    home = os.path.join(work, f"home{i}")
    write(os.path.join(home, "local", "thesis.tex"), "years of work")
    write(os.path.join(home, ".bashrc"), "export X=1\n")
    os.chmod(home, 0o700)
    live = os.path.join(work, f"live{i}")
    shared = os.path.join(work, f"shared{i}")
    os.makedirs(shared, exist_ok=True)
    os.chmod(shared, 0o777)
    squat, loot = os.path.join(work, f"squat{i}"), os.path.join(work, f"loot{i}")
    os.makedirs(loot, exist_ok=True)
    os.makedirs(squat, exist_ok=True)
    os.chmod(squat, 0o777)
    if not os.path.lexists(os.path.join(squat, "local")):
        os.symlink(loot, os.path.join(squat, "local"))
    held = {}

    def hold_live():   # a live job's directory: prepared by this (live) process, holding a snapshot
        held["sd"] = snapshot_dir.prepare(live, "campaign")
        write(os.path.join(live, "local", "latest"), "step_000000007\n")

    return [("a user's non-empty directory", home, [home], "is not empty", None),
            ("a live job's directory", live, [live], "belongs to a live elastor run", hold_live),
            ("a squatted 0777 directory with a symlink", squat, [squat, loot], "other users may enter it", None),
            ("under a folder others may write without the sticky bit", os.path.join(shared, "snap"), [shared],
             "may be written by other users", None)]


def run_snapshot_dir(work: str, rng: random.Random, reps: int) -> Row:
    row = Row()
    script = write(os.path.join(work, "ok.py"), "pass\n")
    for i in range(max(1, reps)):
        for name, given, keep, says, setup in _snapshot_dir_cases(work, i):
            if setup is not None:
                setup()
            before = fingerprint(*keep)
            o = cli(["run", "--standalone", "--no-standby", "--nproc-per-node", "1", "--max-restarts", "0",
                     "--log-dir", os.path.join(work, "logs"), "--snapshot-dir", given, script], 120)
            lost = fingerprint(*keep) != before
            row.add(f"{name} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == 2 and says in o.err and not lost, lost,
                    o.hang, o.traceback)
    return row


def run_overlap_roots(work: str, rng: random.Random, reps: int) -> Row:
    row = Row()
    for i in range(max(1, reps)):
        for name in ("storage inside snapshots", "snapshots inside storage"):
            d = os.path.join(work, f"{name.replace(' ', '_')}{i}")
            os.makedirs(d, exist_ok=True)
            if name == "storage inside snapshots":
                snap = os.path.join(d, "snap")
                save = os.path.join(snap, "ckpt")
            else:
                save = os.path.join(d, "ckpt")
                snap = os.path.join(save, "snap")
            os.makedirs(snap, mode=0o700, exist_ok=True)
            before = fingerprint(d)
            env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()), ELASTOR_SNAPSHOT_DIR=snap)
            o = _proc([sys.executable, TRAINER, *MODEL, "--train-iters", "2", "--save", save,
                       "--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", "0"],
                      180, env, d)
            lost = fingerprint(d) != before
            row.add(f"{name} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == 2 and "overlap" in o.err and not lost,
                    lost, o.hang, o.traceback)
    return row


def run_convert_into_ckpt(work: str, rng: random.Random, reps: int) -> Row:
    from elastor_ds.checkpoint import commit as commit_mod
    row = Row()
    src, other = os.path.join(work, "src"), os.path.join(work, "other")
    save_ckpt(src, 4)
    save_ckpt(other, 7)
    for i in range(max(1, reps)):
        cases = [("into the source's committed step", os.path.join(commit_mod.resolve(src), f"export{i}"), "overlap"),
                 ("into the source root", os.path.join(src, f"export{i}"), "overlap"),
                 ("into another checkpoint's step", os.path.join(commit_mod.resolve(other), f"x{i}"), "lies inside"),
                 ("into another checkpoint's root", os.path.join(other, f"export{i}"), "lies inside")]
        for name, dst, says in cases:
            before = fingerprint(src, other)
            o = cli(["convert", src, dst, "--to", "consolidated", "--no-progress"])
            lost = fingerprint(src, other) != before or os.path.lexists(dst)
            row.add(f"{name} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == 2 and says in o.err and not lost, lost,
                    o.hang, o.traceback)
    return row


def run_non_regular(work: str, rng: random.Random, reps: int) -> Row:
    from elastor_ds.checkpoint import commit as commit_mod
    row = Row()
    for i in range(max(1, reps)):
        root = os.path.join(work, f"fifo{i}")
        save_ckpt(root, 2)
        step = commit_mod.resolve(root)
        os.unlink(os.path.join(root, "latest"))
        os.mkfifo(os.path.join(root, "latest"))
        for cmd in ("verify", "inspect"):
            t0 = time.monotonic()
            o = cli([cmd, root], 30)
            row.add(f"{cmd} with a FIFO as latest (rc {o.rc}, {time.monotonic() - t0:.1f} s: {o.err.strip()[-120:]})",
                    o.rc == 1 and "is a FIFO" in o.err, False, o.hang, o.traceback)
        data = sorted(f for f in os.listdir(step) if f.endswith(".safetensors"))[0]
        os.unlink(os.path.join(step, data))
        os.mkfifo(os.path.join(step, data))
        o = cli(["verify", step], 30)
        row.add(f"verify with a FIFO as a data file (rc {o.rc}: {o.err.strip()[-120:]})",
                o.rc == 1 and "is a FIFO" in o.err, False, o.hang, o.traceback)
    return row


def run_run_flags(work: str, rng: random.Random, reps: int) -> Row:
    row = Row()
    script = write(os.path.join(work, "ok.py"), f"open({os.path.join(work, 'ran')!r}, 'w').close()\n")
    cases = [(["--rdzv-conf", "join_timeout=abc"], "--rdzv-conf join_timeout=abc"),
             (["--rdzv-backend", "bogus"], "--rdzv-backend 'bogus'"),
             (["--rdzv-conf", "read_timeout=-5"], "--rdzv-conf read_timeout=-5"),
             (["--log-dir", "/proc/x"], "--log-dir /proc/x"),
             (["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400"], "does not resolve")]
    for flags, says in cases * max(1, reps):
        o = cli(["run", "--no-standby", *flags, script], 60)
        ran = os.path.exists(os.path.join(work, "ran"))
        row.add(f"{' '.join(flags)} (rc {o.rc}: {o.err.strip()[-120:]})", o.rc == 2 and says in o.err and not ran,
                False, o.hang, o.traceback)
    return row


RUNNERS = {"final-save": run_final_save, "snapshot-dir": run_snapshot_dir, "overlap-roots": run_overlap_roots,
           "convert-into-ckpt": run_convert_into_ckpt, "non-regular": run_non_regular, "run-flags": run_run_flags}
__all__ = ["RUNNERS", "json"]
