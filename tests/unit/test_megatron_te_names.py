"""Transformer Engine parameter names in the Megatron integration (issue 12).

``--transformer-impl transformer_engine`` fuses each layer norm into the following linear
(``self_attention.linear_qkv.layer_norm_weight`` instead of ``input_layernorm.weight``,
``mlp.linear_fc1.layer_norm_*`` instead of ``pre_mlp_layernorm.*``). TE is not installable here, so
the models are synthetic: objects whose ``named_parameters()`` give TE's (or the local spec's) names
with the local shapes megatron-core gives at TP2 (GQA: 4 heads, 2 query groups; gated MLP). Oracle:
slices of the canonical tensors written out by hand below (rows of query group r, gate and up
halves, row-parallel columns), not the sharding rules under test. A checkpoint saved from a TP1 TE
model loads into TE and local-spec models at TP2 (real CheckpointEngine, real files).
"""
from __future__ import annotations

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.errors import ShardingError
from elastor_ds.integrations.megatron.specs import GPTSpecConfig, canonical_name, gpt_tensor_specs
from elastor_ds.integrations.megatron.state import gpt_shards
from elastor_ds.layout import Layout

H, FFN, VOCAB, LAYERS = 16, 32, 50, 2
CFG = GPTSpecConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                    ffn_hidden_size=FFN, gated_linear_unit=True, make_vocab_size_divisible_by=8,
                    max_sequence_length=16)
TE = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


class FakeModel:
    """What the integration reads from a megatron-core GPTModel: named_parameters()."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in params.items()}

    def named_parameters(self):
        return iter(self.params.items())


def te_name(canonical: str) -> str:
    for local, te in TE.items():
        canonical = canonical.replace("." + local, "." + te)
    return canonical


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {s.name: torch.randn(s.shape, generator=g) for s in gpt_tensor_specs(CFG)}


def hand_local(full: dict[str, torch.Tensor], tp: int, r: int) -> dict[str, torch.Tensor]:
    """Local tensors of TP rank r, sliced by hand (canonical names)."""
    if tp == 1:  # vocab 50 padded to a multiple of 8 = 56 rows (zeros)
        return {n: (torch.cat([t, torch.zeros(56 - VOCAB, H)]) if t.shape[0] == VOCAB else t.clone())
                for n, t in full.items()}
    assert tp == 2
    out = {}
    padded_local = 32  # vocab 50 padded to a multiple of 8 * 2 = 64 rows; 32 per rank
    for n, t in full.items():
        if n in ("embedding.word_embeddings.weight", "output_layer.weight"):
            loc = torch.zeros(padded_local, H)
            rows = t[32 * r: min(32 * r + 32, VOCAB)]
            loc[:rows.shape[0]] = rows
        elif n.endswith("linear_qkv.weight") or n.endswith("linear_qkv.bias"):
            loc = t[16 * r: 16 * r + 16]  # query group r: (2 q heads + k + v) x head dim 4 = 16 rows
        elif n.endswith("linear_fc1.weight") or n.endswith("linear_fc1.bias"):
            loc = torch.cat([t[16 * r: 16 * r + 16], t[FFN + 16 * r: FFN + 16 * r + 16]])  # gate | up
        elif n.endswith("linear_proj.weight"):
            loc = t[:, 8 * r: 8 * r + 8]
        elif n.endswith("linear_fc2.weight"):
            loc = t[:, 16 * r: 16 * r + 16]
        else:
            loc = t  # layer norms, biases of row-parallel linears, position embeddings: replicated
        out[n] = loc.clone()
    return out


def test_canonical_name():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_bias") == "decoder.layers.0.pre_mlp_layernorm.bias"
    for same in ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_layernorm.weight",
                 "embedding.word_embeddings.weight", "decoder.layers.1.input_layernorm.weight"):
        assert canonical_name(same) == same


def test_te_shards_are_the_hand_computed_slices():
    full = full_tensors()
    layout = Layout.uniform(2, 1, 1, LAYERS)
    for r in range(2):
        local = hand_local(full, 2, r)
        model = FakeModel({te_name(n): t for n, t in local.items()})
        shards = gpt_shards(model, CFG, layout, r)
        by_name: dict[str, list] = {}
        for s in shards:
            by_name.setdefault(s.name, []).append(s)
        assert set(by_name) == set(full), "TE names map onto every canonical tensor, nothing else"
        # the layer norms are TE's fused parameters themselves (no copy), whole tensors
        ln = by_name["decoder.layers.1.input_layernorm.weight"]
        assert len(ln) == 1 and ln[0].region.offsets == (0,) and ln[0].region.sizes == (H,)
        assert ln[0].tensor.data_ptr() == model.params["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"].data_ptr()
        qkv = by_name["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert [(s.region.offsets, s.region.sizes) for s in qkv] == [((16 * r, 0), (16, H))]
        fc1 = sorted(by_name["decoder.layers.0.mlp.linear_fc1.weight"], key=lambda s: s.region.offsets)
        assert [(s.region.offsets, s.region.sizes) for s in fc1] == [((16 * r, 0), (16, H)), ((FFN + 16 * r, 0), (16, H))]
        proj = by_name["decoder.layers.0.self_attention.linear_proj.weight"]
        assert [(s.region.offsets, s.region.sizes) for s in proj] == [((0, 8 * r), (H, 8))]
        emb = by_name["embedding.word_embeddings.weight"]
        assert [(s.region.offsets, s.region.sizes) for s in emb] == [((32 * r, 0), (min(32, VOCAB - 32 * r), H))]
        for name, ss in by_name.items():  # every shard holds exactly its region of the canonical tensor
            for s in ss:
                want = full[name][tuple(slice(o, o + n) for o, n in zip(s.region.offsets, s.region.sizes))]
                assert torch.equal(s.tensor, want), (name, s.region)


def test_te_checkpoint_loads_into_te_and_local_models_at_another_tp(tmp_path):
    full = full_tensors()
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root)
    src = FakeModel({te_name(n): t for n, t in hand_local(full, 1, 0).items()})  # TP1, TE names
    eng.save(3, gpt_shards(src, CFG, Layout.uniform(1, 1, 1, LAYERS), 0), model=CFG.to_json())
    eng.wait()
    layout = Layout.uniform(2, 1, 1, LAYERS)
    for te in (True, False):
        for r in range(2):
            want = hand_local(full, 2, r)
            dst = FakeModel({(te_name(n) if te else n): torch.full_like(t, 7.0) for n, t in want.items()})
            CheckpointEngine(root).load(None, gpt_shards(dst, CFG, layout, r, for_load=True))
            for n, t in want.items():
                got = dst.params[te_name(n) if te else n].data
                assert torch.equal(got, t), (te, r, n)


def test_model_with_both_names_is_refused():
    full = hand_local(full_tensors(), 1, 0)
    params = {te_name(n): t for n, t in full.items()}
    params["decoder.layers.0.input_layernorm.weight"] = full["decoder.layers.0.input_layernorm.weight"]
    with pytest.raises(ShardingError, match="input_layernorm.weight"):
        gpt_shards(FakeModel(params), CFG, Layout.uniform(1, 1, 1, LAYERS), 0)
