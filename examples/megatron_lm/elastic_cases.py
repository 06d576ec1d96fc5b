"""The ``elastor run`` cases of the Megatron-LM end-to-end sequence (run by ``e2e.py``): patched
``pretrain_gpt.py --elastor`` under ``elastor run --nproc-per-node 4 --on-failure shrink`` on CPU
(gloo, through ``cpu_pretrain_gpt.py``), behaving like the example trainer.

Cases (``--only`` names):

- ``elastic_kill``: rank 3 is SIGKILLed as it starts iteration 8 (``ELASTOR_MLM_FAULT``, after its
  save of iteration 6 committed). Checks: the controller reports the SIGKILL, relaunches on 3
  processes; the relaunch runs the plan ``--elastor-plan auto`` picks for 3 (a ``worker_started``
  event with its layout, not the 4-process one), a ``restore`` event names the step it loaded,
  which is the newest committed one; every iteration after it (the re-run iteration 7 included)
  reproduces the uninterrupted run's loss (rtol 1e-4: the layout changed, so sums are reordered),
  and the iterations before the kill equal it exactly (same layout, same data).
- ``elastic_sigterm``: SIGTERM to the controller mid-run (no periodic saves). Checks: exit 143 (preempted), the
  workers stopped before the last iteration, the one committed checkpoint is the iteration they
  stopped at (``elastor inspect --json``: step and Megatron's iteration; ``elastor verify``: every
  chunk's CRC).
- ``elastic_memory``: ``elastic_kill`` with a memory snapshot every iteration
  (``--elastor-memory-snapshot-*``): the relaunch resumes at iteration 7 (only the killed
  iteration 8 is lost) from this node's memory, 0 bytes from storage.

The reference is one uninterrupted ``elastor run`` of the same flags (``elastic_uninterrupted``).
Megatron-LM's log does not reset its loss average after a launch's first iteration, so the second
logged iteration of every launch is the mean of the first two; :func:`decode_losses` undoes that.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
ITERS = 16
KILL_AT, KILL_RANK, SAVE_EVERY = 8, 3, 3
# 128 vocabulary rows at TP 1, 2 and 4 (the shared flags' divisor 64 pads to 256 at TP4): a re-plan
# may change TP, and a different padding would change the model
DIVISOR = "32"
MEMORY_FLAGS = ["--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-keep", "2",
                "--elastor-memory-snapshot-peer-copies", "1"]


@dataclass
class ElasticRun:
    """One ``elastor run`` job: exit code, its events and each launch's logged losses."""
    name: str
    rc: int
    events: list[dict]
    launches: list[dict[int, float]] = field(default_factory=list)   # per launch: iteration -> logged loss
    output: str = ""

    def kinds(self) -> list[str]:
        return [e.get("event", "?") for e in self.events]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind]


def decode_losses(logged: dict[int, float]) -> dict[int, float]:
    """One launch's per-iteration losses from Megatron-LM's log (``--log-interval 1``): its first
    iteration is logged as is, its second as the mean of the first two (the accumulators are not
    reset after a launch's first iteration), every later one as is."""
    if not logged:
        return {}
    its = sorted(logged)
    out = dict(logged)
    first = its[0]
    if first + 1 in logged:
        out[first + 1] = 2.0 * logged[first + 1] - logged[first]
    return out


def launch_logs(log_dir: str) -> list[str]:
    """The text of every launch's worker logs (stdout and stderr of every local rank), launch order
    (torch elastic's ``<run>/attempt_<n>/<local rank>/`` folders)."""
    attempts: dict[int, list[str]] = {}
    for d, _, files in os.walk(log_dir):
        m = re.search(r"attempt_(\d+)", d)
        if not m:
            continue
        for f in files:
            if f in ("stdout.log", "stderr.log"):
                attempts.setdefault(int(m.group(1)), []).append(os.path.join(d, f))
    out = []
    for n in sorted(attempts):
        out.append("".join(open(p, errors="replace").read() for p in sorted(attempts[n])))
    return out


class ElasticCases:
    """The cases, run through ``e2e`` (an :class:`e2e.E2E`: workdir, checks, model flags)."""

    def __init__(self, e2e: Any, model: list[str], cpu: list[str], runner: str, repo: str,
                 failed: type[Exception]) -> None:
        self.e, self.cpu, self.runner, self.repo, self.failed = e2e, cpu, runner, repo, failed
        self.model = list(model)
        self.model[self.model.index("--make-vocab-size-divisible-by") + 1] = DIVISOR
        self.ref: Optional[dict[int, float]] = None
        self.plan = ["--elastor-plan", "auto"]

    # ---------------------------------------------------------------- launching
    def launch(self, name: str, flags: list[str], env: Optional[dict] = None,
               during: Optional[Callable[[subprocess.Popen, str], None]] = None, timeout: float = 1800) -> ElasticRun:
        work = os.path.join(self.e.work, name)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        events, logs = os.path.join(work, "events.jsonl"), os.path.join(work, "logs")
        ck = os.path.join(work, "ckpt")
        cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--nproc-per-node", "4", "--on-failure", "shrink",
               "--monitor-interval", "0.1", "--events", events, "--log-dir", logs,
               self.runner, "--megatron-lm", self.e.mlm, *self.model, *self.cpu,
               "--train-iters", str(ITERS), "--save", ck, "--load", ck, "--elastor", *self.plan, *flags]
        self.e.commands.append(f"[{name}] elastor run --nproc-per-node 4 --on-failure shrink --events EVENTS "
                               f"cpu_pretrain_gpt.py <model flags> --make-vocab-size-divisible-by {DIVISOR} "
                               f"--train-iters {ITERS} --save CK --load CK --elastor "
                               + " ".join(self.plan + flags) + "".join(f" [{k}={v}]" for k, v in (env or {}).items()))
        penv = dict(os.environ, **(env or {}))
        penv["PYTHONPATH"] = os.pathsep.join([self.e.mlm, self.repo] + [
            p for p in penv.get("PYTHONPATH", "").split(os.pathsep) if p])
        penv.setdefault("OMP_NUM_THREADS", "1")
        penv["PYENV_VERSION"] = "%d.%d.%d" % sys.version_info[:3]
        out_path = os.path.join(work, "elastor_run.out")
        t0 = time.time()
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=penv, start_new_session=True)
            try:
                if during is not None:
                    during(proc, logs)
                rc = proc.wait(timeout=timeout)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        print(f"  launched {name}: elastor run rc {rc} in {time.time() - t0:.0f}s ({work})", flush=True)
        from elastor_ds.elastic.events import read_jsonl

        run = ElasticRun(name, rc, read_jsonl(events) if os.path.exists(events) else [],
                         output=open(out_path, errors="replace").read())
        for text in launch_logs(logs):
            run.launches.append({int(i): float(v) for i, v in LOSS_RE.findall(text)})
        for k, ln in enumerate(run.launches):   # as logged (summary.json), one entry per launch
            self.e.losses[f"{name}#launch{k}"] = {i: repr(v) for i, v in ln.items()}
        return run

    def reference(self) -> dict[int, float]:
        """Per-iteration losses of the uninterrupted ``elastor run`` (run once)."""
        if self.ref is None:
            run = self.launch("elastic_uninterrupted", ["--save-interval", str(SAVE_EVERY)])
            ok = run.rc == 0 and len(run.launches) == 1 and sorted(run.launches[0]) == list(range(1, ITERS + 1))
            self.e.check("elastic_uninterrupted: one launch, iterations 1-%d, exit 0" % ITERS, ok,
                         f"rc {run.rc}, launches {[sorted(x)[:1] + sorted(x)[-1:] for x in run.launches]}")
            if not ok:
                raise self.failed(f"elastic_uninterrupted: {run.output[-3000:]}")
            self.ref = decode_losses(run.launches[0])
        return self.ref

    # ---------------------------------------------------------------- cases
    def case_kill(self, name: str = "elastic_kill", extra: Optional[list[str]] = None,
                  memory: bool = False) -> None:
        ref = self.reference()
        run = self.launch(name, ["--save-interval", str(SAVE_EVERY), *(extra or [])],
                          env={"ELASTOR_MLM_FAULT": f"iteration-{KILL_AT}:{KILL_RANK}"})
        check = self.e.check
        check(f"{name}: exit 0", run.rc == 0, f"rc {run.rc}" + ("" if run.rc == 0 else f"\n{run.output[-3000:]}"))
        fail = run.of("failure")
        sig = [(r.get("global_rank"), r.get("signal")) for f in fail for r in f.get("ranks", [])
               if r.get("cause") == "signal"]
        check(f"{name}: failure event names the SIGKILL of rank {KILL_RANK}", (KILL_RANK, "SIGKILL") in sig,
              f"failure ranks with a signal: {sig}")
        worlds = [e.get("world_size") for e in run.of("launch")]
        check(f"{name}: relaunched on 3 processes", worlds == [4, 3], f"launch world sizes {worlds}")
        started = sorted(run.of("worker_started"), key=lambda e: e["time"])
        shown = [(e.get("world_size"), e.get("layout"), e.get("plan_source"), (e.get("plan") or {}).get("num_gpus"))
                 for e in started]
        source = self.plan[1] if self.plan else "flags"
        planned = all(e.get("plan_source") == source and (not self.plan or (e.get("plan") or {}).get("num_gpus")
                                                           == e.get("world_size")) for e in started)
        check(f"{name}: each launch reports the plan it runs (--elastor-plan {source}), a new one for 3 processes",
              len(started) == 2 and started[1].get("world_size") == 3 and planned
              and started[0].get("layout") != started[1].get("layout"), f"worker_started: {shown}")
        plans = run.of("plan")
        if plans:   # a plan event of its own, should the hooks write one
            check(f"{name}: plan events for both worlds", [p.get("world_size") for p in plans] == [4, 3],
                  json.dumps(plans)[:600])
        resumed = started[1].get("resumed_from") if len(started) == 2 else None
        newest = KILL_AT - 1 if memory else (KILL_AT - 1) // SAVE_EVERY * SAVE_EVERY
        check(f"{name}: the relaunch resumed from the newest {'snapshot' if memory else 'checkpoint'} "
              f"(iteration {newest})", resumed == newest, f"resumed_from {resumed}")
        restores = run.of("restore")
        tier = "memory" if memory else "storage"
        ok = len(restores) == 1 and restores[0].get("step") == newest and restores[0].get("tier") == tier
        if ok and memory:
            ok = restores[0].get("bytes", {}).get("storage", 0) == 0 and restores[0]["bytes"].get("local-memory", 0) > 0
        check(f"{name}: restore event: step {newest} from {tier}" + (", 0 bytes from storage" if memory else ""),
              ok, json.dumps(restores)[:600])
        if len(run.launches) != 2:
            check(f"{name}: two launches' logs", False, f"{len(run.launches)} launches logged")
            return
        first, second = (decode_losses(x) for x in run.launches)
        before = sorted(first)
        same = [i for i in before if first[i] != ref.get(i)]
        check(f"{name}: iterations {before[0]}-{before[-1]} before the kill equal the uninterrupted run's",
              before == list(range(1, KILL_AT)) and not same,
              f"logged {before[:1]}..{before[-1:]}, differ at {[(i, first[i], ref.get(i)) for i in same[:3]]}")
        again = sorted(second)
        rerun = [i for i in again if i in first]
        bad = [(i, second[i], ref.get(i)) for i in again
               if i not in ref or abs(second[i] - ref[i]) > 1e-4 * abs(ref[i])]
        # storage every 3 iterations: iteration 7 ran before the kill and runs again; a snapshot every
        # iteration: the relaunch resumes at 7, the iteration killed (8) is the only one lost
        lost_ok = resumed is not None and (resumed == KILL_AT - 1 if memory else bool(rerun))
        check(f"{name}: iterations {again[:1]}..{again[-1:]} on 3 processes (re-run {rerun}) reproduce the "
              f"uninterrupted run's losses (rtol 1e-4)",
              lost_ok and again == list(range(resumed + 1, ITERS + 1)) and not bad,
              f"differ: {bad[:4]}" if bad else ", ".join(f"{i}: {second[i]:.6f} vs {ref[i]:.6f}" for i in again[:3]))

    def case_memory(self) -> None:
        self.case_kill("elastic_memory", MEMORY_FLAGS, memory=True)


    def case_sigterm(self) -> None:
        name = "elastic_sigterm"
        after = 4
        sent: dict[str, int] = {}

        def sigterm_after(proc: subprocess.Popen, logs: str) -> None:
            t_end = time.time() + 900
            while time.time() < t_end and proc.poll() is None:
                texts = launch_logs(logs)
                its = [int(i) for i, _ in LOSS_RE.findall(texts[-1])] if texts else []
                if its and max(its) >= after:
                    sent["at"] = max(its)
                    os.kill(proc.pid, signal.SIGTERM)
                    return
                time.sleep(0.2)

        run = self.launch(name, ["--save-interval", "1000"], during=sigterm_after)
        check = self.e.check
        check(f"{name}: exit 143 (preempted) after SIGTERM to the controller (sent after iteration {sent.get('at')})",
              run.rc == 143 and "at" in sent, f"rc {run.rc}" + ("" if run.rc == 143 else f"\n{run.output[-3000:]}"))
        logged = sorted(i for ln in run.launches for i in ln)
        last = logged[-1] if logged else None
        check(f"{name}: one launch, stopped before the last iteration", len(run.launches) == 1 and last is not None
              and sent.get("at", ITERS) <= last < ITERS, f"launches {len(run.launches)}, last logged iteration {last}")
        ck = os.path.join(self.e.work, name, "ckpt")
        from elastor_ds.checkpoint import commit as commit_mod

        steps = sorted(dict(commit_mod.list_committed(ck))) if os.path.isdir(ck) else []
        ins = self._cli(["inspect", ck, "--json"])
        doc = json.loads(ins.stdout) if ins.returncode == 0 else {}
        check(f"{name}: the iteration it stopped at is the one committed checkpoint (elastor inspect)",
              steps == [last] and doc.get("step") == last and doc.get("extra", {}).get("iteration") == last,
              f"committed {steps}, inspect step {doc.get('step')}, iteration {doc.get('extra', {}).get('iteration')}, "
              f"last logged {last}" + ("" if ins.returncode == 0 else f"; inspect rc {ins.returncode}: {ins.stderr[-500:]}"))
        ver = self._cli(["verify", ck])
        check(f"{name}: elastor verify (every chunk's CRC)", ver.returncode == 0,
              (ver.stdout + ver.stderr).strip().splitlines()[-1][:300] if (ver.stdout + ver.stderr).strip() else "")
        kinds = run.kinds()
        check(f"{name}: preempt events", "preempt_requested" in kinds and "preempted" in kinds,
              f"events {[k for k in kinds if k not in ('rendezvous',)]}")

    def _cli(self, args: list[str]) -> subprocess.CompletedProcess:
        self.e.commands.append("elastor " + " ".join(args))
        return subprocess.run([sys.executable, "-m", "elastor_ds.cli", *args], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=self.repo + os.pathsep + os.environ.get("PYTHONPATH", "")))


def hooks_have_memory_flags() -> bool:
    """Whether the Megatron hooks register ``--elastor-memory-snapshot-interval`` (the memory tier)."""
    import argparse

    from elastor_ds.integrations.megatron import training_hooks

    parser = training_hooks.add_arguments(argparse.ArgumentParser())
    _, unknown = parser.parse_known_args(MEMORY_FLAGS)
    return not unknown
