"""One `elastor run` per network-namespace node on the example trainer, with the c10d store in a
namespace of its own (the deployment the README asks for: the store outside the nodes that can
fail). Tiny GPT, data parallel + ZeRO-1 (a restore under a smaller world needs every rank's files),
memory snapshots every iteration with one peer copy, a storage checkpoint every iteration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from elastor_ds.elastic.events import read_jsonl
from elastor_ds.testing.netns import Testbed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "6", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--zero-stage", "1", "--profile-iters", "0"]
# each transformer layer sleeps per micro-batch (the example model's bench hook): ~0.7 s an iteration
SLOW = json.dumps({"1": 0.12})
STORE_PORT = 29400
KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS, READ_TIMEOUT_S = 1, 4, 10
LIVENESS_TIMEOUT_S = KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS      # a silent node is lost after this
FENCE_AFTER_S = LIVENESS_TIMEOUT_S - KEEP_ALIVE_S            # a node cut from the store kills its workers


def env(secret: str | None = None) -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="",
               ELASTOR_SIM_LAYER_S=SLOW)
    if secret:
        out["ELASTOR_JOB_SECRET_FILE"] = secret   # the job key file every node is given (peer copies need it)
    return out


def job_secret(tmp) -> str:
    """A 0600 file of 32 random bytes: the job secret every node shares."""
    path = os.path.join(str(tmp), "job.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    return path


def _RUN_HELP(_cache: list = []) -> str:   # noqa: B006,N802 - computed once per session
    if not _cache:
        _cache.append(_run_flags())
    return _cache[0]


def _run_flags() -> str:
    out = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--help"], capture_output=True, text=True,
                         env=env(), cwd=ROOT)
    return out.stdout


class Store:
    def __init__(self, bed: Testbed, name: str, tmp):
        self.addr = bed.node(name).addr
        self.out = open(os.path.join(str(tmp), f"{name}.out"), "w")
        self.proc = bed.popen(name, [sys.executable, "-m", "elastor_ds.elastic.store_main", "--port", str(STORE_PORT)],
                              stdout=self.out, stderr=subprocess.STDOUT, env=env())
        t_end = time.time() + 60
        while "ready" not in open(self.out.name).read():
            assert self.proc.poll() is None and time.time() < t_end, open(self.out.name).read()
            time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{STORE_PORT}"


class NodeJob:
    """`elastor run` in namespace ``name`` with ``nproc`` workers."""

    def __init__(self, bed: Testbed, name: str, tmp, endpoint: str, nproc: int, iters: int, extra_conf: str = "",
                 rdzv_backend: str = "c10d"):
        self.bed, self.name = bed, name
        self.addr = bed.node(name).addr
        self.snapdir = f"/dev/shm/{bed.prefix}{name}"
        self.events = str(tmp / f"{name}_events.jsonl")
        self.metrics = str(tmp / "metrics.jsonl")
        self.ckpt = str(tmp / "ckpt")
        self.out = open(str(tmp / f"{name}.out"), "w")
        secret = os.path.join(str(tmp), "job.secret")
        if not os.path.exists(secret):
            job_secret(tmp)
        conf = (f"join_timeout=120,last_call_timeout=6,keep_alive_interval={KEEP_ALIVE_S},"
                f"keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS},read_timeout={READ_TIMEOUT_S}")
        if rdzv_backend == "c10d":
            conf += ",is_host=0"
        if extra_conf:
            conf += "," + extra_conf
        cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
               "--rdzv-backend", rdzv_backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "netns",
               "--local-addr", self.addr, "--rdzv-conf", conf, "--on-failure", "shrink", "--max-restarts", "3",
               "--monitor-interval", "0.1", "--events", self.events, "--snapshot-dir", self.snapdir, "--no-standby",
               *(["--job-secret-file", secret] if "--job-secret-file" in _RUN_HELP() else []), TRAINER, *MODEL, "--train-iters", str(iters), "--save", self.ckpt, "--load", self.ckpt,
               "--save-interval", "1", "--metrics-file", self.metrics, "--elastor-memory-snapshot-interval", "1",
               "--elastor-memory-snapshot-peer-copies", "1", "--elastor-memory-snapshot-keep", "1"]
        self.proc = bed.popen(name, cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=str(tmp), env=env(secret))

    def output(self) -> str:
        self.out.flush()
        with open(self.out.name, errors="replace") as f:
            return f.read()

    def event_list(self) -> list[dict]:
        return read_jsonl(self.events) if os.path.exists(self.events) else []

    def first(self, kind: str) -> dict | None:
        return next((e for e in self.event_list() if e.get("event") == kind), None)

    def note_injected(self, what: str, t: float) -> None:
        """What the controller's report measures detection and recovery from."""
        with open(self.events, "a") as f:
            f.write(json.dumps({"event": "injected", "time": t, "node": "test", "fault": what}) + "\n")

    def latest(self, sub: str = "local") -> int | None:
        try:
            with open(os.path.join(self.snapdir, sub, "latest")) as f:
                return int(f.read().strip().rsplit("_", 1)[1])
        except (OSError, ValueError, IndexError):
            return None

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.name} did not finish in {timeout} s:\n{self.output()[-6000:]}")


def peer_copy_dir(holder: NodeJob, origin: NodeJob, step: int) -> str:
    from elastor_ds.comm.peer_copy import origin_id
    return os.path.join(holder.snapdir, "peer", origin_id(origin.snapdir), f"step_{step:09d}")


def storage_latest(ckpt: str) -> int | None:
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read().strip().rsplit("_", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def wait_until(cond, nodes, timeout: float, what: str):
    t_end = time.time() + timeout
    while time.time() < t_end:
        got = cond()
        if got:
            return got
        for n in nodes:
            if n.proc.poll() is not None:
                raise AssertionError(f"node {n.name} exited ({n.proc.returncode}) before {what}:\n"
                                     f"{n.output()[-6000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(n.output()[-4000:] for n in nodes))


def restorable_step(survivor: NodeJob, lost: NodeJob) -> int | None:
    """The newest step the survivor can restore from memory alone: its own snapshot of it is
    committed and its peer copy of the lost node's files of that step is complete (from disk)."""
    s = survivor.latest()
    if s is None:
        return None
    ok = os.path.exists(os.path.join(peer_copy_dir(survivor, lost, s), "COMPLETE"))
    return s if ok else None


def data_bytes(folder: str) -> int:
    """Bytes of the tensor data files (``*.safetensors``) in a snapshot folder."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
