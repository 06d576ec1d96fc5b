"""Measured communication costs in the planner: the profile's ``collectives`` field (validation, old
profiles still load), pricing against hand-computed values (TP all-reduces per layer, blocking p2p per
micro-batch with cross-width copies, one split all-reduce call per holder set), the planner against
the brute-force oracle under measured costs, and the measurement function on real gloo ranks."""
from __future__ import annotations

import json
import math
import random

import pytest

from elastor_ds.cli import main as cli_main
from elastor_ds.errors import ConfigError, PlanningError
from elastor_ds.plan import Cluster, CostModel, CostParams, ModelSpec, Plan, PlanReplica, PlanStage, Profile, TrainingSpec, plan
from elastor_ds.plan.comm_cost import CollectiveKind, CommProfile, sync_buffers

from test_plan import BASE, assert_planner_near_oracle

H, S_LEN, V = 1024, 1024, 1000
P_LAYER = 12_584_960  # 4 H^2 (attention) + 2 H 4096 (MLP) + 2 H (norms)
COLL = {"tp_all_reduce": {"2": {"latency_s": 1e-3, "s_per_byte": 1e-9}},
        "p2p": {"2": {"latency_s": 2e-3, "s_per_byte": 2e-9}},
        "dp_all_reduce": {"2": {"latency_s": 3e-3, "s_per_byte": 3e-10}, "3": {"latency_s": 5e-3, "s_per_byte": 4e-10}}}


def cost_with(collectives=COLL, includes=False, micro_batches=2) -> CostModel:
    model = ModelSpec(num_layers=2, hidden_size=H, num_attention_heads=8, seq_length=S_LEN, vocab_size=V,
                      tied_embeddings=False)
    training = TrainingSpec(1, micro_batches, nominal_tp=2, zero_stage=0)
    prof = Profile.from_dict({"version": 1, "layer_time_s": {"1": 1.0, "2": 0.6}, "head_time_s": {"1": 0.5, "2": 0.3},
                              "layer_time_includes_tp_comm": includes, "collectives": collectives})
    return CostModel(model, training, Cluster.from_gpus_per_node("3", gpu_memory_gb=80),
                     CostParams(memory_overhead_gb=0.0), prof)


def st(cost: CostModel, tp: int, layers: tuple[int, int], ids: list[int]) -> PlanStage:
    devs = {d.local_id: d for d in cost.cluster.devices()}
    return PlanStage(tp, layers, tuple(devs[i] for i in ids))


# ---- hand-computed pricing ----------------------------------------------------------------------
def test_tp1_beside_tp2_replica_hand_computed():
    cost = cost_with()
    assert cost.model.params_per_layer == P_LAYER
    p = Plan(2, (PlanReplica((st(cost, 1, (0, 2), [0]),), 1), PlanReplica((st(cost, 2, (0, 2), [1, 2]),), 1)))
    c = cost.evaluate(p)
    # activation 1 x 1024 x 1024 x 2 B = 2,097,152 B; one TP all-reduce of it: 1e-3 + 2.097152e-3
    ar, ar_small = 0.003097152, 0.001004096  # the small one: cross-entropy's 1024 fp32 values
    # TP1 replica: 2 layers x 1.0 + head 0.5, no collectives
    assert c.replicas[0].time_s == pytest.approx(2.5)
    # TP2 replica: 2 x (0.6 + 4 ar) + head 0.3 + output-layer ar + 3 small + embedding ar
    assert c.replicas[1].stage_times_s[0] == pytest.approx(1.5 + 10 * ar + 3 * ar_small)
    assert c.replicas[1].stage_times_s[0] == pytest.approx(1.533983808)
    # sync: the TP1 rank is in 3 holder sets: two blocks {it, one TP2 rank} -- half of each layer's
    # split parameters, (P_LAYER - 2H) / 2 x 2 layers = 12,582,912 / 2... together P_LAYER - 2H, plus the
    # embedding and output rows each TP2 rank holds (1000 rows padded to 1024 for TP2: 512 + 488) --
    # 2 x 13,606,912 fp32 gradients in all (108,855,296 B), and the norms {all three ranks}: 2 layers x
    # 2H + final norm H = 5120 values (20,480 B). The TP2 ranks are in 2 sets each.
    block = 2 * 3e-3 + 3e-10 * 108_855_296
    norms = 5e-3 + 4e-10 * 20_480
    assert c.sync_time_s == pytest.approx(block + norms)
    assert c.sync_time_s == pytest.approx(0.0436647808)
    assert c.iteration_time_s == pytest.approx(2.5436647808)


def test_sync_buffers_counts_one_call_per_holder_set():
    # layers of 10 parameters (2 replicated); a 3-row vocabulary of 2 elements per row (divisible by 1:
    # TP2 pads to 4 rows, rank 0 holds rows 0-1, rank 1 row 2); final norm 1
    sets = sync_buffers([[(1, (0, 2))], [(2, (0, 2))]], params_per_layer=10, replicated_per_layer=2,
                        vocab=3, row_elems=2, divisible_by=1, last_replicated=1)
    tp1, a, b = (0, 0, 0), (1, 0, 0), (1, 0, 1)
    assert sets[tp1] == {frozenset({tp1, a}): 2 * 4 + 2 * 2 + 2 * 2, frozenset({tp1, b}): 2 * 4 + 2 + 2,
                         frozenset({tp1, a, b}): 2 * 2 + 1}
    assert sets[a] == {frozenset({tp1, a}): 16, frozenset({tp1, a, b}): 5}
    # uniform TP1 grid: one set per rank holding everything (= DeepSpeed's one DP all-reduce)
    grid = sync_buffers([[(1, (0, 2))], [(1, (0, 2))]], 10, 2, vocab=3, row_elems=2)
    assert grid == {(0, 0, 0): {frozenset({(0, 0, 0), (1, 0, 0)}): 32},
                    (1, 0, 0): {frozenset({(0, 0, 0), (1, 0, 0)}): 32}}
    # heterogeneous pipelines (TP1 x 2 stages beside one TP1 stage): a set per stage
    pp = sync_buffers([[(1, (0, 1)), (1, (1, 2))], [(1, (0, 2))]], 10, 2, vocab=3, row_elems=2)
    assert pp[(1, 0, 0)] == {frozenset({(0, 0, 0), (1, 0, 0)}): 16, frozenset({(0, 1, 0), (1, 0, 0)}): 16}
    assert sync_buffers([[(2, (0, 2))]], 10, 2, vocab=3, row_elems=2) == {}  # one replica: nothing to sync
    # vocabulary splits need not nest: 97 rows, divisible by 8: TP2 pads to 112 (56 rows each), TP4 to
    # 128 (32 each), so TP4 rank 1 (rows 32-63) shares rows with both TP2 ranks: 2 calls for the table
    v = sync_buffers([[(4, (0, 1))], [(2, (0, 1))]], 10, 2, vocab=97, row_elems=1, divisible_by=8, output_layer=False)
    r1 = v[(0, 0, 1)]
    assert r1[frozenset({(0, 0, 1), (1, 0, 0)})] == 4 // 4 * 2 + 24 and r1[frozenset({(0, 0, 1), (1, 0, 1)})] == 8


def test_cross_width_pipeline_p2p_per_micro_batch():
    cost = cost_with()
    p = Plan(2, (PlanReplica((st(cost, 1, (0, 1), [0]), st(cost, 2, (1, 2), [1, 2])), 2),))
    c = cost.evaluate(p)
    msg = 2e-3 + 2e-9 * 2_097_152  # 0.006194304 s per activation or gradient message
    ar, ar_small = 0.003097152, 0.001004096
    # stage 0 (TP1): 1 layer; sends the activation to both TP2 ranks, receives one gradient
    assert c.replicas[0].stage_times_s[0] == pytest.approx(1.0 + 3 * msg)
    # stage 1 (TP2, last): 0.6 + 4 ar + head 0.3 + ar + 3 small; receives one activation, sends one gradient
    assert c.replicas[0].stage_times_s[1] == pytest.approx(0.9 + 5 * ar + 3 * ar_small + 2 * msg)
    # (2 micro-batches + 1 bubble) x slowest stage; transfers are inside the stage times
    assert c.replicas[0].p2p_s == 0.0
    assert c.iteration_time_s == pytest.approx(3 * 1.018582912)


def test_grid_sync_is_one_call_and_unmeasured_kinds_fall_back():
    cost = cost_with()
    p = Plan(2, (PlanReplica((st(cost, 1, (0, 2), [0]),), 1), PlanReplica((st(cost, 1, (0, 2), [1]),), 1)),
             kind="uniform")
    # 2 layers + embedding + output layer, fp32 gradients, one all-reduce over the 2 replicas
    assert cost.evaluate(p).sync_time_s == pytest.approx(3e-3 + 3e-10 * (2 * P_LAYER + 2 * V * H) * 4)
    # no dp_all_reduce measured: the bandwidth model (2 (R-1)/R x 4 B per parameter at 150 GB/s)
    only_tp = cost_with({"tp_all_reduce": COLL["tp_all_reduce"]})
    assert only_tp.evaluate(p).sync_time_s == pytest.approx((2 * P_LAYER + 2 * V * H) * 4 / 150e9)
    # layer times that include the TP collectives (the trainer's own profile) get nothing added
    incl = cost_with(includes=True)
    assert incl.layer_time(2) == 0.6 and incl.head_time(2) == 0.3
    assert cost_with().layer_time(2) == pytest.approx(0.6 + 4 * 0.003097152)


def test_zero1_sync_is_reduce_scatter_plus_all_gather_per_holder_set():
    coll = {"reduce_scatter": {"2": {"latency_s": 1e-3, "s_per_byte": 1e-10}, "3": {"latency_s": 2e-3, "s_per_byte": 0.0}},
            "all_gather": {"2": {"latency_s": 4e-3, "s_per_byte": 2e-10}}}
    model = ModelSpec(num_layers=2, hidden_size=H, num_attention_heads=8, seq_length=S_LEN, vocab_size=V,
                      tied_embeddings=False)
    prof = Profile.from_dict({"layer_time_s": {"1": 1.0, "2": 0.6}, "collectives": coll})
    cost = CostModel(model, TrainingSpec(1, 2, nominal_tp=2, zero_stage=1), Cluster.from_gpus_per_node("3"),
                     CostParams(memory_overhead_gb=0.0), prof)
    p = Plan(2, (PlanReplica((st(cost, 1, (0, 2), [0]),), 1), PlanReplica((st(cost, 2, (0, 2), [1, 2]),), 1)))
    # all_gather over 3 ranks is scaled from 2: latency x 2, per-byte x (2/3)/(1/2)
    ag3 = 8e-3 + 2e-10 * 4 / 3 * 20_480
    blocks = 2 * (1e-3 + 4e-3) + (1e-10 + 2e-10) * 108_855_296
    assert cost.evaluate(p).sync_time_s == pytest.approx(blocks + 2e-3 + ag3)


# ---- the planner under measured costs -----------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_planner_matches_brute_force_with_measured_collectives(seed):
    rng = random.Random(1000 + seed)
    nodes = rng.choice([[4], [3], [2, 2], [5]])
    L = rng.randint(2, 3 if sum(nodes) >= 5 else 4)
    M = rng.randint(1, 4)
    model = ModelSpec(num_layers=L, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=8000)
    training = TrainingSpec(1, M, nominal_tp=rng.choice([2, 4]), zero_stage=rng.choice([0, 1]))
    scale = rng.choice([1e-4, 1e-2, 1.0])  # from NVLink-like to far slower than compute
    coll = {k: {str(g): {"latency_s": scale * rng.uniform(0.5, 2), "s_per_byte": scale * 1e-9}
                for g in ((2,) if k == "p2p" else (2, 4))}
            for k in ("tp_all_reduce", "p2p", "dp_all_reduce", "reduce_scatter", "all_gather")}
    prof = Profile.from_dict({"layer_time_s": {"1": 1.0, "2": 0.55, "4": 0.3}, "head_time_s": {"1": 0.2, "2": 0.1, "4": 0.05},
                              "layer_time_includes_tp_comm": False, "collectives": coll})
    cost = CostModel(model, training, Cluster.from_gpus_per_node(nodes), CostParams(memory_overhead_gb=0.0), prof)
    assert_planner_near_oracle(cost, at_least_oracle=True)


def test_slow_tp_collectives_steer_the_planner_to_pipelines():
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=8000)
    # 2 micro-batches on 8 GPUs: at most 2 replicas, so each spans 4 GPUs (TP or a pipeline with bubbles)
    training = TrainingSpec(1, 2, nominal_tp=4, zero_stage=0)
    base = {"layer_time_s": {"1": 0.048, "2": 0.027, "4": 0.015}, "layer_time_includes_tp_comm": False}
    fast = Profile.from_dict(base)  # NVLink defaults: 20 us per TP call, TP pays off
    slow = Profile.from_dict({**base, "collectives": {"tp_all_reduce": {"2": {"latency_s": 20e-3, "s_per_byte": 0.0}}}})
    cl = Cluster.from_gpus_per_node("8")
    tps_fast = {s.tp for r in plan(CostModel(model, training, cl, profile=fast)).best.plan.replicas for s in r.stages}
    tps_slow = {s.tp for r in plan(CostModel(model, training, cl, profile=slow)).best.plan.replicas for s in r.stages}
    assert max(tps_fast) > 1 and tps_slow == {1}


# ---- the profile format -------------------------------------------------------------------------
def test_old_profiles_load_and_new_fields_round_trip():
    old = Profile.from_dict({"version": 1, "layer_time_s": {"1": 0.1}})
    assert old.collectives is None and old.layer_time_includes_tp_comm is True
    new = Profile.from_dict({"layer_time_s": {"1": 0.1}, "collectives": COLL, "layer_time_includes_tp_comm": False})
    again = Profile.from_dict(json.loads(json.dumps(new.to_dict())))
    assert again == new and again.to_dict()["collectives"] == COLL
    assert new.collectives.time(CollectiveKind.DP_ALL_REDUCE, 3, 1000) == pytest.approx(5e-3 + 4e-7)
    # group size 4 from the nearest measured (3): latency x 3/2, per-byte x (3/4)/(2/3)
    assert new.collectives.time(CollectiveKind.DP_ALL_REDUCE, 4, 1000) == pytest.approx(7.5e-3 + 4.5e-7)
    assert new.collectives.time(CollectiveKind.DP_ALL_REDUCE, 1, 1000) == 0.0


@pytest.mark.parametrize("coll, field", [
    ({"allreduce": {"2": {"latency_s": 0, "s_per_byte": 0}}}, "collectives.allreduce"),
    ({"p2p": {"3": {"latency_s": 0, "s_per_byte": 0}}}, "collectives.p2p.3"),
    ({"dp_all_reduce": {"1": {"latency_s": 0, "s_per_byte": 0}}}, "collectives.dp_all_reduce.1"),
    ({"dp_all_reduce": {"two": {"latency_s": 0, "s_per_byte": 0}}}, "collectives.dp_all_reduce.two"),
    ({"dp_all_reduce": {"2": {"latency_s": -1e-3, "s_per_byte": 0}}}, "collectives.dp_all_reduce.2.latency_s"),
    ({"dp_all_reduce": {"2": {"latency_s": 1e-3, "s_per_byte": float("nan")}}}, "collectives.dp_all_reduce.2.s_per_byte"),
    ({"dp_all_reduce": {"2": {"latency_s": "1", "s_per_byte": 0}}}, "collectives.dp_all_reduce.2.latency_s"),
    ({"dp_all_reduce": {"2": {"latency_s": 1e-3}}}, "collectives.dp_all_reduce.2"),
    ({"dp_all_reduce": {}}, "collectives.dp_all_reduce"),
    ([1, 2], "collectives"),
])
def test_bad_collectives_are_refused_naming_the_field(coll, field, tmp_path, capsys):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Profile.from_dict({"layer_time_s": {"1": 0.1}, "collectives": coll})
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"layer_time_s": {"1": 0.1}, "collectives": coll}))
    assert cli_main(BASE + ["--gpus-per-node", "8", "--profile", str(f)]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_bad_tp_comm_flag_is_refused(tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"layer_time_s": {"1": 0.1}, "layer_time_includes_tp_comm": "no"}))
    assert cli_main(BASE + ["--gpus-per-node", "8", "--profile", str(f)]) == 2
    assert "layer_time_includes_tp_comm" in capsys.readouterr().err


def test_cli_plans_with_a_measured_profile(tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"layer_time_s": {"1": 0.9, "2": 0.5, "4": 0.3}, "layer_time_includes_tp_comm": False,
                             "collectives": {"tp_all_reduce": {"2": {"latency_s": 5.0, "s_per_byte": 0.0}}}}))
    assert cli_main(BASE + ["--gpus-per-node", "8", "--profile", str(f), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # TP all-reduces of 5 s each: no stage uses TP > 1 although the compute alone would favour TP4
    assert {s["tp"] for r in doc["replicas"] for s in r["stages"]} == {1}


def test_standalone_layer_profile_says_tp_collectives_are_not_in_it():
    from elastor_ds.plan.profile import measure
    doc = measure(64, 4, 16, tps=(1, 2), device="cpu", warmup=1, iters=1)
    prof = Profile.from_dict(doc)
    assert sorted(prof.layer_time_s) == [1, 2] and prof.layer_time_includes_tp_comm is False
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100)
    cost = CostModel(model, TrainingSpec(1, 2, nominal_tp=2), Cluster.from_gpus_per_node("2"), profile=prof)
    # TP2: the measured compute plus 4 all-reduces of 1 x 16 x 64 x 2 B at the NVLink defaults
    # (2 (2-1)/2 x 2048 B / 150 GB/s + 20 us each)
    assert cost.layer_time(2) == pytest.approx(prof.layer_time_s[2] + 4 * (2048 / 150e9 + 20e-6))
    assert cost.layer_time(1) == prof.layer_time_s[1]


# ---- the call count against the runtime's own split all-reduce plan ---------------------------------
@pytest.mark.parametrize("replicas", [
    [[(1, (0, 4))], [(2, (0, 4))]],                                  # TP1 beside TP2
    [[(2, (0, 4))], [(1, (0, 1)), (1, (1, 4))]],                     # one-stage TP2 beside an uneven TP1 pipeline
    [[(2, (0, 2)), (1, (2, 4))], [(2, (0, 4))]],                     # TP2 -> TP1 stages beside TP2
    [[(1, (0, 1)), (1, (1, 2)), (1, (2, 3)), (1, (3, 4))], [(1, (0, 2)), (1, (2, 3)), (1, (3, 4))]],  # PP4 vs PP3
    [[(4, (0, 4))], [(2, (0, 2)), (2, (2, 4))], [(1, (0, 4))]],      # TP4, TP2 pipeline, TP1: nested blocks
    [[(1, (0, 4))], [(1, (0, 4))]],                                  # a grid: one call per rank
])
def test_sync_calls_are_the_runtime_holder_sets(replicas):
    """Independent oracle: the runtime's split all-reduce plan (elastor_ds.runtime, computed from the
    real megatron-core GPT tensor specs and their TP pieces) gives each rank one all-reduce per
    distinct holder set; the cost model's enumeration must list exactly those sets per rank, with
    exactly the same elements of the transformer layers and final norm (the embedding and output
    layer are counted without vocabulary padding and position embedding, so not compared)."""
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig, gpt_tensor_specs
    from elastor_ds.runtime import layout_held, replica_of, split_reduce_plan
    cfg = GPTSpecConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4, vocab_size=97,
                        ffn_hidden_size=256, gated_linear_unit=False, add_bias_linear=False, normalization="RMSNorm",
                        make_vocab_size_divisible_by=8, max_sequence_length=32)
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=97,
                      ffn_hidden_size=256, num_query_groups=4, dtype_bytes=4, tied_embeddings=False,
                      vocab_divisible_by=8)
    n = sum(tp for rep in replicas for tp, _ in rep)
    cost = CostModel(model, TrainingSpec(1, 4, nominal_tp=4, zero_stage=0), Cluster.from_gpus_per_node([n]))
    devs, k, reps = cost.cluster.devices(), 0, []
    for rep in replicas:
        stages = []
        for tp, layers in rep:
            stages.append(PlanStage(tp, layers, tuple(devs[k:k + tp])))
            k += tp
        reps.append(PlanReplica(tuple(stages), 1))
    p = Plan(4, tuple(reps))
    modelled = cost.sync_buffers(p)
    lay = p.to_layout()
    runtime = split_reduce_plan(layout_held(gpt_tensor_specs(cfg), lay), replica_of(lay))
    key = {r: (lay.position(r).replica, lay.position(r).stage, lay.position(r).tp_rank) for r in runtime}
    # elements of the transformer layers and the final norm, exactly (no vocabulary padding there)
    layers_only = sync_buffers([[(s.tp, s.layers) for s in r.stages] for r in p.replicas], model.params_per_layer,
                               2 * 64, last_replicated=64)
    for r, cells in runtime.items():
        sets: dict = {}
        body: dict = {}
        for c in cells:
            if c.cross_replica:
                hs = frozenset(key[h] for h in c.holders)
                sets[hs] = sets.get(hs, 0) + c.region.numel
                if not c.name.startswith(("embedding.", "output_layer.")):
                    body[hs] = body.get(hs, 0) + c.region.numel
        got = modelled.get(key[r], {})
        assert set(got) == set(sets), (r, key[r], sorted(map(sorted, sets)), sorted(map(sorted, got)))
        assert layers_only.get(key[r], {}) == body, r


@pytest.mark.parametrize("doc, words", [
    ({"layer_time_s": {"1": 0.01}, "activation_bytes_per_layer": {"1": -1e13}}, "activation_bytes_per_layer.1=-1"),
    ({"layer_time_s": {"1": 1e-320}}, "layer_time_s.1=1e-320"),
    ({"layer_time_s": {"1": True}}, "layer_time_s.1=True"),
    ({"layer_time_s": {"1_6": 0.1}}, "key '1_6' is not a TP width"),
    ({"layer_time_s": {"\uff11": 0.1}}, "is not a TP width"),
    ({"layer_time_s": {"1" + "0" * 20: 0.1}}, "is not a TP width"),
])
def test_profile_numbers_out_of_range_are_usage_errors(doc, words, tmp_path, capsys):
    """QA round 5: a negative activation size planned a 440 GiB model onto 2 GPUs with negative
    memory (Q5-4); a denormal layer time overflowed the planner (Q5-6); `true`, `1_6` and fullwidth
    digits passed as numbers or TP widths (Q5-11). Each is exit 2 naming the field."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"version": 1, **doc}))
    assert cli_main(BASE + ["--gpus-per-node", "8", "--profile", str(f)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "unexpected" not in err, err


@pytest.mark.parametrize("flag", ["--profile", "--from-plan"])
def test_plan_input_files_nested_too_deeply_or_symlinked_are_usage_errors(flag, tmp_path, capsys):
    """QA round 5, Q5-5 and Q5-12: 100,000 nested brackets were an "unexpected RecursionError"
    (exit 1); --profile followed a symlink and had no size bound (--from-plan refused both)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert cli_main(BASE + ["--gpus-per-node", "8", flag, str(deep)]) == 2
    err = capsys.readouterr().err
    assert "nested too deeply" in err and "Traceback" not in err and "unexpected" not in err, err
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.1}}))
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert cli_main(BASE + ["--gpus-per-node", "8", flag, str(link)]) == 2
    assert "a symlink is not followed" in capsys.readouterr().err


def test_profile_load_reads_like_the_cli(tmp_path):
    """``Profile.load`` (the DeepSpeed ``"elastor": {"profile": ...}`` key and the example trainer's
    profile.json) followed a symlink and read any size; it now reads like ``--profile``."""
    from elastor_ds.errors import ConfigError
    from elastor_ds.plan import Profile

    good = tmp_path / "profile.json"
    good.write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.1}}))
    assert Profile.load(good).layer_time_s == {1: 0.1}
    link = tmp_path / "link.json"
    link.symlink_to(good)
    with pytest.raises(ConfigError, match=r"elastor.profile .*link.json: cannot open .*a symlink is not followed"):
        Profile.load(link, "elastor.profile")
    big = tmp_path / "big.json"
    big.write_text(" " * (17 << 20) + "{}")
    with pytest.raises(ConfigError, match="big.json: 17,825,794 bytes; a JSON profile is at most 16,777,216"):
        Profile.load(big)
