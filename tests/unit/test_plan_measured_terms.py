"""The trainer's measured per-iteration terms: ``layer_profile.in_situ_terms`` turns every rank's
timings of the pipeline instructions and TP all-reduces into the profile (values computed by hand
below), and the cost model adds ``embedding_time_s`` per micro-batch on the first stage and
``step_time_s`` per iteration -- nothing when a profile does not carry them. Pure CPU."""
from __future__ import annotations

import os
import sys

import pytest

from elastor_ds.errors import ConfigError
from elastor_ds.plan import Cluster, CostModel, ModelSpec, Plan, PlanReplica, PlanStage, Profile, TrainingSpec

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.isdir(os.path.join(ROOT, "examples")):   # the repository root from any tests/ subfolder
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "megatron_gpt"))
import layer_profile  # noqa: E402

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=104,
                  dtype_bytes=4)
TRAIN = TrainingSpec(micro_batch_size=2, num_micro_batches=4, zero_stage=0)


def _rank(first, last, layers, layer_s, ar_in, ar_out, instr, iter_s, tp=2):
    return {"tp": tp, "stage": 0, "first": first, "last": last, "layers": layers, "layer_s": layer_s, "iters": 2,
            "micro_batches": 4,
            "iter_s": iter_s, "instr": instr, "ar_in": ar_in, "ar_out": ar_out}


def test_in_situ_terms_by_hand():
    # stages of 2 and 3 layers, 4 micro-batches, 2 timed iterations
    r0 = _rank(True, False, 2, 0.88, [0.16, 32], [0.04, 8],
               {"ForwardPass": [0.5, 8], "BackwardPass": [0.5, 8], "LoadMicroBatch": [0.02, 8],
                "SendActivation": [0.08, 8], "RecvGrad": [0.3, 8], "OptimizerStep": [0.06, 2]}, [0.7, 0.72])
    r1 = _rank(False, True, 3, 1.2, [0.24, 48], [0.08, 32],
               {"ForwardPass": [0.9, 8], "BackwardPass": [0.5, 8], "RecvActivation": [0.2, 8],
                "SendGrad": [0.16, 8], "ReduceGrads": [0.02, 2], "OptimizerStep": [0.1, 2]}, [0.9, 0.92])
    out = layer_profile.in_situ_terms([r0, r1])
    # every rank's layer seconds less all-reduces over all layer micro-batches:
    # (0.88 - 0.16 + 1.2 - 0.24) / (2 x 4 x 2 + 3 x 4 x 2) = 1.68 / 40 = 0.042
    assert out["layer_time_s"]["2"] == pytest.approx(0.042)
    assert out["layer_time_includes_tp_comm"] is False
    # first stage: (0.5 + 0.5 + 0.02 - 0.88 - 0.04) / 8 = 0.0125; last: (0.9 + 0.5 - 1.2 - 0.08) / 8 = 0.015
    assert out["embedding_time_s"]["2"] == pytest.approx(0.0125)
    assert out["head_time_s"]["2"] == pytest.approx(0.015)
    # iteration outside passes, transfers and gradient reduce: 0.71 - (1.02 + 0.08 + 0.3) / 2 = 0.01 and
    # 0.91 - (1.4 + 0.2 + 0.16 + 0.02) / 2 = 0.02, median 0.015
    assert out["step_time_s"] == pytest.approx(0.015)
    # all-reduce per call: (0.16 + 0.24) / (32 + 48) = 0.005; half a send per call: median(0.08 / 8, 0.16 / 8) / 2
    assert out["in_situ"]["tp_all_reduce_s"] == {"2": pytest.approx(0.005)}
    assert out["in_situ"]["p2p_s"] == pytest.approx(0.0075)
    assert all(out["sources"][k].startswith("measured") for k in out["sources"])
    doc = {"collectives": {"tp_all_reduce": {"2": {"latency_s": 1.0, "s_per_byte": 1.0}}}, **out}
    layer_profile.scale_widths(doc, {"1": 3.0, "2": 2.0})
    assert doc["layer_time_s"]["1"] == pytest.approx(0.063) and doc["head_time_s"]["1"] == pytest.approx(0.0225)
    layer_profile.apply_in_situ(doc)
    assert doc["collectives"]["tp_all_reduce"]["2"] == {"latency_s": pytest.approx(0.005), "s_per_byte": 0.0}
    assert "in_situ" not in doc
    Profile.from_dict(doc)  # a valid profile
    # a single-stage rank (embedding and head on one rank): its outside-layer work less the first
    # stage's embedding time counts as head time: (0.3 + 0.2 - 0.4) / 4 - 0.0125 = 0.0125
    r2 = _rank(True, True, 1, 0.4, [0.0, 0], [0.0, 0], {"ForwardPass": [0.3, 8], "BackwardPass": [0.2, 8]},
               [0.5, 0.5])
    r2["micro_batches"] = 2
    assert layer_profile.in_situ_terms([r0, r2])["head_time_s"]["2"] == pytest.approx(0.0125)
    # a job running two widths: each width's terms from its own ranks (TP 1: 0.4 / (1 x 2 x 2) = 0.1)
    r2["tp"] = 1
    two = layer_profile.in_situ_terms([r0, r2])
    assert two["layer_time_s"] == {"1": pytest.approx(0.1), "2": pytest.approx((0.88 - 0.16) / 16)}
    assert two["in_situ"]["tp_all_reduce_s"] == {"2": pytest.approx(0.005)}     # none at TP 1


def test_terms_are_each_counters_median_over_the_timed_iterations():
    # three timed iterations, a burst in a different counter in each (layers in the first, the
    # forward in the second, the backward in the third): each counter's own median counts, so no
    # burst enters. (The counters of the median iteration by wall time, the second, would give a
    # head time of (0.4 + 0.04 - 0.08) / 4 = 0.09 and a step time of 0.)
    its = [{"iter_s": t, "layer_s": ls, "ar_in": [0.0, 0], "ar_out": [0.0, 0],
            "instr": {"ForwardPass": [f, 4], "BackwardPass": [b, 4]}} for t, ls, f, b in
           ((0.9, 0.6, 0.05, 0.05), (0.2, 0.08, 0.4, 0.04), (0.1, 0.04, 0.03, 0.3))]
    r = _rank(True, True, 2, 0.72, [0.0, 0], [0.0, 0], {}, [0.9, 0.2, 0.1], tp=1)
    r.update(per_iter=its, iters=3)
    out = layer_profile.in_situ_terms([r])
    assert out["layer_time_s"]["1"] == pytest.approx(0.08 / (2 * 4))       # not 0.72 / (2 x 4 x 3)
    # medians: forward 0.05, backward 0.05, layers 0.08, wall 0.2
    assert out["head_time_s"]["1"] == pytest.approx((0.05 + 0.05 - 0.08) / 4)
    assert out["step_time_s"] == pytest.approx(0.2 - (0.05 + 0.05))


def _reducing(red_s):
    return [{"iter_s": 0.1, "layer_s": 0.01, "ar_in": [0.0, 0], "ar_out": [0.0, 0],
             "instr": {"ForwardPass": [0.02, 2], "ReduceGrads": [s, 1]}} for s in red_s]


def test_the_gradient_reduce_as_the_job_ran_it_is_the_least_over_ranks_median_over_iterations():
    r0 = _rank(True, True, 2, 0.0, [0.0, 0], [0.0, 0], {}, [0.1] * 3, tp=1)
    r1 = dict(r0)
    r2 = dict(r0)
    r0["per_iter"] = _reducing([0.010, 0.030, 0.002])
    r1["per_iter"] = _reducing([0.020, 0.004, 0.050])
    # a rank that does not reduce (no ReduceGrads call) is left out, though its 0 s is the least
    r2["per_iter"] = [dict(p, instr={"ForwardPass": [0.02, 2]}) for p in _reducing([0.0] * 3)]
    # per iteration the least: 0.010, 0.004, 0.002; their median 0.004
    assert layer_profile.grad_reduce_seconds([r0, r1, r2]) == pytest.approx(0.004)
    assert layer_profile.in_situ_terms([r0, r1, r2])["in_situ"]["grad_reduce_s"] == pytest.approx(0.004)
    assert layer_profile.grad_reduce_seconds([r2]) is None


def test_the_calibrations_gradient_sync_is_scaled_to_the_jobs_own():
    coll = {"dp_all_reduce": {"2": {"latency_s": 0.001, "s_per_byte": 1e-9}},
            "reduce_scatter": {"2": {"latency_s": 0.002, "s_per_byte": 2e-9}},
            "tp_all_reduce": {"2": {"latency_s": 0.5, "s_per_byte": 0.0}}}
    doc = {"layer_time_s": {"1": 0.01}, "head_time_s": {"1": 0.004}, "collectives": coll,
           "sources": {"collectives": "measured: calibration"}}
    cl = Cluster.from_gpus_per_node([2])
    d = cl.devices()
    dp2 = Plan(4, tuple(PlanReplica((PlanStage(1, (0, 4), (d[i],)),), 2) for i in range(2)), (), "uniform")
    before = CostModel(MODEL, TRAIN, cl, profile=Profile.from_dict(doc)).sync_time(dp2)
    # the model prices the sync from these collectives: the latency and the bytes both count
    assert before > 0.001
    assert layer_profile.scale_sync(doc, 3 * before, before, 15) == pytest.approx(3.0)
    assert doc["collectives"]["dp_all_reduce"]["2"] == {"latency_s": pytest.approx(0.003),
                                                        "s_per_byte": pytest.approx(3e-9)}
    assert doc["collectives"]["reduce_scatter"]["2"] == {"latency_s": pytest.approx(0.006),
                                                         "s_per_byte": pytest.approx(6e-9)}
    assert doc["collectives"]["tp_all_reduce"]["2"] == {"latency_s": 0.5, "s_per_byte": 0.0}   # not a sync
    assert "gradient sync x3" in doc["sources"]["collectives"] and "15 iterations" in doc["sources"]["collectives"]
    after = CostModel(MODEL, TRAIN, cl, profile=Profile.from_dict(doc)).sync_time(dp2)
    assert after == pytest.approx(3 * before)
    # nothing to scale against: left as it is
    assert layer_profile.scale_sync(doc, 0.01, 0.0, 15) is None
    assert doc["collectives"]["dp_all_reduce"]["2"]["latency_s"] == pytest.approx(0.003)


def _plan(cluster):
    d = cluster.devices()
    return Plan(4, (PlanReplica((PlanStage(1, (0, 2), (d[0],)), PlanStage(1, (2, 4), (d[1],))), 4),), (), "uniform")


def test_embedding_and_step_terms_add_exactly_and_are_absent_by_default():
    cl = Cluster.from_gpus_per_node([2])
    base = {"layer_time_s": {"1": 0.01}, "head_time_s": {"1": 0.004}}
    plain = CostModel(MODEL, TRAIN, cl, profile=Profile.from_dict(base)).evaluate(_plan(cl))
    # stages: 2 x 0.01 = 0.02 and 0.02 + 0.004 = 0.024; (4 + 1) x 0.024 = 0.12 (+ bandwidth-model p2p)
    assert plain.pipeline_time_s == pytest.approx(0.12, rel=1e-3)
    more = Profile.from_dict({**base, "embedding_time_s": {"1": 0.006}, "step_time_s": 0.05})
    cm = CostModel(MODEL, TRAIN, cl, profile=more)
    got = cm.evaluate(_plan(cl))
    # first stage 0.02 + 0.006 = 0.026 is now the slowest: 5 x 0.026 = 0.13; plus 0.05 once
    assert got.pipeline_time_s - plain.pipeline_time_s == pytest.approx(0.01, rel=1e-3)
    assert got.iteration_time_s - plain.iteration_time_s == pytest.approx(0.06, rel=1e-3)
    assert "embedding_time" in cm.sources() and "step_time" in cm.sources()
    assert "embedding_time" not in CostModel(MODEL, TRAIN, cl, profile=Profile.from_dict(base)).sources()
    assert Profile.from_dict(more.to_dict()) == more


@pytest.mark.parametrize("bad", [{"step_time_s": -1.0}, {"step_time_s": "1"}, {"embedding_time_s": {"1": -0.1}}])
def test_bad_measured_terms_are_config_errors(bad):
    with pytest.raises(ConfigError):
        Profile.from_dict({"layer_time_s": {"1": 0.01}, **bad})

