"""Heterogeneous vs uniform plans, measured against the planner's predictions (simulated compute).

On 2 shared cores, 8 real CPU processes cannot show device speed, so every transformer layer also
sleeps a fixed time per micro-batch at its TP width (``ELASTOR_SIM_LAYER_S``, see
``examples/megatron_gpt/gpt_pipe.simulated_layer_seconds``): 1/3 in forward, 2/3 in backward, a 7B
layer's TP scaling shrunk to CPU scale. The pipeline schedule, p2p (cross-width included), TP
collectives, the split all-reduce and the CPU work of the (small) layers are real.

What the planner is told, all measured on this machine before any timed run:

* **communication** (``collectives`` of the profile): ``elastor_ds.comm.calibrate.measure_collectives``
  run by ``n`` processes for each process count ``n`` (the same world as the timed runs);
* **per-layer time**: the simulated sleep per TP width plus the layer's real CPU cost, which the
  trainer's own layer profiler measures in a short calibration run (8 processes, TP1 pipeline): its
  per-layer time minus the TP1 sleep. TP collectives are priced from the measured costs
  (``layer_time_includes_tp_comm: false``).

Model: 12 layers (hidden 64), global batch 32 micro-batches of 1, ZeRO-0. The planner's device
memory is set so that a stage holds at most 4 TP1 layers: one replica spans >= 3 processes. So 8
processes run 2 replicas of 4; after losing one, a uniform grid can run 2 replicas of 3 (6 processes,
one idle), while a heterogeneous plan can use all 7 (a 4-stage and a 3-stage pipeline with different
micro-batch counts).

For 8 and 7 processes: the planner's best plan using every process (heterogeneous search) and its
best uniform grid (launched on the processes it uses) run ``examples/megatron_gpt/pretrain_gpt.py``;
the median iteration time from the third iteration on is compared with the prediction. At 7
processes the best plan with a TP > 1 stage runs too (TP all-reduces and cross-width p2p priced from
the measured costs; on gloo/CPU they make it slower than the TP1 plans, which is why the planner
does not choose it).

    python bench/hetero_bench.py [--iters 5] [--sizes 8,7] [--out bench/results/hetero.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from elastor_ds.cli_types import positive_int  # noqa: E402

from _args import csv_of, output_file  # noqa: E402
TRAINER = os.path.join(ROOT, "examples", "megatron_gpt", "pretrain_gpt.py")
SIM = {1: 0.048, 2: 0.027, 4: 0.015}   # seconds per layer per micro-batch (7B layer: TP2 0.56x, TP4 0.31x)
LAYERS, MICRO_BATCHES, MAX_TP1_LAYERS = 12, 32, 4
HEAD_S = 1e-3                          # output layer + loss per micro-batch (not measured; small)
FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "4",
         "--ffn-hidden-size", "256", "--no-swiglu", "--seq-length", "32", "--micro-batch-size", "1",
         "--global-batch-size", str(MICRO_BATCHES), "--lr-warmup-iters", "1", "--zero-stage", "0",
         "--log-interval", "1000"]


def specs():
    from elastor_ds.plan import CostParams, ModelSpec, TrainingSpec
    model = ModelSpec(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=104,
                      ffn_hidden_size=256, num_query_groups=4, dtype_bytes=4, gated_mlp=False, tied_embeddings=False)
    training = TrainingSpec(micro_batch_size=1, num_micro_batches=MICRO_BATCHES, nominal_tp=4, zero_stage=0)
    # a fixed overhead keeps the device memory this tiny model needs above the planner's 0.1 GB floor (the
    # same on every GPU: the layer bounds device_memory_gb() aims at do not move)
    return model, training, CostParams(memory_overhead_gb=1.0)


def device_memory_gb() -> float:
    """Device memory at which a TP1 stage holds at most MAX_TP1_LAYERS layers (a 3-stage pipeline of
    4 layers fits, a 2-stage one of 6 does not)."""
    from elastor_ds.plan import Cluster, CostModel
    from elastor_ds.plan.cost import GiB
    model, training, params = specs()
    c = CostModel(model, training, Cluster.from_gpus_per_node([1]), params)
    S = -(-LAYERS // MAX_TP1_LAYERS)
    need = max(c.stage_memory(1, MAX_TP1_LAYERS, pos, S, 1) for pos in range(S))
    gb = need / GiB / (1 - params.memory_safety_margin) * 1.0001
    c2 = CostModel(model, training, Cluster.from_gpus_per_node([1], gpu_memory_gb=gb), params)
    assert all(c2.max_layers(1, pos, S, 1) >= MAX_TP1_LAYERS for pos in range(S))
    assert any(c2.max_layers(1, pos, S - 1, 1) < -(-LAYERS // (S - 1)) for pos in range(S - 1))
    return gb


def planner(n: int, profile, mem_gb: float):
    from elastor_ds.plan import Cluster, CostModel, plan
    model, training, params = specs()
    cost = CostModel(model, training, Cluster.from_gpus_per_node([n], gpu_memory_gb=mem_gb), params, profile=profile)
    res = plan(cost, top_k=50)
    best = next(s for s in res.alternatives if s.plan.to_layout().world_size == n)
    with_tp = next((s for s in res.alternatives if s.plan.to_layout().world_size == n
                    and any(st.tp > 1 for r in s.plan.replicas for st in r.stages)), None)
    return best, res.uniform, with_tp


def split_bytes(layout) -> tuple[int, int, int]:
    """(max bytes any rank sends in the split all-reduce, the same for a DP all-reduce of its params,
    max all-reduce calls of a rank)."""
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig, gpt_tensor_specs
    from elastor_ds.runtime import layout_held, replica_of, split_reduce_bytes, split_reduce_plan, uniform_dp_bytes
    cfg = GPTSpecConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=4, vocab_size=104,
                        ffn_hidden_size=256, gated_linear_unit=False, add_bias_linear=False, normalization="RMSNorm",
                        make_vocab_size_divisible_by=8, max_sequence_length=32)
    held = layout_held(gpt_tensor_specs(cfg), layout)
    plan = split_reduce_plan(held, replica_of(layout))
    split = max(split_reduce_bytes(c) for c in plan.values())
    dp = max(uniform_dp_bytes(sum(c.region.numel for c in cells), layout.dp) for cells in plan.values())
    calls = max(len({c.holders for c in cells if c.cross_replica}) for cells in plan.values())
    return split, dp, calls


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT,
                ELASTOR_SIM_LAYER_S=json.dumps({str(k): v for k, v in SIM.items()}))


def torchrun(n: int, script: str, args: list[str], name: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", script, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=900, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")


def measure_comm(n: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"comm{n}.json")
    torchrun(n, os.path.abspath(__file__), ["--worker-comm", out], f"collective calibration on {n} processes")
    with open(out) as f:
        return json.load(f)


def comm_worker(out: str) -> None:
    import torch.distributed as dist

    from elastor_ds.comm.calibrate import measure_collectives
    dist.init_process_group("gloo")
    doc = measure_collectives(range(2, dist.get_world_size() + 1), reps=7)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(doc, f)
    dist.destroy_process_group()


def measure_layer_overhead(tmp: str) -> float:
    """The trainer's own per-layer time (TP1, 8 processes, 4-stage pipelines) minus the TP1 sleep."""
    save = os.path.join(tmp, "calib")
    metrics = os.path.join(tmp, "calib.jsonl")
    torchrun(8, TRAINER, [*FLAGS, "--pipeline-model-parallel-size", "4", "--train-iters", "4", "--profile-iters", "2",
                          "--save", save, "--metrics-file", metrics], "layer calibration")
    with open(os.path.join(save, "profile.json")) as f:
        measured = json.load(f)["layer_time_s"]["1"]
    comm_s = [json.loads(line).get("profile_comm_s") for line in open(metrics)]
    print(f"the trainer's own collective measurement (8 processes) took {max(c or 0 for c in comm_s):.2f} s", flush=True)
    return max(0.0, measured - SIM[1])


def run(layout, iters: int, tmp: str, name: str) -> float:
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(layout.to_json(), f)
    metrics = os.path.join(tmp, name + ".jsonl")
    torchrun(layout.world_size, TRAINER, [*FLAGS, "--profile-iters", "0", "--train-iters", str(iters),
                                          "--elastor-plan", path, "--metrics-file", metrics], name)
    times = [json.loads(line)["iter_time_s"] for line in open(metrics)]
    return statistics.median(times[2:] or times[-1:])


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=positive_int, default=5, help="iterations per plan (the median from the third)")
    ap.add_argument("--sizes", type=csv_of(positive_int), default="8,7",
                    help="process counts to run, comma-separated (default 8,7)")
    ap.add_argument("--tp-row-sizes", type=csv_of(positive_int, allow_empty=True), default="7",
                    help="process counts at which the best plan with a TP > 1 stage also runs (checks the TP "
                         "collectives' and cross-width p2p pricing; '' for none)")
    ap.add_argument("--out", type=output_file, default=os.path.join(ROOT, "bench", "results", "hetero.json"))
    ap.add_argument("--worker-comm", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker_comm:
        comm_worker(a.worker_comm)
        return 0
    from elastor_ds.plan import Profile
    tp_sizes = set(a.tp_row_sizes)
    t_start = time.time()
    mem_gb = device_memory_gb()
    out: dict = {"sim_layer_s": SIM, "device_memory_gb": mem_gb}
    with tempfile.TemporaryDirectory() as tmp:
        ovh = measure_layer_overhead(tmp)
        out["layer_cpu_overhead_s"] = ovh
        print(f"measured per-layer CPU cost on top of the sleep: {ovh * 1e3:.1f} ms", flush=True)
        for n in a.sizes:
            comm = measure_comm(n, tmp)
            prof = Profile.from_dict({"version": 1, "micro_batch_size": 1, "seq_length": 32,
                                      "device": f"cpu: simulated compute + measured gloo on {n} processes",
                                      "layer_time_s": {str(t): s + ovh for t, s in SIM.items()},
                                      "head_time_s": {str(t): HEAD_S for t in SIM},
                                      "layer_time_includes_tp_comm": False, "collectives": comm})
            best, uni, with_tp = planner(n, prof, mem_gb)
            rows: dict = {"profile": prof.to_dict()}
            done: dict = {}
            runs = [("best", best), ("uniform", uni)]
            if with_tp is not None and n in tp_sizes:
                runs.append(("best_with_tp", with_tp))
            for kind, sp in runs:
                lay = sp.plan.to_layout()
                key = lay.describe()
                meas = done[key] if key in done else run(lay, a.iters, tmp, f"{kind}{n}")
                done[key] = meas
                split, dp, calls = split_bytes(lay)
                rows[kind] = {"plan": key, "processes": lay.world_size, "kind": sp.plan.kind,
                              "predicted_s": sp.cost.iteration_time_s, "predicted_sync_s": sp.cost.sync_time_s,
                              "measured_s": meas, "measured_over_predicted": meas / sp.cost.iteration_time_s,
                              "split_allreduce_bytes_max_rank": split, "dp_allreduce_bytes_max_rank": dp,
                              "split_allreduce_calls_max_rank": calls}
                print(n, kind, json.dumps(rows[kind]), flush=True)
            out[n] = rows
    for kind in ("best", "uniform") if 8 in out and 7 in out else ():
        kept = out[8][kind]["measured_s"] / out[7][kind]["measured_s"]
        pred = out[8][kind]["predicted_s"] / out[7][kind]["predicted_s"]
        print(f"throughput kept 8 -> 7 ({kind}): measured {kept:.3f}, predicted {pred:.3f} (ideal 0.875)")
        out[f"kept_{kind}"] = {"measured": kept, "predicted": pred}
    out["bench_seconds"] = time.time() - t_start
    print(f"bench took {out['bench_seconds']:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
