"""Planner review 32 through the real CLI (subprocesses): hostile cluster files and profiles given to
`elastor plan`. Each must end in time with exit 2 and one line naming the value, no traceback, and
nothing of the file's text acting on the terminal (before: an endless loop on a GPU speed of 1e-200,
'unexpected OverflowError' on 1e999, an internal AssertionError on a collective latency of 1e300,
escape sequences of node names and profile sources printed raw, YAML aliases walked once per node)."""
from __future__ import annotations

import json
import subprocess

import pytest

from cli_utils import assert_one_line_failure as one_line_failure, elastor

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

M7B = ["plan", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
       "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "512",
       "--tensor-model-parallel-size", "4"]


def assert_one_line_failure(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    one_line_failure(p, code, *words)
    assert "\x1b" not in p.stdout + p.stderr and "\u202e" not in p.stdout + p.stderr


@pytest.mark.parametrize("speed", ["1e308", "1e-200", "1e-308"])
def test_extreme_gpu_speed_ends_with_exit_2(tmp_path, speed):
    f = tmp_path / "c.json"
    f.write_text('{"nodes": [{"name": "a", "gpus": [0,1,2,3], "speed": {"1": %s}}, {"name": "b", "gpus": [0,1]}]}'
                 % speed)
    # before: 1e308 and 1e-200 never ended (killed here after 60 s), 1e-308 'unexpected OverflowError'
    assert_one_line_failure(elastor(*M7B, "--cluster", str(f)), 2, "node a", "GPU 1", repr(float(speed)),
                            "0.001 to 1000")


@pytest.mark.parametrize("name,body,words", [
    ("inf.json", '{"nodes": [{"name": "a", "gpus": [0, 1e999]}]}', ["1e999"]),
    ("names.json", '{"nodes": [{"name": "evil\\u001b]0;pwned\\u0007\\u001b[31mRED\\u202e", "gpus": [0,1,2,3]}]}',
     ["control"]),
    ("empty.json", '{"nodes": [{"name": "a", "gpus": [0,1,2,3]}, {"name": "", "gpus": [0,1]}]}', ["empty"]),
    ("key.json", '{"nodes": [{"name": "a", "gpus": [0,1,2,3,4,5,6,7,8,9,10], "speed": {"01": 0.5}}]}', ["'01'"]),
    ("alias.yaml", "nodes:\n  - name: n0\n    gpus: [0]\n    speed: &s {'0': 1.0}\n"
                   + "".join(f"  - {{name: n{i}, gpus: [0], speed: *s}}\n" for i in range(1, 50)), ["anchor"]),
])
def test_hostile_cluster_file_is_exit_2_in_one_line(tmp_path, name, body, words):
    f = tmp_path / name
    f.write_text(body)
    assert_one_line_failure(elastor(*M7B, "--cluster", str(f)), 2, *words)


def test_hostile_profile_is_exit_2_in_one_line(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.05}, "layer_time_includes_tp_comm": False,
                             "collectives": {"p2p": {"2": {"latency_s": 1e300, "s_per_byte": 0}}}}))
    assert_one_line_failure(elastor(*M7B, "--gpus-per-node", "8,8,8,7", "--profile", str(f)), 2,
                            "collectives.p2p.2.latency_s")
    f.write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.05},
                             "sources": {"layer_time_s": "measured\u001b[2J\u001b]0;pwned\u0007 on the GPU"}}))
    assert_one_line_failure(elastor(*M7B, "--gpus-per-node", "8", "--profile", str(f)), 2, "sources", "control")


@pytest.mark.parametrize("value", ["1_6", "\uff18", "\u0668,8"])
def test_gpus_per_node_in_other_digits_is_exit_2(value):
    assert_one_line_failure(elastor(*M7B, "--gpus-per-node", value), 2, "ASCII digits")


def test_from_plan_of_a_layout_document_without_devices_names_what_is_missing(tmp_path):
    """docs/planner.md's plan document (ranks, no devices) given to --from-plan ended as
    "malformed plan document (KeyError: 'devices')": now it says what --from-plan needs."""
    f = tmp_path / "prev.json"
    f.write_text(json.dumps({"version": 1, "num_gpus": 5, "num_layers": 4, "replicas": [
        {"micro_batches": 1, "stages": [{"tp": 2, "layers": [0, 2], "ranks": [0, 1]},
                                        {"tp": 1, "layers": [2, 4], "ranks": [2]}]},
        {"micro_batches": 3, "stages": [{"tp": 2, "layers": [0, 4], "ranks": [3, 4]}]}]}))
    p = elastor("plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--vocab-size", "100", "--micro-batch-size", "1", "--global-batch-size", "4", "--gpus-per-node", "4,1",
                "--from-plan", str(f))
    assert_one_line_failure(p, 2, "replica 0 stage 0 has no 'devices'", "elastor plan ... --json")
    assert "KeyError" not in p.stderr
