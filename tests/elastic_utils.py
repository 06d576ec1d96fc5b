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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
# tiny GPT: TP1 x PP3 on 3 processes, TP1 x PP2 x DP2 on 4, PP2 on 2 under --elastor-plan auto
MODEL = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--elastor-plan", "auto"]


class Job:
    def __init__(self, tmp, nproc: int, iters: int, save_interval: int, ctl_args=(), name="job", metrics=None,
                 ckpt=None, trainer_args=()):
        self.dir = str(tmp)
        self.metrics = metrics or os.path.join(self.dir, "metrics.jsonl")
        self.ckpt = ckpt or os.path.join(self.dir, "ckpt")
        self.events = os.path.join(self.dir, f"{name}_events.jsonl")
        self.out = open(os.path.join(self.dir, f"{name}.out"), "w")
        cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", str(nproc), "--events", self.events,
               "--monitor-interval", "0.1", *ctl_args, TRAINER, *MODEL, "--train-iters", str(iters),
               "--save", self.ckpt, "--load", self.ckpt, "--save-interval", str(save_interval),
               "--metrics-file", self.metrics, *trainer_args]
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
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


def assert_losses_reproduce(recs: list[dict], iters: int, rel: float = 2e-5) -> int:
    """Every iteration 1..iters was logged; each re-run iteration's loss equals the loss logged
    for it before the failure. Returns how many iterations were re-run."""
    first: dict[int, float] = {}
    reruns = 0
    for r in recs:
        it, loss = r["iteration"], r["lm_loss"]
        if it in first:
            reruns += 1
            assert abs(loss - first[it]) <= rel * abs(first[it]), (it, loss, first[it])
        else:
            first[it] = loss
    assert sorted(first) == list(range(1, iters + 1)), sorted(first)
    return reruns
