"""Reading a version-2 plan document back (plan_from_document): the fast loader (C-level passes
over the nodes, the table's devices as runs of slices, each replica's stages made when first read)
gives the same plan and cluster as a straightforward construction: the version-1 reader, which
makes every device from its name one by one, on the same document expanded to version 1; and a
brute-force old cluster made here. Checked for clusters that kept, lost, slowed, renamed, added and
reordered nodes, stages read one replica at a time and all at once. Pure CPU."""
from __future__ import annotations

import copy
import json
import pickle
import random

import pytest

from elastor_ds.layout.compact_plan import decode, to_replicas_json
from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan, plan_document
from elastor_ds.plan import plan_doc
from elastor_ds.plan.cluster import Node
from elastor_ds.plan.plan_doc import plan_from_document

MODEL = ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                  seq_length=4096, vocab_size=32000, gated_mlp=True)


def as_version1(doc: dict) -> dict:
    """The same plan as a version-1 document (every device by name)."""
    cp = decode(doc)
    names = cp.device_names()
    return {"version": 1, "num_layers": cp.num_layers, "kind": doc.get("kind"), "replicas": to_replicas_json(cp),
            "unused_devices": [names[p] for p in cp.unused.tolist()]}


def brute_cluster(doc: dict, now: Cluster) -> Cluster:
    """The cluster a document was made for, numbered like ``now``: by name, GPU by GPU."""
    cp = decode(doc)
    table = dict(zip(cp.node_names, cp.node_gpus))
    nodes = []
    for nd in now.nodes:
        ids = table.get(nd.name, ())
        speed = dict(zip(nd.gpus, nd.speeds))
        nodes.append(Node(nd.name, tuple(ids), tuple(speed.get(g, 1.0) for g in ids)))
    have = {nd.name for nd in now.nodes}
    nodes += [Node(n, tuple(ids), (1.0,) * len(ids)) for n, ids in table.items() if n not in have]
    return Cluster(tuple(nodes), now.gpu_memory_gb, now.intra_node_bandwidth_gbs, now.inter_node_bandwidth_gbs)


def check_same(doc: dict, now: Cluster, read: str) -> None:
    p1, c1 = plan_from_document(as_version1(doc), now)
    p2, c2 = plan_from_document(copy.deepcopy(doc), now)
    assert c2 == c1 == brute_cluster(doc, now)
    assert [n.speeds for n in c2.nodes] == [n.speeds for n in c1.nodes]
    # what the re-plan reads before any stage is made
    assert p2.num_gpus == p1.num_gpus and p2.num_replicas == p1.num_replicas
    assert [r.num_gpus for r in p2.replicas] == [r.num_gpus for r in p1.replicas]
    assert p2.priced_replicas() == p1.priced_replicas()
    assert p2.uniform_dims() == p1.uniform_dims() and p2.describe() == p1.describe()
    assert all(p1.replicas_on([n]) == p2.replicas_on([n]) for n in range(-1, len(c1.nodes)))
    assert p2.unused == p1.unused
    reps = p2.replicas
    if read == "some":  # a few replicas, as the re-plan reads them, then every one (the bulk path)
        idx = sorted({0, len(reps) - 1, len(reps) // 2})
        for i in idx:
            assert reps[i].stages == p1.replicas[i].stages
        assert sum("stages" in r.__dict__ for r in reps) == len(idx) or len(reps) > plan_doc._GroupStages.BULK
    m = reps[-1].with_micro_batches(reps[-1].micro_batches + 1)  # a copy made before its stages are
    assert m.stages == p1.replicas[-1].stages and m.shape_key() is reps[-1].shape_key()
    assert p2 == p1
    for r1, r2 in zip(p1.replicas, p2.replicas):
        assert r2.micro_batches == r1.micro_batches and r2.shape_key() == r1.shape_key()
        for s1, s2 in zip(r1.stages, r2.stages):
            assert (s2.tp, s2.layers, s2.devices, s2.speed, s2.node) == (s1.tp, s1.layers, s1.devices, s1.speed,
                                                                        s1.node)
            assert [(d.node, d.node_name, d.local_id, d.speed) for d in s2.devices] == \
                [(d.node, d.node_name, d.local_id, d.speed) for d in s1.devices]
    assert p2.holder_nodes() == p1.holder_nodes()
    assert p2.layout_fingerprint() == p1.layout_fingerprint()


def random_nodes(rng: random.Random, n: int) -> list[dict]:
    nodes = []
    for i in range(n):
        gpus = sorted(rng.sample(range(8), rng.choice([8, 8, 8, 7, 4])))
        nodes.append({"name": f"n{i}", "gpus": gpus, "speed": {str(g): 0.5 for g in gpus if rng.random() < 0.03}})
    return nodes


def variants(rng: random.Random, nodes: list[dict]) -> dict[str, list[dict]]:
    """Clusters after the plan was made: unchanged, a GPU lost, a node's GPUs all lost (still
    listed), a node removed (later ones shift), a GPU slowed, a node renamed (gone + new), nodes
    added, the order reversed."""
    k = rng.randrange(len(nodes))
    out = {"same": copy.deepcopy(nodes)}
    lost = copy.deepcopy(nodes)
    lost[k]["gpus"] = lost[k]["gpus"][1:]
    lost[k]["speed"] = {g: v for g, v in lost[k]["speed"].items() if int(g) in lost[k]["gpus"]}
    out["gpu lost"] = lost
    empty = copy.deepcopy(nodes)
    empty[k].update(gpus=[], speed={})
    out["node emptied"] = empty
    out["node removed"] = copy.deepcopy(nodes[:k] + nodes[k + 1:])
    slow = copy.deepcopy(nodes)
    slow[k]["speed"] = {str(slow[k]["gpus"][0]): 0.25}
    out["gpu slowed"] = slow
    ren = copy.deepcopy(nodes)
    ren[k]["name"] = "fresh"
    out["node renamed"] = ren
    out["nodes added"] = copy.deepcopy(nodes) + [{"name": "x0", "gpus": list(range(8))}, {"name": "x1", "gpus": [0]}]
    out["reversed"] = copy.deepcopy(nodes[::-1])
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("read", ["some", "all"])
def test_fast_loader_matches_the_straightforward_one(seed, read, monkeypatch):
    monkeypatch.setattr(plan_doc._GroupStages, "BULK", 3)  # both paths: replica by replica, then the group
    rng = random.Random(seed)
    nodes = random_nodes(rng, rng.choice([6, 17, 40]))
    res = plan(CostModel(MODEL, TrainingSpec(1, 256, nominal_tp=rng.choice([1, 2, 4])),
                         Cluster.from_dict({"nodes": nodes})))
    doc = json.loads(json.dumps(plan_document(res, 256, 1, compact=True)))
    for name, now in variants(rng, nodes).items():
        if not any(n["gpus"] for n in now):
            continue
        check_same(doc, Cluster.from_dict({"nodes": now}), read)


def test_hand_made_documents_stages_across_runs_and_positions_one_by_one():
    # stage groups across two nodes (positions 2, 3: node a's last GPU and node b's first) and a
    # TP group given position by position, on a cluster where b changed (its devices made anew)
    doc = {"version": 2, "num_layers": 4, "nodes": [["a", 3], ["b", 3], ["c", [0, 2]]],
           "replica_groups": [
               {"count": 1, "micro_batches": 2, "stages": [{"tp": 2, "layers": [0, 2], "devices": [[2, 1, 1]]},
                                                           {"tp": 2, "layers": [2, 4], "devices": [{"at": [6, 0]}]}]},
               {"count": 2, "micro_batches": 1, "stages": [{"tp": 1, "layers": [0, 4], "devices": [[4, 3, 2]]}]}],
           "unused_devices": [[1, 1, 1], [5, 1, 1]]}
    for now in (Cluster.from_dict({"nodes": [{"name": "a", "gpus": [0, 1, 2]}, {"name": "b", "gpus": [0, 2]},
                                             {"name": "c", "gpus": [0, 2], "speed": {"2": 0.5}}]}),
                Cluster.from_dict({"nodes": [{"name": "c", "gpus": [0, 1, 2]}, {"name": "a", "gpus": [0, 1, 2]}]}),
                Cluster.from_gpus_per_node([3, 3])):
        for read in ("some", "all"):
            check_same(doc, now, read)


def test_a_loaded_replica_before_and_after_its_stages_are_made():
    res = plan(CostModel(MODEL, TrainingSpec(1, 64, nominal_tp=4), Cluster.from_gpus_per_node([8] * 6)))
    doc = json.loads(json.dumps(plan_document(res, 64, 1, compact=True)))
    now = Cluster.from_gpus_per_node([8] * 6)
    p, _ = plan_from_document(doc, now)
    r = p.replicas[0]
    assert "stages" not in r.__dict__
    # a stage read before the cluster made its device tuple: devices made from the table's arrays,
    # equal to the cluster's own (which the load did not make: the re-plan does not need them)
    got = p.replicas[1].stages
    assert "_devices" not in now.__dict__
    own = set(now.device_tuple())
    assert all(d in own for s in got for d in s.devices)
    assert getattr(r, "no_such_field", None) is None
    with pytest.raises(AttributeError, match="no_such_field"):
        r.no_such_field  # noqa: B018
    q = pickle.loads(pickle.dumps(r))
    assert "_lazy" not in q.__dict__ and "_lazy" not in copy.deepcopy(r).__dict__
    assert q == r and hash(q) == hash(r) and copy.deepcopy(r) == r and "stages" in r.__dict__
    assert q.shape_key() == r.shape_key() and q.num_gpus == r.num_gpus
    assert repr(r).startswith("PlanReplica(stages=(PlanStage(")
    assert p.replicas[1].with_micro_batches(3).stages == p.replicas[1].stages
