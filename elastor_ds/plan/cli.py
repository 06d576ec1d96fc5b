"""``elastor plan``: Megatron-style model flags + a cluster -> the best plan (table or JSON).

Exit codes: 0 a plan was found, 1 no layout fits (the message says why and what would), 2 usage
errors (bad flags, unreadable cluster or profile file).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..cli_types import positive_float, positive_int
from ..errors import ConfigError, PlanningError
from .cluster import Cluster
from .cost import CostModel, CostParams, GiB, Profile
from .model import ModelSpec, TrainingSpec
from .plan_doc import plan_document
from .search import plan


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="choose the best layout for the usable GPUs",
                              description=__doc__.splitlines()[0])
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=positive_int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=positive_int, required=True, help="hidden size")
    g.add_argument("--ffn-hidden-size", type=positive_int, default=None, help="default 4 x hidden")
    g.add_argument("--num-attention-heads", type=positive_int, required=True, help="attention heads")
    g.add_argument("--num-query-groups", type=positive_int, default=None, help="KV heads (GQA); default = heads")
    g.add_argument("--seq-length", type=positive_int, required=True, help="sequence length")
    g.add_argument("--vocab-size", type=positive_int, required=True, help="vocabulary size")
    g.add_argument("--swiglu", action="store_true", help="gated MLP (three FFN matrices)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", help="separate output layer")
    g.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per parameter (default 2)")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128,
                   help="Megatron's vocabulary padding (decides which ranks of different TP widths share embedding "
                        "rows in the split all-reduce)")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=positive_int, required=True, help="samples per micro-batch")
    t.add_argument("--global-batch-size", type=positive_int, required=True, help="samples per iteration (fixed)")
    t.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, help="nominal (maximum) TP")
    t.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3),
                   help="default 1; heterogeneous plans run ZeRO-1 at most and are priced so")
    c = p.add_argument_group("cluster")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--gpus-per-node", help="usable GPUs per node, e.g. 8,8,8,7")
    src.add_argument("--cluster", help="cluster YAML/JSON file (see elastor_ds.plan.cluster)")
    c.add_argument("--gpu-memory-gb", type=positive_float, default=None, help="default 80 (or the file's)")
    c.add_argument("--intra-node-bandwidth-gbs", type=positive_float, default=None, help="per GPU, GB/s (default 150)")
    c.add_argument("--inter-node-bandwidth-gbs", type=positive_float, default=None, help="per GPU, GB/s (default 25)")
    c.add_argument("--gpu-tflops", type=positive_float, default=CostParams.gpu_tflops, help="achieved TFLOP/s per GPU")
    s = p.add_argument_group("search")
    s.add_argument("--profile", help="per-layer time profile JSON (elastor_ds.plan.profile)")
    s.add_argument("--top-k", type=positive_int, default=3, help="alternatives to list")
    s.add_argument("--layouts", choices=("uniform", "heterogeneous"), default="heterogeneous",
                   help="uniform: TP x PP x DP grids only (what stock DeepSpeed/Megatron run)")
    s.add_argument("--json", action="store_true", help="print the plan JSON document to stdout")
    p.set_defaults(func=run)


def build_inputs(args: argparse.Namespace) -> CostModel:
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      vocab_size=args.vocab_size, ffn_hidden_size=args.ffn_hidden_size,
                      num_query_groups=args.num_query_groups, dtype_bytes=args.dtype_bytes,
                      gated_mlp=args.swiglu, tied_embeddings=not args.untie_embeddings_and_output_weights,
                      vocab_divisible_by=args.make_vocab_size_divisible_by)
    training = TrainingSpec.from_global_batch(args.micro_batch_size, args.global_batch_size,
                                              nominal_tp=args.tensor_model_parallel_size,
                                              zero_stage=args.zero_stage)
    training.check_against(model)
    kw = {"gpu_memory_gb": args.gpu_memory_gb, "intra_node_bandwidth_gbs": args.intra_node_bandwidth_gbs,
          "inter_node_bandwidth_gbs": args.inter_node_bandwidth_gbs}
    if args.cluster:
        cluster = Cluster.from_file(args.cluster, **kw)
    else:
        cluster = Cluster.from_gpus_per_node(args.gpus_per_node, **{k: v for k, v in kw.items() if v is not None})
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 1")
    profile = Profile.load(args.profile) if args.profile else None
    return CostModel(model, training, cluster, CostParams(gpu_tflops=args.gpu_tflops), profile)


def run(args: argparse.Namespace) -> int:
    try:
        cost = build_inputs(args)
    except ConfigError as e:
        print(f"elastor plan: error: {e}", file=sys.stderr)
        return 2
    try:
        result = plan(cost, layouts=args.layouts, top_k=args.top_k)
    except PlanningError as e:
        print(f"elastor plan: infeasible: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"elastor plan: error: {e}", file=sys.stderr)
        return 2
    tr = cost.training
    doc = plan_document(result, tr.num_micro_batches, tr.micro_batch_size,
                        inputs={"cluster": cost.cluster.describe(), "layouts": args.layouts,
                                "profile": args.profile, "zero_stage": tr.zero_stage})
    doc["zero_stage"] = cost.plan_zero_stage(result.best.plan)  # what the plan runs with (priced so)
    if args.json:
        json.dump(doc, sys.stdout, indent=1, sort_keys=False)
        sys.stdout.write("\n")
    else:
        print(format_table(doc, cost))
    return 0


def format_table(doc: dict[str, Any], cost: CostModel) -> str:
    lines = [f"cluster: {cost.cluster.describe()}",
             f"plan ({doc['kind']}): {doc['num_gpus']} of {doc['num_usable_gpus']} GPUs, "
             f"predicted iteration {doc['predicted_iteration_time_s']:.4g} s "
             f"({doc['predicted_samples_per_s']:.4g} samples/s)"]
    u = doc.get("uniform_baseline")
    if u:
        lines.append(f"best uniform: {u['description']} on {u['num_gpus']} GPUs, "
                     f"{u['predicted_iteration_time_s']:.4g} s -> plan is {doc['speedup_vs_uniform']:.3f}x uniform")
    lines.append("")
    lines.append(f"{'replica':>7} {'mbs':>4} {'stage':>5} {'tp':>3} {'layers':>9} {'mem GB':>7} {'s/mb':>9}  devices")
    for ri, r in enumerate(doc["replicas"]):
        for si, s in enumerate(r["stages"]):
            devs = s["devices"]
            dtxt = ",".join(devs) if len(devs) <= 4 else f"{devs[0]}..{devs[-1]}"
            lines.append(f"{ri if si == 0 else '':>7} {r['micro_batches'] if si == 0 else '':>4} {si:>5} {s['tp']:>3} "
                         f"{s['layers'][0]:>4}-{s['layers'][1]:<4} {s['memory_gb']:>7.1f} "
                         f"{s['time_per_micro_batch_s']:>9.4g}  {dtxt}")
    cb = doc["cost_breakdown"]
    lines.append("")
    lines.append(f"pipeline {cb['pipeline_s']:.4g} s + gradient sync {cb['gradient_sync_s']:.4g} s; "
                 f"peak memory {cb['peak_memory_gb']:.1f} of {cb['memory_limit_gb']:.1f} GB")
    z, asked = doc.get("zero_stage"), (doc.get("inputs") or {}).get("zero_stage")
    if z is not None:
        note = ""
        if asked is not None and asked != z:
            note = (f" (--zero-stage {asked} asked; a heterogeneous plan runs ZeRO-1 at most: optimizer state "
                    f"sharded among the holders of each block, gradients and weights whole; priced so)")
        elif doc["kind"] != "uniform" and z == 1:
            note = " (optimizer state sharded among the holders of each block)"
        lines.append(f"ZeRO-{z}{note}")
    if doc["unused_devices"]:
        lines.append(f"unused devices: {', '.join(doc['unused_devices'])}")
    if len(doc["alternatives"]) > 1:
        lines.append("alternatives:")
        for a in doc["alternatives"]:
            lines.append(f"  {a['predicted_iteration_time_s']:.4g} s  {a['kind']:<13} {a['num_gpus']:>5} GPUs  "
                         f"{a['description'][:100]}")
    _ = GiB
    return "\n".join(lines)
