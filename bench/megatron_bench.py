"""Megatron dist_checkpointing (torch_dist, sync and async) vs elastor on the same GPT state and the
same layout change (TP2 x PP1 -> TP1 x PP2), side by side in one run on 2 gloo ranks (CPU).

Weights only on both sides (Megatron's own optimizers do not run on CPU). Prints the ratios
(max over ranks); see the "## Megatron" section of bench/README.md.
Run: ``.venv/bin/python bench/megatron_bench.py [--hidden 256 --layers 8]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from elastor_ds.cli_types import positive_int  # noqa: E402

HEADS = 8   # attention heads of the bench's GPT (4 query groups)


def _worker(rank, world, root, hidden, layers):
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.integrations.megatron import GPTSpecConfig, initialize_from_layout, load_gpt, save_gpt
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout

    cfg = GPTSpecConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=HEADS, num_query_groups=4,
                        vocab_size=4096, ffn_hidden_size=4 * hidden, gated_linear_unit=True,
                        make_vocab_size_divisible_by=128, max_sequence_length=256)
    src, dst = Layout.uniform(2, 1, 1, layers), Layout.uniform(1, 2, 1, layers)
    out = {}

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        r = fn()
        return r, time.perf_counter() - t

    m = build_gpt(cfg, initialize_from_layout(src))
    comm = TorchComm.create(300)
    eng = CheckpointEngine(os.path.join(root, "el"), comm, async_save=True)
    for rep in range(2):  # rep 0 warms plan + staging; report rep 1
        st, _ = timed(lambda: save_gpt(eng, rep + 1, m, cfg, src))
        t0 = time.perf_counter()
        eng.wait()
        out["el_stall"], out["el_durable"] = st.stall_s + st.plan_s, time.perf_counter() - t0 + st.stall_s + st.plan_s
    for mode in ("sync", "async"):
        d = os.path.join(root, f"mc_{mode}")
        if rank == 0:
            os.makedirs(d, exist_ok=True)
        dist.barrier()
        if mode == "sync":
            _, t = timed(lambda: dist_checkpointing.save(m.sharded_state_dict(), d))
            out["mc_sync"] = t
        else:
            q = AsyncCallsQueue()
            t0 = time.perf_counter()
            req = dist_checkpointing.save(m.sharded_state_dict(), d, async_sharded_save=True)
            q.schedule_async_request(req)
            out["mc_async_stall"] = time.perf_counter() - t0
            q.maybe_finalize_async_calls(blocking=True)
            out["mc_async_durable"] = time.perf_counter() - t0
            q.close()
    m2 = build_gpt(cfg, initialize_from_layout(dst))
    _, out["mc_load"] = timed(lambda: dist_checkpointing.load(m2.sharded_state_dict(), os.path.join(root, "mc_sync")))
    _, out["el_load"] = timed(lambda: load_gpt(eng, None, m2, cfg, dst))
    got = [None] * world
    dist.all_gather_object(got, out)
    if rank == 0:
        agg = {k: max(g[k] for g in got) for k in out}
        agg["state_mb"] = sum(p.numel() * 4 for p in m.parameters()) * world / 2**20
        with open(os.path.join(root, "res.json"), "w") as f:
            json.dump(agg, f)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=positive_int, default=256, help=f"hidden size, a multiple of {HEADS} (heads)")
    ap.add_argument("--layers", type=positive_int, default=8, help="transformer layers, >= 2 (the target is PP2)")
    a = ap.parse_args()
    if a.hidden % HEADS:
        ap.error(f"argument --hidden: {a.hidden} must be a multiple of {HEADS} (the model's attention heads)")
    if a.layers < 2:
        ap.error(f"argument --layers: {a.layers} must be >= 2 (the layout change goes to 2 pipeline stages)")
    from dist_utils import run_world
    root = tempfile.mkdtemp(prefix="mbench_")
    try:
        run_world(_worker, 2, root, a.hidden, a.layers, timeout_s=300)
        r = json.load(open(os.path.join(root, "res.json")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(r, indent=1))
    print(f"megatron sync save / elastor stall        {r['mc_sync'] / r['el_stall']:.1f}x")
    print(f"megatron async stall / elastor stall      {r['mc_async_stall'] / r['el_stall']:.1f}x")
    print(f"megatron async durable / elastor durable  {r['mc_async_durable'] / r['el_durable']:.2f}x")
    print(f"megatron reshard load / elastor load      {r['mc_load'] / r['el_load']:.2f}x")


if __name__ == "__main__":
    main()
