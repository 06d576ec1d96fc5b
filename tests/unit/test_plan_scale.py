"""The planner at scale: heterogeneous plans are considered on large clusters too, and choosing a
uniform grid is a stated decision with its numbers (not a time-out); `elastor plan` output stays
short while --json keeps every device. Pure CPU; 16,384-GPU cases take about a second each."""
from __future__ import annotations

import json
import re

from elastor_ds.cli import main as cli_main
from elastor_ds.layout import Layout
from elastor_ds.layout.compact_plan import decode
from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan

LLAMA70 = ModelSpec(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                    num_query_groups=8, seq_length=4096, vocab_size=32000, gated_mlp=True)
FLAGS70 = ["plan", "--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--swiglu",
           "--num-attention-heads", "64", "--num-query-groups", "8", "--seq-length", "4096", "--vocab-size", "32000",
           "--micro-batch-size", "1", "--global-batch-size", "4096", "--tensor-model-parallel-size", "8"]


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"(\d+(?:\.\d+)?) s", text)]


def test_heterogeneous_plans_are_searched_at_16k_gpus_and_the_choice_is_stated():
    counts = [8] * 2048
    for i in (3, 700, 1500):
        counts[i] = 7  # three GPUs lost
    cost = CostModel(LLAMA70, TrainingSpec(1, 4096, nominal_tp=8), Cluster.from_gpus_per_node(counts))
    res = plan(cost)
    assert res.heterogeneous is not None and res.uniform is not None
    assert res.search_stats["groupings"] >= 1 and res.search_stats["candidates"] > 0
    h, u = res.heterogeneous.cost.iteration_time_s, res.uniform.cost.iteration_time_s
    decision = res.search_stats["decision"]
    # the statement carries both predictions, rounded as printed, and names the winner
    assert decision.startswith("heterogeneous: " if h < u else "uniform: "), decision
    assert _numbers(decision) == [float(f"{h:.4g}"), float(f"{u:.4g}")] or \
        _numbers(decision) == [float(f"{u:.4g}"), float(f"{h:.4g}")], decision
    assert res.best.cost.iteration_time_s == min(h, u)


def test_a_full_grid_chooses_uniform_and_says_so_with_the_heterogeneous_number():
    cost = CostModel(LLAMA70, TrainingSpec(1, 1024, nominal_tp=8), Cluster.from_gpus_per_node([8] * 128))
    res = plan(cost)
    assert res.heterogeneous is not None  # considered, not skipped
    assert res.best.plan.kind == "uniform"
    d = res.search_stats["decision"]
    assert d.startswith("uniform: predicted ") and "<= best heterogeneous" in d
    assert _numbers(d) == [float(f"{res.best.cost.iteration_time_s:.4g}"),
                           float(f"{res.heterogeneous.cost.iteration_time_s:.4g}")]


def test_table_stays_short_at_16k_gpus_and_json_keeps_every_device(capsys):
    gpus = ",".join(["8"] * 2047 + ["5"])
    assert cli_main(FLAGS70 + ["--gpus-per-node", gpus]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 60 and len(out) <= 8000, (len(lines), len(out))
    assert re.search(r"^\s+[\d,]+ x\s", out, re.M), out  # identical replicas folded: "94 x"
    assert "16,381 GPUs on 2,048 nodes (2,047 x 8, 1 x 5)" in out
    assert cli_main(FLAGS70 + ["--gpus-per-node", gpus, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 2  # above 4,096 GPUs: replica groups and device ranges (layout/compact_plan.py)
    lay = Layout.from_json(doc)
    names = [d for r in lay.replicas for s in r.stages for d in s.devices]
    cp = decode(doc)
    table = cp.device_names()
    unused = [table[p] for p in cp.unused.tolist()]
    assert len(names) + len(unused) == 16381 == len(set(names) | set(unused))
    assert doc["search"]["decision"] and doc["cost_sources"]["layer_time"].startswith("assumed")
