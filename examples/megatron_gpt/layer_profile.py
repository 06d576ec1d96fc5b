"""Per-layer profile measured by the trainer, in the format of ``elastor plan --profile``.

During a few training iterations each rank times the forward and backward of its own transformer
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

    def end(self, iteration: int) -> bool:
        """After ``iteration``; True when the window just closed (then call :meth:`gather` on every rank)."""
        if self.on:
            self.iters += 1
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
        mine = (self.tp, self.seconds_per_layer())
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        per_tp: dict[int, list[float]] = {}
        for tp, t in got:
            if t is not None:
                per_tp.setdefault(tp, []).append(t)
        return {"version": 1, "micro_batch_size": micro_batch_size, "seq_length": seq_length,
                "device": "cpu (measured by pretrain_gpt.py)" if not _cuda() else "cuda (measured by pretrain_gpt.py)",
                "layer_time_s": {str(tp): statistics.median(v) for tp, v in sorted(per_tp.items())},
                "sources": {"layer_time_s": f"measured: median over ranks of each layer's forward+backward in "
                                            f"{self.iters} training iterations (TP all-reduces included)"}}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def write(doc: dict, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, PROFILE_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def find(*dirs: Optional[str]) -> Optional[str]:
    """The first ``profile.json`` in one of ``dirs`` (a checkpoint root, or a step directory's root)."""
    for d in dirs:
        if not d:
            continue
        for cand in (d, os.path.dirname(os.path.abspath(d))):
            p = os.path.join(cand, PROFILE_NAME)
            if os.path.isfile(p):
                return p
    return None
