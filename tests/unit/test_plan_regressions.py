"""Planner regressions: multi-node clusters just under the exhaustive-placement size once made the
planner materialise every permutation of 15 groups (killed for memory). They must plan quickly."""
from __future__ import annotations

import json

import pytest

from elastor_ds.cli import main
from elastor_ds.layout import Layout

MODEL = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
         "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "64"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpus,tp", [("8,7", 4), ("1," * 15 + "1", 1), ("3,5", 2)])
def test_small_multi_node_clusters_plan_without_blowup(gpus, tp, capsys):
    assert main(["plan", *MODEL, "--tensor-model-parallel-size", str(tp), "--gpus-per-node", gpus, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layout = Layout.from_json(doc, 32)
    n_usable = sum(int(x) for x in gpus.split(","))
    assert 1 <= layout.world_size <= n_usable
    devices = [d for r in doc["replicas"] for s in r["stages"] for d in s["devices"]]
    assert len(devices) == len(set(devices)) == layout.world_size


def test_a_stage_without_layers_is_refused():
    """Review of the thirty-second session: a plan document with a stage of layers [0, 0] (a device
    that holds no layer, and a pipeline a trainer cannot build) was accepted."""
    from elastor_ds.errors import LayoutError
    doc = {"num_layers": 4, "replicas": [{"micro_batches": 4, "stages": [
        {"tp": 1, "layers": [0, 0], "ranks": [0]}, {"tp": 1, "layers": [0, 4], "ranks": [1]}]}]}
    with pytest.raises(LayoutError, match=r"stage layer range \[0, 0\) is invalid: .*at least one layer"):
        Layout.from_json(doc)
    doc["replicas"][0]["stages"] = [{"tp": 1, "layers": [0, 1], "ranks": [0]}, {"tp": 1, "layers": [1, 4], "ranks": [1]}]
    assert Layout.from_json(doc).replicas[0].stages[0].num_layers == 1
