"""Measure a :class:`~elastor_ds.plan.cost.Profile` on this machine: forward+backward seconds of one
real transformer layer per micro-batch at each TP width, written as the planner's profile JSON.

A TP-``t`` stage runs a ``1/t`` slice of every matmul (heads and FFN columns split, as in Megatron)
on one device, so the layer is timed with ``heads/t`` heads and ``ffn/t`` FFN width; the TP
all-reduces are not timed here, so the profile says ``"layer_time_includes_tp_comm": false`` and the
cost model adds them: at their measured costs when the profile also carries ``collectives`` (e.g.
from ``elastor_ds.comm.calibrate.measure_collectives`` on the target job), else at the NVLink
defaults. Imports torch (never torch.distributed); CPU or CUDA.

Usage::

    python -m elastor_ds.plan.profile --hidden-size 1024 --num-attention-heads 16 --seq-length 512 \\
        --tp 1,2,4 --out profile.json
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Sequence

log = logging.getLogger(__name__)


def _layer(torch, h: int, heads: int, kv_heads: int, ffn: int, gated: bool, tp: int, device, dtype):  # noqa: ANN001
    nn = torch.nn
    hd = h // heads
    qh, kvh, f = heads // tp, max(1, kv_heads // tp), max(1, ffn // tp)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, (qh + 2 * kvh) * hd, bias=False)
            self.proj = nn.Linear(qh * hd, h, bias=False)
            self.n2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, f * (2 if gated else 1), bias=False)
            self.fc2 = nn.Linear(f, h, bias=False)

        def forward(self, x):  # noqa: ANN001
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([qh * hd, kvh * hd, kvh * hd], dim=-1)
            q = q.view(b, s, qh, hd).transpose(1, 2)
            k = k.view(b, s, kvh, hd).transpose(1, 2).repeat_interleave(qh // kvh, dim=1)
            v = v.view(b, s, kvh, hd).transpose(1, 2).repeat_interleave(qh // kvh, dim=1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, qh * hd))
            y = self.fc1(self.n2(x))
            if gated:
                g, u = y.chunk(2, dim=-1)
                y = torch.nn.functional.silu(g) * u
            else:
                y = torch.nn.functional.gelu(y)
            return x + self.fc2(y)

    return Layer().to(device=device, dtype=dtype)


def measure(hidden_size: int, num_attention_heads: int, seq_length: int, micro_batch_size: int = 1,
            ffn_hidden_size: int | None = None, num_query_groups: int | None = None, gated_mlp: bool = False,
            tps: Sequence[int] = (1, 2, 4), device: str | None = None, dtype: str = "float32",
            warmup: int = 2, iters: int = 5) -> dict:
    """Time forward+backward of one layer at each TP width; returns the profile JSON dict."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype)
    ffn = ffn_hidden_size or 4 * hidden_size
    kv = num_query_groups or num_attention_heads
    times: dict[str, float] = {}
    for tp in tps:
        if num_attention_heads % tp or kv % tp:
            log.warning("skipping tp=%d: does not divide the heads", tp)
            continue
        layer = _layer(torch, hidden_size, num_attention_heads, kv, ffn, gated_mlp, tp, dev, dt)
        x = torch.randn(micro_batch_size, seq_length, hidden_size, device=dev, dtype=dt, requires_grad=True)

        def step() -> None:
            layer(x).sum().backward()

        for _ in range(warmup):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times[str(tp)] = (time.perf_counter() - t0) / iters
        log.info("tp=%d: %.4g s per layer fwd+bwd", tp, times[str(tp)])
    device_name = f"{dev.type}:{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
    return {"version": 1, "micro_batch_size": micro_batch_size, "seq_length": seq_length,
            "device": device_name, "layer_time_s": times, "layer_time_includes_tp_comm": False,
            "sources": {"layer_time_s": f"measured: one layer's forward+backward at each TP width's slice, "
                                        f"{iters} iterations on {device_name}, TP all-reduces not included"}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastor_ds.plan.profile", description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--tp", default="1,2,4", help="TP widths, e.g. 1,2,4,8")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    prof = measure(a.hidden_size, a.num_attention_heads, a.seq_length, a.micro_batch_size, a.ffn_hidden_size,
                   a.num_query_groups, a.swiglu, [int(t) for t in a.tp.split(",")], a.device, a.dtype,
                   iters=a.iters)
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
