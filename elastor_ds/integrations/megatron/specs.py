"""Elastor tensor specs for a megatron-core GPTModel: names, canonical shapes, sharding rules.

Names are those of ``GPTModel.state_dict()`` with GLOBAL layer indices
(``decoder.layers.{i}.self_attention.linear_qkv.weight``); on a pipeline stage the model holds
local indices, and :func:`local_to_global` / :func:`global_to_local` translate with the stage's
first layer. The canonical form of each tensor is what megatron-core holds at TP=1:

==============================================  ============================================
``embedding.word_embeddings.weight``            vocab-parallel rows, unpadded (placement pre,
                                                or ``tied`` when shared with the output layer)
``embedding.position_embeddings.weight``        replicated (pre)
``*.input_layernorm.*``, ``*.pre_mlp_layernorm.*``, ``decoder.final_layernorm.*``  replicated
``self_attention.linear_qkv.weight/bias``       fused QKV, per query group ``[q.., k, v]``
``self_attention.linear_proj.weight``           row-parallel (dim 1); its bias replicated
``mlp.linear_fc1.weight/bias``                  column-parallel; gated: ``[gate; up]`` parts
``mlp.linear_fc2.weight``                       row-parallel; its bias replicated
``output_layer.weight``                         vocab-parallel rows, unpadded (post)
==============================================  ============================================

**Transformer Engine** (``--transformer-impl transformer_engine``): TE fuses the two layer norms of
a layer into the following linear, so a TE model holds ``self_attention.linear_qkv.layer_norm_weight``
/ ``layer_norm_bias`` instead of ``input_layernorm.weight`` / ``bias`` and ``mlp.linear_fc1.layer_norm_*``
instead of ``pre_mlp_layernorm.*`` (replicated like them); every other TE parameter has the local
spec's name and sharding. :func:`canonical_name` maps TE names to the canonical (local-spec) ones,
so a TE checkpoint and a local one hold the same tensors and load into each other.

The vocabulary is padded the way Megatron-LM pads it: at TP ``t`` to a multiple of
``make_vocab_size_divisible_by * t`` (:func:`padded_vocab_size`); padding rows are never saved.

Pure: no torch, no megatron.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

from ...errors import ConfigError
from ...layout import ShardRule, TensorSpec

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class GPTSpecConfig:
    """What the sharding rules need to know about a megatron-core GPT (a checkpoint carries it)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int                      # true (unpadded) vocabulary
    ffn_hidden_size: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    normalization: str = "LayerNorm"     # LayerNorm has a bias, RMSNorm has not
    make_vocab_size_divisible_by: int = 128
    max_sequence_length: int = 1024
    position_embedding_type: str = "learned_absolute"
    share_embeddings_and_output_weights: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # a config may come from a checkpoint (its args, a sidecar file): types and ranges first, before
        # anything sized by them is built (10^8 layers made the tensor list for minutes)
        for name, hi in (("num_layers", 1 << 16), ("hidden_size", 1 << 20), ("num_attention_heads", 1 << 14),
                         ("vocab_size", 1 << 24), ("ffn_hidden_size", 1 << 22), ("num_query_groups", 1 << 14),
                         ("kv_channels", 1 << 16), ("make_vocab_size_divisible_by", 1 << 20),
                         ("max_sequence_length", 1 << 24)):
            v = getattr(self, name)
            if v is None and name in ("num_query_groups", "kv_channels"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ConfigError(f"model config {name}={v!r}: expected an integer from 1 to {hi:,}")
        g = self.groups
        if self.num_attention_heads % g:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"num_query_groups={g}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"normalization={self.normalization!r}: expected 'LayerNorm' or 'RMSNorm'")

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def check_tp(self, tp: int) -> None:
        """Megatron's own divisibility for TP ``tp`` (heads, query groups, FFN)."""
        for what, n in (("num_attention_heads", self.num_attention_heads), ("num_query_groups", self.groups),
                        ("ffn_hidden_size", self.ffn_hidden_size)):
            if n % tp:
                raise ConfigError(f"tensor parallel size {tp} does not divide {what}={n}; choose a TP degree "
                                  f"that divides the heads, query groups and FFN size")

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def to_json(self) -> dict[str, Any]:
        return dict(asdict(self), kind="megatron-core-gpt")

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "GPTSpecConfig":
        """From a JSON object of the fields (others are ignored); a missing required field is a
        ValueError naming every one missing (not a Python signature)."""
        from dataclasses import MISSING
        names = {f.name for f in fields(GPTSpecConfig)}
        missing = [f.name for f in fields(GPTSpecConfig)
                   if f.name not in d and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)} (a JSON object of GPTSpecConfig fields, as the "
                             f"export's elastor_model_config.json holds)")
        return GPTSpecConfig(**{k: v for k, v in d.items() if k in names})


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def gpt_tensor_specs(cfg: GPTSpecConfig) -> list[TensorSpec]:
    """Every parameter of the GPT in canonical (TP=1) form, in state-dict order."""
    h, dt = cfg.hidden_size, cfg.dtype
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.groups) * cfg.head_dim
    attn_out = cfg.num_attention_heads * cfg.head_dim
    ffn = cfg.ffn_hidden_size
    fc1_rows = 2 * ffn if cfg.gated_linear_unit else ffn
    qkv_rule = ShardRule.fused_qkv(cfg.num_attention_heads, cfg.groups, cfg.head_dim)
    fc1_rule = ShardRule.gated_mlp(ffn) if cfg.gated_linear_unit else ShardRule.column_parallel()
    vocab_rule = ShardRule.vocab_parallel(cfg.make_vocab_size_divisible_by)
    rep = ShardRule.replicated()
    norm = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    tied = cfg.share_embeddings_and_output_weights
    out = [TensorSpec("embedding.word_embeddings.weight", (cfg.vocab_size, h), dt, vocab_rule,
                      "tied" if tied else "pre")]
    if cfg.position_embedding_type == "learned_absolute":
        out.append(TensorSpec("embedding.position_embeddings.weight", (cfg.max_sequence_length, h), dt, rep, "pre"))
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out += [TensorSpec(p + f"input_layernorm.{n}", (h,), dt, rep, i) for n in norm]
        out.append(TensorSpec(p + "self_attention.linear_qkv.weight", (qkv_rows, h), dt, qkv_rule, i))
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            out.append(TensorSpec(p + "self_attention.linear_qkv.bias", (qkv_rows,), dt, qkv_rule, i))
        out.append(TensorSpec(p + "self_attention.linear_proj.weight", (h, attn_out), dt, ShardRule.row_parallel(), i))
        if cfg.add_bias_linear:
            out.append(TensorSpec(p + "self_attention.linear_proj.bias", (h,), dt, rep, i))
        out += [TensorSpec(p + f"pre_mlp_layernorm.{n}", (h,), dt, rep, i) for n in norm]
        out.append(TensorSpec(p + "mlp.linear_fc1.weight", (fc1_rows, h), dt, fc1_rule, i))
        if cfg.add_bias_linear:
            out.append(TensorSpec(p + "mlp.linear_fc1.bias", (fc1_rows,), dt, fc1_rule, i))
        out.append(TensorSpec(p + "mlp.linear_fc2.weight", (h, ffn), dt, ShardRule.row_parallel(), i))
        if cfg.add_bias_linear:
            out.append(TensorSpec(p + "mlp.linear_fc2.bias", (h,), dt, rep, i))
    out += [TensorSpec(f"decoder.final_layernorm.{n}", (h,), dt, rep, "post") for n in norm]
    if not tied:
        out.append(TensorSpec("output_layer.weight", (cfg.vocab_size, h), dt, vocab_rule, "post"))
    return out


# Transformer Engine's fused layer-norm parameters -> the canonical (local spec) names
TE_FUSED_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                  "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


def canonical_name(name: str) -> str:
    """A parameter name of the local or the Transformer Engine spec -> its canonical (local) name:
    ``decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight`` ->
    ``decoder.layers.{i}.input_layernorm.weight`` (likewise ``mlp.linear_fc1.layer_norm_*`` ->
    ``pre_mlp_layernorm.*``); any other name is returned unchanged."""
    m = _LAYER_RE.match(name)
    if not m:
        return name
    rest = m.group(2)
    for te, local in TE_FUSED_NORMS.items():
        if rest.startswith(te):
            return f"decoder.layers.{m.group(1)}.{local}{rest[len(te):]}"
    return name


def local_to_global(name: str, first_layer: int) -> str:
    """``decoder.layers.{local}.x`` on a stage starting at ``first_layer`` -> global index."""
    m = _LAYER_RE.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) + first_layer}.{m.group(2)}"


def global_to_local(name: str, first_layer: int) -> str:
    m = _LAYER_RE.match(name)
    if not m:
        return name
    i = int(m.group(1)) - first_layer
    if i < 0:
        raise ConfigError(f"{name}: layer {m.group(1)} is before the stage's first layer {first_layer}")
    return f"decoder.layers.{i}.{m.group(2)}"


def layer_of(name: str) -> Optional[int]:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None
