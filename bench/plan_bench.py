"""Planner benchmark: wall and CPU time and peak memory of `plan()` at 64 / 1,024 / 16,384 / 131,072
GPUs with a few failed GPUs; re-planning from the previous plan (`plan.replan`) after losing 1-8 GPUs
or one node, against a full search on the same cluster; and the predicted throughput retained after
losing 1 of 8, 1 of 64 and 8 of 512 GPUs, heterogeneous plan vs the best uniform (TP x PP x DP)
layout. Pure CPU; prints Markdown tables. Each timed case runs in its own subprocess, so its peak
memory (ru_maxrss) is its own; CPU seconds are reported next to wall seconds because the machine
may be shared (wall time then includes waiting for a core).

    .venv/bin/python bench/plan_bench.py [--quick] [--skip-retained]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan  # noqa: E402

from _args import csv_choices  # noqa: E402

SECTIONS = ("planner", "replan", "metadata", "retained")


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
    cl.device_tuple()  # the cluster is an input: made before the clock starts
    cost = CostModel(model, TrainingSpec(1, gbs, nominal_tp=tp), cl)
    t0, c0 = time.perf_counter(), time.process_time()
    res = plan(cost)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return {"gpus": nodes * 8, "failed": failed, "model": model_name, "M": gbs, "seconds": dt, "cpu_s": dc,
            "speedup": res.uniform.cost.iteration_time_s / res.best.cost.iteration_time_s,
            "plan": res.best.plan.kind, "decision": res.search_stats.get("decision", ""),
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def replan_case(model_name: str, nodes: int, loss: str, gbs: int, seed: int = 0) -> dict:
    """Full search on the healthy cluster, then a loss (``"node"`` or a GPU count); times the
    re-plan from the previous plan (no full search beside it) and the full search on the new cluster."""
    from elastor_ds.plan.replan import replan
    from elastor_ds.plan import plan_document
    from elastor_ds.plan.plan_doc import COMPACT_ABOVE_GPUS, plan_from_document
    model, tp = MODELS[model_name]
    tr = TrainingSpec(1, gbs, nominal_tp=tp)
    old = failed_cluster(nodes, 8, 0)
    # the previous plan as a relaunched trainer or `elastor plan --from-plan` has it: read back from
    # its JSON document as `elastor plan --json` writes it (version 2 above COMPACT_ABOVE_GPUS GPUs;
    # nothing cached from the search that made it)
    compact = old.num_gpus > COMPACT_ABOVE_GPUS
    text = json.dumps(plan_document(plan(CostModel(model, tr, old)), tr.num_micro_batches, 1, compact=compact),
                      separators=(",", ":") if compact else None)
    rng = random.Random(seed)
    counts = [8] * nodes
    if loss == "node":
        counts[rng.randrange(nodes)] = 0  # the node stays listed with no GPUs: names keep their index
    else:
        for i in rng.sample(range(nodes * 8), int(loss)):
            counts[i // 8] -= 1
    new = Cluster.from_gpus_per_node(counts)
    cost = CostModel(model, tr, new)
    c0 = time.process_time()
    doc = json.loads(text)
    pc = time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    prev, prev_cluster = plan_from_document(doc, new)
    lt, lc = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    res = replan(cost, prev, prev_cluster, full_search_below=0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    # a re-shaped plan is priced before its devices are made (LazyPlan), and a replica read from a
    # version-2 document makes its stages when they are first read; what reading every stage's
    # devices costs (the document, the table, a trainer's placement) is paid here once
    c0 = time.process_time()
    sum(len(s.devices) for r in res.best.plan.replicas for s in r.stages)
    place_cpu = time.process_time() - c0
    import tracemalloc  # a second re-plan from a fresh copy, for its peak Python heap
    prev, prev_cluster = plan_from_document(json.loads(text), new)
    tracemalloc.start()
    replan(cost, prev, prev_cluster, full_search_below=0)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    new.device_tuple()
    t1, c1 = time.perf_counter(), time.process_time()
    full = plan(cost)
    ft, fc = time.perf_counter() - t1, time.process_time() - c1
    return {"gpus": nodes * 8, "loss": loss, "model": model_name, "M": gbs, "seconds": dt, "cpu_s": dc,
            "load_seconds": lt, "load_cpu_s": lc, "parse_cpu_s": pc, "doc_mb": len(text) / 2**20,
            "doc_version": 2 if compact else 1, "place_cpu_s": place_cpu, "replan_peak_mb": peak,
            "full_seconds": ft, "full_cpu_s": fc,
            "how": f"{res.search_stats.get('replan', '')}: {res.search_stats.get('path', '')}",
            "ratio": res.best.cost.iteration_time_s / full.best.cost.iteration_time_s}


def metadata_case(ranks: int, load_rank: int | None = None) -> dict:
    """Checkpoint metadata at scale for a 70B model (80 layers, hidden 8192, GQA 64/8, SwiGLU,
    bf16 weights) on TP8 x PP8 x DP(ranks/64): the save plan from every rank's shard list
    (:func:`plan_save`), the manifest (:func:`build_manifest` from per-rank write results with
    placeholder CRCs, then its compact JSON), and one rank's load plan after resharding to
    TP4 x PP8 x DP(ranks/32) (:func:`plan_load`). Time and peak Python heap (tracemalloc) of each;
    the inputs (shard lists, results) are built before each clock starts."""
    import tracemalloc

    from elastor_ds.checkpoint.planning.load_plan import Request, plan_load
    from elastor_ds.checkpoint.planning.save_plan import ShardMeta, plan_save
    from elastor_ds.checkpoint.writer import build_manifest, chunk_key
    from elastor_ds.layout import Layout, rank_tensors
    from elastor_ds.testing.synthetic import GPTShape, gpt_specs

    shape = GPTShape(num_layers=80, hidden=8192, ffn=28672, heads=64, groups=8, vocab=32000, pad_multiple=128,
                     dtype="bfloat16")
    specs = gpt_specs(shape)
    src = Layout.uniform(8, 8, ranks // 64, 80)
    by_place: dict[tuple[int, int], list] = {}
    per_rank = []
    for r in range(ranks):
        pos = src.position(r)
        key = (pos.stage, pos.tp_rank)
        if key not in by_place:  # DP replicas hold the same regions: one list, shared
            by_place[key] = [ShardMeta(sp.name, sp.shape, sp.dtype, pc.global_)
                             for sp, h in rank_tensors(specs, src, r) for pc in h.pieces]
        per_rank.append(by_place[key])
    out: dict = {"ranks": ranks, "shards": sum(len(x) for x in per_rank)}

    def measured(label: str, fn):  # noqa: ANN001, ANN202
        """Timed once as is, then its peak Python heap in a second run under tracemalloc (which
        slows it down)."""
        t0, c0 = time.perf_counter(), time.process_time()
        v = fn()
        out[label + "_s"], out[label + "_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        del v
        tracemalloc.start()
        v = fn()
        out[label + "_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        return v

    plan_ = measured("save_plan", lambda: plan_save(per_rank))
    results = []
    for r, items in enumerate(plan_.items):
        chunks, off = [], 0
        for it in items:
            chunks.append((it.name, chunk_key(it.name, it.region), it.region.to_json(), off, it.nbytes, 0,
                           (1 << 16, f"rank_{r:06d}.crc", 0)))
            off += it.nbytes
        results.append({"rank": r, "data": f"rank_{r:06d}.safetensors", "chunks": chunks,
                        "files": {f"rank_{r:06d}.safetensors": (off, 0)}, "state": None})
    man = measured("manifest", lambda: build_manifest(1, plan_, results, {}, None, None))
    text = measured("manifest_json", lambda: man.dumps(compact=True))
    out["manifest_mb"] = len(text) / 2**20
    dst = Layout.uniform(4, 8, ranks // 32, 80)
    lr = ranks // 2 + 3 if load_rank is None else load_rank
    reqs = [Request(sp.name, pc.global_, i) for i, (sp, h) in enumerate(rank_tensors(specs, dst, lr))
            for pc in h.pieces]
    lp = measured("load_plan", lambda: plan_load(man.tensors, reqs))
    out["load_reads"] = len(lp.reads)
    out["chunks"] = sum(len(t.chunks) for t in man.tensors.values())
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def in_subprocess(fn: str, *args) -> dict:  # noqa: ANN002
    """Run ``fn(*args)`` of this module in a fresh interpreter; its JSON result."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import plan_bench; "
            f"print(json.dumps(plan_bench.{fn}(*{list(args)!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 16,384- and 131,072-GPU cases")
    ap.add_argument("--skip-retained", action="store_true", help="skip the throughput-retained table")
    ap.add_argument("--sections", type=csv_choices(*SECTIONS), default=",".join(SECTIONS),
                    help=f"comma-separated subset of {', '.join(SECTIONS)}")
    a = ap.parse_args()
    want = set(a.sections)
    if a.skip_retained:
        want.discard("retained")
    if "planner" in want:
        planner_rows(a.quick)
    if "replan" in want:
        replan_rows(a.quick)
    if "metadata" in want:
        metadata_rows(a.quick)
    if "retained" in want:
        retained_rows()


def planner_rows(quick: bool) -> None:
    print("## Planner time (full search, one subprocess per case)\n")
    print("| GPUs | failed | model | micro-batches | plan() wall s | CPU s | peak RSS MB | chosen | "
          "predicted speedup vs uniform |")
    print("|---:|---:|---|---:|---:|---:|---:|---|---:|")
    cases = [("7B", 8, 3, 256), ("7B", 128, 5, 1024), ("70B", 128, 5, 1024)]
    if not quick:
        cases += [("70B", 2048, 7, 4096), ("7B", 16384, 1, 16384), ("70B", 16384, 1, 16384)]
    for name, nodes, failed, gbs in cases:
        r = in_subprocess("timing", name, nodes, failed, gbs)
        print(f"| {r['gpus']:,} | {r['failed']} | {r['model']} | {r['M']} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | "
              f"{r['peak_mb']:.0f} | {r['plan']} | {r['speedup']:.3f} |", flush=True)
        print(f"<!-- {r['decision']} -->", flush=True)


def replan_rows(quick: bool) -> None:
    print("\n## Re-plan from the previous plan vs a full search (same cluster, one subprocess per case)\n")
    print("The previous plan is read back from its JSON document first, as a relaunched trainer or `elastor plan "
          "--from-plan` has it, in the version `elastor plan --json` writes at that size (v2, replica groups and "
          "device ranges, above 4,096 GPUs): 'parse' is `json.loads` of the document (its size in MB), 'load' the "
          "plan and cluster made from the parsed document (`plan_from_document`: devices and every check); "
          "'parse + load + re-plan' is the recovery path's planning from a file. 'devices CPU s': making the "
          "chosen plan's devices and stages afterwards (a re-shaped plan is priced before they are made; a "
          "replica read from the document makes its stages when they are first read).\n")
    print("| GPUs before | lost | model | micro-batches | doc | doc MB | parse CPU s | load CPU s | re-plan wall s | "
          "re-plan CPU s | parse + load + re-plan CPU s | devices CPU s | re-plan peak heap MB | full search wall s | "
          "full search CPU s | re-plan / full search (iteration time) | re-plan path |")
    print("|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rcases = [("70B", 128, "1", 1024), ("70B", 128, "8", 1024), ("70B", 128, "node", 1024), ("7B", 128, "4", 1024)]
    if not quick:
        rcases += [("70B", 16384, "1", 16384), ("70B", 16384, "8", 16384), ("70B", 16384, "node", 16384),
                   ("7B", 16384, "1", 16384), ("7B", 16384, "node", 16384)]
    for name, nodes, loss, gbs in rcases:
        r = in_subprocess("replan_case", name, nodes, loss, gbs)
        lost = "1 node" if loss == "node" else f"{loss} GPU" + ("s" if loss != "1" else "")
        print(f"| {r['gpus']:,} | {lost} | {r['model']} | {r['M']} | v{r['doc_version']} | {r['doc_mb']:.2f} | "
              f"{r['parse_cpu_s']:.3f} | {r['load_cpu_s']:.3f} | {r['seconds']:.3f} | {r['cpu_s']:.3f} | "
              f"{r['parse_cpu_s'] + r['load_cpu_s'] + r['cpu_s']:.2f} | {r['place_cpu_s']:.3f} | "
              f"{r['replan_peak_mb']:.1f} | "
              f"{r['full_seconds']:.2f} | {r['full_cpu_s']:.2f} | {r['ratio']:.4f} | {r['how']} |", flush=True)


def metadata_rows(quick: bool) -> None:
    print("\n## Checkpoint metadata at scale: 70B (bf16 weights) on TP8 x PP8 x DP(ranks/64), one subprocess per "
          "row\n")
    print("Save plan from every rank's shard list; the manifest (built, then its compact JSON with checksum); one "
          "rank's load plan after resharding to TP4 x PP8. Time (CPU s in brackets) of one run as is, peak Python "
          "heap (tracemalloc) of a second run; peak RSS of the whole process (inputs included).\n")
    print("| ranks | shard entries | save plan s | save plan peak MB | manifest build s | manifest JSON s | "
          "manifest MB | chunks | load plan (1 rank) s | load plan reads | process peak RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ranks in ([1024] if quick else [1024, 16384, 131072]):
        r = in_subprocess("metadata_case", ranks)
        print(f"| {r['ranks']:,} | {r['shards']:,} | {r['save_plan_s']:.2f} ({r['save_plan_cpu_s']:.2f}) | "
              f"{r['save_plan_peak_mb']:.1f} | {r['manifest_s']:.2f} ({r['manifest_cpu_s']:.2f}) | "
              f"{r['manifest_json_s']:.2f} ({r['manifest_json_cpu_s']:.2f}) | {r['manifest_mb']:.1f} | "
              f"{r['chunks']:,} | "
              f"{r['load_plan_s']:.3f} ({r['load_plan_cpu_s']:.3f}) | {r['load_reads']:,} | {r['peak_rss_mb']:.0f} |",
              flush=True)


def retained_rows() -> None:
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
