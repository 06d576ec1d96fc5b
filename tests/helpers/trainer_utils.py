"""The example trainer launched for tests: its path, a tiny GPT's flags, a launcher that asserts
success, and the losses from a metrics file.

``torchrun(nproc, ...)`` starts the ranks from the test session's forkserver (the one
``dist_utils.run_world`` uses, which imported torch, DeepSpeed and Megatron-core once): each rank
gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
GROUP_RANK, ROLE_*, TORCHELASTIC_*) and runs the trainer as ``__main__``, so a rank starts in
milliseconds instead of importing for ~8 CPU seconds. When one rank fails the others are stopped,
as torchrun does. ``real_torchrun=True`` launches through ``python -m torch.distributed.run``
itself (tests/e2e/test_trainer.py keeps one such run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
sys.path.insert(0, os.path.join(ROOT, "examples", "megatron_gpt"))
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
          "--lr-warmup-iters", "2", "--log-interval", "100"]


def _rank_main(script: str, argv: list[str], env: dict[str, str], out: str, err: str, cwd: str) -> None:
    """In a rank forked from the forkserver: torchrun's worker, minus the interpreter start."""
    import runpy
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:   # noqa: BLE001 - a failed rank: its traceback, exit 1 (as under torchrun)
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fork_launch(nproc: int, script: str, argv: list[str], env: dict[str, str], cwd: str,
                timeout: float) -> subprocess.CompletedProcess:
    import torch.multiprocessing as mp

    from dist_utils import _start_method, free_port
    ctx = mp.get_context(_start_method())
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    logs = tempfile.mkdtemp(prefix="elastor-fork-launch-")
    procs = []
    for rank in range(nproc):
        renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                    ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id,
                    TORCHELASTIC_USE_AGENT_STORE="False")
        p = ctx.Process(target=_rank_main, args=(script, argv, renv, os.path.join(logs, f"{rank}.out"),
                                                 os.path.join(logs, f"{rank}.err"), cwd))
        p.start()
        procs.append(p)
    t_end, code, failed_at = time.time() + timeout, 0, None
    while any(p.is_alive() for p in procs):
        bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if bad and failed_at is None:
            code, failed_at = bad[0], time.time()
        if failed_at is not None and time.time() > failed_at + 5:   # torchrun stops the other ranks too
            for p in procs:
                if p.is_alive():
                    p.kill()
        if time.time() > t_end:
            for p in procs:
                p.kill()
            raise subprocess.TimeoutExpired(script, timeout)
        time.sleep(0.05)
    for p in procs:
        p.join()
    if code == 0:
        code = next((p.exitcode for p in procs if p.exitcode), 0)
    outs = []
    for kind in ("out", "err"):
        text = ""
        for rank in range(nproc):
            with open(os.path.join(logs, f"{rank}.{kind}"), errors="replace") as f:
                text += f.read()
        outs.append(text)
    for name in os.listdir(logs):
        os.unlink(os.path.join(logs, name))
    os.rmdir(logs)
    return subprocess.CompletedProcess(["fork_launch", script, *argv], code, outs[0], outs[1])


def torchrun(nproc: int, *args: str, timeout: int = 300, real_torchrun: bool = False,
             check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if real_torchrun:
        from dist_utils import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", TRAINER, *COMMON, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    else:
        p = fork_launch(nproc, TRAINER, [*COMMON, *args], env, ROOT, timeout)
    if check:
        assert p.returncode == 0, p.stderr[-4000:]
    return p


def losses(path: str) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(path))}
