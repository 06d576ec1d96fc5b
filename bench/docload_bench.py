"""Reading a previous plan back from its version-2 document at 131,072 GPUs: parse
(``json.loads``), load (:func:`~elastor_ds.plan.plan_doc.plan_from_document`) and re-plan
(:func:`~elastor_ds.plan.replan.replan`), CPU seconds, one process per run.

    python bench/docload_bench.py gen DIR                 # the documents and clusters (full searches)
    python bench/docload_bench.py time DIR CASE [--replan] # one run: prints a JSON line
    python bench/docload_bench.py profile DIR CASE         # cProfile of the load

CASE: ``70B-1``, ``70B-node``, ``7B-1``, ``7B-node`` (model, what the cluster lost).
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH first: an A/B run picks the tree

from elastor_ds.plan import Cluster, CostModel, TrainingSpec, plan  # noqa: E402

from plan_bench import MODELS, failed_cluster  # noqa: E402

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


def inputs(d: Path, case: str):  # noqa: ANN201
    model_name, _ = CASES[case]
    text = (d / f"{model_name}.json").read_text()
    new = Cluster.from_gpus_per_node(json.loads((d / f"{case}.cluster.json").read_text()))
    new.device_tuple()  # the cluster is an input: made before the clock starts
    model, tp = MODELS[model_name]
    return text, new, CostModel(model, TrainingSpec(1, GBS, nominal_tp=tp), new)


def run(d: Path, case: str, with_replan: bool) -> dict:
    from elastor_ds.plan.plan_doc import plan_from_document
    text, new, cost = inputs(d, case)
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


if __name__ == "__main__":
    cmd, d = sys.argv[1], Path(sys.argv[2])
    if cmd == "gen":
        gen(d)
    elif cmd == "time":
        print(json.dumps(run(d, sys.argv[3], "--replan" in sys.argv)))
    else:
        profile(d, sys.argv[3])
