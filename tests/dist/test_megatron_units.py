"""Megatron integration without process groups: rank order, pipeline layouts, specs, name
mapping, and the legacy export -> import round trip through ``elastor convert``."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from elastor_ds.errors import ConfigError, LayoutError
from elastor_ds.integrations.megatron.convert import torch_dist_key
from elastor_ds.integrations.megatron.parallel import check_layout, megatron_rank, pipeline_layer_layout
from elastor_ds.integrations.megatron.specs import GPTSpecConfig, global_to_local, gpt_tensor_specs, local_to_global
from elastor_ds.layout import Layout, Replica, Stage, local_pieces


@pytest.mark.parametrize("tp,pp,dp", list(itertools.product((1, 2, 4), (1, 2, 3), (1, 2))))
def test_layout_uniform_is_megatron_order(tp, pp, dp):
    lay = Layout.uniform(tp, pp, dp, 6)
    for r in range(lay.world_size):
        p = lay.position(r)
        assert megatron_rank(p.tp_rank, p.replica, p.stage, tp, dp) == r
    assert check_layout(lay).world_size == tp * pp * dp


def test_megatron_rank_generator_agrees():
    """megatron-core's own RankGenerator (tp-cp-ep-dp-pp) gives the same TP and DP groups."""
    rg_mod = pytest.importorskip("megatron.core.parallel_state")
    tp, pp, dp = 2, 3, 2
    gen = rg_mod.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    lay = Layout.uniform(tp, pp, dp, 6)
    for group in gen.get_ranks("tp"):
        assert len({(lay.position(r).replica, lay.position(r).stage) for r in group}) == 1
    for group in gen.get_ranks("pp"):
        assert [lay.position(r).stage for r in group] == list(range(pp))
    for group in gen.get_ranks("dp"):
        assert [lay.position(r).replica for r in group] == list(range(dp))


def test_check_layout_rejects_heterogeneous_and_reordered():
    het = Layout(4, (Replica((Stage(2, (0, 2), (0, 1)), Stage(1, (2, 4), (2,)))),))
    with pytest.raises(LayoutError, match="uniform"):
        check_layout(het)
    swapped = Layout(2, (Replica((Stage(1, (0, 1), (1,)), Stage(1, (1, 2), (0,)))),))
    with pytest.raises(LayoutError, match="rank 0"):
        check_layout(swapped)


def test_pipeline_layer_layout_uneven():
    grid = check_layout(Layout.uniform(1, 3, 1, 4))
    assert grid.uneven
    assert pipeline_layer_layout(grid) == [["embedding", "decoder"], ["decoder"], ["decoder", "decoder", "loss"]]


def _cfg(**kw):
    base = dict(num_layers=3, hidden_size=16, num_attention_heads=8, num_query_groups=4, vocab_size=50,
                ffn_hidden_size=24, gated_linear_unit=True, make_vocab_size_divisible_by=4, max_sequence_length=8)
    base.update(kw)
    return GPTSpecConfig(**base)


def test_specs_shapes_and_local_shapes():
    cfg = _cfg()
    specs = {s.name: s for s in gpt_tensor_specs(cfg)}
    qkv = specs["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((8 + 2 * 4) * 2, 16)
    for tp in (1, 2, 4):
        shape, pieces = local_pieces(qkv, tp, tp - 1)
        assert shape[0] == qkv.shape[0] // tp and len(pieces) == 1
        fc1 = specs["decoder.layers.0.mlp.linear_fc1.weight"]
        shape, pieces = local_pieces(fc1, tp, 0)
        assert shape == (48 // tp, 16) and [p.global_.offsets[0] for p in pieces] == ([0] if tp == 1 else [0, 24])
        emb = specs["embedding.word_embeddings.weight"]
        shape, _ = local_pieces(emb, tp, 0)
        assert shape[0] * tp == cfg.padded_vocab(tp)
    with pytest.raises(ConfigError, match="query_groups"):
        cfg.check_tp(8)


def test_name_mapping():
    assert local_to_global("decoder.layers.0.mlp.linear_fc1.weight", 2) == "decoder.layers.2.mlp.linear_fc1.weight"
    assert global_to_local("decoder.layers.3.mlp.linear_fc1.weight", 2) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert torch_dist_key("decoder.layers.2.input_layernorm.weight") == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 2)
    assert torch_dist_key("output_layer.weight") == ("output_layer.weight", None)


@pytest.mark.parametrize("tied", [False, True])
def test_legacy_roundtrip_cli(tmp_path, tied):
    from elastor_ds.checkpoint.convert import write_single_writer_checkpoint
    from elastor_ds.cli import main

    cfg = _cfg(share_embeddings_and_output_weights=tied)
    specs = gpt_tensor_specs(cfg)
    g = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    src = str(tmp_path / "el")
    write_single_writer_checkpoint(src, 5, list(full), {n: t.shape for n, t in full.items()},
                                   {n: "float32" for n in full}, full.__getitem__, model=cfg.to_json(),
                                   progress=False)
    meg = str(tmp_path / "meg")
    assert main(["convert", src, meg, "--to", "megatron", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--no-progress"]) == 0
    assert open(os.path.join(meg, "latest_checkpointed_iteration.txt")).read() == "5"
    sd = torch.load(os.path.join(meg, "iter_0000005", "mp_rank_01_001", "model_optim_rng.pt"), weights_only=False)
    # stage 1 holds global layer 2 (boundaries [0, 1, 3]) as local layer 1; vocab padded to 56 / 2 rows
    assert "decoder.layers.1.mlp.linear_fc1.weight" in sd["model"]
    assert sd["model"]["decoder.layers.1.mlp.linear_fc1.weight"].shape == (24, 16)
    vocab_local = sd["model"]["output_layer.weight" if not tied else "output_layer.weight"]
    assert vocab_local.shape == (cfg.padded_vocab(2) // 2, 16)
    back = str(tmp_path / "back")
    assert main(["convert", meg, back, "--from", "megatron", "--no-progress"]) == 0
    cons = str(tmp_path / "cons")
    assert main(["convert", back, cons, "--to", "consolidated", "--no-progress"]) == 0
    from safetensors.torch import load_file
    got = load_file(os.path.join(cons, "model.safetensors"))
    assert set(got) == set(full)
    for n, t in full.items():
        assert torch.equal(got[n], t), n


def test_the_convert_process_group_leaves_nothing_in_the_temp_dir(tmp_path):
    """``elastor convert --megatron-format torch_dist`` made a one-process group on a FileStore in a
    ``mkdtemp`` folder and never removed it: one ``elastor_pg_*`` folder left per run."""
    import subprocess
    import sys
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    code = ("from elastor_ds.integrations.megatron.convert import _ensure_single_process_group as f\n"
            "import torch, torch.distributed as d\n"
            "f(); t = torch.ones(3); d.all_reduce(t); d.barrier(); print(d.get_world_size(), int(t.sum()))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=root))
    assert p.returncode == 0 and p.stdout.split() == ["1", "3"], p.stderr[-2000:]
    assert os.listdir(tmp) == []
