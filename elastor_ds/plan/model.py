"""What is trained: the transformer's shape (:class:`ModelSpec`) and the training setup
(:class:`TrainingSpec`), validated once at construction, with parameter and FLOP counts.

Pure: no torch, no torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..errors import ConfigError


def default_ffn_hidden_size(hidden_size: int, gated_mlp: bool) -> int:
    """Megatron-LM's ``--ffn-hidden-size`` when none is given (``megatron/training/arguments.py``):
    ``4 h``; with ``--swiglu``, two thirds of that rounded down to a multiple of 64 (10,880 for
    ``h = 4096``), which keeps the parameters of the three FFN matrices near those of two of ``4 h``.
    The same rule as the Megatron integration's in-job planner (``integrations/megatron/autoplan.py``)."""
    if gated_mlp:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder: ``num_layers`` identical transformer layers plus embedding and head.

    ``num_query_groups`` is Megatron's name for the number of KV heads (GQA); ``None`` means
    multi-head attention (as many KV heads as query heads). ``gated_mlp`` is SwiGLU (three FFN
    matrices instead of two). ``ffn_hidden_size`` ``None`` means Megatron-LM's default
    (:func:`default_ffn_hidden_size`: ``4 h``, or ``int(4 h 2 / 3 / 64) x 64`` for a gated MLP).
    ``dtype_bytes`` is the bytes of a parameter/activation element in the training precision (2 for
    bf16/fp16). ``vocab_divisible_by`` (Megatron's
    ``make_vocab_size_divisible_by``) decides how a TP-``t`` stage splits the vocabulary rows (padded
    to a multiple of it x ``t``), hence which ranks of different widths share embedding rows.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    dtype_bytes: int = 2
    gated_mlp: bool = False
    tied_embeddings: bool = True
    vocab_divisible_by: int = 128   # Megatron's make_vocab_size_divisible_by: TP-t padding to a multiple of it x t

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "dtype_bytes",
                     "vocab_divisible_by"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be a positive integer")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.gated_mlp))
            if self.ffn_hidden_size < 1:  # type: ignore[operator]
                raise ConfigError(f"ffn_hidden_size: Megatron-LM's default for a gated MLP, int(4 x {self.hidden_size} "
                                  f"x 2 / 3 / 64) x 64, is 0 at hidden_size={self.hidden_size}; give "
                                  f"--ffn-hidden-size")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size < 1:  # type: ignore[operator]
            raise ConfigError(f"ffn_hidden_size={self.ffn_hidden_size}: must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                              f"{self.num_attention_heads}")
        g = self.num_query_groups
        if g < 1 or self.num_attention_heads % g:  # type: ignore[operator]
            raise ConfigError(f"num_query_groups={g} must divide num_attention_heads={self.num_attention_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @cached_property
    def params_per_layer(self) -> int:
        """Weights of one transformer layer (QKV, output projection, MLP, two norms)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        kv = self.num_query_groups * self.head_dim  # type: ignore[operator]
        attn = h * (h + 2 * kv) + h * h
        mlp = h * f * (3 if self.gated_mlp else 2)
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def layer_fwd_flops(self, micro_batch_size: int) -> float:
        """Forward FLOPs of one layer for one micro-batch (matmuls only, full attention)."""
        b, s, h, f = micro_batch_size, self.seq_length, self.hidden_size, self.ffn_hidden_size
        kv = self.num_query_groups * self.head_dim  # type: ignore[operator]
        qkv = 2.0 * b * s * h * (h + 2 * kv)
        attn = 4.0 * b * s * s * h
        proj = 2.0 * b * s * h * h
        mlp = 2.0 * b * s * h * f * (3 if self.gated_mlp else 2)  # type: ignore[operator]
        return qkv + attn + proj + mlp

    def head_fwd_flops(self, micro_batch_size: int) -> float:
        """Forward FLOPs of the output layer (logits) for one micro-batch."""
        return 2.0 * micro_batch_size * self.seq_length * self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class TrainingSpec:
    """How the model is trained.

    ``num_micro_batches`` is the total number of micro-batches per iteration over all replicas
    (global batch / micro-batch size); it stays fixed across re-plans so the sample order does not
    change. ``nominal_tp`` caps the TP degree of every stage. ``zero_stage`` 0-3 shards optimizer
    state (>=1), gradients (>=2) and parameters (3) across the replicas holding a layer.
    ``grad_bytes``/``optimizer_bytes`` are per parameter (fp32 main grads; fp32 master + two Adam
    moments = 12).
    """

    micro_batch_size: int
    num_micro_batches: int
    nominal_tp: int = 1
    zero_stage: int = 1
    grad_bytes: int = 4
    optimizer_bytes: int = 12

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "num_micro_batches", "nominal_tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be a positive integer")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage={self.zero_stage}: must be 0, 1, 2 or 3")
        if self.grad_bytes < 0 or self.optimizer_bytes < 0:
            raise ConfigError("grad_bytes and optimizer_bytes must be >= 0")

    @staticmethod
    def from_global_batch(micro_batch_size: int, global_batch_size: int, **kw) -> "TrainingSpec":
        """Megatron style: ``global_batch_size`` in samples, divisible by ``micro_batch_size``."""
        if micro_batch_size < 1 or global_batch_size < 1:
            raise ConfigError(f"micro_batch_size={micro_batch_size} and global_batch_size={global_batch_size} "
                              f"must be >= 1")
        if global_batch_size % micro_batch_size:
            raise ConfigError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size="
                              f"{micro_batch_size}; use a multiple, e.g. "
                              f"{(global_batch_size // micro_batch_size + 1) * micro_batch_size}")
        return TrainingSpec(micro_batch_size, global_batch_size // micro_batch_size, **kw)

    def valid_tps(self, model: ModelSpec) -> tuple[int, ...]:
        """Power-of-two TP degrees <= nominal TP that divide the attention heads, the KV heads and the
        FFN width (Megatron's column-parallel FC1 splits it: ``ffn_hidden_size % tp == 0``)."""
        out = []
        t = 1
        while t <= self.nominal_tp:
            if _splits(model, t):
                out.append(t)
            t *= 2
        return tuple(out)

    def check_against(self, model: ModelSpec) -> None:
        """The nominal TP must split the heads, the query groups and the FFN width, as Megatron requires."""
        tp = self.nominal_tp
        if not _splits(model, tp):
            ok = [t for t in range(1, max(tp, 1) * 2 + 1) if _splits(model, t)]
            sizes = (("num_attention_heads", model.num_attention_heads), ("num_query_groups", model.num_query_groups),
                     ("ffn_hidden_size", model.ffn_hidden_size))
            parts = [f"{k}={v}" for k, v in sizes if v % tp]  # type: ignore[operator]
            raise ConfigError(f"tensor-model-parallel-size={tp} does not divide {', '.join(parts)}; TP degrees "
                              f"that would: {ok}")


def _splits(model: ModelSpec, tp: int) -> bool:
    """TP degree ``tp`` splits the attention heads, the KV heads and the FFN width."""
    return (model.num_attention_heads % tp == 0 and model.num_query_groups % tp == 0  # type: ignore[operator]
            and model.ffn_hidden_size % tp == 0)  # type: ignore[operator]
