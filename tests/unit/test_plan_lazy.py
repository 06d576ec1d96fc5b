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


# ---- the devices of a lazily placed plan against a brute-force oracle ------------------------------
def oracle_devices(cl: Cluster) -> tuple:
    """Every usable GPU as a Device, node by node, GPU ids ascending, one at a time."""
    from elastor_ds.plan.cluster import Device
    return tuple(Device(i, n.name, g, s) for i, n in enumerate(cl.nodes) for g, s in sorted(zip(n.gpus, n.speeds)))


def oracle_placement(pl: Planner, cd) -> tuple[list, tuple]:  # noqa: ANN001
    """The replicas and unused devices of candidate ``cd`` placed by brute force from the pool's
    groups (Group objects, cut node by node): every slot (first layer, kind, replica) in that order
    takes the next group of its class in (node, first GPU id) order; the plan's stages made by the
    plain constructors (pace and node worked out from the devices)."""
    from elastor_ds.plan.plan_doc import PlanReplica, PlanStage
    by_class: dict = {}
    for g in sorted(cd.pool.groups, key=lambda g: (g.node, min(d.local_id for d in g.devices))):
        by_class.setdefault((g.tp, min(d.speed for d in g.devices)), []).append(g)
    slots = []
    for q, (sol, m, n) in enumerate(cd.kinds):
        first = 0
        for j, (k, cnt) in enumerate(zip(sol.order, sol.counts)):
            slots.extend(((first, q, t, j), k, (first, first + cnt)) for t in range(n))
            first += cnt
    nxt = {k: 0 for k in by_class}
    taken = {}
    for key, k, lay in sorted(slots):
        g = by_class[k][nxt[k]]
        nxt[k] += 1
        taken[(key[1], key[2], key[3])] = (k[0], lay, tuple(sorted(g.devices, key=lambda d: d.local_id)))
    reps = []
    for q, (sol, m, n) in enumerate(cd.kinds):
        for t in range(n):
            reps.append(PlanReplica(tuple(PlanStage(*taken[(q, t, j)]) for j in range(len(sol.order))), m))
    used = {d for r in reps for s in r.stages for d in s.devices}
    return reps, tuple(d for d in oracle_devices(pl.cluster) if d not in used)


def big_cluster(seed: int) -> Cluster:
    """Up to ~1,000 GPUs: full nodes, nodes with lost GPUs (ids not 0..k-1), empty nodes,
    stragglers on some nodes and whole slow nodes (a node type of one speed below 1)."""
    rng = random.Random(1000 + seed)
    nodes = []
    for i in range(rng.choice([12, 33, 70, 125])):
        gpus = sorted(rng.sample(range(8), rng.choice([8, 8, 8, 8, 7, 6, 4, 0])))
        r = rng.random()
        speed = {str(g): 0.5 for g in gpus} if r < 0.08 else \
            {str(g): rng.choice([0.5, 0.75]) for g in gpus if rng.random() < 0.1} if r < 0.3 else {}
        nodes.append({"name": f"h{i}", "gpus": gpus, "speed": speed})
    return Cluster.from_dict({"nodes": nodes})


@pytest.mark.parametrize("seed", range(10))
def test_lazy_devices_equal_a_brute_force_placement(seed):
    cl = big_cluster(seed) if seed % 2 else cluster(seed)
    assert cl.device_tuple() == oracle_devices(cl)
    starts = cl.node_starts()
    assert [cl.device_tuple()[a:a + len(n.gpus)] for a, n in zip(starts, cl.nodes)] == \
        [tuple(d for d in oracle_devices(cl) if d.node == i) for i in range(len(cl.nodes))]
    cost = CostModel(MODEL, TrainingSpec(1, 1024, nominal_tp=8 if seed % 3 == 0 else 4), cl)
    pl = Planner(cost)
    cands = sorted(pl.heterogeneous_candidates(), key=lambda cd: (cd.estimate, cd.num_replicas))
    rng = random.Random(seed)
    picked = cands[:4] + rng.sample(cands[4:], min(4, len(cands[4:])))
    kinds = set()
    for cd in picked:
        lazy = pl.place_lazy(cd)
        # the pool's positions (vectorised per node type) are those of its groups, in the same order
        fast = cd.pool.class_positions(cl.device_tuple())
        at = {d: i for i, d in enumerate(cl.device_tuple())}
        by_groups: dict = {}
        for g in cd.pool.groups:
            by_groups.setdefault(g.key, []).append([at[d] for d in g.devices])
        assert {k: v.tolist() for k, v in fast.items()} == by_groups
        assert {k: v.tolist() for k, v in cd.pool.class_nodes().items()} == \
            {k: [cl.device_tuple()[r[0]].node for r in v] for k, v in by_groups.items()}
        reps, unused = oracle_placement(pl, cd)
        assert not lazy.is_placed
        assert lazy.replicas == tuple(reps) and lazy.unused == unused
        for a, b in zip(lazy.replicas, reps):
            assert a.shape_key() == b.shape_key() and a.micro_batches == b.micro_batches
            assert [(s.speed, s.node) for s in a.stages] == [(s.speed, s.node) for s in b.stages]
        assert lazy.replicas == pl.place(cd).replicas and lazy.kind == pl.place(cd).kind
        assert sorted(lazy.used_devices() + list(lazy.unused)) == sorted(cl.device_tuple())
        kinds.add(lazy.kind)
    assert "heterogeneous" in kinds or len(picked) < 2


def test_lazy_devices_of_a_small_pool_come_from_its_groups():
    """Pools of at most Planner.SMALL_GROUPS GPUs carry groups only: positions come from them."""
    cl = Cluster.from_dict({"nodes": [{"name": "a", "gpus": [0, 2, 3, 5, 7], "speed": {"3": 0.5}},
                                      {"name": "b", "gpus": [1, 4]}]})
    pl = Planner(CostModel(MODEL, TrainingSpec(1, 64, nominal_tp=4), cl))
    for cd in pl.heterogeneous_candidates()[:6]:
        lazy = pl.place_lazy(cd)
        reps, unused = oracle_placement(pl, cd)
        assert lazy.replicas == tuple(reps) and lazy.unused == unused and lazy == pl.place(cd)
