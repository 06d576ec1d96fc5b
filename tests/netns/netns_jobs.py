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

from elastic_utils import assert_losses_reproduce, storage_latest, wait_until  # noqa: F401 - used below
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
ITERS = 12
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
                 rdzv_backend: str = "c10d", keep_alive_attempts: int = KEEP_ALIVE_ATTEMPTS, standby: bool = True):
        self.bed, self.name, self.iters = bed, name, iters
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
                f"keep_alive_max_attempt={keep_alive_attempts},read_timeout={READ_TIMEOUT_S}")
        if rdzv_backend == "c10d":
            conf += ",is_host=0"
        if extra_conf:
            conf += "," + extra_conf
        cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
               "--rdzv-backend", rdzv_backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "netns",
               "--local-addr", self.addr, "--rdzv-conf", conf, "--on-failure", "shrink", "--max-restarts", "3",
               "--monitor-interval", "0.1", "--events", self.events, "--snapshot-dir", self.snapdir,
               *([] if standby else ["--no-standby"]),
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
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    return os.path.join(holder.snapdir, "peer", origin_id(origin.snapdir), f"step_{step:09d}")


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


def still_training(job: NodeJob) -> None:
    """Right before a fault: the job has iterations left, so the fault hits a running job (a test
    whose job already finished would check nothing)."""
    recs = read_jsonl(job.metrics) if os.path.exists(job.metrics) else []
    last = recs[-1]["iteration"] if recs else 0
    assert last < job.iters - 1, (f"the job reached iteration {last} of {job.iters} before the fault was injected; "
                                  f"give the test more iterations")


def strike_point(survivor: NodeJob, lost: NodeJob, nodes, after: int = 2) -> int:
    """Wait for a step > ``after`` whose peer copy (lost -> survivor) is complete; returns as soon
    as the copy is, so a fault injected right after hits the longest stretch in which the survivor's
    newest snapshot has its peer copy (until its next snapshot commits). A test that does something
    slow between this and its fault calls it again with ``after`` = the step it returned."""
    def ready():
        s = restorable_step(survivor, lost)
        return s if s is not None and s > after else None
    return wait_until(ready, nodes, 240, f"a step > {after} with a complete peer copy")


def after_detection(survivor: NodeJob, lost: NodeJob, timeout: float = 60) -> tuple[dict, int, dict]:
    """The survivor's failure event, the step it can restore from memory and that step's files
    (:func:`snapshot_files`), read from disk once its workers are torn down and before the
    relaunched ones snapshot again."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        td = [e for e in survivor.event_list() if e.get("event") == "teardown"]
        if td:
            fail = next(e for e in survivor.event_list() if e.get("event") == "failure")
            step = restorable_step(survivor, lost)
            assert step is not None, "no complete peer copy on the survivor"
            return fail, step, snapshot_files(survivor, lost, step)
        time.sleep(0.02)
    dump_stacks(survivor)
    raise AssertionError(f"the survivor did not detect the loss in {timeout} s:\n{survivor.output()[-12000:]}")


def dump_stacks(job: "NodeJob") -> None:
    """Ask a controller that stopped reacting where its threads wait (SIGUSR2: every thread's stack
    to its output, which the failure message then shows)."""
    import signal
    if job.proc.poll() is None:
        try:
            os.kill(job.proc.pid, signal.SIGUSR2)
            time.sleep(1.0)
        except OSError:
            pass


def check_recovery(survivor: NodeJob, lost: NodeJob, step: int, t_fault: float, world_after: int,
                   expect_bytes=None) -> dict:
    """The survivor resumed from ``step`` in memory, re-ran exactly the iterations after it with
    the same losses, read nothing from storage; ``expect_bytes()``: the exact bytes per source (an
    oracle such as :func:`restore_bytes`)."""
    recs = read_jsonl(survivor.metrics)
    before = [r for r in recs if r["time"] <= t_fault]
    assert before and {r["world_size"] for r in before} == {3}
    assert recs[-1]["world_size"] == world_after and recs[-1]["iteration"] == survivor.iters, recs[-1]
    # the iterations the old world logged after the step resumed from run again, each with the loss
    # it had then (the step is read from the survivor's disk at detection, not from our events)
    last_before = max(r["iteration"] for r in recs if r["world_size"] == 3)
    reruns = assert_losses_reproduce(recs, survivor.iters, reruns=last_before - step)
    started = [e for e in survivor.event_list() if e.get("event") == "worker_started"]
    assert started[-1]["resumed_from"] == step, (started[-1], step)
    rest = [e for e in survivor.event_list() if e.get("event") == "restore"][-1]
    assert rest["tier"] == "memory" and rest["step"] == step, rest
    by = rest["bytes"]
    # bytes per source: nothing from storage, no remote node asked; the lost node's ranks came from
    # the peer copy the survivor holds, the survivor's own ranks from its local snapshot
    assert by.get("storage", 0) == 0 and not any(k.startswith("remote:") for k in by), by
    assert set(by) <= {"local-memory", "peer-memory", "storage"}, by
    assert by["peer-memory"] > 0 and by["local-memory"] > 0, by
    if expect_bytes is not None:   # a callable: the oracle reads the relaunched world's manifest
        expect = expect_bytes()
        assert {k: v for k, v in by.items() if v} == expect, (by, expect)
    return {"recs": recs, "rest": rest, "last_before": last_before, "reruns": reruns}


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read(300).replace(b"\0", b" ").decode(errors="replace").strip()
        return f"{pid} (state {fields[0]}, parent {fields[1]}: {cmd})"
    except (OSError, IndexError):
        return f"{pid} (gone)"


def no_process_left(bed, *names, grace: float = 2.0):
    """No process of the job is left on the nodes: the controller has exited, so only a process it
    killed that the kernel is still tearing down may be there, and not for ``grace`` seconds."""
    t_end = time.monotonic() + grace
    while True:
        left = {n: bed.pids(n) for n in names if bed.pids(n)}
        if not left or time.monotonic() > t_end:
            break
        time.sleep(0.05)
    assert not left, f"processes left on nodes: { {n: [_describe(p) for p in ps] for n, ps in left.items()} }"


def snapshot_files(survivor: NodeJob, lost: NodeJob, step: int) -> dict:
    """The oracle of a memory restore, read from the file system: the step's manifest (in the
    survivor's own snapshot), and, for every file it lists, the size of the survivor's local copy and
    of the peer copy it holds of the lost node's files (None: not there)."""
    local = os.path.join(survivor.snapdir, "local", f"step_{step:09d}")
    peer = peer_copy_dir(survivor, lost, step)
    with open(os.path.join(local, "manifest.json")) as f:
        manifest = json.load(f)

    def size(folder, name):
        p = os.path.join(folder, name)
        return os.path.getsize(p) if os.path.isfile(p) else None
    return {"manifest": manifest, "local": {n: size(local, n) for n in manifest["files"]},
            "peer": {n: size(peer, n) for n in manifest["files"]}}


def final_manifest(ckpt: str) -> dict:
    """The manifest of the newest storage step: written by the relaunched world, it shows how that
    world partitions the optimizer state (which rank wrote which region)."""
    with open(os.path.join(ckpt, f"step_{storage_latest(ckpt):09d}", "manifest.json")) as f:
        return json.load(f)


def _overlap(a, b) -> bool:
    """Rectangular regions ``[offsets, sizes]`` share an element."""
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def restore_bytes(files: dict, own_ranks, new: dict) -> dict:
    """Bytes a memory restore into the world of manifest ``new`` (data parallel, ZeRO-1) reads per
    source, from the manifests alone (the restored step's, and ``new``, written by the relaunched
    world: :func:`final_manifest`). Each new rank reads whole every old chunk it needs: every chunk of
    every parameter (replicated), and of the optimizer state the chunks that overlap a region it
    owns in ``new``; it checks them against their files' block-CRC tables, each read whole once per
    rank; new rank r reads old rank r's state file. The files the survivor's old ranks wrote come
    from its local snapshot, all the others from the peer copy it holds. Checked first: each file is
    where that says, at the size the manifest gives."""
    m = files["manifest"]
    own = {n for n, f in m["files"].items() if f["writer_rank"] in own_ranks}
    for n, f in m["files"].items():
        where = files["local"] if n in own else files["peer"]
        assert where[n] == f["size"], (n, f, files["local"].get(n), files["peer"].get(n))
    world = new["world_size"]
    owners = {name: [(c["region"], new["files"][c["file"]]["writer_rank"]) for c in t["chunks"]]
              for name, t in new["tensors"].items() if name.startswith("optimizer.")}
    by_file: dict[str, int] = {}
    tables: dict[int, set] = {r: set() for r in range(world)}
    for name, t in m["tensors"].items():
        for c in t["chunks"]:
            readers = ({r for region, r in owners[name] if _overlap(region, c["region"])}
                       if name.startswith("optimizer.") else set(range(world)))
            by_file[c["file"]] = by_file.get(c["file"], 0) + len(readers) * c["length"]
            for r in readers:
                tables[r].add(c["blocks"]["table"])
    for r in range(world):
        for table in tables[r]:
            by_file[table] = by_file.get(table, 0) + m["files"][table]["size"]
        state = m["rank_state_files"][str(r)]
        by_file[state] = m["files"][state]["size"]
    out = {"local-memory": 0, "peer-memory": 0}
    for n, b in by_file.items():
        out["local-memory" if n in own else "peer-memory"] += b
    return out
