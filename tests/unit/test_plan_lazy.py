"""Lazy placement (elastor_ds.plan.lazy_plan): a candidate placed lazily is priced exactly as the
eager placement of the same candidate, and its devices, once made, are the eager plan's. Clusters
with lost GPUs, stragglers (nodes of mixed speeds) and empty nodes. Pure CPU."""
from __future__ import annotations

import random

import pytest

from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec
from elastor_ds.plan.lazy_plan import LazyPlan
from elastor_ds.plan.search import Planner

MODEL = ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                  seq_length=4096, vocab_size=32000, gated_mlp=True)


def cluster(seed: int) -> Cluster:
    rng = random.Random(seed)
    nodes = []
    for i in range(rng.choice([9, 16, 40, 130])):
        gpus = sorted(rng.sample(range(8), rng.choice([8, 8, 8, 7, 5, 0])))
        speed = {str(g): 0.5 for g in gpus if rng.random() < 0.05}
        nodes.append({"name": f"n{i}", "gpus": gpus, "speed": speed})
    return Cluster.from_dict({"nodes": nodes})


@pytest.mark.parametrize("seed", range(8))
def test_lazy_placement_prices_and_places_like_the_eager_one(seed):
    cl = cluster(seed)
    cost = CostModel(MODEL, TrainingSpec(1, 512, nominal_tp=4), cl)
    pl = Planner(cost)
    cands = sorted(pl.heterogeneous_candidates(), key=lambda cd: (cd.estimate, cd.num_replicas))
    assert cands
    for cd in cands[:6]:
        lazy, eager = pl.place_lazy(cd), pl.place(cd)
        assert isinstance(lazy, LazyPlan) and not lazy.is_placed
        assert [(m, k) for m, k in lazy.priced_replicas()] == [(r.micro_batches, r.shape_key()) for r in eager.replicas]
        assert lazy.holder_nodes() == eager.holder_nodes()
        assert (lazy.uniform_dims(), lazy.kind, lazy.num_gpus, lazy.num_replicas) == \
            (eager.uniform_dims(), eager.kind, eager.num_gpus, len(eager.replicas))
        assert cost.evaluate(lazy) == cost.evaluate(eager)
        assert lazy.describe() == eager.describe()
        assert not lazy.is_placed  # priced and described without its devices
        assert lazy.replicas == eager.replicas and lazy.unused == eager.unused and lazy == eager
        assert lazy.is_placed
        assert lazy.layout_fingerprint() == eager.to_layout().fingerprint()


def test_lazy_placement_raises_like_place_when_a_class_runs_out():
    cl = Cluster.from_gpus_per_node([8, 8])
    pl = Planner(CostModel(MODEL, TrainingSpec(1, 64, nominal_tp=4), cl))
    cd = min(pl.heterogeneous_candidates(), key=lambda c: c.estimate)
    tp4 = (4, 1.0)
    bad = type(cd)(cd.estimate, tuple((s, m, n * 9) for s, m, n in cd.kinds), cd.pool)
    if any(tp4 in s.order for s, _, _ in bad.kinds):
        with pytest.raises(IndexError):
            pl.place_lazy(bad)
        with pytest.raises(IndexError):
            pl.place(bad)
