"""The full search's coarse pass skips replica counts whose lower bound (Planner.lpt_bound) exceeds
the best estimates so far, and runs again without skipping when the plans it places reach past that
bar: the search returns the same plans, alternatives and prices as without skipping. Random clusters
(lost GPUs, stragglers) of 72-1,600 GPUs, 7B and 70B. Pure CPU."""
from __future__ import annotations

import random

import pytest

from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan
from elastor_ds.plan import search as se

MODELS = {
    "7B": (ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                     seq_length=4096, vocab_size=32000, gated_mlp=True), 4),
    "70B": (ModelSpec(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                      num_query_groups=8, seq_length=4096, vocab_size=32000, gated_mlp=True), 8),
}


@pytest.mark.parametrize("seed", range(5))
def test_pruned_search_returns_the_same_plans(seed, monkeypatch):
    rng = random.Random(seed)
    name = rng.choice(["7B", "70B"])
    model, tp = MODELS[name]
    nodes = rng.choice([9, 33, 64, 200])
    counts = [8] * nodes
    for i in rng.sample(range(nodes * 8), rng.randint(0, 12)):
        counts[i // 8] -= 1
    cl = Cluster.from_dict({"nodes": [{"name": f"n{i}", "gpus": list(range(c)),
                                       "speed": {str(g): 0.6 for g in range(c) if rng.random() < 0.02}}
                                      for i, c in enumerate(counts)]})
    tr = TrainingSpec(1, rng.choice([1, 2, 4]) * nodes * 8 // tp, nominal_tp=tp)
    pruned = plan(CostModel(model, tr, cl))
    orig = se.Planner.heterogeneous_candidates
    monkeypatch.setattr(se.Planner, "heterogeneous_candidates",
                        lambda self, keep=None, prune_keep=0: orig(self, keep, 0))
    every = plan(CostModel(model, tr, cl))
    assert [(a.plan, a.cost) for a in pruned.alternatives] == [(a.plan, a.cost) for a in every.alternatives]
    assert (pruned.best.plan, pruned.best.cost) == (every.best.plan, every.best.cost)
    assert pruned.search_stats["candidates"] <= every.search_stats["candidates"]
