"""A Megatron model config may come from a checkpoint (its pickled args, or the export's
``elastor_model_config.json`` beside it): its fields are typed and bounded before anything sized by
them is built. 10^8 layers kept the tensor list growing for minutes (1.4 GB) before any check."""
from __future__ import annotations

import time

import pytest

from elastor_ds.errors import ConfigError
from elastor_ds.integrations.megatron.specs import GPTSpecConfig

BASE = dict(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=16, ffn_hidden_size=16)


@pytest.mark.parametrize("field, value", [("num_layers", 10 ** 8), ("hidden_size", 0), ("vocab_size", -1),
                                          ("ffn_hidden_size", 2.5), ("num_attention_heads", True),
                                          ("num_query_groups", "2"), ("max_sequence_length", 10 ** 12)])
def test_a_field_out_of_range_or_of_another_type_is_refused_at_once(field, value):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"model config {field}="):
        GPTSpecConfig.from_json({**BASE, field: value})
    assert time.perf_counter() - t0 < 1.0


def test_a_plain_config_and_its_optional_fields_still_load():
    assert GPTSpecConfig.from_json(BASE).groups == 2
    assert GPTSpecConfig.from_json({**BASE, "num_query_groups": 1, "kv_channels": 4}).head_dim == 4
