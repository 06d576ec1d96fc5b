"""Helpers for `elastor run` tests: launch the controller on the example trainer (tiny GPT), watch
its metrics, inject real faults into its worker processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from elastor_ds.elastic.events import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
# tiny GPT: TP1 x PP3 on 3 processes, TP1 x PP2 x DP2 on 4, PP2 on 2 under --elastor-plan auto
MODEL = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--elastor-plan", "auto"]


class Job:
    def __init__(self, tmp, nproc: int, iters: int, save_interval: int, ctl_args=(), name="job", metrics=None,
                 ckpt=None, trainer_args=(), env=None):
        self.dir = str(tmp)
        self.metrics = metrics or os.path.join(self.dir, "metrics.jsonl")
        self.ckpt = ckpt or os.path.join(self.dir, "ckpt")
        self.events = os.path.join(self.dir, f"{name}_events.jsonl")
        self.out = open(os.path.join(self.dir, f"{name}.out"), "w")
        cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", str(nproc), "--events", self.events,
               "--monitor-interval", "0.1", *ctl_args, TRAINER, *MODEL, "--train-iters", str(iters),
               "--save", self.ckpt, "--load", self.ckpt, "--save-interval", str(save_interval),
               "--metrics-file", self.metrics, *trainer_args]
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="",
                   **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=self.dir, env=env,
                                     start_new_session=True)

    def output(self) -> str:
        self.out.flush()
        with open(self.out.name, errors="replace") as f:
            return f.read()

    def records(self) -> list[dict]:
        return read_jsonl(self.metrics)

    def event_list(self) -> list[dict]:
        return read_jsonl(self.events)

    def wait_for(self, cond, timeout: float = 240, what: str = "condition") -> list[dict]:
        t_end = time.time() + timeout
        while time.time() < t_end:
            recs = self.records()
            if cond(recs):
                return recs
            if self.proc.poll() is not None:
                raise AssertionError(f"elastor run exited ({self.proc.returncode}) before {what}:\n{self.output()[-5000:]}")
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-5000:]}")

    def workers(self) -> dict[int, int]:
        """global rank -> pid of this controller's live workers, from its latest ``launch`` event
        (a standby worker's /proc environment is the one it was spawned with, not its rank's)."""
        import psutil
        launches = [e for e in self.event_list() if e["event"] == "launch"]
        if not launches:
            return {}
        out = {}
        for rank, pid in zip(launches[-1]["global_ranks"], launches[-1]["pids"]):
            try:
                p = psutil.Process(pid)
                if p.ppid() == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out[int(rank)] = pid
            except psutil.NoSuchProcess:
                continue
        return out

    def signal_worker(self, rank: int, sig: int) -> int:
        pid = self.workers()[rank]
        os.kill(pid, sig)
        with open(self.events, "a") as f:   # what the controller's report measures detection from
            f.write(json.dumps({"event": "injected", "time": time.time(), "node": "test", "rank": rank,
                                "signal": signal.Signals(sig).name}) + "\n")
        return pid

    def standby_ready(self) -> int:
        """How many standby workers of this controller have finished their imports."""
        path = os.path.join(self.dir, os.path.basename(self.events).replace(".jsonl", "_logs"), "standby",
                            "standby.log")
        if not os.path.exists(path):
            return 0
        with open(path, errors="replace") as f:
            return f.read().count("] ready:")

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"elastor run did not finish in {timeout} s:\n{self.output()[-5000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            import psutil
            try:   # workers and standbys are the controller's children, each in its own session
                kids = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            for c in kids:
                try:
                    c.kill()
                except psutil.NoSuchProcess:
                    pass
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def last_iteration(recs: list[dict]) -> int:
    return recs[-1]["iteration"] if recs else 0


def resumed_steps(events: list[dict]) -> list[int]:
    """The step each relaunch resumed from, as the trainer reported it (``worker_started`` events
    after the first launch)."""
    started = sorted((e for e in events if e.get("event") == "worker_started"), key=lambda e: e["time"])
    return [int(e["resumed_from"] or 0) for e in started[1:]]


def expected_reruns(recs: list[dict], resumed: list[int]) -> int:
    """Iterations a run must have re-run: for each relaunch (its first record carries the plan), the
    iterations logged before it after the step it resumed from (``resumed``: from the events, what
    the trainer reported, not from the records), up to where that launch itself got (a launch
    killed in its turn re-runs only the iterations it reached). Each launch's iterations must be
    contiguous from its resume step."""
    launches: list[list[int]] = []       # each launch's iterations, in record order
    for i, r in enumerate(recs):
        if i == 0 or "plan" in r:            # the first record of a launch
            launches.append([])
        launches[-1].append(r["iteration"])
    assert len(launches) - 1 == len(resumed), f"{len(launches) - 1} relaunches in the records, {len(resumed)} in the events"
    total, high = 0, 0
    for k, its in enumerate(launches):
        if k > 0:
            r0 = resumed[k - 1]
            assert its[0] == r0 + 1, f"relaunch {k - 1} logged iteration {its[0]} first but reported step {r0}"
            total += max(0, min(high, its[-1]) - r0)
        assert its == list(range(its[0], its[0] + len(its))), f"launch {k} logged iterations {its}, not contiguous"
        high = max(high, its[-1])
    return total


def assert_losses_reproduce(recs: list[dict], iters: int, *, reruns: int, rel: float = 2e-5) -> int:
    """Every iteration 1..iters was logged, exactly ``reruns`` of them twice (a test states the count
    it claims: 0 is never assumed), and each re-run iteration's loss equals the loss logged for it
    before the failure. Returns ``reruns``."""
    first: dict[int, float] = {}
    seen = 0
    for r in recs:
        it, loss = r["iteration"], r["lm_loss"]
        if it in first:
            seen += 1
            assert abs(loss - first[it]) <= rel * abs(first[it]), (it, loss, first[it])
        else:
            first[it] = loss
    assert sorted(first) == list(range(1, iters + 1)), sorted(first)
    assert seen == reruns, f"{seen} iterations were re-run, the test expected {reruns}"
    return seen


def check_reruns(recs: list[dict], events: list[dict], iters: int, at_least: int, rel: float = 2e-5) -> int:
    """The exact re-run count the relaunches' reported resume steps imply (at least ``at_least``,
    what the test's fault guarantees), and the losses of those re-runs (see assert_losses_reproduce)."""
    n = expected_reruns(recs, resumed_steps(events))
    assert n >= at_least, f"only {n} iterations were re-run; the fault should have cost at least {at_least}"
    return assert_losses_reproduce(recs, iters, reruns=n, rel=rel)


def storage_latest(ckpt: str) -> int | None:
    """The step storage's ``latest`` names, or None."""
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read().strip().rsplit("_", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def wait_until(cond, nodes, timeout: float, what: str):
    """Poll ``cond`` until it is truthy (returned); fail at once when a node's controller exited."""
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


def no_cas_store():
    """A store with only the methods torch's ``EtcdStore`` implements (no ``compare_set``), over a
    ``HashStore``: what the failure ledger sees on the etcd-v2 backend."""
    import torch.distributed as dist

    class NoCasStore(dist.Store):
        def __init__(self):
            super().__init__()
            self.kv = dist.HashStore()

        def set(self, key, value):
            self.kv.set(key, value)

        def get(self, key):
            return self.kv.get(key)

        def add(self, key, num):
            return self.kv.add(key, num)

        def wait(self, keys, override_timeout=None):
            self.kv.wait(keys, override_timeout) if override_timeout else self.kv.wait(keys)

        def check(self, keys):
            return self.kv.check(keys)

        def delete_key(self, key):
            return self.kv.delete_key(key)

    return NoCasStore()
