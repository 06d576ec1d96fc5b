"""A standby worker of ``elastor run``: a fresh interpreter that does the trainer's slow imports
(torch, DeepSpeed, Megatron, ...) *before* it is needed, then waits for its rank assignment and
becomes an ordinary worker (:func:`worker_main.run_script`).

``python -u -m elastor_ds.elastic.standby_main`` with, in its environment, ``ELASTOR_STANDBY_READY_FD``
(a pipe to the agent) and ``ELASTOR_STANDBY_PRELOAD`` (comma-separated modules). Steps:

1. Parent-death signal first (it dies with the agent), then, unless the assignment is already
   there (a cold start: nothing to gain), import the modules: the node's learned list
   (``<ELASTOR_STANDBY_DIR>/modules.json``, written by a previous worker) and the preload list,
   each in its own ``try`` (a module that fails here is imported again, and fails visibly, in the
   trainer).
2. Tell the agent "ready" through the pipe: ``R``, or ``C`` when the CUDA driver got loaded by an
   import (``libcuda`` mapped): then ``CUDA_VISIBLE_DEVICES`` is fixed already and the agent uses
   this process only for an assignment with the same value.
3. Block on stdin until the agent has written the assignment itself (JSON: argv, the full
   environment, the per-rank stdout/stderr log files, cwd) and closed the pipe: the pipe is the
   only channel (never a file path another user could swap). EOF without a byte means retire
   (exit 0); a torn or malformed assignment exits 1 (the agent sees a failed worker).
4. Become the worker: stdout/stderr onto the rank's log files, stdin from /dev/null, the
   environment replaced by the assignment's, the launch marks set, then the script runs as
   ``__main__`` exactly as under :mod:`worker_main` (signals, exit codes, the agreed-stop fast exit).

A standby never forks and never serves a second assignment: every round gets fresh processes
(no process group, CUDA context or trainer state carried over), one per rank. With the node's
template (:mod:`standby_template`, the default) steps 1's imports are done once, in the template,
and each standby is forked from it before it has a rank; it then runs steps 2-4 here (:func:`serve`).
"""
from __future__ import annotations

import os
import sys
import time

T_SPAWN = time.time()

from elastor_ds.elastic.protocol import ENV_STANDBY_DIR  # noqa: E402 - after T_SPAWN
from elastor_ds.elastic.protocol import ENV_STANDBY_PRELOAD as ENV_PRELOAD  # noqa: E402
from elastor_ds.elastic.protocol import ENV_STANDBY_READY_FD as ENV_READY_FD  # noqa: E402

# what a trainer on DeepSpeed + Megatron-core imports anyway; the learned list adds the rest
DEFAULT_PRELOAD = ("torch", "torch.distributed", "deepspeed", "megatron.core", "megatron.core.parallel_state",
                   "megatron.core.tensor_parallel", "elastor_ds.deepspeed", "elastor_ds.checkpoint")


_MAX_ASSIGNMENT = 16 << 20   # argv + environment; far above any real one
_SPAWN = [T_SPAWN]           # a standby forked by the template starts at its fork, not the template's start


def spawn_time() -> float:
    return _SPAWN[0]


def set_spawn_time(t: float) -> None:
    _SPAWN[0] = t


def _log(msg: str) -> None:
    print(f"[elastor standby {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def libcuda_mapped() -> bool:
    """Whether the CUDA driver library is loaded in this process (then it may have read
    CUDA_VISIBLE_DEVICES already)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def _assignment_waiting(fd: int) -> bool:
    import select
    return bool(select.select([fd], [], [], 0)[0])


def preload_names() -> list[str]:
    names = [m.strip() for m in os.environ.get(ENV_PRELOAD, "").split(",") if m.strip()]
    learned = os.path.join(os.environ.get(ENV_STANDBY_DIR, ""), "modules.json")
    if os.environ.get(ENV_STANDBY_DIR) and os.path.isfile(learned):
        import json
        try:   # the pool's folder is private (0700, ours); a symlink is still never followed
            with os.fdopen(os.open(learned, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))) as f:
                doc = json.loads(f.read(1 << 20))
            if isinstance(doc, list):
                names = [m for m in doc if isinstance(m, str)] + names
        except (OSError, ValueError) as e:
            _log(f"ignoring {learned}: {e}")
    return list(dict.fromkeys(names))


def preload(names: list[str]) -> tuple[int, int]:
    import importlib
    ok = failed = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            ok += 1
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - any import may fail here; the trainer's own import reports it
            failed += 1
            if failed <= 5:
                _log(f"preload of {name} failed ({type(e).__name__}: {e}); the trainer imports it itself")
    return ok, failed


def _redirect(path: str | None, fd: int) -> None:
    if not path:
        return
    # torch's agent created it in its private log folder; never through a symlink
    target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.dup2(target, fd)
    os.close(target)


def become_worker(job: dict, t_ready: float | None) -> None:
    from elastor_ds.elastic.protocol import ENV_T_STANDBY_READY, ENV_T_STANDBY_SPAWN, ENV_T_START
    # the worker "process start": when it both existed and was asked to be a worker (a standby still
    # importing then counts the rest of its imports as start-up, like a freshly spawned worker)
    t_spawn = spawn_time()
    t_start = max(t_spawn, float(job.get("t_assigned") or time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(job.get("stdout"), 1)
    _redirect(job.get("stderr"), 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    env = {str(k): str(v) for k, v in job["env"].items()}
    env[ENV_T_START] = repr(t_start)
    env[ENV_T_STANDBY_SPAWN] = repr(t_spawn)
    if t_ready is not None:
        env[ENV_T_STANDBY_READY] = repr(t_ready)
    os.environ.clear()
    os.environ.update(env)
    if job.get("cwd"):
        os.chdir(job["cwd"])
    argv = list(job["argv"])
    from elastor_ds.elastic import worker_main
    worker_main.run_script(argv)


def serve(fd: int, forked: bool = False) -> None:
    """Steps 2-4 for a standby whose process exists (spawned, or ``forked`` by the template): import
    what is still missing, report on ``fd``, read the assignment from stdin and become the worker. A
    forked standby has the template's imports, so it is ready even when its assignment is waiting."""
    import json

    t_ready = None
    if forked or not _assignment_waiting(0):
        names = preload_names()
        t0 = time.time()
        ok, failed = preload(names)
        t_ready = time.time()
        cuda = libcuda_mapped()
        _log(f"ready: {ok} module(s) imported in {t_ready - t0:.2f} s ({failed} failed); "
             f"CUDA driver {'loaded' if cuda else 'not loaded'}")
        if fd >= 0:
            try:
                os.write(fd, b"C" if cuda else b"R")
            except OSError:
                pass
    if fd >= 0:
        os.close(fd)
    with os.fdopen(0, "rb", closefd=False) as stdin:
        raw = stdin.read(_MAX_ASSIGNMENT + 1)
    if not raw.strip():   # the agent retired this standby (or died)
        os._exit(0)
    try:
        job = json.loads(raw) if len(raw) <= _MAX_ASSIGNMENT else None
        if not (isinstance(job, dict) and isinstance(job.get("argv"), list) and isinstance(job.get("env"), dict)):
            raise ValueError("not an assignment")
    except ValueError as e:
        _log(f"malformed assignment on stdin ({len(raw)} bytes: {e}); exiting")
        os._exit(1)
    become_worker(job, t_ready)


def main() -> None:
    from elastor_ds.elastic import worker
    worker.set_parent_death_signal()
    serve(int(os.environ.pop(ENV_READY_FD, "-1")))


if __name__ == "__main__":
    main()
