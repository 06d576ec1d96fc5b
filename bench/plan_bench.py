"""Planner benchmark: wall time of `plan()` at 64 / 1,024 / 16,384 GPUs with a few failed GPUs, and
the predicted throughput retained after losing 1 of 8, 1 of 64 and 8 of 512 GPUs, heterogeneous
plan vs the best uniform (TP x PP x DP) layout. Pure CPU; prints a Markdown table.

    .venv/bin/python bench/plan_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan  # noqa: E402


def llama(layers: int, hidden: int, ffn: int, heads: int, groups: int) -> ModelSpec:
    return ModelSpec(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                     num_query_groups=groups, seq_length=4096, vocab_size=32000, gated_mlp=True)


MODELS = {
    "7B": (llama(32, 4096, 11008, 32, 32), 4),
    "70B": (llama(80, 8192, 28672, 64, 8), 8),
}


def failed_cluster(nodes: int, per_node: int, failed: int, seed: int = 0) -> Cluster:
    rng = random.Random(seed)
    counts = [per_node] * nodes
    for i in rng.sample(range(nodes * per_node), failed):
        counts[i // per_node] -= 1
    return Cluster.from_gpus_per_node(counts)


def timing(model_name: str, nodes: int, failed: int, gbs: int) -> dict:
    model, tp = MODELS[model_name]
    cl = failed_cluster(nodes, 8, failed)
    cost = CostModel(model, TrainingSpec(1, gbs, nominal_tp=tp), cl)
    t0 = time.perf_counter()
    res = plan(cost)
    dt = time.perf_counter() - t0
    return {"gpus": nodes * 8, "failed": failed, "model": model_name, "M": gbs, "seconds": dt,
            "speedup": res.uniform.cost.iteration_time_s / res.best.cost.iteration_time_s,
            "plan": res.best.plan.kind}


def retained(model_name: str, nodes: int, failed: int, gbs: int) -> dict:
    model, tp = MODELS[model_name]
    tr = TrainingSpec(1, gbs, nominal_tp=tp)
    full = plan(CostModel(model, tr, failed_cluster(nodes, 8, 0)))
    base = full.best.cost.iteration_time_s  # healthy cluster, best plan (uniform on a full grid)
    res = plan(CostModel(model, tr, failed_cluster(nodes, 8, failed, seed=1)))
    het = res.best.cost.iteration_time_s
    uni = res.uniform.cost.iteration_time_s
    return {"gpus": nodes * 8, "failed": failed, "model": model_name, "M": gbs,
            "kept_gpu_fraction": (nodes * 8 - failed) / (nodes * 8),
            "hetero_retained": base / het, "uniform_retained": base / uni, "hetero_vs_uniform": uni / het,
            "healthy": full.best.plan.describe()[:60], "hetero": res.best.plan.describe()[:90],
            "uniform": res.uniform.plan.describe()[:60]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the 16,384-GPU timing")
    a = ap.parse_args()
    print("## Planner wall time\n")
    print("| GPUs | failed | model | micro-batches | plan() wall s | chosen | predicted speedup vs uniform |")
    print("|---:|---:|---|---:|---:|---|---:|")
    cases = [("7B", 8, 3, 256), ("70B", 128, 5, 1024)] + ([] if a.quick else [("70B", 2048, 7, 4096)])
    for name, nodes, failed, gbs in cases:
        r = timing(name, nodes, failed, gbs)
        print(f"| {r['gpus']:,} | {r['failed']} | {r['model']} | {r['M']} | {r['seconds']:.2f} | {r['plan']} | "
              f"{r['speedup']:.3f} |", flush=True)
    print("\n## Throughput retained after failures (predicted; 1.0 = healthy cluster's best plan)\n")
    print("| lost | model | micro-batches | GPUs kept | heterogeneous retained | uniform retained | "
          "hetero / uniform |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, nodes, failed, gbs in [("7B", 1, 1, 32), ("7B", 8, 1, 128), ("70B", 64, 8, 512)]:
        r = retained(name, nodes, failed, gbs)
        print(f"| {failed} of {nodes * 8} | {r['model']} | {r['M']} | {r['kept_gpu_fraction']:.3f} | "
              f"{r['hetero_retained']:.3f} | {r['uniform_retained']:.3f} | {r['hetero_vs_uniform']:.3f} |", flush=True)
        print(f"<!-- healthy: {r['healthy']} | hetero: {r['hetero']} | uniform: {r['uniform']} -->", flush=True)


if __name__ == "__main__":
    main()
