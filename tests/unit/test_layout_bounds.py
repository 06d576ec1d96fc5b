"""A plan document may come from anyone (a manifest's ``layout``, ``--from-plan``): its sizes are
bounded before anything of that size is built. A stage of ``tp`` 10^9 built a tuple of 10^9 ranks
(7.9 GB, then MemoryError) inside ``elastor inspect``. Oracle: the error, at once."""
from __future__ import annotations

import time

import pytest

from elastor_ds.errors import LayoutError
from elastor_ds.layout import Layout
from elastor_ds.layout.compact_plan import MAX_DEVICES


def plan(*tps):
    return {"version": 1, "num_layers": 1, "replicas": [{"stages": [{"tp": tp, "layers": [0, 1]}]} for tp in tps]}


@pytest.mark.parametrize("tps, words", [((10 ** 9,), "at most 262,144"), ((0,), "at least 1"),
                                        ((MAX_DEVICES, 1), "at most 262,144")])
def test_a_plan_too_large_or_empty_is_refused_at_once(tps, words):
    t0 = time.perf_counter()
    with pytest.raises(LayoutError, match=words):
        Layout.from_json(plan(*tps))
    assert time.perf_counter() - t0 < 1.0


def test_the_largest_plan_still_loads():
    assert Layout.from_json(plan(MAX_DEVICES)).world_size == MAX_DEVICES
