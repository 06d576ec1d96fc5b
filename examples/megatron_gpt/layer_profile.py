"""Per-layer profile measured by the trainer, in the format of ``elastor plan --profile``.

During a window of a few training iterations (the trainer opens a new one after each, while the
launch runs, and rewrites the profile each time) each rank times the forward and backward of its own transformer
layers (forward: module hooks; backward: tensor hooks on the layer's output gradient and input
gradient, so the autograd graph is unchanged) and divides by layers x micro-batches. The ranks
gather their (TP width, seconds per layer per micro-batch); rank 0 writes the median per TP width as
``{"version": 1, "micro_batch_size": b, "seq_length": s, "device": ..., "layer_time_s": {"<tp>": t}}``
next to the checkpoints (``<save>/profile.json``), where ``--elastor-plan auto`` finds it after a
restart. Widths the layout did not run are scaled by the planner from the nearest measured one.
The layer times include the TP all-reduces inside the layers (``layer_time_includes_tp_comm`` is
left at its default, true). The trainer adds ``collectives``: the job's per-call costs of all-reduce,
reduce-scatter, all-gather (groups of 2-4) and p2p, measured right after the timed iterations by
``elastor_ds.comm.calibrate.measure_collectives`` (well under a second on CPU), so the planner prices
the split all-reduce, ZeRO-1 and pipeline transfers of the plans it compares from this job's numbers.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Optional

PROFILE_NAME = "profile.json"
PLAN_NAME = "plan.json"  # the running plan as a plan document (``elastor plan --json`` format), for re-planning


class LayerProfiler:
    def __init__(self, module: Any, layer_cls: type, tp: int, micro_batches: int, first_iter: int, num_iters: int):
        self.layers = [m for m in module.modules() if isinstance(m, layer_cls)]
        self.tp, self.micro_batches = tp, micro_batches
        self.first, self.last = first_iter, first_iter + num_iters  # iterations [first, last) are timed
        self.on = False
        self.total = 0.0
        self.iters = 0
        self._t: dict[int, float] = {}
        self._b: dict[int, float] = {}
        self._handles = []
        for layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._pre))
            self._handles.append(layer.register_forward_hook(self._post))
        self.instr: dict[str, list[float]] = {}   # pipeline instruction -> [seconds, calls] in the window
        self.ar_in = [0.0, 0]                      # TP all-reduces inside the layers: [seconds, calls]
        self.ar_out = [0.0, 0]                     # TP all-reduces of the embedding, output layer and loss
        self._tp_group = None
        self._ar_orig = None
        self.iter_s: list[float] = []              # train_batch wall seconds of the timed iterations
        self.per_iter: list[dict] = []             # each timed iteration's own counters (in_situ_terms)
        self._engine = None

    def attach(self, engine: Any) -> None:
        """Also time the pipeline engine's instructions (forward, backward, sends, receives, gradient
        reduction, optimizer step) through the instance's instruction map, which the engine's
        schedule loop looks up on every instruction; :meth:`gather` restores the class map."""
        self._engine = engine
        timed = {}
        for kind, fn in type(engine)._INSTRUCTION_MAP.items():
            timed[kind] = self._timed(kind.__name__, fn)
        engine._INSTRUCTION_MAP = timed
        if self.tp > 1:
            self._time_tp_all_reduce()

    def _time_tp_all_reduce(self) -> None:
        """Time megatron's TP all-reduces (``torch.distributed.all_reduce`` on the TP group, looked up
        at call time by megatron's mappings) while the window is open, apart inside and outside the
        layers, so the layer times can be stored without them and the calls priced on their own."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        self._tp_group = ps.get_tensor_model_parallel_group()
        orig = self._ar_orig = dist.all_reduce

        def all_reduce(tensor: Any, *a: Any, **kw: Any) -> Any:
            group = kw.get("group", a[1] if len(a) > 1 else None)
            if not self.on or group is not self._tp_group:
                return orig(tensor, *a, **kw)
            t0 = time.perf_counter()
            try:
                return orig(tensor, *a, **kw)
            finally:
                acc = self.ar_in if (self._t or self._b) else self.ar_out
                acc[0] += time.perf_counter() - t0
                acc[1] += 1
        dist.all_reduce = all_reduce

    def _timed(self, name: str, fn: Any) -> Any:
        def run(eng: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(eng, **kw)
            t0 = time.perf_counter()
            try:
                return fn(eng, **kw)
            finally:
                acc = self.instr.setdefault(name, [0.0, 0])
                acc[0] += time.perf_counter() - t0
                acc[1] += 1
        return run

    def _pre(self, mod: Any, inputs: Any) -> None:
        if not self.on:
            return
        self._t[id(mod)] = time.perf_counter()
        x = inputs[0] if inputs else None
        if x is not None and getattr(x, "requires_grad", False):
            x.register_hook(lambda g, k=id(mod): self._bwd_end(k))

    def _post(self, mod: Any, inputs: Any, out: Any) -> None:
        if not self.on or id(mod) not in self._t:
            return
        self.total += time.perf_counter() - self._t.pop(id(mod))
        if getattr(out, "requires_grad", False):
            out.register_hook(lambda g, k=id(mod): self._bwd_start(k))

    def _bwd_start(self, k: int) -> None:
        self._b[k] = time.perf_counter()

    def _bwd_end(self, k: int) -> None:
        t0 = self._b.pop(k, None)
        if t0 is not None and self.on:
            self.total += time.perf_counter() - t0

    def begin(self, iteration: int) -> None:
        self.on = self.first <= iteration < self.last

    def end(self, iteration: int, iter_s: float | None = None) -> bool:
        """After ``iteration`` (``iter_s``: its train_batch wall seconds); True when the window just
        closed (then call :meth:`gather` on every rank)."""
        if self.on:
            self.iters += 1
            if iter_s is not None:
                self.iter_s.append(iter_s)
                done = self.per_iter
                before = {"layer_s": sum(d["layer_s"] for d in done), "ar_in": [sum(d["ar_in"][i] for d in done)
                                                                            for i in (0, 1)],
                          "ar_out": [sum(d["ar_out"][i] for d in done) for i in (0, 1)]}
                instr_before: dict[str, list[float]] = {}
                for d in done:
                    for k, v in d["instr"].items():
                        acc = instr_before.setdefault(k, [0.0, 0])
                        acc[0] += v[0]
                        acc[1] += v[1]
                instr = {}
                for k, v in self.instr.items():
                    b = instr_before.get(k, [0.0, 0])
                    instr[k] = [v[0] - b[0], v[1] - b[1]]
                done.append({"iter_s": iter_s, "layer_s": self.total - before["layer_s"],
                             "ar_in": [self.ar_in[i] - before["ar_in"][i] for i in (0, 1)],
                             "ar_out": [self.ar_out[i] - before["ar_out"][i] for i in (0, 1)], "instr": instr})
        self.on = False
        return iteration + 1 == self.last

    def seconds_per_layer(self) -> Optional[float]:
        n = len(self.layers) * self.micro_batches * self.iters
        return self.total / n if n and self.total > 0 else None

    def gather(self, micro_batch_size: int, seq_length: int) -> dict:
        """Collective: the profile document (same on every rank); removes the hooks."""
        import torch.distributed as dist
        for h in self._handles:
            h.remove()
        if self._engine is not None and "_INSTRUCTION_MAP" in vars(self._engine):
            del self._engine._INSTRUCTION_MAP
        if self._ar_orig is not None:
            dist.all_reduce = self._ar_orig
        eng = self._engine
        mine = (self.tp, self.seconds_per_layer(), {
            "tp": self.tp, "stage": getattr(eng, "stage_id", None),
            "first": bool(eng.is_first_stage()) if eng else None,
            "last": bool(eng.is_last_stage()) if eng else None, "layers": len(self.layers), "layer_s": self.total,
            "iters": self.iters, "micro_batches": self.micro_batches, "iter_s": self.iter_s, "instr": self.instr,
            "ar_in": self.ar_in, "ar_out": self.ar_out, "per_iter": self.per_iter})
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        self.breakdown = [g[2] for g in got]
        dev = "cpu (measured by pretrain_gpt.py)" if not _cuda() else "cuda (measured by pretrain_gpt.py)"
        if self._engine is None or self.iters == 0:  # layer hooks only: the whole layers, TP all-reduces included
            per_tp: dict[int, list[float]] = {}
            for tp, t, _ in got:
                if t is not None:
                    per_tp.setdefault(tp, []).append(t)
            return {"version": 1, "micro_batch_size": micro_batch_size, "seq_length": seq_length, "device": dev,
                    "layer_time_s": {str(tp): statistics.median(v) for tp, v in sorted(per_tp.items())},
                    "sources": {"layer_time_s": f"measured: median over ranks of each layer's forward+backward in "
                                                f"{self.iters} training iterations (TP all-reduces included)"}}
        return {"version": 1, "micro_batch_size": micro_batch_size, "seq_length": seq_length, "device": dev,
                **in_situ_terms(self.breakdown)}


def _med(v: list[float]) -> Optional[float]:
    return statistics.median(v) if v else None


def median_iteration(ranks: list[dict]) -> list[dict]:
    """Every rank's counters of a typical timed iteration: each counter's median over the rank's
    timed iterations, so a burst of other processes' work in a few of them does not enter."""
    its = ranks[0].get("per_iter") or []
    if not its or any(len(r.get("per_iter") or []) != len(its) for r in ranks):
        return ranks
    out = []
    for r in ranks:
        per = r["per_iter"]
        keys = sorted({k for p in per for k in p["instr"]})
        instr = {k: [statistics.median(p["instr"].get(k, [0.0, 0])[0] for p in per),
                     statistics.median(p["instr"].get(k, [0.0, 0])[1] for p in per)] for k in keys}
        out.append(dict(r, iters=1, iter_s=[statistics.median(p["iter_s"] for p in per)],
                        layer_s=statistics.median(p["layer_s"] for p in per),
                        ar_in=[statistics.median(p["ar_in"][i] for p in per) for i in (0, 1)],
                        ar_out=[statistics.median(p["ar_out"][i] for p in per) for i in (0, 1)], instr=instr))
    return out


def in_situ_terms(ranks: list[dict]) -> dict:
    """The profile's terms from every rank's breakdown of the median timed iteration
    (:func:`median_iteration`; pure arithmetic), per TP width the job ran (a rank's ``tp``):

    * ``layer_time_s[t]``: a layer's forward+backward per micro-batch, less the TP all-reduces inside
      it (``layer_time_includes_tp_comm: false``): the width's ranks' layer seconds over all their
      layer micro-batches. Where processes outnumber cores the ranks' per-layer times differ by up
      to 3x (who shares the cores with whom), so no single rank's is the layer's; taking only the
      busiest ranks' (those computing the most of the iteration) was tried and dropped: under other
      processes' load a preempted rank looks busiest (bench/results/2026-12-01-predictions.md);
    * ``tp_all_reduce_s[t]``: those all-reduces' seconds over their number;
    * ``embedding_time_s[t]`` / ``head_time_s[t]``: the first / last stage's forward, backward and
      micro-batch loading per micro-batch outside its layers and TP all-reduces (embedding; output
      layer and loss), median over those ranks; a single-stage rank's counts as head time less the
      embedding time;
    * ``p2p_s``: half the median seconds of one blocking pipeline send: the cost model charges a
      stage a receive and a send per neighbour and micro-batch, and a blocking receive's time in the
      job is mostly waiting for the neighbour's pass (the pipeline's own schedule), so the measured
      send -- the whole transfer -- is spread over the two messages;
    * ``step_time_s``: median over ranks of the iteration's wall time outside the forward,
      backward, load, send and receive instructions and the gradient reduce (which the cost model
      prices from the collectives): optimizer step, loss aggregation, the checkpoint hooks.
    """
    reduce_s = grad_reduce_seconds(ranks)
    ranks = median_iteration(ranks)
    emb: dict[int, list[float]] = {}
    head: dict[int, list[float]] = {}
    both: dict[int, list[float]] = {}
    lay: dict[int, list[float]] = {}   # width -> [layer seconds, layer micro-batches, all-reduce s, calls]
    send, step = [], []
    for r in ranks:
        n, mb, t = r["iters"], r["micro_batches"], r["tp"]
        ins = {k: v[0] for k, v in r["instr"].items()}
        calls = {k: v[1] for k, v in r["instr"].items()}
        acc = lay.setdefault(t, [0.0, 0, 0.0, 0])
        acc[0] += r["layer_s"] - r["ar_in"][0]
        acc[1] += r["layers"] * mb * n
        acc[2] += r["ar_in"][0]
        acc[3] += r["ar_in"][1]
        work = sum(ins.get(k, 0.0) for k in ("ForwardPass", "BackwardPass", "LoadMicroBatch"))
        rest = max(0.0, (work - r["layer_s"] - r["ar_out"][0]) / (mb * n))
        where = both if r["first"] and r["last"] else head if r["last"] else emb if r["first"] else None
        if where is not None:
            where.setdefault(t, []).append(rest)
        sends = sum(calls.get(k, 0) for k in ("SendActivation", "SendGrad"))
        if sends:
            send.append(sum(ins.get(k, 0.0) for k in ("SendActivation", "SendGrad")) / sends)
        passes = work + sum(ins.get(k, 0.0) for k in ("SendActivation", "SendGrad", "RecvActivation", "RecvGrad",
                                                      "ReduceGrads"))
        if r["iter_s"]:
            step.append(max(0.0, sum(r["iter_s"]) / len(r["iter_s"]) - passes / n))
    n = len(ranks[0].get("per_iter") or []) or ranks[0]["iters"]
    emb_med = {t: statistics.median(v) for t, v in emb.items()}
    for t, v in both.items():
        e = emb_med.get(t, statistics.median(emb_med.values()) if emb_med else 0.0)
        head.setdefault(t, []).extend(max(0.0, x - e) for x in v)
    widths = ",".join(str(t) for t in sorted(lay))
    how = f"measured: the median of {n} training iterations at TP {widths}"
    out: dict = {"layer_time_s": {str(t): a[0] / a[1] for t, a in sorted(lay.items()) if a[1]},
                 "layer_time_includes_tp_comm": False,
                 "sources": {"layer_time_s": f"{how}, every layer's forward+backward less its TP all-reduces, over "
                                             f"all ranks of the width"}}
    if emb_med:
        out["embedding_time_s"] = {str(t): v for t, v in sorted(emb_med.items())}
        out["sources"]["embedding_time_s"] = (f"{how}, median over ranks, first stage's passes outside its layers "
                                              f"and TP all-reduces")
    if head:
        out["head_time_s"] = {str(t): statistics.median(v) for t, v in sorted(head.items())}
        out["sources"]["head_time_s"] = (f"{how}, median over ranks, last stage's passes outside its layers and "
                                         f"TP all-reduces")
    if step:
        out["step_time_s"] = _med(step)
        out["sources"]["step_time_s"] = (f"{how}, median over ranks, iteration wall time outside the pipeline "
                                         f"passes, transfers and gradient reduce")
    out["in_situ"] = {"tp_all_reduce_s": {str(t): a[2] / a[3] for t, a in sorted(lay.items()) if a[3] and t > 1},
                      "p2p_s": _med(send) / 2 if send else None, "grad_reduce_s": reduce_s}
    return out


def grad_reduce_seconds(ranks: list[dict]) -> Optional[float]:
    """The gradient reduce as the job ran it: per timed iteration, the least ``ReduceGrads`` time
    over the ranks that reduce (the rank that arrives last waits for nobody: its time is the
    collectives' own), median over the iterations; None when no rank reduced."""
    per = [r.get("per_iter") or [] for r in ranks]
    n = min((len(p) for p in per), default=0)
    mins = []
    for k in range(n):
        got = [p[k]["instr"]["ReduceGrads"][0] for p in per if p[k]["instr"].get("ReduceGrads", [0.0, 0])[1]]
        if got:
            mins.append(min(got))
    return statistics.median(mins) if mins else None


SYNC_KINDS = ("dp_all_reduce", "reduce_scatter", "all_gather")


def scale_sync(doc: dict, measured_s: float, model_s: float, iterations: int) -> Optional[float]:
    """Scale the calibration's gradient-sync collectives (``SYNC_KINDS``, every group size) by
    ``measured_s / model_s``: the gradient reduce as the job ran it (:func:`grad_reduce_seconds`)
    over the cost model's price of the same sync from the calibration, which ran each collective
    three times on otherwise idle ranks. Returns the factor (None when either is not positive)."""
    coll = doc.get("collectives")
    if not coll or not (measured_s > 0 and model_s > 0):
        return None
    f = measured_s / model_s
    for kind in SYNC_KINDS:
        for ab in (coll.get(kind) or {}).values():
            ab["latency_s"] *= f
            ab["s_per_byte"] *= f
    doc.setdefault("sources", {})["collectives"] = (
        doc["sources"].get("collectives", "measured") + f"; gradient sync x{f:.3g}: the job's own gradient reduce "
        f"(least over ranks, median of {iterations} iterations) over the calibration's price of it")[:300]
    return f


def scale_widths(doc: dict, micro: dict) -> None:
    """Fill the widths the job did not run: the nearest measured width's times x this machine's
    single-layer micro-benchmark ratio ``micro[t] / micro[measured]`` (``elastor_ds.plan.profile.measure``
    on every rank right after the timed iterations)."""
    for key in ("layer_time_s", "embedding_time_s", "head_time_s"):
        table = doc.get(key)
        have = [int(t) for t in (table or {}) if str(t) in micro]
        if not have:
            continue
        added = []
        for t, v in micro.items():
            if t in table:
                continue
            near = str(min(have, key=lambda k: (abs(k - int(t)), k)))
            table[t] = table[near] * v / micro[near]
            added.append(t)
        if added and key in doc.get("sources", {}):
            doc["sources"][key] += (f"; TP {','.join(sorted(added))} scaled by this machine's single-layer "
                                    f"forward+backward ratio")
    for key, text in list(doc.get("sources", {}).items()):
        doc["sources"][key] = text[:300]


def apply_in_situ(doc: dict) -> dict:
    """Replace the calibration's TP all-reduce at the widths the job ran and its p2p with the calls
    as the job ran them (waits for peers included), and drop the working field."""
    ins = doc.pop("in_situ", None) or {}
    coll = doc.get("collectives")
    if coll is None:
        return ins
    for t, v in (ins.get("tp_all_reduce_s") or {}).items():
        coll.setdefault("tp_all_reduce", {})[t] = {"latency_s": v, "s_per_byte": 0.0}
    if ins.get("p2p_s") is not None:
        coll["p2p"] = {"2": {"latency_s": ins["p2p_s"], "s_per_byte": 0.0}}
    return ins


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def write(doc: dict, folder: str, name: str = PROFILE_NAME) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def find(*dirs: Optional[str], name: str = PROFILE_NAME) -> Optional[str]:
    """The first ``name`` (``profile.json``) in one of ``dirs`` (a checkpoint root, or a step directory's root)."""
    for d in dirs:
        if not d:
            continue
        for cand in (d, os.path.dirname(os.path.abspath(d))):
            p = os.path.join(cand, name)
            if os.path.isfile(p):
                return p
    return None
