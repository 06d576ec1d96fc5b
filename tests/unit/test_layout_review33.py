"""Plan documents: integer fields are taken only as real integers (review 33, finding 3).

Before, ``Layout.from_json`` ran ``int(...)`` over tp, layers, ranks, micro_batches and num_layers:
``{"micro_batches": 2.9, "tp": 1.8, "layers": [0, 3.7]}`` became 2, 1 and [0, 3], and ``true`` became
1, silently training another plan than the one written. Now each such value is refused with a
LayoutError naming the field, the value and an example. Expected values are written by hand."""
from __future__ import annotations

import copy

import pytest

from elastor_ds.errors import LayoutError
from elastor_ds.layout import Layout

GOOD = {"version": 1, "num_layers": 8, "replicas": [
    {"micro_batches": 3, "stages": [{"tp": 2, "layers": [0, 3], "ranks": [0, 1]}, {"tp": 1, "layers": [3, 8]}]},
    {"micro_batches": 1, "stages": [{"tp": 1, "layers": [0, 8]}]}]}


def _with(path, value):
    doc = copy.deepcopy(GOOD)
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def test_good_document_still_loads():
    lay = Layout.from_json(GOOD, 8)
    assert lay.describe() == "R0(mb3)[tp2:0-3|tp1:3-8] R1(mb1)[tp1:0-8]"
    assert [s.ranks for s in lay.replicas[0].stages] == [(0, 1), (2,)]
    assert lay.replicas[1].stages[0].ranks == (3,)
    assert Layout.from_json(GOOD).num_layers == 8


@pytest.mark.parametrize("path,value,field,bad", [
    (("replicas", 0, "micro_batches"), 2.9, "replicas[0].micro_batches", 2.9),
    (("replicas", 0, "micro_batches"), True, "replicas[0].micro_batches", True),
    (("replicas", 1, "micro_batches"), 2.0, "replicas[1].micro_batches", 2.0),
    (("replicas", 0, "stages", 0, "tp"), 1.8, "replicas[0].stages[0].tp", 1.8),
    (("replicas", 0, "stages", 1, "tp"), True, "replicas[0].stages[1].tp", True),
    (("replicas", 0, "stages", 1, "tp"), "1", "replicas[0].stages[1].tp", "1"),
    (("replicas", 0, "stages", 0, "layers"), [0, 3.7], "replicas[0].stages[0].layers[1]", 3.7),
    (("replicas", 0, "stages", 1, "layers"), [True, 8], "replicas[0].stages[1].layers[0]", True),
    (("replicas", 0, "stages", 0, "ranks"), [0, 1.0], "replicas[0].stages[0].ranks[1]", 1.0),
    (("replicas", 0, "stages", 0, "ranks"), [False, 1], "replicas[0].stages[0].ranks[0]", False),
    (("num_layers",), 8.5, "num_layers", 8.5),
    (("num_layers",), True, "num_layers", True),
])
def test_non_integer_fields_are_refused(path, value, field, bad):
    doc = _with(path, value)
    for num_layers in (8, None):
        with pytest.raises(LayoutError) as e:
            Layout.from_json(doc, num_layers)
        msg = str(e.value)
        assert f"plan document: {field} must be an integer, got {bad!r} ({type(bad).__name__})" in msg, msg
        assert "e.g. \"" in msg and "\n" not in msg


def test_num_layers_argument_must_be_an_integer():
    for bad in (8.0, True, "8"):
        with pytest.raises(LayoutError, match=r"num_layers must be an integer, got "):
            Layout.from_json(GOOD, bad)


def test_non_list_layers_and_ranks_are_refused():
    with pytest.raises(LayoutError, match=r"replicas\[0\]\.stages\[0\]\.layers must be a list, got '0-3'"):
        Layout.from_json(_with(("replicas", 0, "stages", 0, "layers"), "0-3"), 8)
    with pytest.raises(LayoutError, match=r"replicas\[0\]\.stages\[0\]\.ranks must be a list, got 1"):
        Layout.from_json(_with(("replicas", 0, "stages", 0, "ranks"), 1), 8)


def test_out_of_range_integers_name_the_field():
    with pytest.raises(LayoutError, match=r"replicas\[1\]\.micro_batches must be at least 1, got 0"):
        Layout.from_json(_with(("replicas", 1, "micro_batches"), 0), 8)
    with pytest.raises(LayoutError, match=r"replicas\[0\]\.stages\[0\]\.tp must be at least 1, got 0"):
        Layout.from_json(_with(("replicas", 0, "stages", 0, "tp"), 0), 8)
