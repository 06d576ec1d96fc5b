"""The save plan's gathered shard metadata travels as JSON text (planning/save_plan.py)."""
from __future__ import annotations

import pytest

from elastor_ds.checkpoint.planning.save_plan import ShardMeta, metas_from_text, metas_to_text
from elastor_ds.errors import ShardingError
from elastor_ds.layout.region import Region


def test_round_trip_and_exact_text():
    metas = [ShardMeta("w", (4, 6), "float32", Region((0, 3), (4, 3))), ShardMeta("s", (), "int64", Region((), ()))]
    text = metas_to_text(metas)
    assert text == '[["w",[4,6],"float32",[0,3],[4,3]],["s",[],"int64",[],[]]]'
    assert metas_from_text(text, 0) == metas


@pytest.mark.parametrize("text", [
    b'[["w",[4],"float32",[0],[4]]]',            # not a str
    "[[\"w\",[4],\"float32\",[0],[4]]",           # truncated JSON
    '{"w": 1}',                                   # not a list
    '[["w",[4.0],"float32",[0],[4]]]',            # a float in a shape
    '[["w",[true],"float32",[0],[4]]]',           # a bool in a shape
    '[["w",[4],"float32",[0]]]',                  # four fields
    '[[1,[4],"float32",[0],[4]]]',                # a name that is not a str
    "[" * 100000 + "]" * 100000,                  # nested too deeply for the parser
])
def test_malformed_metadata_is_a_sharding_error_naming_the_rank(text):
    with pytest.raises(ShardingError, match="rank 3 sent shard metadata that is not valid"):
        metas_from_text(text, 3)
