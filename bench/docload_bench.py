"""Reading a previous plan back from its version-2 document at 131,072 GPUs: parse
(``json.loads``), load (:func:`~elastor_ds.plan.plan_doc.plan_from_document`) and re-plan
(:func:`~elastor_ds.plan.replan.replan`), CPU seconds, one process per run.

    python bench/docload_bench.py gen DIR                 # the documents and clusters (full searches)
    python bench/docload_bench.py time DIR CASE [--replan] [--fresh-cluster]  # one run: a JSON line
    python bench/docload_bench.py ab DIR CASE N OLD_TREE NEW_TREE [--replan] [--fresh-cluster]
                                # N runs of each tree, alternating, one process each: min (median)
    python bench/docload_bench.py profile DIR CASE         # cProfile of the load

CASE: ``70B-1``, ``70B-node``, ``7B-1``, ``7B-node`` (model, what the cluster lost). The cluster
after the loss is made before the clocks start, with its device tuple unless ``--fresh-cluster``
(as a recovering process has it, and as ``plan_bench.replan_case`` times the load). With
``--replan``, 'read_all': reading every stage's devices of the chosen plan afterwards.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH first: an A/B run picks the tree

from elastor_ds.cli_types import positive_int  # noqa: E402
from elastor_ds.plan import Cluster, CostModel, TrainingSpec, plan  # noqa: E402

from plan_bench import MODELS, failed_cluster  # noqa: E402

from _args import dir_to_make  # noqa: E402

NODES, GBS = 16384, 16384
CASES = {"70B-1": ("70B", "1"), "70B-node": ("70B", "node"), "7B-1": ("7B", "1"), "7B-node": ("7B", "node")}


def gen(out: Path) -> None:
    from elastor_ds.plan import plan_document
    out.mkdir(parents=True, exist_ok=True)
    for model_name in ("70B", "7B"):
        model, tp = MODELS[model_name]
        tr = TrainingSpec(1, GBS, nominal_tp=tp)
        old = failed_cluster(NODES, 8, 0)
        doc = plan_document(plan(CostModel(model, tr, old)), tr.num_micro_batches, 1, compact=True)
        (out / f"{model_name}.json").write_text(json.dumps(doc, separators=(",", ":")))
    for case, (_, loss) in CASES.items():  # as plan_bench.replan_case makes the cluster after the loss
        rng = random.Random(0)
        counts = [8] * NODES
        if loss == "node":
            counts[rng.randrange(NODES)] = 0
        else:
            for i in rng.sample(range(NODES * 8), int(loss)):
                counts[i // 8] -= 1
        (out / f"{case}.cluster.json").write_text(json.dumps(counts))


def inputs(d: Path, case: str, fresh: bool = False):  # noqa: ANN201
    model_name, _ = CASES[case]
    text = (d / f"{model_name}.json").read_text()
    new = Cluster.from_gpus_per_node(json.loads((d / f"{case}.cluster.json").read_text()))
    if not fresh:  # the cluster's devices are an input: made before the clock starts
        new.device_tuple()
    model, tp = MODELS[model_name]
    return text, new, CostModel(model, TrainingSpec(1, GBS, nominal_tp=tp), new)


def run(d: Path, case: str, with_replan: bool, fresh: bool = False) -> dict:
    from elastor_ds.plan.plan_doc import plan_from_document
    text, new, cost = inputs(d, case, fresh)
    c0 = time.process_time()
    doc = json.loads(text)
    pc = time.process_time() - c0
    c0 = time.process_time()
    prev, prev_cluster = plan_from_document(doc, new)
    lc = time.process_time() - c0
    import elastor_ds
    out = {"case": case, "tree": str(Path(elastor_ds.__file__).parents[1]), "parse_cpu_s": pc, "load_cpu_s": lc}
    if with_replan:
        from elastor_ds.plan.replan import replan
        c0 = time.process_time()
        res = replan(cost, prev, prev_cluster, full_search_below=0)
        out["replan_cpu_s"] = time.process_time() - c0
        out["iteration_time_s"] = res.best.cost.iteration_time_s
        # afterwards, what a reader of the chosen plan's every device pays (a re-shaped plan's devices
        # and a loaded replica's stages are made when first read)
        c0 = time.process_time()
        out["devices"] = sum(len(s.devices) for r in res.best.plan.replicas for s in r.stages)
        out["read_all_cpu_s"] = time.process_time() - c0
        out["how"] = f"{res.search_stats.get('replan', '')}: {res.search_stats.get('path', '')}"
    return out


def profile(d: Path, case: str) -> None:
    import cProfile
    import pstats
    from elastor_ds.plan.plan_doc import plan_from_document
    text, new, _ = inputs(d, case)
    doc = json.loads(text)
    pr = cProfile.Profile()
    pr.enable()
    plan_from_document(doc, new)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def ab(d: Path, case: str, n: int, trees: list[str], flags: list[str]) -> None:
    with_replan = "--replan" in flags
    import os
    import statistics
    import subprocess
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(n):
        for t in trees:
            env = dict(os.environ, PYTHONPATH=t)
            cmd = [sys.executable, str(Path(__file__).resolve()), "time", str(d.resolve()), case] + flags
            r = json.loads(subprocess.run(cmd, env=env, cwd=t, check=True, capture_output=True, text=True).stdout)
            assert Path(r["tree"]) == Path(t).resolve(), (r["tree"], t)
            runs[t].append(r)
    keys = ["parse_cpu_s", "load_cpu_s"] + (["replan_cpu_s", "total", "read_all_cpu_s"] if with_replan else [])
    for t in trees:
        for r in runs[t]:
            r["total"] = r["parse_cpu_s"] + r["load_cpu_s"] + r.get("replan_cpu_s", 0.0)
        cells = [f"{min(r[k] for r in runs[t]):.4f} ({statistics.median(r[k] for r in runs[t]):.4f})" for k in keys]
        extra = f" | {runs[t][0].get('how', '')}, {runs[t][0].get('iteration_time_s', '')}" if with_replan else ""
        print(f"| {case} | {t} | {n} | " + " | ".join(cells) + extra + " |")
    print(json.dumps(runs), file=sys.stderr)


def existing_dir(text: str) -> Path:
    """A directory that ``gen`` filled (the previous plans and the clusters after the loss)."""
    d = Path(text)
    missing = [f for f in ("70B.json", "7B.json", *(f"{c}.cluster.json" for c in CASES)) if not (d / f).is_file()]
    if not d.is_dir() or missing:
        raise argparse.ArgumentTypeError(f"{text!r} {'is not a directory' if not d.is_dir() else 'lacks ' + missing[0]}"
                                         f": run `docload_bench.py gen {text}` first")
    return d


def tree(text: str) -> str:
    """A source tree to A/B: a directory holding the ``elastor_ds`` package."""
    if not (Path(text) / "elastor_ds" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} holds no elastor_ds/__init__.py (give a checkout's root)")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                 epilog="CASE: " + ", ".join(CASES) + " (model, what the cluster lost)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{gen,time,ab,profile}")
    g = sub.add_parser("gen", allow_abbrev=False, help="write the documents and clusters (full searches) into DIR")
    g.add_argument("dir", metavar="DIR", type=lambda t: Path(dir_to_make(t)))
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--replan", action="store_true", help="re-plan after the load (and read every device)")
    flags.add_argument("--fresh-cluster", action="store_true", help="the cluster's device tuple not made beforehand")
    t = sub.add_parser("time", allow_abbrev=False, parents=[flags], help="one run: a JSON line")
    t.add_argument("dir", metavar="DIR", type=existing_dir)
    t.add_argument("case", metavar="CASE", choices=list(CASES))
    a = sub.add_parser("ab", allow_abbrev=False, parents=[flags],
                       help="N runs of each tree, alternating, one process each: min (median)")
    a.add_argument("dir", metavar="DIR", type=existing_dir)
    a.add_argument("case", metavar="CASE", choices=list(CASES))
    a.add_argument("n", metavar="N", type=positive_int)
    a.add_argument("trees", metavar="TREE", nargs=2, type=tree, help="OLD_TREE NEW_TREE")
    p = sub.add_parser("profile", allow_abbrev=False, help="cProfile of the load")
    p.add_argument("dir", metavar="DIR", type=existing_dir)
    p.add_argument("case", metavar="CASE", choices=list(CASES))
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.cmd == "gen":
        gen(args.dir)
    elif args.cmd == "ab":
        ab(args.dir, args.case, args.n, args.trees,
           [f for f, on in (("--replan", args.replan), ("--fresh-cluster", args.fresh_cluster)) if on])
    elif args.cmd == "time":
        print(json.dumps(run(args.dir, args.case, args.replan, args.fresh_cluster)))
    else:
        profile(args.dir, args.case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
