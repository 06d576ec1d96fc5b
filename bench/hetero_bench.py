"""Heterogeneous vs uniform plans, measured against the planner's predictions (simulated compute).

On 2 shared cores, 8 real CPU processes cannot show device speed, so every transformer layer also
sleeps a calibrated time per micro-batch at its TP width (``ELASTOR_SIM_LAYER_S``, see
``examples/megatron_gpt/gpt_pipe.simulated_layer_seconds``): 1/3 in forward, 2/3 in backward, a 7B
layer's TP scaling shrunk to CPU scale. The pipeline schedule, p2p (cross-width included), TP
collectives and the split all-reduce are real. The planner gets the same numbers as its profile.

For 8 "GPUs" and for 7 (one lost): the planner's best plan that uses every process (heterogeneous
search) and its best uniform grid (which may leave processes idle: it is launched on the processes
it uses) run ``examples/megatron_gpt/pretrain_gpt.py`` for a few iterations; the median iteration
time after warm-up is compared with the prediction. Also the split all-reduce's bytes per rank
(from the pure plan) against a uniform DP all-reduce of the same parameters.

    python bench/hetero_bench.py [--iters 6] [--sizes 8,7] [--out bench/results/hetero.json]

(4 launches of 7-8 CPU processes; ``--sizes 7 --iters 3`` is a quick smoke run.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
SIM = {1: 0.048, 2: 0.027, 4: 0.015}   # seconds per layer per micro-batch (7B layer: TP2 0.56x, TP4 0.31x)
FLAGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "4",
         "--ffn-hidden-size", "256", "--no-swiglu", "--seq-length", "32", "--micro-batch-size", "1",
         "--global-batch-size", "16", "--lr-warmup-iters", "1", "--zero-stage", "0", "--log-interval", "1000",
         "--profile-iters", "0"]


def planner(n: int):
    from elastor_ds.plan import Cluster, CostModel, ModelSpec, Profile, TrainingSpec, plan
    model = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=104,
                      ffn_hidden_size=256, num_query_groups=4, dtype_bytes=4, gated_mlp=False, tied_embeddings=False)
    training = TrainingSpec(micro_batch_size=1, num_micro_batches=16, nominal_tp=4, zero_stage=0)
    prof = Profile(layer_time_s=SIM, head_time_s={t: 1e-3 for t in SIM}, micro_batch_size=1, seq_length=32)
    res = plan(CostModel(model, training, Cluster.from_gpus_per_node([n]), profile=prof), top_k=50)
    best = next(s for s in res.alternatives if s.plan.to_layout().world_size == n)
    return best, res.uniform


def split_bytes(layout) -> tuple[int, int]:
    """(max bytes any rank sends in the split all-reduce, the same for a DP all-reduce of its params)."""
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig, gpt_tensor_specs
    from elastor_ds.runtime import layout_held, replica_of, split_reduce_bytes, split_reduce_plan, uniform_dp_bytes
    cfg = GPTSpecConfig(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=4, vocab_size=104,
                        ffn_hidden_size=256, gated_linear_unit=False, add_bias_linear=False, normalization="RMSNorm",
                        make_vocab_size_divisible_by=8, max_sequence_length=32)
    held = layout_held(gpt_tensor_specs(cfg), layout)
    plan = split_reduce_plan(held, replica_of(layout))
    split = max(split_reduce_bytes(c) for c in plan.values())
    dp = max(uniform_dp_bytes(sum(c.region.numel for c in cells), layout.dp) for cells in plan.values())
    return split, dp


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(layout, iters: int, tmp: str, name: str) -> float:
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(layout.to_json(), f)
    metrics = os.path.join(tmp, name + ".jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT,
               ELASTOR_SIM_LAYER_S=json.dumps({str(k): v for k, v in SIM.items()}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={layout.world_size}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", TRAINER, *FLAGS, "--train-iters", str(iters),
           "--elastor-plan", path, "--metrics-file", metrics]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
    times = [json.loads(line)["iter_time_s"] for line in open(metrics)]
    return statistics.median(times[2:] or times[-1:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--sizes", default="8,7", help="process counts to run, comma-separated (default 8,7)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "hetero.json"))
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.sizes.split(",")]:
            best, uni = planner(n)
            rows = {}
            for kind, sp in (("best", best), ("uniform", uni)):
                lay = sp.plan.to_layout()
                meas = run(lay, a.iters, tmp, f"{kind}{n}")
                split, dp = split_bytes(lay)
                rows[kind] = {"plan": lay.describe(), "processes": lay.world_size, "heterogeneous": sp.plan.kind,
                              "predicted_s": sp.cost.iteration_time_s, "measured_s": meas,
                              "measured_over_predicted": meas / sp.cost.iteration_time_s,
                              "split_allreduce_bytes_max_rank": split, "dp_allreduce_bytes_max_rank": dp}
                print(n, kind, json.dumps(rows[kind]), flush=True)
            out[n] = rows
    for kind in ("best", "uniform") if 8 in out and 7 in out else ():
        kept = out[8][kind]["measured_s"] / out[7][kind]["measured_s"]
        print(f"throughput kept 8 -> 7 ({kind}): {kept:.3f} (ideal 0.875)")
        out[f"kept_{kind}"] = kept
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
