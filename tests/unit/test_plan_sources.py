"""Predictions users can audit: the profile format says which numbers were measured and which were
assumed, the planner names the source of every cost term (`elastor plan` table and --json), and the
run report sets each phase's prediction beside its measured median and states how many processes
the best uniform alternative leaves idle. Pure CPU."""
from __future__ import annotations

import json

import pytest

from elastor_ds.cli import main as cli_main
from elastor_ds.elastic.events import Phase
from elastor_ds.elastic.report import _plan_text
from elastor_ds.errors import ConfigError
from elastor_ds.plan import Cluster, CostModel, ModelSpec, Profile, TrainingSpec

MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000)
BASE = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
        "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--tensor-model-parallel-size", "2", "--gpus-per-node", "4"]


def test_without_a_profile_every_term_is_assumed_and_says_its_constants():
    src = CostModel(MODEL, TrainingSpec(1, 16, nominal_tp=2), Cluster.from_gpus_per_node("4")).sources()
    assert set(src) == {"layer_time", "head_time", "tp_all_reduce", "p2p", "gradient_sync", "memory"}
    assert all(v.startswith("assumed") for v in src.values()), src
    assert "200 TFLOP/s" in src["layer_time"] and "150 GB/s" in src["tp_all_reduce"] and "25 GB/s" in src["p2p"]


def test_profile_sources_name_measured_and_scaled_widths():
    prof = Profile.from_dict({"layer_time_s": {"1": 0.02}, "layer_time_includes_tp_comm": False,
                              "sources": {"layer_time_s": "measured: 5 iterations on cpu"},
                              "collectives": {"tp_all_reduce": {"2": {"latency_s": 1e-4, "s_per_byte": 1e-9}}}})
    src = CostModel(MODEL, TrainingSpec(1, 16, nominal_tp=2), Cluster.from_gpus_per_node("4"), profile=prof).sources()
    assert src["layer_time"] == "measured: 5 iterations on cpu (TP 1); TP 2 scaled from the nearest measured width"
    # collectives present without a source: an older profile, taken as measured and said so
    assert src["tp_all_reduce"] == "measured (the profile does not say how)"
    assert src["p2p"].startswith("assumed") and src["gradient_sync"].startswith("assumed")
    assert Profile.from_dict(prof.to_dict()).sources == prof.sources  # round trip keeps them


@pytest.mark.parametrize("sources", [{"layer_time_s": "guessed"}, {"bogus": "measured"}, ["measured"]])
def test_bad_profile_sources_are_config_errors(sources):
    with pytest.raises(ConfigError):
        Profile.from_dict({"layer_time_s": {"1": 0.02}, "sources": sources})


def test_cli_names_the_source_of_every_term(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.02, "2": 0.011},
                                "sources": {"layer_time_s": "measured: by hand"}}))
    assert cli_main(BASE + ["--profile", str(prof), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cost_sources"]["layer_time"] == "measured: by hand (TP 1,2)"
    assert doc["cost_sources"]["tp_all_reduce"] == "inside the measured layer times"
    assert cli_main(BASE + ["--profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "  layer time: measured: by hand (TP 1,2)" in out and "  gradient sync: assumed:" in out


def test_report_sets_prediction_beside_measurement_and_states_idle_processes():
    ph = Phase(0, 6, "hetero", 0, 1, 40, median_iter_s=0.077,
               plan={"plan_source": "auto", "predicted_iter_s": 0.0616, "uniform_plan": "(mb4)[tp1:0-5]",
                     "uniform_predicted_iter_s": 0.0924, "uniform_idle_processes": 5})
    text = _plan_text(ph)
    # 61.6 / 77 = 0.8; 92.4 / 61.6 = 1.5
    assert "predicted 61.6 ms/it vs measured 77 (predicted/measured 0.80)" in text
    assert "best uniform on this world (mb4)[tp1:0-5] 92.4 ms/it (1.500x), 5 of 6 process(es) idle" in text
    ph.plan["uniform_idle_processes"] = 0
    assert _plan_text(ph).endswith("92.4 ms/it (1.500x), every process used")
    # the trainer's one word per cost term (pretrain_gpt.source_kinds of CostModel.sources())
    ph.plan["predicted_sources"] = {"layer_time": "measured", "p2p": "measured", "memory": "assumed"}
    assert _plan_text(ph).endswith("every process used; priced from measured: layer time + p2p, assumed: memory")
    ph.median_iter_s, ph.plan["predicted_iter_s"] = 1.1916, 0.9584   # whole milliseconds from 100 ms
    assert "predicted 958 ms/it vs measured 1192 (predicted/measured 0.80)" in _plan_text(ph)


def test_phase_median_leaves_out_the_two_warm_up_iterations():
    from elastor_ds.elastic.events import phases
    ev = [{"event": "worker_started", "time": 100.0, "world_size": 3, "layout": "L", "resumed_from": 0}]
    times = [5.0, 3.0, 1.0, 1.0, 2.0]   # median of the last three: 1.0 (of the last four: 1.5)
    t, ms = 100.0, []
    for i, dt in enumerate(times, 1):
        t += dt
        ms.append({"iteration": i, "time": t, "iter_time_s": dt})
    (ph,) = phases(ev, ms)
    assert ph.median_iter_s == 1.0
    (ph,) = phases(ev, ms[:3])          # too short to leave out two: only the first
    assert ph.median_iter_s == 2.0
