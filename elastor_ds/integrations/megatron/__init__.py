"""Megatron-core adapter: parallel_state from an elastor layout, GPT parameter and Adam-state
shards, save/load through the checkpoint engine, and Megatron checkpoint import/export.

The only package of elastor_ds that imports megatron (lazily, inside functions).
"""
from .parallel import MegatronGrid, check_layout, initialize_from_layout, megatron_rank, pipeline_layer_layout, teardown
from .specs import GPTSpecConfig, gpt_tensor_specs, padded_vocab_size
from .state import ensure_adam_state, gpt_shards, load_gpt, save_gpt

__all__ = ["MegatronGrid", "check_layout", "initialize_from_layout", "megatron_rank", "pipeline_layer_layout",
           "teardown", "GPTSpecConfig", "gpt_tensor_specs", "padded_vocab_size", "ensure_adam_state",
           "gpt_shards", "load_gpt", "save_gpt"]
