"""Where a heterogeneous iteration's time goes, per rank (bench tool; wraps the example trainer).

Run in place of the trainer under ``torch.distributed.run`` with the trainer's arguments; set
``ELASTOR_TRACE_OUT=<folder>``. Each rank wraps, for the iterations from the third on:

* DeepSpeed's pipeline instructions (forward, backward, send/recv of activations and gradients,
  reduce grads, optimizer step, ...): inclusive wall time per instruction kind;
* ``torch.distributed`` collectives and p2p by the instruction they run in: TP all-reduces inside
  forward/backward, p2p inside send/recv, the split all-reduce / ZeRO-1 reduce-scatter + all-gather
  inside ReduceGrads / OptimizerStep: wall time and call count;
* ``time.sleep`` of the simulated compute (main thread);

and writes ``rank<r>.json`` with the totals over the traced iterations and their count. What is left
of the iteration outside every instruction is the schedule's own Python (``other_s``).

    ELASTOR_TRACE_OUT=/tmp/tr ELASTOR_SIM_LAYER_S='{"1": 0.048, "2": 0.027}' \\
      python -m torch.distributed.run --nproc-per-node 7 bench/hetero_trace.py <trainer flags>
"""
from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys
import threading
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
SKIP_ITERS = 2
RANK_FILE = re.compile(r"rank(\d+)\.json")

_acc: dict[str, float] = defaultdict(float)
_cnt: dict[str, int] = defaultdict(int)
_state = {"instr": "outside", "iter": 0, "on": False}
_main = threading.main_thread()


def _add(key: str, dt: float) -> None:
    if _state["on"] and threading.current_thread() is _main:
        _acc[key] += dt
        _cnt[key] += 1


def _install() -> None:
    import torch.distributed as dist
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from elastor_ds.integrations.deepspeed.hetero import HeteroPipelineEngine

    real_sleep = time.sleep

    def sleep(s):  # noqa: ANN001
        t = time.perf_counter()
        real_sleep(s)
        _add(f"sleep@{_state['instr']}", time.perf_counter() - t)
    time.sleep = sleep

    for name in ("all_reduce", "send", "recv", "isend", "irecv", "reduce_scatter_tensor", "all_gather_into_tensor",
                 "broadcast", "barrier", "all_gather_object", "all_gather"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _name=name, **k):  # noqa: ANN001
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _add(f"dist.{_name}@{_state['instr']}", time.perf_counter() - t)
        setattr(dist, name, wrap)

    def wrap_instr(fn, key):  # noqa: ANN001
        def w(self, *a, **k):  # noqa: ANN001
            prev = _state["instr"]
            _state["instr"] = key
            t = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                _add(f"instr.{key}", time.perf_counter() - t)
                _state["instr"] = prev
        return w

    for cls in (PipelineEngine, HeteroPipelineEngine):
        m = cls.__dict__.get("_INSTRUCTION_MAP")
        if m is not None:
            cls._INSTRUCTION_MAP = {k: wrap_instr(v, k.__name__) for k, v in m.items()}

    orig_train = PipelineEngine.train_batch

    def train_batch(self, *a, **k):  # noqa: ANN001
        _state["on"] = _state["iter"] >= SKIP_ITERS
        t = time.perf_counter()
        try:
            return orig_train(self, *a, **k)
        finally:
            _add("iteration", time.perf_counter() - t)
            _state["iter"] += 1
            _state["on"] = False
    PipelineEngine.train_batch = train_batch

    import atexit

    def dump() -> None:
        out = os.environ.get("ELASTOR_TRACE_OUT")
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        r = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out, f"rank{r}.json"), "w") as f:
            json.dump({"rank": r, "iters": max(0, _state["iter"] - SKIP_ITERS), "seconds": dict(_acc),
                       "calls": dict(_cnt)}, f, indent=1)
    atexit.register(dump)


def summarize(folder: str) -> str:
    """A table: per rank, seconds per iteration by part."""
    rows = []
    for fn in sorted((f for f in os.listdir(folder) if RANK_FILE.fullmatch(f)), key=lambda s: int(s[4:-5])):
        d = json.load(open(os.path.join(folder, fn)))
        n = max(1, d["iters"])
        s, c = d["seconds"], d["calls"]

        def g(prefix: str, where: tuple[str, ...] = ()) -> tuple[float, int]:
            keys = [k for k in s if k.startswith(prefix) and (not where or k.split("@")[-1] in where)]
            return sum(s[k] for k in keys) / n, sum(c[k] for k in keys) // n
        it = s.get("iteration", 0.0) / n
        instr = sum(v for k, v in s.items() if k.startswith("instr.")) / n
        fb = ("ForwardPass", "BackwardPass")
        sr = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
        parts = {
            "iter": (it, 1),
            "sleep(sim compute)": g("sleep@", fb),
            "fwd+bwd total": (sum(s.get(f"instr.{k}", 0.0) for k in fb) / n, 0),
            "TP all-reduce": g("dist.all_reduce@", fb),
            "p2p instr total": (sum(s.get(f"instr.{k}", 0.0) for k in sr) / n, 0),
            "p2p dist calls": g("dist.", sr),
            "ReduceGrads total": (s.get("instr.ReduceGrads", 0.0) / n, 0),
            "  collectives in ReduceGrads": g("dist.", ("ReduceGrads",)),
            "OptimizerStep total": (s.get("instr.OptimizerStep", 0.0) / n, 0),
            "  collectives in OptimizerStep": g("dist.", ("OptimizerStep",)),
            "other instr": ((instr - sum(s.get(f"instr.{k}", 0.0) for k in fb + sr + ("ReduceGrads", "OptimizerStep")) / n), 0),
            "outside instr": (it - instr, 0),
            "  collectives outside": g("dist.", ("outside",)),
        }
        rows.append((d["rank"], parts))
    keys = list(rows[0][1]) if rows else []
    lines = ["part | " + " | ".join(f"r{r}" for r, _ in rows)]
    for i, k in enumerate(keys):
        vals = []
        for _, p in rows:
            v, c = list(p.values())[i]
            vals.append(f"{v * 1e3:.0f}ms" + (f"/{c}" if c else ""))
        lines.append(f"{k} | " + " | ".join(vals))
    return "\n".join(lines)


def trace_folder(text: str) -> str:
    """A folder holding the ``rank<r>.json`` files of a traced run."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not any(RANK_FILE.fullmatch(f) for f in os.listdir(text)):
        raise argparse.ArgumentTypeError(f"{text!r} holds no rank<r>.json (the folder ELASTOR_TRACE_OUT named)")
    return text


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] in ("--summarize", "-h", "--help"):
        ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                     epilog="Without --summarize every argument is the trainer's, and "
                                            "ELASTOR_TRACE_OUT names the trace folder.")
        ap.add_argument("--summarize", metavar="FOLDER", type=trace_folder, required=True,
                        help="print the per-rank table of a traced run's folder")
        print(summarize(ap.parse_args().summarize))
        return 0
    if not os.environ.get("ELASTOR_TRACE_OUT"):
        print(f"{os.path.basename(__file__)}: error: ELASTOR_TRACE_OUT is not set: name the folder each rank writes "
              f"its trace to (nothing would be recorded)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(TRAINER))
    _install()
    sys.argv = [TRAINER] + sys.argv[1:]
    runpy.run_path(TRAINER, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
