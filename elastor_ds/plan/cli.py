"""``elastor plan``: Megatron-style model flags + a cluster -> the best plan (table or JSON).

``--from-plan PREV.json`` re-plans from a previous plan document (``--json`` output) after a small
change of the cluster (:mod:`elastor_ds.plan.replan`): fast enough for the recovery path.

Every size is bounded (:data:`LIMITS`): the planner's time and memory grow with them, and a value
past the bound is a typo (``--num-layers 100000``), refused with exit 2 before any work.

Exit codes: 0 a plan was found, 1 no layout fits (the message says why and what would), 2 usage
errors (bad flags, a size past its bound, unreadable cluster, profile or previous plan file).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from ..cli_types import ascii_int, bounded_float
from ..errors import ConfigError
from ..user_json import read_json_file
from .cluster import HARDWARE_RANGES, Cluster
from .cost import GPU_TFLOPS_RANGE, CostModel, CostParams, GiB, Profile
from .model import ModelSpec, TrainingSpec
from .plan_doc import COMPACT_ABOVE_GPUS, device_ranges, plan_document, plan_from_document
from .replan import FULL_SEARCH_BELOW
from .search import PlanResult, plan

# Upper bounds of the sizes the planner accepts (flag -> bound). The largest public models have
# ~130 layers, 16k-wide hidden states, 128k-token contexts and vocabularies of ~256k.
LIMITS = {
    "--num-layers": 512,
    "--hidden-size": 1 << 18,
    "--ffn-hidden-size": 1 << 20,
    "--num-attention-heads": 1 << 12,
    "--num-query-groups": 1 << 12,
    "--seq-length": 1 << 24,
    "--vocab-size": 1 << 24,
    "--dtype-bytes": 8,
    "--make-vocab-size-divisible-by": 1 << 16,
    "--micro-batch-size": 1 << 16,
    "--global-batch-size": 1 << 26,
    "--tensor-model-parallel-size": 64,
    "--top-k": 100,
}
MAX_MICRO_BATCHES = 1 << 22          # global batch / micro-batch size
# --from-plan: a version-1 document at 131,072 GPUs is 10-17 MB (what --json writes there, version 2,
# under 1 MB); parsed, JSON takes ~27x its size in memory (a 20 MB file of empty lists: 575 MB RSS)
MAX_PLAN_FILE_BYTES = 32 << 20


def bounded_int(flag: str) -> Callable[[str], int]:
    """An integer in 1..LIMITS[flag] (argparse then names the flag and exits 2)."""
    hi = LIMITS[flag]

    def parse(text: str) -> int:
        v = ascii_int(text)
        if not 1 <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range: give 1 to {hi:,}")
        return v

    parse.__name__ = "integer"
    return parse


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="choose the best layout for the usable GPUs",
                              description=__doc__.splitlines()[0].replace("``", ""))
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=bounded_int("--num-layers"), required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=bounded_int("--hidden-size"), required=True, help="hidden size")
    g.add_argument("--ffn-hidden-size", type=bounded_int("--ffn-hidden-size"), default=None,
                   help="default 4 x hidden; with --swiglu Megatron-LM's int(8 x hidden / 3 / 64) x 64")
    g.add_argument("--num-attention-heads", type=bounded_int("--num-attention-heads"),
                   required=True, help="attention heads")
    g.add_argument("--num-query-groups", type=bounded_int("--num-query-groups"),
                   default=None, help="KV heads (GQA); default = heads")
    g.add_argument("--seq-length", type=bounded_int("--seq-length"), required=True, help="sequence length")
    g.add_argument("--vocab-size", type=bounded_int("--vocab-size"), required=True, help="vocabulary size")
    g.add_argument("--swiglu", action="store_true", help="gated MLP (three FFN matrices)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", help="separate output layer")
    g.add_argument("--dtype-bytes", type=bounded_int("--dtype-bytes"), choices=(1, 2, 4, 8),
                   default=2, help="bytes per parameter: 1, 2 (default), 4 or 8")
    g.add_argument("--make-vocab-size-divisible-by", type=bounded_int("--make-vocab-size-divisible-by"), default=128,
                   help="Megatron's vocabulary padding (decides which ranks of different TP widths share embedding "
                        "rows in the split all-reduce)")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=bounded_int("--micro-batch-size"),
                   required=True, help="samples per micro-batch")
    t.add_argument("--global-batch-size", type=bounded_int("--global-batch-size"),
                   required=True, help="samples per iteration (fixed)")
    t.add_argument("--tensor-model-parallel-size", type=bounded_int("--tensor-model-parallel-size"),
                   default=1, help="nominal (maximum) TP")
    t.add_argument("--zero-stage", type=ascii_int, default=1, choices=(0, 1, 2, 3),
                   help="default 1; heterogeneous plans and pipelines (more than one stage) run ZeRO-1 at most "
                        "and are priced so")
    c = p.add_argument_group("cluster")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--gpus-per-node", help="usable GPUs per node, e.g. 8,8,8,7")
    src.add_argument("--cluster", help="cluster YAML/JSON file (see elastor_ds.plan.cluster)")
    c.add_argument("--gpu-memory-gb", type=bounded_float(*HARDWARE_RANGES["gpu_memory_gb"]), default=None,
                   help="default 80 (or the file's)")
    c.add_argument("--intra-node-bandwidth-gbs", type=bounded_float(*HARDWARE_RANGES["intra_node_bandwidth_gbs"]),
                   default=None, help="per GPU, GB/s (default 150)")
    c.add_argument("--inter-node-bandwidth-gbs", type=bounded_float(*HARDWARE_RANGES["inter_node_bandwidth_gbs"]),
                   default=None, help="per GPU, GB/s (default 25)")
    c.add_argument("--gpu-tflops", type=bounded_float(*GPU_TFLOPS_RANGE), default=CostParams.gpu_tflops,
                   help=f"achieved dense TFLOP/s per GPU (default {CostParams.gpu_tflops:g})")
    s = p.add_argument_group("search")
    s.add_argument("--profile", help="per-layer time profile JSON (elastor_ds.plan.profile)")
    s.add_argument("--top-k", type=bounded_int("--top-k"), default=3, help="alternatives to list")
    s.add_argument("--layouts", choices=("uniform", "heterogeneous"), default="heterogeneous",
                   help="uniform: TP x PP x DP grids only (what stock DeepSpeed/Megatron run)")
    s.add_argument("--homogeneous", action="store_true",
                   help="the best TP x PP x DP grid over every listed GPU (one TP x PP for every replica, uneven "
                        "layer splits allowed): what Megatron-LM's --elastor-plan runs, one process per GPU")
    s.add_argument("--json", action="store_true", help="print the plan JSON document to stdout")
    s.add_argument("--from-plan", metavar="PREV.json",
                   help="re-plan from this previous plan document (--json output) after a small change of the "
                        f"cluster: undamaged replicas are kept (fast at any scale); up to {FULL_SEARCH_BELOW:,} GPUs "
                        "the full search runs too and the faster plan wins, printed with the best uniform grid; "
                        "above, no uniform baseline")
    s.add_argument("--full", action="store_true", help="print every replica and stage (the table folds repeats)")
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
    if training.num_micro_batches > MAX_MICRO_BATCHES:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} / --micro-batch-size "
                          f"{args.micro_batch_size} = {training.num_micro_batches:,} micro-batches; at most "
                          f"{MAX_MICRO_BATCHES:,} are supported")
    training.check_against(model)
    kw = {"gpu_memory_gb": args.gpu_memory_gb, "intra_node_bandwidth_gbs": args.intra_node_bandwidth_gbs,
          "inter_node_bandwidth_gbs": args.inter_node_bandwidth_gbs}
    if args.cluster:
        cluster = Cluster.from_file(args.cluster, **kw)
    else:
        cluster = Cluster.from_gpus_per_node(args.gpus_per_node, **{k: v for k, v in kw.items() if v is not None})
        if not any(n.gpus for n in cluster.nodes):   # a flag value that cannot mean anything: a usage error
            raise ConfigError(f"--gpus-per-node {args.gpus_per_node!r} lists no GPU; give at least one, e.g. 8 or 8,8,8,7")
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 1")
    profile = Profile.load(args.profile, "--profile") if args.profile else None
    return CostModel(model, training, cluster, CostParams(gpu_tflops=args.gpu_tflops), profile)


def read_previous(path: str, cluster: Cluster):  # noqa: ANN201
    """The previous plan document at ``path`` -> (Plan, the cluster it was made for)."""
    doc = read_json_file(path, "--from-plan", MAX_PLAN_FILE_BYTES, "a JSON plan document",
                         "give the file `elastor plan --json` wrote")
    return plan_from_document(doc, cluster)


def run(args: argparse.Namespace) -> int:
    """A ConfigError (exit 2) and a PlanningError (exit 1, "infeasible") go to :mod:`elastor_ds.cli`,
    which prints them on one line with non-printable characters escaped (a path given here may hold
    terminal escapes)."""
    cost = build_inputs(args)
    previous = read_previous(args.from_plan, cost.cluster) if args.from_plan else None
    if getattr(args, "homogeneous", False):
        if previous is not None:
            raise ConfigError("--homogeneous plans grids from scratch; drop --from-plan")
        result = homogeneous_result(cost)
    elif previous is not None:
        if args.layouts == "uniform":
            raise ConfigError("--from-plan re-plans heterogeneous plans; drop --layouts uniform")
        from .replan import replan
        result = replan(cost, previous[0], previous[1], top_k=args.top_k)
    else:
        result = plan(cost, layouts=args.layouts, top_k=args.top_k)
    tr = cost.training
    # --json above COMPACT_ABOVE_GPUS: version 2 (replica groups and device ranges, under 1 MB at
    # 131,072 GPUs instead of 10-17 MB); the table reads version 1
    compact = bool(args.json) and cost.cluster.num_gpus > COMPACT_ABOVE_GPUS
    doc = plan_document(result, tr.num_micro_batches, tr.micro_batch_size,
                        inputs={"cluster": cost.cluster.describe(), "layouts": args.layouts,
                                "profile": args.profile, "zero_stage": tr.zero_stage,
                                "from_plan": args.from_plan}, compact=compact)
    doc["search"] = {k: v for k, v in result.search_stats.items() if isinstance(v, (int, float, str))}
    doc["cost_sources"] = cost.sources()  # which numbers were measured, which assumed
    doc["zero_stage"] = cost.plan_zero_stage(result.best.plan)  # what the plan runs with (priced so)
    if args.json:
        if doc["num_usable_gpus"] <= 4096:
            text = json.dumps(doc, indent=1, sort_keys=False)
        else:  # json's C encoder: only json.dumps without indentation uses it (json.dump never does)
            text = json.dumps(doc, separators=(",", ":"), sort_keys=False)
        for i in range(0, len(text), 1 << 16):   # in pieces: one huge write hides a reader that left (CPython)
            sys.stdout.write(text[i:i + (1 << 16)])
        sys.stdout.write("\n")
    else:
        print(format_table(doc, cost, full=args.full))
    return 0


def homogeneous_result(cost: CostModel) -> PlanResult:
    """``--homogeneous``: :func:`~.world.best_plan_for_world` over every GPU of the cluster, grids only."""
    from .world import PlanConstraints, best_plan_for_world
    best = best_plan_for_world(cost, PlanConstraints(homogeneous_only=True))
    prov = best.provenance
    stats = {"decision": "homogeneous: the best TP x PP x DP grid over every GPU (--homogeneous)",
             "candidates": prov.candidates if prov is not None else 1}
    return PlanResult(best, best, None, [best], (), stats, cost.cluster)


def format_table(doc: dict[str, Any], cost: CostModel, full: bool = False, max_rows: int = 40) -> str:
    """The plan as text that stays short at any scale: identical replicas folded into one row set
    ("1,024 x"), runs of identical stages folded ("8 x"), device lists as ranges; ``full`` lists
    every replica and stage."""
    lines = [f"cluster: {cost.cluster.describe()}",
             f"plan ({doc['kind']}): {doc['num_gpus']:,} of {doc['num_usable_gpus']:,} GPUs, "
             f"predicted iteration {doc['predicted_iteration_time_s']:.4g} s "
             f"({doc['predicted_samples_per_s']:.4g} samples/s)"]
    search = doc.get("search") or {}
    if search.get("replan"):
        lines.append(f"re-planned: {search['replan']}" + (
            f" ({search['kept_replicas']:,} replicas kept, {search['damaged_replicas']:,} damaged; "
            f"{search.get('path', '')})"
            if "kept_replicas" in search else ""))
    if search.get("decision"):
        lines.append(f"search: {search['decision']}")
    u = doc.get("uniform_baseline")
    if u:
        idle = doc["num_usable_gpus"] - u["num_gpus"]
        lines.append(f"best uniform: {_short(u['description'])} on {u['num_gpus']:,} GPUs"
                     f"{f' ({idle:,} idle)' if idle else ''}, {u['predicted_iteration_time_s']:.4g} s -> plan is "
                     f"{doc['speedup_vs_uniform']:.3f}x uniform")
    lines.append("")
    lines.append(f"{'replicas':>9} {'mbs':>4} {'stage':>7} {'tp':>3} {'layers':>12} {'mem GB':>7} {'s/mb':>9}  devices")
    reps = doc["replicas"]
    kinds: dict[tuple, list[int]] = {}
    for ri, r in enumerate(reps):
        key = (r["micro_batches"],) + tuple((s["tp"], tuple(s["layers"])) for s in r["stages"])
        kinds.setdefault(key if not full else (ri,), []).append(ri)
    rows = 0
    for idx in kinds.values():
        r = reps[idx[0]]
        label = f"{len(idx):,} x" if len(idx) > 1 else f"#{idx[0]}"
        stages = r["stages"]
        j = 0
        while j < len(stages):
            s = stages[j]
            k = j + 1
            while not full and k < len(stages) and stages[k]["tp"] == s["tp"] and \
                    stages[k]["layers"][1] - stages[k]["layers"][0] == s["layers"][1] - s["layers"][0] and \
                    stages[k]["time_per_micro_batch_s"] == s["time_per_micro_batch_s"]:
                k += 1
            names = [d for i in idx for jj in range(j, k) for d in reps[i]["stages"][jj]["devices"]] \
                if len(idx) * (k - j) <= 4096 else None
            dtxt = device_ranges(names) if names is not None else f"{len(idx) * (k - j) * s['tp']:,} GPUs"
            stxt = f"{j}" if k - j == 1 else f"{j}-{k - 1}"
            ltxt = f"{s['layers'][0]}-{s['layers'][1]}" if k - j == 1 else \
                f"{s['layers'][0]}-{stages[k - 1]['layers'][1]} by {s['layers'][1] - s['layers'][0]}"
            mems = [st["memory_gb"] for st in stages[j:k]]
            mtxt = f"{max(mems):.1f}" if k - j == 1 or max(mems) - min(mems) < 0.05 else \
                f"{min(mems):.0f}-{max(mems):.0f}"
            lines.append(f"{label if j == 0 else '':>9} {r['micro_batches'] if j == 0 else '':>4} {stxt:>7} "
                         f"{s['tp']:>3} {ltxt:>12} {mtxt:>7} {s['time_per_micro_batch_s']:>9.4g}  {dtxt}")
            rows += 1
            j = k
        left = len(kinds) - list(kinds.values()).index(idx) - 1
        if rows >= max_rows and not full and left:
            lines.append(f"... {left:,} more replica shapes (--full lists all, --json has the plan)")
            break
    cb = doc["cost_breakdown"]
    lines.append("")
    step = f" + step {cb['step_s']:.4g} s" if cb.get("step_s") else ""
    lines.append(f"pipeline {cb['pipeline_s']:.4g} s + gradient sync {cb['gradient_sync_s']:.4g} s{step}; "
                 f"peak memory {cb['peak_memory_gb']:.1f} of {cb['memory_limit_gb']:.1f} GB; priced from:")
    for term, src in (doc.get("cost_sources") or {}).items():
        lines.append(f"  {term.replace('_', ' ')}: {src}")
    z, asked = doc.get("zero_stage"), (doc.get("inputs") or {}).get("zero_stage")
    if z is not None:
        note = ""
        if asked is not None and asked != z:
            note = (f" (--zero-stage {asked} asked; a heterogeneous plan runs ZeRO-1 at most: optimizer state "
                    f"sharded among the holders of each block, gradients and weights whole; priced so)"
                    if doc["kind"] != "uniform" else
                    f" (--zero-stage {asked} asked; a pipeline of more than one stage runs ZeRO-1 at most: "
                    f"DeepSpeed's PipelineEngine refuses ZeRO-2/3; priced so)")
        elif doc["kind"] != "uniform" and z == 1:
            note = " (optimizer state sharded among the holders of each block)"
        lines.append(f"ZeRO-{z}{note}")
    if doc["unused_devices"]:
        lines.append(f"unused devices ({len(doc['unused_devices']):,}): {device_ranges(doc['unused_devices'])}")
    if len(doc["alternatives"]) > 1:
        lines.append("alternatives:")
        for a in doc["alternatives"]:
            lines.append(f"  {a['predicted_iteration_time_s']:.4g} s  {a['kind']:<13} {a['num_gpus']:>7,} GPUs  "
                         f"{_short(a['description'])}")
    _ = GiB
    return "\n".join(lines)


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
