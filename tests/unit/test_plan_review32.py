"""Planner review 32: every kept replica of ``--from-plan`` checked, GPU speeds bounded and the
micro-batch assignment closed-form, cluster YAML without anchors through libyaml, TP degrees that
split the FFN width, a ``--from-plan`` size that fits in memory, bounded collective costs, printable
names, strict numbers and integers in cluster files, Megatron's FFN default for ``--swiglu``, pipelines
priced at ZeRO-1 at most, every DP degree of the uniform search.

Oracles: hand-computed values, brute force over every grid or every micro-batch split, and the
frameworks' own rules (Megatron splits heads, query groups and FFN width by TP; DeepSpeed's
PipelineEngine refuses ZeRO-2/3)."""
from __future__ import annotations

import itertools
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest

from elastor_ds.cli import build_parser
from elastor_ds.cli import main as cli_main
from elastor_ds.errors import ConfigError, PlanningError
from elastor_ds.plan import Cluster, CostModel, ModelSpec, TrainingSpec, plan
from elastor_ds.plan.cli import MAX_PLAN_FILE_BYTES, build_inputs
from elastor_ds.plan.cluster import CLUSTER_YAML_MAX, SPEED_RANGE, load_yaml
from elastor_ds.plan.plan_doc import plan_from_document
from elastor_ds.plan.replan import replan
from elastor_ds.plan.search import _divisors, assign_micro_batches, split_layers_parametric
from elastor_ds.plan.world import _grid, widest_tp

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
M7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
       "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "512"]


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("elastor")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- 1. --from-plan: every kept replica's TP degrees and TP groups ------------------------------------
def _replan_inputs(replicas: list[dict], nominal_tp: int = 4):
    # 12 heads: Megatron splits them by TP 1, 2, 4 (3 x 4), never by 8
    model = ModelSpec(num_layers=32, hidden_size=3072, num_attention_heads=12, seq_length=2048, vocab_size=32000)
    training = TrainingSpec(1, 16, nominal_tp=nominal_tp)
    prev_cluster = Cluster.from_gpus_per_node("8,8,8,8")
    prev, _ = plan_from_document({"version": 1, "num_layers": 32, "replicas": replicas}, prev_cluster)
    now = Cluster.from_gpus_per_node("7,8,8,8")   # node0 lost a GPU: replica 0 is damaged, the others kept
    return CostModel(model, training, now), prev, prev_cluster


def _stage(tp: int, layers: list[int], devices: list[str]) -> dict:
    return {"tp": tp, "layers": layers, "devices": devices}


def test_from_plan_checks_every_replica_tp_degree_not_only_the_first():
    reps = [{"micro_batches": 4, "stages": [_stage(4, [0, 16], [f"node0:{g}" for g in range(4)]),
                                            _stage(4, [16, 32], [f"node0:{g}" for g in range(4, 8)])]}]
    reps += [{"micro_batches": 4, "stages": [_stage(8, [0, 32], [f"node{i}:{g}" for g in range(8)])]}
             for i in (1, 2, 3)]
    cost, prev, prev_cluster = _replan_inputs(reps)
    res = replan(cost, prev, prev_cluster, full_search_below=0)  # the re-plan's own answer, no full search beside
    tps = {s.tp for r in res.best.plan.replicas for s in r.stages}
    assert all(12 % t == 0 and t <= 4 for t in tps), tps        # Megatron: heads % tp == 0, tp <= nominal
    assert "replica 1" in res.search_stats["replan"] and "TP 8" in res.search_stats["replan"]


def test_from_plan_does_not_keep_a_tp_group_across_nodes():
    reps = [{"micro_batches": 4, "stages": [_stage(4, [0, 16], [f"node0:{g}" for g in range(4)]),
                                            _stage(4, [16, 32], [f"node0:{g}" for g in range(4, 8)])]},
            {"micro_batches": 4, "stages": [_stage(4, [0, 32], ["node1:0", "node1:1", "node2:0", "node2:1"])]},
            {"micro_batches": 4, "stages": [_stage(4, [0, 32], [f"node3:{g}" for g in range(4)])]}]
    cost, prev, prev_cluster = _replan_inputs(reps)
    res = replan(cost, prev, prev_cluster, full_search_below=0)
    for r in res.best.plan.replicas:
        for s in r.stages:
            assert len({d.node for d in s.devices}) == 1, s    # a TP group within one node
    assert "across nodes" in res.search_stats["replan"]


# ---- 2. GPU speeds: bounded; the micro-batch assignment closed-form ----------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("speed", ["1e308", "1e-200", "1e-308", "0.0009", "1000.5"])
def test_cluster_speed_out_of_range_is_exit_2_naming_node_gpu_value_and_range(tmp_path, capsys, speed):
    f = write(tmp_path, "c.json", '{"nodes": [{"name": "a", "gpus": [0,1,2,3], "speed": {"1": %s}}, '
                                  '{"name": "b", "gpus": [0,1]}]}' % speed)
    rc, _, err = run_plan(capsys, *M7B, "--tensor-model-parallel-size", "4", "--cluster", f)
    line = one_error_line(err)
    assert rc == 2
    assert "node a" in line and "GPU 1" in line and repr(float(speed)) in line
    assert f"{SPEED_RANGE[0]:g} to {SPEED_RANGE[1]:g}" in line and SPEED_RANGE == (1e-3, 1e3)


def test_speeds_at_the_ends_of_the_range_plan(tmp_path, capsys):
    f = write(tmp_path, "c.json", '{"nodes": [{"name": "a", "gpus": [0,1,2,3], "speed": {"1": 0.001, "2": 1000}}, '
                                  '{"name": "b", "gpus": [0,1]}]}')
    rc, out, _ = run_plan(capsys, *M7B, "--tensor-model-parallel-size", "4", "--cluster", f)
    assert rc == 0 and "2 with non-nominal speed" in out


def _brute_assignment(kinds: list[tuple[float, float, int]], total: int) -> float:
    reps = [(o, b) for o, b, c in kinds for _ in range(c)]
    best = math.inf
    for ms in itertools.product(range(1, total + 1), repeat=len(reps)):
        if sum(ms) == total:
            best = min(best, max(o * m + b for (o, b), m in zip(reps, ms)))
    return best


@pytest.mark.timeout(60)
def test_micro_batch_assignment_ends_and_is_exact_for_extreme_ratios():
    # what `elastor plan` handed it for a cluster file with a speed of 1e-200 (it looped for ever:
    # a count near 1e200 stepped down by one while the float product stayed the same)
    kinds = [(0.31748398252032, 0.6358627498939734, 1), (5.010410626525867e+199, 0.0, 1)]
    out = assign_micro_batches(kinds, 512)
    assert out == [[(511, 1)], [(1, 1)]]               # by hand: the slow replica takes the one it must
    # speed 1e308: a denormal time per micro-batch
    kinds = [(0.9396958946918399, 0.0, 3), (0.47790101102592, 0.47834840345258667, 1), (9.3969589469184e-309, 0.0, 1)]
    out = assign_micro_batches(kinds, 512)
    assert sum(m * n for lst in out for m, n in lst) == 512
    assert out[2] == [(508, 1)] and out[0] == [(1, 3)] and out[1] == [(1, 1)]
    rng = random.Random(32)
    for _ in range(150):   # brute force: random replicas, time ratios up to 1e300
        k = rng.randint(1, 3)
        kinds = [(10.0 ** rng.uniform(-300, 300) if rng.random() < 0.3 else rng.uniform(0.1, 3.0),
                  rng.choice([0.0, rng.uniform(0, 2)]), rng.randint(1, 2)) for _ in range(k)]
        total = rng.randint(sum(c for _, _, c in kinds), 7)
        out = assign_micro_batches(kinds, total)
        got = max(o * lst[0][0] + b for (o, b, _), lst in zip(kinds, out))
        assert sum(m * n for lst in out for m, n in lst) == total
        assert got <= _brute_assignment(kinds, total) * (1 + 1e-12), (kinds, total, out)


# ---- 3 (and 12, 13). Cluster files: YAML without aliases, strict numbers and integers ------------------
def test_yaml_anchors_and_aliases_are_refused_with_exit_2(tmp_path, capsys):
    text = ("nodes:\n  - name: n0\n    gpus: [0, 1]\n    speed: &s {'0': 1.0}\n"
            + "".join(f"  - {{name: n{i}, gpus: [0], speed: *s}}\n" for i in range(1, 4)))
    rc, _, err = run_plan(capsys, *M7B, "--cluster", write(tmp_path, "a.yaml", text))
    line = one_error_line(err)
    assert rc == 2 and "anchor" in line and "line 4" in line
    rc, _, err = run_plan(capsys, *M7B, "--cluster", write(tmp_path, "b.yaml", "nodes: *x\n"))
    assert rc == 2 and "alias" in one_error_line(err)


def test_a_yaml_cluster_file_is_at_most_8_mib(tmp_path, capsys):
    assert CLUSTER_YAML_MAX == 8 << 20
    p = tmp_path / "big.yaml"
    with open(p, "wb") as f:
        f.truncate(CLUSTER_YAML_MAX + 1)   # sparse: refused from its size, never read
    rc, _, err = run_plan(capsys, *M7B, "--cluster", str(p))
    line = one_error_line(err)
    assert rc == 2 and f"{CLUSTER_YAML_MAX:,}" in line and ".json" in line


def test_yaml_loader_matches_safe_load_and_is_fast():
    import yaml
    nodes = 16384
    text = "gpu_memory_gb: 80\nnodes:\n" + "".join(
        f"  - {{name: node{i}, gpus: [0, 1, 2, 3, 4, 5, 6, 7], speed: {{\"3\": 0.9}}}}\n" for i in range(nodes))
    small = text[:4000].rsplit("\n  -", 1)[0] + "\n"
    assert load_yaml(small) == yaml.safe_load(small)
    odd = "a: 0x10\nb: 1_000\nc: .inf\nd: ~\ne: 'x: y'\nf: [yes, no, 1.5e3, -7]\ng: {1: 2}\n"
    assert load_yaml(odd) == yaml.safe_load(odd)   # YAML 1.1's scalars, as safe_load resolves them
    t0 = time.process_time()
    cl = Cluster.from_dict(load_yaml(text))
    cpu = time.process_time() - t0
    assert cl.num_gpus == 8 * nodes
    # 1.15 MB: PyYAML's pure-Python safe_load took ~8 s of CPU here, its C loader ~2.5 s; the events
    # of libyaml's parser ~0.4 s (without libyaml, PyYAML's own parser: ~4.6 s)
    if getattr(yaml, "__with_libyaml__", False):
        assert cpu < 2.0, cpu


@pytest.mark.parametrize("text", ["a: 1\n---\nb: 2\n", "a: 2001-12-14\n", "a: !!set {x}\n", "? [1]\n: 2\n",
                                  "a: 1\na: 2\n", "<<: {a: 1}\n"])
def test_yaml_loader_refuses_what_a_cluster_file_cannot_hold(text):
    with pytest.raises(ConfigError):
        load_yaml(text)


@pytest.mark.parametrize("name,body,words", [
    # 12: beyond a float's range: strict JSON, and a number too large to convert
    ("big.json", '{"nodes": [{"name": "a", "gpus": [0, 1e999]}]}', ["1e999", "range"]),
    ("bigint.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speed": {"1": 1%s}}]}' % ("0" * 400), ["too large"]),
    ("mem.json", '{"gpu_memory_gb": 1%s, "gpus_per_node": [8]}' % ("0" * 400), ["gpu_memory_gb", "too large"]),
    ("inf.yaml", "nodes:\n  - {name: a, gpus: [0, 1.0e999]}\n", ["whole number"]),
    # 13: loose integers and speed keys
    ("f.yaml", "nodes:\n  - {name: a, gpus: [0, 1.9]}\n", ["1.9", "whole number"]),
    ("b.yaml", "nodes:\n  - {name: a, gpus: [0, true]}\n", ["True", "whole number"]),
    ("s.yaml", "nodes:\n  - {name: a, gpus: [0, '2']}\n", ["'2'", "whole number"]),
    ("g.json", '{"gpus_per_node": [8, 7.0]}', ["7.0", "whole number"]),
    ("k01.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speed": {"01": 0.5}}]}', ["'01'", "GPU id"]),
    ("k1_0.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speed": {"1_0": 0.5}}]}', ["'1_0'", "GPU id"]),
    ("kf.yaml", "nodes:\n  - {name: a, gpus: [0, 1], speed: {1.5: 0.5}}\n", ["1.5", "GPU id"]),
    ("kx.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speed": {"7": 0.5}}]}', ["GPU 7"]),
    ("kdup.yaml", "nodes:\n  - {name: a, gpus: [0, 1], speed: {1: 0.5, '1': 0.6}}\n", ["GPU 1", "twice"]),
    ("vb.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speed": {"1": true}}]}', ["True", "number"]),
    ("vs.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speed": {"1": "0.5"}}]}', ["'0.5'", "number"]),
    ("typo.json", '{"nodes": [{"name": "a", "gpus": [0, 1], "speeds": {"1": 0.5}}]}', ["speeds", "unknown"]),
    # 11: names that are printed
    ("esc.json", '{"nodes": [{"name": "evil\\u001b]0;x\\u0007\\u001b[31m", "gpus": [0]}]}', ["control"]),
    ("rtl.json", '{"nodes": [{"name": "a\\u202eb", "gpus": [0]}]}', ["control"]),
    ("zw.json", '{"nodes": [{"name": "a\\u200bb", "gpus": [0]}]}', ["control"]),
    ("empty.json", '{"nodes": [{"name": "", "gpus": [0]}]}', ["''", "empty"]),
    ("null.json", '{"nodes": [{"name": null, "gpus": [0]}]}', ["None", "not a string"]),
    ("num.json", '{"nodes": [{"name": 5, "gpus": [0]}]}', ["5", "not a string"]),
])
def test_bad_cluster_fields_are_exit_2_naming_them(tmp_path, capsys, name, body, words):
    rc, out, err = run_plan(capsys, *M7B, "--cluster", write(tmp_path, name, body))
    line = one_error_line(err)
    assert rc == 2, (rc, out, err)
    for w in words:
        assert w in line, (w, line)
    assert "\x1b" not in out + err and "\u202e" not in out + err


def test_speed_keys_that_name_a_gpu_apply_its_speed(tmp_path, capsys):
    # a straggler's speed is applied whichever way its key is written: "1" (JSON) or 1 (YAML)
    for name, body in (("a.json", '{"nodes": [{"name": "a", "gpus": [0,1,2,3,4,5,6,7,8,9,10], "speed": {"1": 0.5}}]}'),
                       ("a.yaml", "nodes:\n  - {name: a, gpus: [0,1,2,3,4,5,6,7,8,9,10], speed: {1: 0.5, 10: 0.25}}\n")):
        cl = Cluster.from_file(write(tmp_path, name, body))
        assert dict(zip(cl.nodes[0].gpus, cl.nodes[0].speeds))[1] == 0.5
    assert dict(zip(cl.nodes[0].gpus, cl.nodes[0].speeds))[10] == 0.25


@pytest.mark.parametrize("value", ["1_6", "\uff18", "\u0668,8", "8,\u0668", "0x8"])
def test_gpus_per_node_takes_ascii_digits_only(capsys, value):
    rc, _, err = run_plan(capsys, *M7B, "--gpus-per-node", value)
    assert rc == 2 and "ASCII digits" in one_error_line(err)


def test_profile_sources_with_control_characters_are_refused(tmp_path, capsys):
    for text in ("measured\u001b[2J\u001b]0;pwned\u0007 on the GPU", "measured \u202eUPG eht no"):
        prof = {"version": 1, "layer_time_s": {"1": 0.05}, "sources": {"layer_time_s": text}}
        rc, out, err = run_plan(capsys, *M7B, "--gpus-per-node", "8",
                                "--profile", write(tmp_path, "p.json", json.dumps(prof)))
        line = one_error_line(err)
        assert rc == 2 and "sources" in line and "control" in line
        assert "\x1b" not in out + err and "\u202e" not in out + err


# ---- 4. the uniform search tries every DP degree --------------------------------------------------------
def _cost(argv: list[str]) -> CostModel:
    return build_inputs(build_parser().parse_args(["plan", *argv]))


def _brute_grid_best(cost: CostModel) -> float:
    """The fastest TP x PP x DP grid on the first groups of the cluster (every DP dividing M, every
    stage count, the layers split by the exact min-max split), priced by CostModel.evaluate."""
    devs = cost.cluster.device_tuple()
    best = math.inf
    for tp in cost.training.valid_tps(cost.model):
        groups = [devs[k * tp:(k + 1) * tp] for k in range(len(devs) // tp)]
        groups = [g for g in groups if len({d.node for d in g}) == 1]
        for pp in range(1, min(cost.model.num_layers, len(groups)) + 1):
            for dp in _divisors(cost.training.num_micro_batches):
                if pp * dp > len(groups):
                    continue
                p = _grid(cost, tp, pp, dp, groups[:pp * dp])
                if p is not None:
                    cb = cost.evaluate(p)
                    if cb.feasible:
                        best = min(best, cb.iteration_time_s)
    return best


def test_uniform_search_finds_a_grid_of_dp_1():
    # slow links across nodes: one node's 8-stage pipeline (DP 1) beats any grid that syncs gradients
    cost = _cost("--num-layers 32 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --vocab-size 32000 "
                 "--micro-batch-size 1 --global-batch-size 16 --tensor-model-parallel-size 1 --gpus-per-node 8,8,8,8 "
                 "--inter-node-bandwidth-gbs 0.1 --intra-node-bandwidth-gbs 10".split())
    res = plan(cost)
    brute = _brute_grid_best(cost)
    assert res.uniform.cost.iteration_time_s <= brute * (1 + 1e-9), (res.uniform.plan.describe(), brute)
    assert res.best.cost.iteration_time_s <= brute * (1 + 1e-9)
    assert res.uniform.plan.uniform_dims()[2] == 1   # DP 1 (the search tried only the two largest DP degrees)


@pytest.mark.parametrize("seed", range(10))
def test_uniform_search_matches_brute_force_over_every_grid(seed):
    rng = random.Random(seed)
    heads = rng.choice([8, 16])
    argv = (f"--num-layers {rng.choice([8, 12, 16])} --hidden-size {heads * 64} --num-attention-heads {heads} "
            f"--seq-length {rng.choice([512, 2048])} --vocab-size 32000 --micro-batch-size 1 "
            f"--global-batch-size {rng.choice([12, 16, 24, 36])} --tensor-model-parallel-size {rng.choice([1, 2, 4])} "
            f"--gpus-per-node {rng.choice(['8,8', '4,4,4', '8,8,8,8'])} "
            f"--inter-node-bandwidth-gbs {rng.choice(['0.1', '1', '25'])} --layouts uniform").split()
    cost = _cost(argv)
    # enough grids priced exactly that the estimate's ranking does not matter: what is checked is
    # that every grid is among the candidates (DP 1 and the small DP degrees were never)
    res = plan(cost, layouts="uniform", top_k=100)
    assert res.best.cost.iteration_time_s <= _brute_grid_best(cost) * (1 + 1e-9), argv


# ---- 5. a pipeline runs ZeRO-1 at most -------------------------------------------------------------------
def test_zero_stage_3_prices_a_pipeline_at_zero_1(capsys):
    argv = ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40", "--seq-length", "1024",
            "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "512",
            "--tensor-model-parallel-size", "1", "--gpus-per-node", "8,8", "--gpu-memory-gb", "40"]
    rc, out, _ = run_plan(capsys, *argv, "--zero-stage", "3", "--json")
    assert rc == 0
    doc = json.loads(out)
    stages = {len(r["stages"]) for r in doc["replicas"]}
    # DeepSpeed's PipelineEngine asserts ZeRO < 2: a plan of more than one stage runs ZeRO-1 at most
    assert max(stages) >= 2 and doc["zero_stage"] <= 1, (doc["description"], doc["zero_stage"])
    # priced so: the same memory as the same plan under --zero-stage 1
    cost3 = _cost(argv + ["--zero-stage", "3"])
    cost1 = _cost(argv + ["--zero-stage", "1"])
    res = plan(cost3)
    assert len(res.best.plan.replicas[0].stages) >= 2
    assert res.best.cost.peak_memory_bytes == cost1.evaluate(res.best.plan).peak_memory_bytes
    for s in [res.best, *res.alternatives, res.uniform]:
        if s is not None and max(len(r.stages) for r in s.plan.replicas) > 1:
            assert cost3.plan_zero_stage(s.plan) <= 1
    rc, out, _ = run_plan(capsys, *argv, "--zero-stage", "3")
    assert "ZeRO-1 (--zero-stage 3 asked; a pipeline" in out


def test_zero_stage_3_stays_on_a_one_stage_grid():
    cost = CostModel(ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1000),
                     TrainingSpec(1, 8, zero_stage=3), Cluster.from_gpus_per_node("4"))
    res = plan(cost, layouts="uniform", top_k=10)
    one = [s for s in [res.best, *res.alternatives] if len(s.plan.replicas[0].stages) == 1 and
           len(s.plan.replicas) > 1]
    assert one and all(cost.plan_zero_stage(s.plan) == 3 for s in one)   # DeepSpeed's engine: any ZeRO


# ---- 6. TP degrees split the FFN width ------------------------------------------------------------------
def test_tp_degrees_divide_the_ffn_width(capsys):
    argv = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--num-query-groups", "8",
            "--seq-length", "4096", "--vocab-size", "128256", "--micro-batch-size", "1", "--global-batch-size", "512",
            "--swiglu", "--ffn-hidden-size", "28670", "--gpus-per-node", "8,8,8,8"]
    # 28670 = 2 x 5 x 47 x 61: Megatron's ColumnParallelLinear splits it by TP 1 or 2 only
    rc, _, err = run_plan(capsys, *argv, "--tensor-model-parallel-size", "8")
    line = one_error_line(err)
    assert rc == 2 and "ffn_hidden_size=28670" in line and "[1, 2]" in line
    for extra in ([], ["--homogeneous"]):
        rc, out, _ = run_plan(capsys, *argv, "--tensor-model-parallel-size", "2", "--gpu-memory-gb", "200",
                              "--json", *extra)
        assert rc == 0
        doc = json.loads(out)
        assert all(28670 % s["tp"] == 0 for r in doc["replicas"] for s in r["stages"])
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=8, vocab_size=8,
                      ffn_hidden_size=12)
    assert TrainingSpec(1, 1, nominal_tp=4).valid_tps(model) == (1, 2, 4)
    assert TrainingSpec(1, 1, nominal_tp=8).valid_tps(model) == (1, 2, 4)   # 12 % 8 != 0
    with pytest.raises(ConfigError, match="ffn_hidden_size=12"):
        TrainingSpec(1, 1, nominal_tp=8).check_against(model)
    assert widest_tp(model, 8) == 4   # the in-job planner's TP cap splits the FFN width too


# ---- 7. --from-plan: at most 32 MiB, documented ---------------------------------------------------------
def test_from_plan_is_at_most_32_mib_and_the_docs_say_so(tmp_path, capsys):
    assert MAX_PLAN_FILE_BYTES == 32 << 20
    p = tmp_path / "prev.json"
    with open(p, "wb") as f:
        f.truncate(MAX_PLAN_FILE_BYTES + 1)
    rc, _, err = run_plan(capsys, *M7B, "--gpus-per-node", "8", "--from-plan", str(p))
    line = one_error_line(err)
    assert rc == 2 and f"at most {MAX_PLAN_FILE_BYTES:,}" in line
    doc = (ROOT / "docs" / "planner.md").read_text()
    section = doc[doc.index("## Re-planning after a change"):doc.index("## The plan document")]
    assert "at most 32 MiB" in section


# ---- 8. collective costs bounded; a non-finite bound is a PlanningError ---------------------------------
@pytest.mark.parametrize("field,value", [("latency_s", "1e308"), ("latency_s", "1e300"), ("s_per_byte", "2.0"),
                                         ("latency_s", "1" + "0" * 400), ("s_per_byte", "-1e-9")])
def test_collective_costs_out_of_range_are_exit_2_naming_the_field(tmp_path, capsys, field, value):
    ab = {"latency_s": "0.001", "s_per_byte": "1e-9", field: value}
    text = ('{"version": 1, "layer_time_s": {"1": 0.05}, "layer_time_includes_tp_comm": false, "collectives": '
            '{"p2p": {"2": {"latency_s": %s, "s_per_byte": %s}}}}' % (ab["latency_s"], ab["s_per_byte"]))
    rc, _, err = run_plan(capsys, *M7B, "--tensor-model-parallel-size", "4", "--gpus-per-node", "8,8,8,7",
                          "--profile", write(tmp_path, "p.json", text))
    line = one_error_line(err)
    assert rc == 2 and f"collectives.p2p.2.{field}" in line


def test_a_split_whose_times_overflow_is_a_planning_error():
    with pytest.raises(PlanningError, match="overflow"), np.errstate(over="ignore"):
        split_layers_parametric([1e308, 1e308], [1e308, 0.0], [4, 4], 4)


# ---- 14. --swiglu without --ffn-hidden-size: Megatron-LM's default ---------------------------------------
def test_swiglu_default_ffn_is_megatrons(capsys):
    # Megatron-LM (arguments.py): int((4 * h * 2 / 3) / 64) * 64 -> h = 4096: int(10922.67 / 64) * 64 = 10880
    cost = _cost(M7B + ["--swiglu", "--gpus-per-node", "8"])
    assert cost.model.ffn_hidden_size == 10880
    assert _cost(M7B + ["--gpus-per-node", "8"]).model.ffn_hidden_size == 4 * 4096
    assert ModelSpec(num_layers=1, hidden_size=96, num_attention_heads=4, seq_length=8, vocab_size=8,
                     gated_mlp=True).ffn_hidden_size == 256          # int(256 / 64) * 64
    outs = []
    for extra in (["--swiglu"], ["--swiglu", "--ffn-hidden-size", "10880"]):
        rc, out, _ = run_plan(capsys, *M7B, "--tensor-model-parallel-size", "4", "--gpus-per-node", "8,8,8,7",
                              "--json", *extra)
        assert rc == 0
        outs.append(json.loads(out)["predicted_iteration_time_s"])
    assert outs[0] == outs[1]
    # the in-job planner (Megatron-LM hooks) prices the same model
    import argparse

    from elastor_ds.integrations.megatron import autoplan
    args = argparse.Namespace(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                              vocab_size=32000, tokenizer_type="GPT2BPETokenizer", ffn_hidden_size=None, swiglu=True,
                              group_query_attention=False, bf16=True, fp16=False,
                              untie_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128)
    assert autoplan.model_spec(args) == cost.model
    rc, _, err = run_plan(capsys, *M7B[:2], "--hidden-size", "16", "--num-attention-heads", "4", *M7B[6:],
                          "--swiglu", "--gpus-per-node", "8")
    line = one_error_line(err)
    assert rc == 2 and "--ffn-hidden-size" in line   # int(42.7 / 64) * 64 = 0
