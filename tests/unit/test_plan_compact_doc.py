"""The compact plan document (version 2, elastor_ds.layout.compact_plan): the same plan as version
1 (same layout, same fingerprint, the same previous plan read back by `--from-plan`), every field
checked with the bad value named, and `elastor plan --json` writes it above 4,096 GPUs. Pure CPU."""
from __future__ import annotations

import copy
import json
import random

import pytest

from elastor_ds.cli import main as cli_main
from elastor_ds.errors import ConfigError, LayoutError
from elastor_ds.layout import Layout
from elastor_ds.layout.compact_plan import encode_devices, segments
from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan, plan_document
from elastor_ds.plan.plan_doc import plan_from_document

MODEL = ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                  seq_length=4096, vocab_size=32000, gated_mlp=True)


def random_nodes(rng: random.Random) -> list[dict]:
    nodes = []
    for i in range(rng.choice([3, 9, 40])):
        gpus = sorted(rng.sample(range(8), rng.choice([8, 8, 7, 5, 0])))
        nodes.append({"name": f"n{i}", "gpus": gpus, "speed": {str(g): 0.5 for g in gpus if rng.random() < 0.05}})
    return nodes


@pytest.mark.parametrize("seed", range(6))
def test_compact_document_is_the_same_plan(seed):
    rng = random.Random(seed)
    nodes = random_nodes(rng)
    res = plan(CostModel(MODEL, TrainingSpec(1, 256, nominal_tp=4), Cluster.from_dict({"nodes": nodes})))
    v1 = json.loads(json.dumps(plan_document(res, 256, 1)))
    v2 = json.loads(json.dumps(plan_document(res, 256, 1, compact=True)))
    assert v2["version"] == 2 and "replicas" not in v2 and len(json.dumps(v2)) < len(json.dumps(v1))
    assert v1["fingerprint"] == v2["fingerprint"]
    # the document's fingerprint (hashed from the plan) is what the Layout read from it hashes to
    assert v1["fingerprint"] == Layout.from_json(v1).fingerprint() == Layout.from_json(v2).fingerprint()
    assert Layout.from_json(v1).to_json() == Layout.from_json(v2).to_json()
    for k in ("predicted_iteration_time_s", "description", "kind", "num_gpus"):
        assert v1[k] == v2[k]
    # read back against a cluster that lost a node (later nodes shift): the same previous plan
    now = Cluster.from_dict({"nodes": nodes[:1] + nodes[2:]})
    p1, c1 = plan_from_document(v1, now)
    p2, c2 = plan_from_document(v2, now)
    assert p1 == p2 and c1 == c2
    assert [r.shape_key() for r in p1.replicas] == [r.shape_key() for r in p2.replicas]
    assert all(p1.replicas_on([n]) == p2.replicas_on([n]) for n in range(-1, len(c1.nodes)))


def test_segments_and_device_fields():
    assert segments([0, 4, 8, 12, 100, 101]) == [[0, 4, 4], [100, 1, 2]]
    assert segments([7]) == [[7, 1, 1]] and segments([]) == []
    assert encode_devices([[0, 1], [2, 3], [5, 4], [8, 9]]) == [[0, 2, 2], {"at": [5, 4]}, [8, 1, 1]]


GOOD = {"version": 2, "num_layers": 4, "nodes": [["node0", 4], ["node1", [0, 2, 3]]],
        "replica_groups": [
            {"count": 1, "micro_batches": 1, "stages": [{"tp": 2, "layers": [0, 2], "devices": [[0, 1, 1]]},
                                                        {"tp": 1, "layers": [2, 4], "devices": [[4, 1, 1]]}]},
            {"count": 1, "micro_batches": 3, "stages": [{"tp": 2, "layers": [0, 4], "devices": [{"at": [5, 6]}]}]}],
        "unused_devices": [[2, 1, 2]]}


def test_compact_document_checked_field_by_field():
    cl = Cluster.from_gpus_per_node([4, 4])
    prev, old = plan_from_document(GOOD, cl)
    assert prev.describe() == "(mb1)[tp2:0-2|tp1:2-4] (mb3)[tp2:0-4]"
    assert [n.gpus for n in old.nodes] == [(0, 1, 2, 3), (0, 2, 3)]
    assert [d.name for d in prev.unused] == ["node0:2", "node0:3"]
    lay = Layout.from_json(GOOD)
    assert [s.devices for r in lay.replicas for s in r.stages] == [("node0:0", "node0:1"), ("node1:0",),
                                                                   ("node1:2", "node1:3")]
    assert [s.ranks for r in lay.replicas for s in r.stages] == [(0, 1), (2,), (3, 4)]
    faults = [
        (lambda d: d.update(version=3), "version 3"),
        (lambda d: d["nodes"].append(["node0", 2]), "node names must be distinct"),
        (lambda d: d["nodes"][1].__setitem__(1, [0, 3, 2]), "must be ascending"),
        (lambda d: d["nodes"][0].__setitem__(1, 65), "nodes[0] GPU count=65"),
        (lambda d: d["replica_groups"][0]["stages"][1].update(layers=[3, 4]), "should start at 2"),
        (lambda d: d["replica_groups"][1]["stages"][0].update(layers=[0, 3]), "cover layers [0, 3)"),
        (lambda d: d["replica_groups"][0]["stages"][0].update(devices=[[5, 1, 1]]), "is placed 2 times"),
        (lambda d: d["replica_groups"][0]["stages"][0].update(devices=[[6, 1, 1]]), "run outside the 7 devices"),
        (lambda d: d["replica_groups"][0]["stages"][0].update(devices=[[0, 1, 2]]), "count=2"),
        (lambda d: d["replica_groups"][0].update(count=True), "count=True: must be an integer"),
        (lambda d: d["replica_groups"][0]["stages"][0].update(tp="2"), "tp='2': must be an integer"),
        (lambda d: d["replica_groups"][1]["stages"][0].update(devices=[{"at": [5]}]), "2 device positions"),
        (lambda d: d.update(unused_devices=[[2, 1, 1]]), "lists 1 devices"),
        (lambda d: d.update(replica_groups=[]), "at least one replica"),
    ]
    for change, want in faults:
        doc = copy.deepcopy(GOOD)
        change(doc)
        with pytest.raises(ConfigError, match="^previous plan: ") as e:
            plan_from_document(doc, cl)
        assert want in str(e.value), (want, str(e.value))
        with pytest.raises(LayoutError) as e2:
            Layout.from_json(doc)
        assert want in str(e2.value)


def test_cli_json_is_compact_above_4096_gpus_and_from_plan_reads_it(tmp_path, capsys):
    base = ["plan", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008", "--swiglu",
            "--num-attention-heads", "32", "--seq-length", "4096", "--vocab-size", "32000",
            "--micro-batch-size", "1", "--global-batch-size", "4096", "--tensor-model-parallel-size", "4"]
    counts = [8] * 520
    assert cli_main(base + ["--gpus-per-node", ",".join(map(str, counts)), "--json"]) == 0
    text = capsys.readouterr().out
    doc = json.loads(text)
    assert doc["version"] == 2 and len(text) < 200_000
    assert Layout.from_json(doc).world_size == doc["num_gpus"]
    prev = tmp_path / "prev.json"
    prev.write_text(text)
    counts[7] = 5
    assert cli_main(base + ["--gpus-per-node", ",".join(map(str, counts)), "--from-plan", str(prev), "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert new["version"] == 2 and new["search"]["replan"] == "from the previous plan"
    lay = Layout.from_json(new)
    names = [d for r in lay.replicas for s in r.stages for d in s.devices]
    assert len(names) == len(set(names)) and not {f"node7:{g}" for g in (5, 6, 7)} & set(names)
