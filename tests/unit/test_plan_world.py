"""best_plan_for_world (elastor_ds/plan/world.py): the best plan for exactly the launched world.

1. Oracle: for small worlds, every TP x PP x DP grid over all devices in megatron-core's rank order,
   with every layer split (all compositions), priced by the same cost model: the homogeneous
   choice is as fast as the fastest of them (bandwidths so high that the gradient sync does not
   depend on the split, so the min-max split is the optimum).
2. Hand-checked cases: 3 processes and 16 micro-batches leave one grid (TP1 x PP3 x DP1); a model
   whose weights and Adam state do not fit one GPU forces PP >= 2 on 4 processes; a TP group
   never spans two nodes; a fixed TP or PP is honoured, and an impossible one is a PlanningError
   with the numbers.
3. The constraint never returns heterogeneous replicas (random small clusters, stragglers
   included); without it the choice is never slower than the best grid and uses every device.
"""
from __future__ import annotations

import itertools
import random

import pytest

from elastor_ds.errors import PlanningError
from elastor_ds.plan import (Cluster, CostModel, ModelSpec, Plan, PlanConstraints, PlanReplica, PlanStage,
                             ScoredPlan, TrainingSpec, best_plan_for_world)
from elastor_ds.plan.world import world_grids

pytestmark = pytest.mark.unit

HOMOGENEOUS = PlanConstraints(homogeneous_only=True)


def small_model(layers: int = 6, heads: int = 4, **kw) -> ModelSpec:
    return ModelSpec(num_layers=layers, hidden_size=256, num_attention_heads=heads, seq_length=128, vocab_size=8000,
                     **kw)


def fast_cluster(per_node: list[int], **kw) -> Cluster:
    return Cluster.from_gpus_per_node(per_node, intra_node_bandwidth_gbs=1e9, inter_node_bandwidth_gbs=1e9, **kw)


def compositions(n: int, k: int):
    """Every way to write n as k positive parts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield tuple(b[i + 1] - b[i] for i in range(k))


def oracle(cost: CostModel) -> float:
    """The fastest feasible grid over every device, by brute force (TP a power of two <= the
    nominal TP dividing heads, query groups and FFN width; TP groups inside a node; DP | M)."""
    model, training = cost.model, cost.training
    devs = cost.cluster.devices()
    n, L, M = len(devs), model.num_layers, training.num_micro_batches
    best = float("inf")
    for tp in (1, 2, 4, 8, 16):
        if tp > training.nominal_tp or n % tp or model.num_attention_heads % tp or \
                model.num_query_groups % tp or model.ffn_hidden_size % tp:
            continue
        for pp in range(1, L + 1):
            if (n // tp) % pp:
                continue
            dp = n // tp // pp
            if M % dp:
                continue
            rank = {(j, d, t): j * dp * tp + d * tp + t for j in range(pp) for d in range(dp) for t in range(tp)}
            groups = {(j, d): tuple(devs[rank[(j, d, t)]] for t in range(tp)) for j in range(pp) for d in range(dp)}
            if any(len({x.node for x in g}) > 1 for g in groups.values()):
                continue
            for counts in compositions(L, pp):
                first = [sum(counts[:j]) for j in range(pp)]
                reps = tuple(PlanReplica(tuple(PlanStage(tp, (first[j], first[j] + counts[j]), groups[(j, d)])
                                               for j in range(pp)), M // dp) for d in range(dp))
                c = cost.evaluate(Plan(L, reps, (), "uniform"))
                if c.feasible:
                    best = min(best, c.iteration_time_s)
    return best


def assert_megatron_grid(s: ScoredPlan, cluster: Cluster) -> tuple[int, int, int]:
    """Uses every device, one TP x PP and one split for every replica, equal micro-batches, rank r on
    the cluster's r-th device in megatron-core's order, TP groups inside a node."""
    dims = s.plan.uniform_dims()
    assert dims is not None, s.plan.describe()
    tp, pp, dp = dims
    assert s.plan.num_gpus == cluster.num_gpus == tp * pp * dp
    assert len({r.micro_batches for r in s.plan.replicas}) == 1
    lay = s.layout
    assert lay.is_uniform() and lay.world_size == cluster.num_gpus
    devs = cluster.devices()
    for d, rep in enumerate(s.plan.replicas):
        for j, st in enumerate(rep.stages):
            assert len({x.node for x in st.devices}) == 1
            for t, dev in enumerate(st.devices):
                assert dev == devs[j * dp * tp + d * tp + t]
    for r in range(lay.world_size):
        p = lay.position(r)
        assert r == p.stage * dp * tp + p.replica * tp + p.tp_rank
    return tp, pp, dp


# ---------------------------------------------------------------- 1. oracle
@pytest.mark.parametrize("per_node,layers,M,heads,nominal", [
    ([1], 5, 4, 4, 4), ([2], 6, 4, 4, 4), ([3], 7, 6, 4, 4), ([4], 6, 8, 4, 4), ([2, 2], 6, 4, 4, 2),
    ([6], 6, 6, 2, 2), ([4, 4], 8, 8, 4, 4), ([3, 1], 5, 4, 4, 4), ([5], 6, 10, 4, 1),
    # DP cannot divide the micro-batches: pipelines are forced, and the split decides
    ([3], 7, 4, 4, 4), ([5], 8, 4, 4, 1), ([6], 9, 4, 4, 2), ([2, 2, 2], 7, 2, 4, 2), ([7], 9, 1, 4, 1)])
def test_homogeneous_choice_equals_the_brute_force_optimum(per_node, layers, M, heads, nominal):
    cluster = fast_cluster(per_node)
    cost = CostModel(small_model(layers, heads), TrainingSpec(micro_batch_size=1, num_micro_batches=M,
                                                              nominal_tp=nominal), cluster)
    got = best_plan_for_world(cost, HOMOGENEOUS)
    assert_megatron_grid(got, cluster)
    want = oracle(cost)
    assert got.cost.iteration_time_s >= want * (1 - 1e-12)  # it is one of the oracle's plans
    assert got.cost.iteration_time_s == pytest.approx(want, rel=1e-6)
    assert got.cost.iteration_time_s == pytest.approx(cost.evaluate(got.plan).iteration_time_s)
    assert got.provenance is not None and got.provenance.search == "grids over every device"


def test_stragglers_grids_against_the_oracle():
    """Slow GPUs: the split per stage follows the slowest GPU of the stage; still the optimum."""
    from elastor_ds.plan import Node
    cluster = Cluster((Node("a", (0, 1, 2, 3), (1.0, 1.0, 0.5, 1.0)),), intra_node_bandwidth_gbs=1e9,
                      inter_node_bandwidth_gbs=1e9)
    cost = CostModel(small_model(8), TrainingSpec(micro_batch_size=1, num_micro_batches=4, nominal_tp=2), cluster)
    got = best_plan_for_world(cost, HOMOGENEOUS)
    assert_megatron_grid(got, cluster)
    assert got.cost.iteration_time_s == pytest.approx(oracle(cost), rel=1e-6)


# ---------------------------------------------------------------- 2. hand-checked cases
def test_three_processes_and_sixteen_micro_batches_leave_one_grid():
    # 3 = tp * pp * dp with tp in {1, 2}: tp 1 only; dp must divide 16: dp 1, so pp 3
    cluster = Cluster.from_gpus_per_node([3])
    cost = CostModel(small_model(8), TrainingSpec(micro_batch_size=1, num_micro_batches=16, nominal_tp=2), cluster)
    got = best_plan_for_world(cost, HOMOGENEOUS)
    assert assert_megatron_grid(got, cluster) == (1, 3, 1)
    b = got.layout.boundaries()
    assert b[0] == 0 and b[-1] == 8 and all(y > x for x, y in zip(b, b[1:]))
    assert got.plan.replicas[0].micro_batches == 16
    assert got.provenance.candidates == 1


def test_memory_forces_pipeline_stages_on_four_processes():
    # h = 2046, FFN 4h: 12 h^2 + 2 h = 50.2M weights per layer; fp32 weights (4 B) + fp32 grads (4 B)
    # + Adam with fp32 master (12 B) unsharded (ZeRO-0) = 20 B per weight: 1.0 GB per layer, 8 layers
    # 8.05 GB = 7.5 GiB. A 10 GB device keeps (10 - 3 GiB overhead) x 0.95 < 6.7 GiB: one stage cannot
    # hold all 8 layers, two stages of 4 (3.75 GiB + small activations) can. 3 heads: TP 1 only.
    model = ModelSpec(num_layers=8, hidden_size=2046, num_attention_heads=3, seq_length=64, vocab_size=1000,
                      dtype_bytes=4)
    training = TrainingSpec(micro_batch_size=1, num_micro_batches=8, nominal_tp=4, zero_stage=0)
    cluster = Cluster.from_gpus_per_node([4], gpu_memory_gb=10)
    cost = CostModel(model, training, cluster)
    assert model.params_per_layer == 12 * 2046 ** 2 + 2 * 2046
    got = best_plan_for_world(cost, HOMOGENEOUS)
    tp, pp, dp = assert_megatron_grid(got, cluster)
    assert tp == 1 and pp >= 2 and got.cost.feasible
    assert not [g for g in world_grids(cost, HOMOGENEOUS) if g.plan.uniform_dims()[1] == 1]


def test_tp_groups_stay_inside_a_node():
    # [3, 1]: ranks (2, 3) would be a TP-2 group across the two nodes; [2, 2]: TP 2 fits
    model = small_model(4)
    tr = TrainingSpec(micro_batch_size=1, num_micro_batches=4, nominal_tp=2)
    split = world_grids(CostModel(model, tr, Cluster.from_gpus_per_node([3, 1])), HOMOGENEOUS)
    assert split and {g.plan.uniform_dims()[0] for g in split} == {1}
    even = world_grids(CostModel(model, tr, Cluster.from_gpus_per_node([2, 2])), HOMOGENEOUS)
    assert 2 in {g.plan.uniform_dims()[0] for g in even}
    for g in even:
        assert all(len({x.node for x in st.devices}) == 1 for r in g.plan.replicas for st in r.stages)


def test_fixed_tp_or_pp_is_honoured_and_an_impossible_one_names_the_numbers():
    cluster = Cluster.from_gpus_per_node([4])
    cost = CostModel(small_model(6), TrainingSpec(micro_batch_size=1, num_micro_batches=4, nominal_tp=4), cluster)
    assert best_plan_for_world(cost, PlanConstraints(homogeneous_only=True, tp=2)).plan.uniform_dims()[0] == 2
    assert best_plan_for_world(cost, PlanConstraints(homogeneous_only=True, pp=4)).plan.uniform_dims() == (1, 4, 1)
    with pytest.raises(PlanningError, match=r"no plan uses exactly the 4 launched processes .*TP=8.*TP degrees \[\]"):
        best_plan_for_world(cost, PlanConstraints(homogeneous_only=True, tp=8))
    with pytest.raises(PlanningError, match=r"pp=0"):
        PlanConstraints(pp=0)
    # 3 processes, 4 micro-batches, TP 1 only: pp 3 x dp 1 (dp 3 does not divide 4); with 2 layers, none
    c3 = CostModel(small_model(2), TrainingSpec(micro_batch_size=1, num_micro_batches=4), Cluster.from_gpus_per_node([3]))
    with pytest.raises(PlanningError, match=r"exactly the 3 launched processes.*2 layers, 4 micro-batches"):
        best_plan_for_world(c3, HOMOGENEOUS)


# ---------------------------------------------------------------- 3. never heterogeneous
def test_the_constraint_never_returns_heterogeneous_replicas():
    from elastor_ds.plan import Node
    rng = random.Random(20)
    seen = searched = 0
    for _ in range(25):
        nodes = tuple(Node(f"n{i}", tuple(range(k)), tuple(rng.choice((1.0, 1.0, 0.6)) for _ in range(k)))
                      for i, k in enumerate(rng.choice(([4], [2, 2], [3], [4, 2], [6], [8], [4, 4]))))
        cluster = Cluster(nodes)
        model = small_model(rng.choice((4, 6, 8)))
        tr = TrainingSpec(micro_batch_size=1, num_micro_batches=rng.choice((4, 8, 12)), nominal_tp=4)
        cost = CostModel(model, tr, cluster)
        try:
            got = best_plan_for_world(cost, HOMOGENEOUS)
        except PlanningError:
            continue
        seen += 1
        assert_megatron_grid(got, cluster)
        if cluster.num_gpus <= 4:  # the full search (seconds on 8 GPUs with stragglers) on the small ones
            free = best_plan_for_world(cost)  # heterogeneous plans allowed: never slower, still every device
            assert free.plan.num_gpus == cluster.num_gpus
            assert free.cost.iteration_time_s <= got.cost.iteration_time_s * (1 + 1e-12)
            searched += 1
    assert seen >= 15 and searched >= 5


def _demo_cost(micro_batches: int) -> CostModel:
    """The demo's model on one node of 3 processes, priced from a hand-written profile: a layer
    10 ms at TP1 and 6 ms at TP2 (TP all-reduces included), the output layer 1 ms, bandwidths so
    high that transfers and the gradient sync are below 1e-5 s."""
    from elastor_ds.plan import Profile
    model = ModelSpec(num_layers=5, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64,
                      vocab_size=104, ffn_hidden_size=168, dtype_bytes=4, gated_mlp=True, tied_embeddings=False)
    training = TrainingSpec(micro_batch_size=2, num_micro_batches=micro_batches, nominal_tp=2)
    prof = Profile({1: 0.010, 2: 0.006}, head_time_s={1: 0.001, 2: 0.001})
    return CostModel(model, training, fast_cluster([3]), profile=prof)


def test_best_uniform_is_on_the_same_world_and_says_how_many_processes_it_leaves_idle():
    # 4 micro-batches on 3 processes: the only grid over all 3 is TP1 x PP3 (layers 2+2+1):
    # (4 + 2) x 20 ms = 120 ms; DP2 on 2 of them: 2 x (5 x 10 + 1) = 102 ms, 1 process idle;
    # TP2 on 2: 4 x 31 = 124 ms; PP2 on 2: 5 x 30 = 150 ms
    cost = _demo_cost(4)
    (grid,) = world_grids(cost)
    assert grid.plan.uniform_dims() == (1, 3, 1) and grid.cost.iteration_time_s == pytest.approx(0.120, abs=1e-5)
    uni = best_plan_for_world(cost).provenance.uniform
    assert uni.plan.uniform_dims() == (1, 1, 2) and uni.plan.num_gpus == 2   # leaves 1 of 3 idle
    assert uni.cost.iteration_time_s == pytest.approx(0.102, abs=1e-5)
    # 6 micro-batches: DP3 over all 3 runs 2 each, 2 x 51 = 102 ms, beats DP2 on 2 (3 x 51 = 153 ms)
    uni = best_plan_for_world(_demo_cost(6)).provenance.uniform
    assert uni.plan.uniform_dims() == (1, 1, 3) and uni.plan.num_gpus == 3
    assert uni.cost.iteration_time_s == pytest.approx(0.102, abs=1e-5)
    # grids only (Megatron-LM): the best grid over every device
    uni = best_plan_for_world(cost, HOMOGENEOUS).provenance.uniform
    assert uni.plan.uniform_dims() == (1, 3, 1) and uni.plan.num_gpus == 3
