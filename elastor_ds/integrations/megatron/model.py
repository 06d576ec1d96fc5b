"""Build a megatron-core GPTModel for the current parallel_state from a :class:`GPTSpecConfig`.

Used by the converters (torch_dist export goes through a real model's ``sharded_state_dict``), the
tests and the benchmark. Fusions are off so the model also runs on CPU (with
:mod:`elastor_ds.testing.megatron_cpu`); on GPUs pass ``overrides`` to turn them on.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ...errors import ConfigError
from .parallel import MegatronGrid, apply_to_config
from .specs import GPTSpecConfig

log = logging.getLogger(__name__)


def spec_config_from_model(model: Any, vocab_size: int, make_vocab_size_divisible_by: int = 128) -> GPTSpecConfig:
    """The spec config of a live GPTModel; ``vocab_size`` is the true (unpadded) vocabulary."""
    c = model.config
    padded = int(model.vocab_size)
    if padded < vocab_size:
        raise ConfigError(f"model vocab {padded} < vocab_size {vocab_size}: pass the true vocabulary size")
    return GPTSpecConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        vocab_size=vocab_size, ffn_hidden_size=c.ffn_hidden_size, num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels, gated_linear_unit=bool(c.gated_linear_unit),
        add_bias_linear=bool(c.add_bias_linear), add_qkv_bias=bool(getattr(c, "add_qkv_bias", False)),
        normalization=c.normalization, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        max_sequence_length=int(model.max_sequence_length), position_embedding_type=model.position_embedding_type,
        share_embeddings_and_output_weights=bool(model.share_embeddings_and_output_weights),
        dtype=str(c.params_dtype).replace("torch.", ""))


def build_gpt(cfg: GPTSpecConfig, grid: MegatronGrid, parallel_output: bool = True,
              **overrides: Any) -> Any:
    """A GPTModel (local spec) for this rank's pipeline stage. parallel_state must be initialised
    for ``grid`` (:func:`~.parallel.initialize_from_layout`); otherwise a :class:`ConfigError` saying so."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not ps.model_parallel_is_initialized():
        raise ConfigError(f"build_gpt: megatron-core's parallel_state is not initialised (never, or torn down by "
                          f"teardown()/destroy_model_parallel()); call initialize_from_layout(layout) first, with "
                          f"the layout of this grid (tp {grid.tp} x pp {grid.pp} x dp {grid.dp})")
    running = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_data_parallel_world_size())
    if running != (grid.tp, grid.pp, grid.dp):
        raise ConfigError(f"build_gpt: the grid tp {grid.tp} x pp {grid.pp} x dp {grid.dp} is not the one "
                          f"megatron-core's parallel_state runs (tp {running[0]} x pp {running[1]} x dp "
                          f"{running[2]}); pass the grid initialize_from_layout returned, or initialise "
                          f"parallel_state for this grid first")
    cfg.check_tp(grid.tp)
    dtype = getattr(torch, cfg.dtype)
    kw: dict[str, Any] = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
        gated_linear_unit=cfg.gated_linear_unit, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias, normalization=cfg.normalization,
        activation_func=torch.nn.functional.silu if cfg.gated_linear_unit else torch.nn.functional.gelu,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    apply_to_config(kw, grid)
    kw.update(overrides)
    tc = TransformerConfig(**kw)
    return GPTModel(tc, get_gpt_layer_local_spec(normalization=cfg.normalization),
                    vocab_size=cfg.padded_vocab(grid.tp), max_sequence_length=cfg.max_sequence_length,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    parallel_output=parallel_output,
                    share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
                    position_embedding_type=cfg.position_embedding_type)
