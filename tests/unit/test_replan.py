"""Re-planning from the previous plan (elastor_ds.plan.replan, `elastor plan --from-plan`): on random
small losses (1-8 GPUs or one node) the re-plan is within 1 % of a full search on the same cluster,
is a valid plan of the new cluster, and keeps the undamaged replicas. Pure CPU, no process groups."""
from __future__ import annotations

import json
import random

import pytest

from elastor_ds.cli import main as cli_main
from elastor_ds.errors import ConfigError
from elastor_ds.plan import Cluster, CostModel, ModelSpec, Plan, TrainingSpec, plan
from elastor_ds.plan.replan import changed_nodes, replan

MODELS = {
    "7B": (ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                     seq_length=4096, vocab_size=32000, gated_mlp=True), 4),
    "70B": (ModelSpec(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                      num_query_groups=8, seq_length=4096, vocab_size=32000, gated_mlp=True), 8),
}


def named_cluster(counts: list[int], names: list[str]) -> Cluster:
    return Cluster.from_dict({"nodes": [{"name": n, "gpus": list(range(c))} for n, c in zip(names, counts)]})


def assert_valid(p: Plan, cluster: Cluster) -> None:
    """Every device at most once, used + unused = the cluster's usable devices, numbered like the
    cluster (node index by name), TP groups within a node, layers covered in order."""
    used = [d for r in p.replicas for s in r.stages for d in s.devices]
    assert len(used) == len(set(used)), "a device is used twice"
    assert set(used) | set(p.unused) == set(cluster.devices()) and not set(used) & set(p.unused)
    index = cluster.node_index()
    for r in p.replicas:
        assert r.stages[0].layers[0] == 0 and r.stages[-1].layers[1] == p.num_layers
        for a, b in zip(r.stages, r.stages[1:]):
            assert a.layers[1] == b.layers[0] and a.num_layers >= 1
        for s in r.stages:
            assert len({d.node for d in s.devices}) == 1
            assert all(index[d.node_name] == d.node for d in s.devices)
    p.to_layout()


def random_loss(rng: random.Random, nodes: int) -> tuple[list[int], list[str]]:
    """(GPUs per node, node names) after losing 1-8 random GPUs, or one whole node (its entry
    removed: later nodes shift)."""
    counts, names = [8] * nodes, [f"n{i}" for i in range(nodes)]
    if rng.random() < 0.3:
        k = rng.randrange(nodes)
        return counts[:k] + counts[k + 1:], names[:k] + names[k + 1:]
    for i in rng.sample(range(nodes * 8), rng.randint(1, 8)):
        counts[i // 8] -= 1
    return counts, names


@pytest.mark.parametrize("seed", range(6))
def test_replan_within_1_percent_of_full_search_on_random_losses(seed):
    """The re-plan alone (no full search beside it, as above FULL_SEARCH_BELOW GPUs) on 4,096 and
    8,192 GPUs, against the full search on the same cluster."""
    rng = random.Random(seed)
    name = rng.choice(["7B", "70B"])
    model, tp = MODELS[name]
    nodes = rng.choice([512, 1024])
    M = nodes * 8 // tp * rng.choice([1, 2, 4]) // rng.choice([1, 2])
    tr = TrainingSpec(1, M, nominal_tp=tp)
    before = named_cluster([8] * nodes, [f"n{i}" for i in range(nodes)])
    prev = plan(CostModel(model, tr, before)).best.plan
    after = named_cluster(*random_loss(rng, nodes))
    cost = CostModel(model, tr, after)
    res = replan(cost, prev, before, full_search_below=0)
    assert res.search_stats["replan"] == "from the previous plan", res.search_stats
    assert_valid(res.best.plan, after)
    got = cost.evaluate(res.best.plan)  # priced independently of the re-plan's own bookkeeping
    assert got.feasible and got.iteration_time_s == pytest.approx(res.best.cost.iteration_time_s)
    full = plan(cost).best.cost.iteration_time_s
    assert got.iteration_time_s <= full * 1.01, (name, nodes, tr.num_micro_batches, got.iteration_time_s, full,
                                                 res.best.plan.describe()[:200])


def test_replan_keeps_undamaged_replicas_and_their_devices():
    model, tp = MODELS["70B"]
    tr = TrainingSpec(1, 2048, nominal_tp=tp)
    before = Cluster.from_gpus_per_node([8] * 32)
    prev = plan(CostModel(model, tr, before)).best.plan
    after = Cluster.from_gpus_per_node([8] * 5 + [6] + [8] * 26)  # node5 lost two GPUs
    assert changed_nodes(before, after) == {"node5"}
    res = replan(CostModel(model, tr, after), prev, before, full_search_below=0)
    assert_valid(res.best.plan, after)
    kept = {tuple(s.devices for s in r.stages) for r in res.best.plan.replicas}
    undamaged = [r for r in prev.replicas if all(s.devices[0].node_name != "node5" for s in r.stages)]
    assert res.search_stats["path"] == "kept replicas", res.search_stats
    assert undamaged and res.search_stats["kept_replicas"] == len(undamaged)
    for r in undamaged:
        assert tuple(s.devices for s in r.stages) in kept


def test_replan_falls_back_to_full_search_and_says_why():
    model, tp = MODELS["7B"]
    tr = TrainingSpec(1, 64, nominal_tp=tp)
    before = Cluster.from_gpus_per_node([8] * 4)
    prev = plan(CostModel(model, tr, before)).best.plan
    other = ModelSpec(num_layers=30, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000)
    res = replan(CostModel(other, tr, Cluster.from_gpus_per_node([8, 8, 8, 7])), prev, before)
    assert res.search_stats["replan"].startswith("full search: the previous plan covers 32 layers, the model has 30")
    assert res.uniform is not None


BASE = ["plan", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008", "--swiglu",
        "--num-attention-heads", "32", "--seq-length", "4096", "--vocab-size", "32000",
        "--micro-batch-size", "1", "--global-batch-size", "64", "--tensor-model-parallel-size", "4"]


def test_cli_from_plan_round_trip(tmp_path, capsys):
    assert cli_main(BASE + ["--gpus-per-node", "8,8,8,8", "--json"]) == 0
    prev = tmp_path / "prev.json"
    prev.write_text(capsys.readouterr().out)
    assert cli_main(BASE + ["--gpus-per-node", "8,8,5,8", "--from-plan", str(prev), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["search"]["replan"] in ("from the previous plan", "full search: ") or \
        doc["search"]["replan"].startswith("full search: ") and "beats the re-plan" in doc["search"]["replan"]
    assert doc["predicted_iteration_time_s"] > 0
    names = [d for r in doc["replicas"] for s in r["stages"] for d in s["devices"]]
    assert len(names) == len(set(names)) and not {f"node2:{g}" for g in (5, 6, 7)} & set(names)
    usable = {d.name for d in Cluster.from_gpus_per_node("8,8,5,8").devices()}
    assert set(names) | set(doc["unused_devices"]) == usable
    # the table says it re-planned
    assert cli_main(BASE + ["--gpus-per-node", "8,8,5,8", "--from-plan", str(prev)]) == 0
    assert "re-planned: " in capsys.readouterr().out


@pytest.mark.parametrize("k", [1, 4])
def test_cli_from_plan_lists_top_k_alternatives(tmp_path, capsys, k):
    """Review of the thirty-second session: ``--top-k`` was ignored on the re-plan path (the
    result listed its own plan only). The alternatives are the re-plan's candidates and, below
    the full-search bound, the full search's: best first, distinct, at most k."""
    base = ["plan", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length",
            "4096", "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "512",
            "--tensor-model-parallel-size", "8"]
    assert cli_main(base + ["--gpus-per-node", "8,8,8,8", "--json"]) == 0
    prev = tmp_path / "prev.json"
    prev.write_text(capsys.readouterr().out)
    assert cli_main(base + ["--gpus-per-node", "8,8,8,7", "--from-plan", str(prev), "--json", "--top-k", str(k)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["search"]["replan"] == "from the previous plan"   # the re-plan's own result, not the full search's
    alts = doc["alternatives"]
    assert len(alts) == k
    times = [a["predicted_iteration_time_s"] for a in alts]
    assert times == sorted(times) and times[0] == doc["predicted_iteration_time_s"]
    assert len({a["description"] for a in alts}) == k


def test_cli_from_plan_bad_files(tmp_path, capsys):
    assert cli_main(BASE + ["--gpus-per-node", "8", "--from-plan", str(tmp_path / "missing.json")]) == 2
    assert "--from-plan" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "num_layers": 32, "replicas": [{"micro_batches": 1, "stages": '
                   '[{"tp": 2, "layers": [0, 32], "devices": ["node0:0"]}]}]}')
    assert cli_main(BASE + ["--gpus-per-node", "8", "--from-plan", str(bad)]) == 2
    assert "previous plan" in capsys.readouterr().err
    link = tmp_path / "link.json"
    link.symlink_to(bad)
    assert cli_main(BASE + ["--gpus-per-node", "8", "--from-plan", str(link)]) == 2


def test_previous_plan_document_checked_like_a_layout():
    """plan_from_document checks what Layout.from_json checks (it no longer builds the layout):
    contiguous layers covering the model, TP degrees, ranks 0..n-1 once each; each fault named."""
    import copy

    from elastor_ds.plan.plan_doc import plan_from_document
    cl = Cluster.from_gpus_per_node([4, 4])
    good = {"version": 1, "num_layers": 4, "replicas": [
        {"micro_batches": 1, "stages": [{"tp": 2, "layers": [0, 2], "devices": ["node0:0", "node0:1"]},
                                        {"tp": 1, "layers": [2, 4], "devices": ["node1:0"]}]},
        {"micro_batches": 3, "stages": [{"tp": 2, "layers": [0, 4], "devices": ["node1:2", "node1:3"]}]}]}
    prev, old = plan_from_document(good, cl)
    assert prev.describe() == "(mb1)[tp2:0-2|tp1:2-4] (mb3)[tp2:0-4]"
    assert [n.gpus for n in old.nodes] == [(0, 1), (0, 2, 3)]
    faults = [((0, 1), {"layers": [3, 4]}, "replica 0 stage 1 starts at layer 3 but the previous stage ends at 2"),
              ((1, 0), {"layers": [0, 3]}, "replica 1 covers layers [0, 3) but the model has 4"),
              ((0, 0), {"ranks": [0, 0]}, "rank 0 appears twice"),
              ((0, 0), {"ranks": [0, 7]}, "ranks must be 0..4 without gaps; missing [1]; out of range [7]"),
              ((0, 0), {"ranks": [0]}, "stage with tp=2 lists 1 ranks [0]"),
              ((0, 0), {"ranks": [-1, 1]}, "rank -1 is negative"),
              ((0, 0), {"layers": [2, 1]}, "stage layer range [2, 1) is invalid")]
    for (ri, si), change, want in faults:
        doc = copy.deepcopy(good)
        doc["replicas"][ri]["stages"][si].update(change)
        with pytest.raises(ConfigError, match="previous plan: malformed plan document") as e:
            plan_from_document(doc, cl)
        assert want in str(e.value), (change, str(e.value))


@pytest.mark.parametrize("path, value, want", [
    ((), {"version": True}, "expected a version-1 or -2 plan document"),
    ((), {"version": 1.0}, "expected a version-1 or -2 plan document"),
    ((), {"num_gpus": "4"}, "num_gpus must be an integer >= 1 (got '4' of type str)"),
    ((), {"num_layers": 4.0}, "num_layers must be an integer >= 1 (got '4.0' of type float)"),
    ((0,), {"micro_batches": -3}, "replica 0 micro_batches must be >= 1 (got -3)"),
    ((0,), {"micro_batches": True}, "replica 0 micro_batches must be an integer >= 1"),
    ((0, 0), {"tp": "2"}, "replica 0 stage 0 tp must be an integer >= 1 (got '2' of type str)"),
    ((0, 1), {"tp": 2}, "replica 0 stage 1 lists 1 devices for tp=2"),
    ((0, 1), {"layers": [2.0, 4]}, "replica 0 stage 1 layers[0] must be an integer"),
    ((0, 1), {"layers": "2-4"}, "replica 0 stage 1 layers must be [first, last_exclusive]"),
    ((0, 0), {"ranks": ["0", "1"]}, "replica 0 stage 0 ranks must be an integer (got '0' of type str)")])
def test_previous_plan_document_types_are_strict(path, value, want):
    """QA round 5, Q5-11: ``int()`` took true as version 1, "2" as a TP of 2, 2.0 as a layer, and
    negative micro-batch counts; each is now refused, naming the field and its place."""
    import copy

    from elastor_ds.plan.plan_doc import plan_from_document
    cl = Cluster.from_gpus_per_node([4, 4])
    doc = {"version": 1, "num_layers": 4, "replicas": [
        {"micro_batches": 1, "stages": [{"tp": 2, "layers": [0, 2], "devices": ["node0:0", "node0:1"]},
                                        {"tp": 1, "layers": [2, 4], "devices": ["node1:0"]}]}]}
    plan_from_document(copy.deepcopy(doc), cl)   # the unchanged document is good
    node = doc
    if path:
        node = doc["replicas"][path[0]]
        if len(path) > 1:
            node = node["stages"][path[1]]
    node.update(value)
    with pytest.raises(ConfigError) as e:
        plan_from_document(doc, cl)
    assert want in str(e.value), str(e.value)


@pytest.mark.parametrize("seed", range(4))
def test_bounded_reshape_ladder_finds_the_same_best_candidates(seed, monkeypatch):
    """The re-shape's ladder of replica counts (above RESHAPE_SEARCH_MAX GPUs; forced here on 2,048)
    skips counts whose lower bound exceeds the second-best estimate: the two best candidates are
    those of the full ladder."""
    import elastor_ds.plan.replan as rp
    monkeypatch.setattr(rp, "RESHAPE_SEARCH_MAX", 0)
    rng = random.Random(seed)
    name = rng.choice(["7B", "70B"])
    model, tp = MODELS[name]
    tr = TrainingSpec(1, 256 * rng.choice([1, 2, 4]), nominal_tp=tp)
    before = named_cluster([8] * 256, [f"n{i}" for i in range(256)])
    prev = plan(CostModel(model, tr, before)).best.plan
    after = named_cluster(*random_loss(rng, 256))

    def top2():  # noqa: ANN202
        r = rp._Replanner(CostModel(model, tr, after), prev, before, changed_nodes(before, after))
        kept, damaged, _ = r._split_replicas()
        return [(cd.estimate, cd.num_replicas, [(s.order, s.counts, m, n) for s, m, n in cd.kinds])
                for cd in r._reshape(kept, damaged)[:2]]

    bounded = top2()

    def every(self, pool, Rs, done, tried):  # noqa: ANN001, ANN202
        tried.update(Rs)
        return self.planner._lpt_replicas(pool, 0, list(Rs))

    monkeypatch.setattr(rp._Replanner, "_bounded_lpt", every)
    assert bounded == top2()
