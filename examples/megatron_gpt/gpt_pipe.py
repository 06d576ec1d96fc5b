"""A GPT made of megatron-core tensor-parallel layers, laid out as DeepSpeed pipeline layers.

Layer list (DeepSpeed layer index -> canonical megatron-core GPTModel name prefix):

    0          EmbeddingPipe          -> embedding.                (word + learned position embeddings)
    1 .. L     TransformerLayerPipe   -> decoder.layers.{i-1}.     (megatron-core local spec layer)
    L + 1      FinalNormPipe          -> decoder.final_layernorm.
    L + 2      OutputPipe             -> output_layer.             (column-parallel, vocab padded)

so an elastor checkpoint written by this trainer uses the same names and canonical shapes as a
megatron-core GPTModel at TP=1 (``elastor convert --to megatron`` and back work on it).
Transformer layer ``i`` of the plan is DeepSpeed layer ``i + 1``; :func:`ds_parts` turns plan stage
boundaries into DeepSpeed partition boundaries.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Sequence

import torch
from deepspeed.pipe import LayerSpec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn


def ds_parts(boundaries: Sequence[int], num_layers: int) -> list[int]:
    """Plan boundaries over transformer layers -> DeepSpeed ``parts`` over the L+3 pipe layers."""
    parts = [0] + [b + 1 for b in boundaries[1:-1]] + [num_layers + 3]
    return parts


def pipe_layout(layout: Any) -> Any:
    """A plan over the L transformer layers -> the same plan over the L + 3 pipe layers (the first
    stage of each replica also takes the embedding, the last the final norm and output layer)."""
    from elastor_ds.layout import Layout
    L = layout.num_layers
    doc = layout.to_json()
    for rep in doc["replicas"]:
        for st in rep["stages"]:
            a, b = st["layers"]
            st["layers"] = [0 if a == 0 else a + 1, L + 3 if b == L else b + 1]
    doc["num_layers"] = L + 3
    return Layout.from_json(doc, L + 3)


def canonical_name(ds_name: str, num_layers: int) -> str:
    """``"<ds index>.<param>"`` -> the megatron-core GPTModel name."""
    m = re.match(r"^(\d+)\.(.*)$", ds_name)
    if not m:
        return ds_name
    i, rest = int(m.group(1)), m.group(2)
    if i == 0:
        return rest  # embedding.word_embeddings.weight, embedding.position_embeddings.weight
    if i <= num_layers:
        return f"decoder.layers.{i - 1}.{rest}"
    if i == num_layers + 1:
        return "decoder.final_layernorm." + rest.split(".", 1)[1]   # strip the wrapper's "norm."
    return "output_layer." + rest.split(".", 1)[1]                  # strip the wrapper's "linear."


def _vocab_rows(weight: torch.Tensor, true_vocab: int, start: int, init: Any, seed: int) -> None:
    """Fill a vocab-parallel shard (rows ``[start, start + n)`` of the padded table) from a canonical
    ``[true_vocab, h]`` master drawn from ``seed``; padding rows are zero.

    Megatron draws the master of the *padded* table, whose size depends on the TP degree
    (``make_vocab_size_divisible_by * tp``): the number of random values drawn then differs per TP, and
    so does everything drawn after it (the position embeddings were 0.1 apart between TP1 and TP2)."""
    gen_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        master = torch.empty(true_vocab, weight.shape[1], dtype=torch.float32)
        init(master)
    finally:
        torch.set_rng_state(gen_state)
    n = weight.shape[0]
    with torch.no_grad():
        weight.zero_()
        hi = min(start + n, true_vocab)
        if hi > start:
            weight[: hi - start].copy_(master[start:hi].to(weight.dtype))


class EmbeddingPipe(nn.Module):
    """Word + learned position embeddings. Fresh weights do not depend on the TP degree: the word
    table comes from a canonical master over the true vocabulary and the position table from its own
    seed (see :func:`_vocab_rows`)."""

    def __init__(self, config: Any, padded_vocab: int, max_seq: int, true_vocab: int | None = None,
                 init_seed: int | None = None):
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        self.embedding = LanguageModelEmbedding(config, padded_vocab, max_seq, "learned_absolute")
        if init_seed is not None and config.perform_initialization:
            words = self.embedding.word_embeddings
            _vocab_rows(words.weight, true_vocab or padded_vocab, words.vocab_start_index,
                        config.embedding_init_method, init_seed)
            gen_state = torch.get_rng_state()
            torch.manual_seed(init_seed + 1)
            try:
                with torch.no_grad():
                    config.embedding_init_method(self.embedding.position_embeddings.weight)
            finally:
                torch.set_rng_state(gen_state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        return self.embedding(tokens, pos)  # [s, b, h]


_SIM: dict[int, float] | None = None


def simulated_layer_seconds() -> dict[int, float]:
    """``ELASTOR_SIM_LAYER_S='{"1": 0.06, "2": 0.033}'`` (bench only): each transformer layer also sleeps
    this many seconds per micro-batch at its stage's TP width, 1/3 in forward and 2/3 in backward, so
    8 CPU processes on 2 cores behave like devices whose compute takes that long while the schedule,
    p2p, TP collectives and the split all-reduce stay real."""
    global _SIM
    if _SIM is None:
        from elastor_ds.elastic.protocol import ENV_SIM_LAYER_S
        raw = os.environ.get(ENV_SIM_LAYER_S)
        _SIM = {int(k): float(v) for k, v in json.loads(raw).items()} if raw else {}
    return _SIM


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        time.sleep(ctx.seconds)
        return g, None


class TransformerLayerPipe(TransformerLayer):
    """A megatron-core local-spec transformer layer whose forward takes and returns one tensor."""

    def __init__(self, config: Any, layer_number: int):
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
        super().__init__(config, spec.submodules, layer_number=layer_number)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        sim = simulated_layer_seconds()
        if sim:
            from megatron.core import parallel_state as ps
            t = sim[ps.get_tensor_model_parallel_world_size()]
            time.sleep(t / 3)
            if hidden_states.requires_grad:
                hidden_states = _SleepInBackward.apply(hidden_states, 2 * t / 3)
        s = hidden_states.shape[0]
        mask = getattr(self, "_causal", None)
        if mask is None or mask.shape[-1] != s or mask.device != hidden_states.device:
            # explicit causal mask (True = masked): megatron's default one is built on "cuda"
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=hidden_states.device), 1)[None, None]
            self._causal = mask
        out, _ = super().forward(hidden_states=hidden_states, attention_mask=mask)
        return out


class FinalNormPipe(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        self.norm = WrappedTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class OutputPipe(nn.Module):
    """Column-parallel output layer. Logits of the vocabulary padding rows are masked out, so the
    loss does not depend on how much padding this TP degree adds (Megatron pads to a multiple of
    ``divisible_by * tp``) and padding rows never train: resuming under another TP is exact."""

    def __init__(self, config: Any, padded_vocab: int, true_vocab: int | None = None, init_seed: int | None = None):
        super().__init__()
        self.true_vocab = true_vocab if true_vocab is not None else padded_vocab
        self.padded_vocab = padded_vocab
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        self.linear = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, padded_vocab, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_bias_add=False)
        if init_seed is not None and config.perform_initialization:
            w = self.linear.weight
            _vocab_rows(w, self.true_vocab, ps.get_tensor_model_parallel_rank() * w.shape[0], config.init_method,
                        init_seed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits, _ = self.linear(h)  # [s, b, v / tp]
        if self.true_vocab < self.padded_vocab:
            from megatron.core import parallel_state as ps
            n = logits.shape[-1]
            start = ps.get_tensor_model_parallel_rank() * n
            pad = torch.arange(start, start + n, device=logits.device) >= self.true_vocab
            if bool(pad.any()):
                logits = logits.masked_fill(pad, -1e4)
        return logits


def make_loss_fn(pad_id: int):
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        lab = labels.transpose(0, 1).contiguous()  # [s, b]
        losses = vocab_parallel_cross_entropy(logits.float(), lab)
        mask = (lab != pad_id).float()
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)
    return loss_fn


class SeededLayerSpec(LayerSpec):
    """Builds its layer from its own seed. Megatron's CPU initialisation builds the full (TP=1)
    weight before slicing it, so fresh weights do not depend on the layout either."""

    def __init__(self, seed: int, typename: type, *args: Any, **kwargs: Any):
        super().__init__(typename, *args, **kwargs)
        self.seed = seed

    def build(self, log: bool = False) -> nn.Module:
        state = torch.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            return super().build(log=log)
        finally:
            torch.set_rng_state(state)


def build_layers(config: Any, num_layers: int, padded_vocab: int, max_seq: int, seed: int = 1234,
                 true_vocab: int | None = None) -> list:
    """The L + 3 DeepSpeed pipe layers as LayerSpecs (each stage builds only its own)."""
    base = seed * 1000
    specs = [SeededLayerSpec(base, EmbeddingPipe, config, padded_vocab, max_seq, true_vocab, init_seed=base)]
    specs += [SeededLayerSpec(base + i + 1, TransformerLayerPipe, config, i + 1) for i in range(num_layers)]
    specs += [SeededLayerSpec(base + num_layers + 1, FinalNormPipe, config),
              SeededLayerSpec(base + num_layers + 2, OutputPipe, config, padded_vocab, true_vocab,
                              init_seed=base + num_layers + 2)]
    return specs


class Geometry:
    """DeepSpeed parameter name -> (canonical name, global shape, TP pieces) for the elastor checkpoint.

    Used by the DeepSpeed integration (``module.elastor_geometry``) so that the checkpoint holds
    canonical megatron-core tensors whatever the TP degree and pipeline partition."""

    def __init__(self, spec_cfg: Any, tp: int, tp_rank: int, num_layers: int):
        from elastor_ds.integrations.megatron.specs import gpt_tensor_specs
        self.specs = {s.name: s for s in gpt_tensor_specs(spec_cfg)}
        self.tp, self.tp_rank, self.num_layers = tp, tp_rank, num_layers
        self.model = spec_cfg.to_json()

    def __call__(self, ds_name: str, local_shape: tuple) -> tuple:
        from elastor_ds.layout import local_pieces
        name = canonical_name(ds_name, self.num_layers)
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"parameter {ds_name} (canonical {name}) has no sharding spec")
        shape, pieces = local_pieces(spec, self.tp, self.tp_rank)
        if tuple(shape) != tuple(local_shape):
            raise ValueError(f"{name}: local shape {tuple(local_shape)} != expected {shape} at TP {self.tp}")
        return name, spec.shape, pieces
