"""Pure unit tests of the layout model: regions, layouts, sharding rules, ZeRO ranges, save/load plans.
Expected values are computed by hand in the tests."""
from __future__ import annotations

import pytest

from elastor_ds.checkpoint.planning.load_plan import Request, plan_load
from elastor_ds.checkpoint.planning.manifest import Chunk, TensorEntry
from elastor_ds.checkpoint.planning.save_plan import ShardMeta, plan_save
from elastor_ds.errors import LayoutError, ShardingError, TensorMismatchError
from elastor_ds.layout import (Layout, Region, Replica, ShardRule, Stage, TensorSpec, flat_partition_pieces,
                               flat_range_to_regions, holdings, local_pieces, partition_bounds)


def R(offs, sizes):
    return Region(tuple(offs), tuple(sizes))


def test_region_intersect_and_flat_ranges():
    assert R((0, 0), (4, 4)).intersect(R((2, 3), (5, 5))) == R((2, 3), (2, 1))
    assert R((0,), (4,)).intersect(R((4,), (2,))) is None
    # 3x4 tensor, elements 2..9: row0 cols 2-3, row1 full, row2 cols 0-1
    assert flat_range_to_regions((3, 4), 2, 10) == [R((0, 2), (1, 2)), R((1, 0), (1, 4)), R((2, 0), (1, 2))]
    assert flat_range_to_regions((3, 4), 4, 12) == [R((1, 0), (2, 4))]
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_regions((3, 4), 0, 13)


def test_region_ends_are_kept_but_identity_is_offsets_and_sizes():
    import copy
    import dataclasses
    import pickle
    a, b = Region((2, 3), (4, 5)), Region((2, 3), (4, 5))
    assert a.ends == (6, 8) and Region((), ()).ends == ()
    assert a == b and hash(a) == hash(b) and not a < b and repr(a) == "Region(offsets=(2, 3), sizes=(4, 5))"
    assert sorted([Region((1,), (9,)), Region((0,), (3,))]) == [Region((0,), (3,)), Region((1,), (9,))]
    for c in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a), dataclasses.replace(a, sizes=(1, 1))):
        assert c.ends == tuple(o + s for o, s in zip(c.offsets, c.sizes))
    assert dataclasses.astuple(a) == ((2, 3), (4, 5))
    with pytest.raises(ValueError, match="negative"):
        Region((0, -1), (1, 1))
    with pytest.raises(ValueError, match="negative"):
        Region((0, 0), (1, -1))
    with pytest.raises(ValueError, match="rank mismatch"):
        Region((0,), (1, 1))


def test_uniform_rank_order_matches_deepspeed_and_megatron():
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=8)
    # rank = pp*(dp*tp) + dp*tp + tp
    p = lay.position(6)
    assert (p.stage, p.replica, p.tp_rank) == (1, 1, 0)
    assert lay.replicas[1].stages[0].ranks == (2, 3)
    assert lay.boundaries() == [0, 4, 8]
    assert lay.uniform_dims() == (2, 2, 2)


def test_layout_validation_messages_show_numbers():
    with pytest.raises(LayoutError, match=r"starts at layer 3 but the previous stage ends at 4"):
        Layout(8, (Replica((Stage(1, (0, 4), (0,)), Stage(1, (3, 8), (1,)))),))
    with pytest.raises(LayoutError, match=r"rank 0 appears twice"):
        Layout(4, (Replica((Stage(1, (0, 4), (0,)),)), Replica((Stage(1, (0, 4), (0,)),))))
    with pytest.raises(LayoutError, match=r"tp=2 lists 1 ranks"):
        Stage(2, (0, 4), (0,))
    with pytest.raises(LayoutError, match=r"missing \[1\]"):
        Layout(4, (Replica((Stage(1, (0, 4), (0,)),)), Replica((Stage(1, (0, 4), (2,)),))))


def test_heterogeneous_plan_json_roundtrip():
    plan = {"version": 1, "replicas": [
        {"micro_batches": 16, "stages": [{"tp": 1, "layers": [0, 6]}, {"tp": 4, "layers": [6, 32]}]},
        {"micro_batches": 16, "stages": [{"tp": 2, "layers": [0, 32]}]}]}
    lay = Layout.from_json(plan)
    assert lay.world_size == 7 and not lay.is_uniform()
    assert lay.replicas[1].stages[0].ranks == (5, 6)
    assert Layout.from_json(lay.to_json()) == lay
    with pytest.raises(LayoutError, match="version 3"):
        Layout.from_json({"version": 3, "replicas": []})
    with pytest.raises(LayoutError, match="num_layers=None: must be an integer"):  # version 2: compact, checked
        Layout.from_json({"version": 2, "replicas": []})


def test_gated_mlp_pieces_tp2():
    # ffn=4, hidden=3: global rows [gate0..3, up0..3]; TP rank 1 holds gate2,gate3,up2,up3
    spec = TensorSpec("fc1", (8, 3), rule=ShardRule.gated_mlp(4), placement=0)
    shape, pieces = local_pieces(spec, 2, 1)
    assert shape == (4, 3)
    assert [(p.local, p.global_) for p in pieces] == [(R((0, 0), (2, 3)), R((2, 0), (2, 3))),
                                                      (R((2, 0), (2, 3)), R((6, 0), (2, 3)))]


def test_fused_qkv_gqa_pieces_follow_groups():
    # 4 heads, 2 groups, head_dim 2: a group = (2 q + k + v) * 2 = 8 rows; TP2 rank 1 = rows 8..16
    spec = TensorSpec("qkv", (16, 8), rule=ShardRule.fused_qkv(4, 2, 2), placement=0)
    shape, pieces = local_pieces(spec, 2, 1)
    assert shape == (8, 8) and pieces[0].global_ == R((8, 0), (8, 8))
    # TP4 with 2 groups: uneven (ranks 0 and 2 get nothing), never splits a group
    sizes = [local_pieces(spec, 4, r)[0][0] for r in range(4)]
    assert sorted(sizes) == [0, 0, 8, 8]


def test_vocab_parallel_padding():
    # 10 rows, pad multiple 4, TP2: padded to 16, 8 rows per rank; rank 1 holds global rows 8,9 + 6 padding rows
    spec = TensorSpec("emb", (10, 2), rule=ShardRule.vocab_parallel(4), placement="tied")
    shape, pieces = local_pieces(spec, 2, 1)
    assert shape == (8, 2) and [p.global_ for p in pieces] == [R((8, 0), (2, 2))]
    lay = Layout.uniform(1, 2, 1, 4)
    assert [h.rank for h in holdings(spec, lay)] == [0, 1]  # tied: first and last stage


def test_row_parallel_and_bad_rules():
    spec = TensorSpec("proj", (4, 6), rule=ShardRule.row_parallel(), placement=0)
    assert [p.global_ for p in local_pieces(spec, 3, 2)[1]] == [R((0, 4), (4, 2))]
    with pytest.raises(ShardingError, match="parts"):
        TensorSpec("x", (8, 3), rule=ShardRule.split(0, parts=(3, 3)), placement=0)


def test_zero_partition_maps_to_global_regions():
    # two local params (TP rank 1 of gated fc1 (4x3) and a (2,) bias); flat = 14 elements, dp=2 -> 7 each
    spec = TensorSpec("fc1", (8, 3), rule=ShardRule.gated_mlp(4), placement=0)
    s1, p1 = local_pieces(spec, 2, 1)
    bias = TensorSpec("b", (2,), placement=0)
    s2, p2 = local_pieces(bias, 2, 1)
    assert partition_bounds(14, 2, 1) == (7, 14)
    fps = flat_partition_pieces([s1, s2], [p1, p2], 7, 14)
    # local fc1 elements 7..11 = local row 2 col 1-2 (global row 6), local row 3 (global row 7); then bias
    assert [(f.param_index, f.flat_offset, f.global_) for f in fps] == [
        (0, 0, R((6, 1), (1, 2))), (0, 2, R((7, 0), (1, 3))), (1, 5, R((0,), (2,)))]


def test_save_plan_dedups_and_balances():
    # dp=2 replicas each hold the two halves of a (8,4) fp32 tensor: 4 ranks, 2 distinct regions
    top, bot = R((0, 0), (4, 4)), R((4, 0), (4, 4))
    per_rank = [[ShardMeta("w", (8, 4), "float32", top)], [ShardMeta("w", (8, 4), "float32", bot)],
                [ShardMeta("w", (8, 4), "float32", top)], [ShardMeta("w", (8, 4), "float32", bot)]]
    plan = plan_save(per_rank)
    written = sorted(i.region for its in plan.items for i in its)
    assert written == sorted([top, bot])  # each region exactly once
    assert sorted(plan.bytes_per_rank()) == [0, 0, 64, 64]  # spread over two ranks, not one
    # overlapping holdings (TP2 replica + TP1 replica) -> grid cells, still exactly once
    per_rank = [[ShardMeta("w", (8, 4), "float32", top)], [ShardMeta("w", (8, 4), "float32", bot)],
                [ShardMeta("w", (8, 4), "float32", R((0, 0), (8, 4)))]]
    plan = plan_save(per_rank)
    assert sum(plan.bytes_per_rank()) == 128
    assert max(plan.bytes_per_rank()) <= 64
    with pytest.raises(ShardingError, match="held by no rank"):
        plan_save([[ShardMeta("w", (8, 4), "float32", top)]])
    with pytest.raises(ShardingError, match="all ranks must agree"):
        plan_save([[ShardMeta("w", (8, 4), "float32", top)], [ShardMeta("w", (8, 5), "float32", bot)]])


def test_load_plan_coalesces_and_reads_each_byte_once():
    # two chunks stored back to back in one file; a request spanning both -> one merged read
    ent = TensorEntry("w", (8, 4), "float32", (Chunk("f", "a", R((0, 0), (4, 4)), 100, 64),
                                               Chunk("f", "b", R((4, 0), (4, 4)), 164, 64)))
    plan = plan_load({"w": ent}, [Request("w", R((0, 0), (8, 4)), 0)])
    assert len(plan.reads) == 1 and plan.reads[0].offset == 100 and plan.reads[0].length == 128
    # an eighth of the columns of big rows -> one strided op, reading exactly the needed runs
    big = TensorEntry("w", (4, 65536), "float32", (Chunk("f", "a", R((0, 0), (4, 65536)), 0, 4 * 65536 * 4),))
    plan = plan_load({"w": big}, [Request("w", R((0, 0), (4, 8192)), 0)])
    assert plan.bytes_read == plan.bytes_needed == 4 * 8192 * 4
    assert len(plan.reads) == 1 and plan.reads[0].repeat == 4 and plan.reads[0].stride == 65536 * 4
    # half the columns -> sequential covering read (2 rows' span minus the tail)
    plan = plan_load({"w": big}, [Request("w", R((0, 0), (4, 32768)), 0)])
    assert plan.bytes_read == (3 * 65536 + 32768) * 4
    with pytest.raises(TensorMismatchError, match="not in the checkpoint"):
        plan_load({"w": ent}, [Request("x", R((0,), (1,)), 0)])
