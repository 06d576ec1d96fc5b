"""Pure group derivation of the heterogeneous runtime against brute-force enumeration: every element
of every parameter is reduced among exactly the ranks that hold it (one contribution per replica),
owned once for the norm; a simulated split all-reduce gives every holder the per-replica sum; p2p
pairing between stages of different TP widths covers every receiver exactly once."""
from __future__ import annotations

import itertools
import random

import pytest

from elastor_ds.errors import LayoutError
from elastor_ds.integrations.megatron.specs import GPTSpecConfig, gpt_tensor_specs
from elastor_ds.layout import Layout
from elastor_ds.runtime import (creation_order, layout_held, recv_source, reduce_groups, replica_of, send_targets,
                                split_reduce_bytes, split_reduce_plan, stage_groups, uniform_dp_bytes, zero_partition)

CFG = GPTSpecConfig(num_layers=4, hidden_size=8, num_attention_heads=4, num_query_groups=2, vocab_size=10,
                    ffn_hidden_size=12, gated_linear_unit=True, add_bias_linear=True, make_vocab_size_divisible_by=4,
                    max_sequence_length=4)
SPECS = gpt_tensor_specs(CFG)


def random_layout(rng: random.Random) -> Layout:
    reps = []
    for _ in range(rng.randint(1, 3)):
        pp = rng.randint(1, 3)
        cuts = sorted(rng.sample(range(1, CFG.num_layers), pp - 1))
        b = [0] + cuts + [CFG.num_layers]
        reps.append({"micro_batches": rng.randint(1, 3),
                     "stages": [{"tp": rng.choice([1, 2]), "layers": [b[i], b[i + 1]]} for i in range(pp)]})
    return Layout.from_json({"version": 1, "replicas": reps}, CFG.num_layers)


def elements(shape):
    return itertools.product(*[range(n) for n in shape])


def brute_holders(layout: Layout):
    """(tensor, element) -> {rank: local index} by walking every element of every piece."""
    out: dict = {}
    for rank, tensors in layout_held(SPECS, layout).items():
        for name, _, pieces in tensors:
            for p in pieces:
                for e in elements(p.global_.sizes):
                    g = tuple(o + x for o, x in zip(p.global_.offsets, e))
                    loc = tuple(o + x for o, x in zip(p.local.offsets, e))
                    out.setdefault((name, g), {})[rank] = loc
    return out


@pytest.mark.parametrize("seed", range(12))
def test_split_reduce_plan_matches_brute_force(seed):
    rng = random.Random(seed)
    layout = random_layout(rng)
    rep = replica_of(layout)
    plan = split_reduce_plan(layout_held(SPECS, layout), rep)
    truth = brute_holders(layout)
    seen: dict = {}
    for rank, cells in plan.items():
        for c in cells:
            for e in elements(c.region.sizes):
                g = tuple(o + x for o, x in zip(c.region.offsets, e))
                loc = tuple(o + x for o, x in zip(c.local.offsets, e))
                key = (c.name, g)
                assert key not in seen.get(rank, {}), f"element {key} in two cells of rank {rank}"
                seen.setdefault(rank, {})[key] = (loc, c)
    # every held element is in exactly one cell of its holder, with the brute-force holder set
    for key, holders in truth.items():
        hset = tuple(sorted(holders))
        for r, loc in holders.items():
            got_loc, c = seen[r][key]
            assert got_loc == loc and c.holders == hset, (key, r)
            first = min(x for x in hset if rep[x] == rep[r])
            assert c.contributes == (r == first)
            assert c.owner == (r == hset[0])
            assert c.cross_replica == (len({rep[x] for x in hset}) > 1)
        # one contribution per replica, one owner
        assert sum(seen[r][key][1].contributes for r in holders) == len({rep[x] for x in hset})
        assert sum(seen[r][key][1].owner for r in holders) == 1
    assert sum(len(v) for v in seen.values()) == sum(len(h) for h in truth.values())
    # simulated reduction: every holder ends with the sum of one value per replica (a tensor held by one
    # replica only, e.g. a TP-replicated norm with one replica, keeps its value: its copies are equal)
    val = {(r, key): rng.random() for key, hs in truth.items() for r in hs}
    for key, hs in truth.items():
        want = sum(val[(min(x for x in hs if rep[x] == p), key)] for p in {rep[x] for x in hs})
        for r in hs:
            c = seen[r][key][1]
            got = sum(val[(x, key)] for x in c.holders if seen[x][key][1].contributes) if c.cross_replica else val[(r, key)]
            assert got == pytest.approx(want if c.cross_replica else val[(r, key)])
    order = creation_order(layout, reduce_groups(plan))
    assert len(order) == len(set(order)) and order[:layout.world_size] == [(r,) for r in range(layout.world_size)]
    assert set(stage_groups(layout)) <= set(order) and set(reduce_groups(plan)) <= set(order)


@pytest.mark.parametrize("seed", range(8))
def test_zero1_shares_own_every_element_once(seed):
    """ZeRO-1 over the holders of each block, against brute force: walking every rank's share
    element by element, every element of every tensor held by two or more replicas is owned by
    exactly one of its holders; holders agree on each buffer's cell order; shares differ by at most
    one chunk; param groups never share a buffer."""
    rng = random.Random(100 + seed)
    layout = random_layout(rng)
    rep = replica_of(layout)
    plan = split_reduce_plan(layout_held(SPECS, layout), rep)
    truth = brute_holders(layout)
    names = sorted({n for n, _ in truth})
    group_of = {n: rng.randint(0, 1) for n in names}
    owned: dict = {}
    buffers: dict = {}
    for rank, cells in plan.items():
        for part in zero_partition(cells, rank, group_of):
            assert all(group_of[c.name] == part.group and c.holders == part.holders for c in part.cells)
            assert 0 <= part.end - part.start <= part.chunk and part.numel == sum(c.region.numel for c in part.cells)
            seq = [(c.name, c.region) for c in part.cells]
            assert buffers.setdefault((part.group, part.holders), seq) == seq, "holders disagree on a buffer"
            pos = 0
            for c in part.cells:
                for i, e in enumerate(elements(c.region.sizes)):
                    if part.start <= pos + i < part.end:
                        key = (c.name, tuple(o + x for o, x in zip(c.region.offsets, e)))
                        assert key not in owned, f"{key} owned by {owned.get(key)} and {rank}"
                        owned[key] = rank
                pos += c.region.numel
    multi = {key: hs for key, hs in truth.items() if len({rep[r] for r in hs}) > 1}
    assert set(owned) == set(multi)
    assert all(owned[key] in multi[key] for key in multi)
    sizes = {}
    for (g, holders), seq in buffers.items():
        n = sum(r.numel for _, r in seq)
        sizes[(g, holders)] = n
    for rank, cells in plan.items():  # shares are balanced: at most one chunk each
        for part in zero_partition(cells, rank, group_of):
            assert part.chunk == -(-sizes[(part.group, part.holders)] // len(part.holders))


def test_uniform_layout_split_bytes_equal_dp_allreduce():
    layout = Layout.uniform(2, 2, 3, CFG.num_layers)
    plan = split_reduce_plan(layout_held(SPECS, layout), replica_of(layout))
    for rank, cells in plan.items():
        local = sum(c.region.numel for c in cells)
        # layer norms are replicated over TP 2: reduced among 2 x 3 ranks, not 3
        norm = sum(c.region.numel for c in cells if len(c.holders) == 6)
        assert split_reduce_bytes(cells) == pytest.approx(
            uniform_dp_bytes(local - norm, 3) + 2 * 5 / 6 * norm * 4, abs=2)
    assert reduce_groups(plan)  # DP groups across the 3 replicas
    assert all(len({replica_of(layout)[r] for r in g}) == 3 for g in reduce_groups(plan))


def test_tp1_beside_tp2_splits_into_halves():
    layout = Layout.from_json({"version": 1, "replicas": [
        {"stages": [{"tp": 2, "layers": [0, 4]}]}, {"stages": [{"tp": 1, "layers": [0, 4]}]}]}, 4)
    plan = split_reduce_plan(layout_held(SPECS, layout), replica_of(layout))
    assert reduce_groups(plan) == [(0, 1, 2), (0, 2), (1, 2)]
    fc1 = [c for c in plan[2] if c.name == "decoder.layers.0.mlp.linear_fc1.weight"]
    # gate and up halves for TP rank 0 and 1: four row blocks of 6 (gated [gate; up], ffn 12)
    assert sorted((c.region.offsets[0], c.region.sizes[0], c.holders) for c in fc1) == [
        (0, 6, (0, 2)), (6, 6, (1, 2)), (12, 6, (0, 2)), (18, 6, (1, 2))]


def test_cross_width_p2p_pairs():
    layout = Layout.from_json({"version": 1, "replicas": [{"stages": [
        {"tp": 2, "layers": [0, 1]}, {"tp": 1, "layers": [1, 2]}, {"tp": 4, "layers": [2, 4]}]}]}, 4)
    # ranks: stage0 {0,1}, stage1 {2}, stage2 {3,4,5,6}
    assert send_targets(layout, 0, 1) == [2] and send_targets(layout, 1, 1) == []
    assert recv_source(layout, 2, 0) == 0
    assert send_targets(layout, 2, 2) == [3, 4, 5, 6] and [recv_source(layout, r, 1) for r in (3, 4, 5, 6)] == [2] * 4
    assert send_targets(layout, 2, 0) == [0, 1] and [recv_source(layout, r, 1) for r in (0, 1)] == [2, 2]
    assert send_targets(layout, 3, 1) == [2] and send_targets(layout, 4, 1) == [] and recv_source(layout, 2, 2) == 3
    # every receiver has exactly one sender and it is in that sender's target list
    for r in range(layout.world_size):
        st = layout.position(r).stage
        for src in (st - 1, st + 1):
            if 0 <= src < 3:
                assert r in send_targets(layout, recv_source(layout, r, src), st)
    with pytest.raises(LayoutError, match="adjacent"):
        send_targets(layout, 0, 2)


def test_deepspeed_auto_plan_from_launch_world(tmp_path):
    """"elastor": {"plan": "auto"} plans from WORLD_SIZE / LOCAL_WORLD_SIZE, the model description and a
    measured profile: the plan uses exactly the launched processes and no TP group spans two nodes."""
    import json

    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.deepspeed.autoplan import launch_world, resolve_plan
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.01, "2": 0.006}}))
    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 16,
           "elastor": {"plan": "auto", "profile": str(prof),
                       "model": {"hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
                                 "vocab_size": 32000}}}
    assert launch_world({"WORLD_SIZE": "7", "LOCAL_WORLD_SIZE": "4"}) == [4, 3]
    # uneven nodes under `elastor run`: the controller's list wins over this node's LOCAL_WORLD_SIZE
    assert launch_world({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "ELASTOR_PROCS_PER_NODE": "2,1"}) == [2, 1]
    assert launch_world({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "ELASTOR_PROCS_PER_NODE": "1,1"}) == [1, 1, 1]
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=0"):
        launch_world({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "0"})
    for env in ({"WORLD_SIZE": "7", "LOCAL_WORLD_SIZE": "4"}, {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}):
        lay = resolve_plan(cfg, num_layers=12, env=env)
        assert lay.world_size == int(env["WORLD_SIZE"]) and lay.num_layers == 12
        local = int(env["LOCAL_WORLD_SIZE"])
        assert all(len({r // local for r in s.ranks}) == 1 for rep in lay.replicas for s in rep.stages)
        assert sum(r.micro_batches for r in lay.replicas) == 16
    bad = dict(cfg, elastor={"plan": "auto"})
    with pytest.raises(ConfigError, match="needs the model description"):
        resolve_plan(bad, num_layers=12, env={"WORLD_SIZE": "3"})
    assert resolve_plan({"train_batch_size": 4}, num_layers=12) is None
