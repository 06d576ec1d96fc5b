"""The trainer's --elastor-plan auto re-plans from the previous launch's plan (``<save>/plan.json``)
only when that is safe: the re-plan's plan must give every launched process a place, else the full
search's best plan using all of them runs. Planning only (no processes started)."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.isdir(os.path.join(ROOT, "examples")):   # the repository root from any tests/ subfolder
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "megatron_gpt"))
import pretrain_gpt  # noqa: E402

from elastor_ds.layout import Layout  # noqa: E402
from elastor_ds.plan import CostModel, Profile, plan  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"]


def _save_previous(folder, layout, world, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    folder.mkdir(exist_ok=True)
    (folder / "plan.json").write_text(json.dumps(pretrain_gpt.plan_document_of(layout, world)))


def _auto(folder, world, monkeypatch, *extra):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    args = pretrain_gpt.parse_args(MODEL + ["--elastor-plan", "auto", "--save", str(folder), *extra])
    d = pretrain_gpt.derive(args, world)
    return d["layout"], args.plan_info


def _best_full_search(folder, world, *extra):
    args = pretrain_gpt.parse_args(MODEL + list(extra))
    model, training = pretrain_gpt.plan_specs(args)
    prof = folder / "profile.json"
    cost = CostModel(model, training, pretrain_gpt.elastic_cluster(world),
                     profile=Profile.load(prof) if prof.exists() else None)
    res = plan(cost, top_k=50)
    return min(c.cost.iteration_time_s for c in [res.best, *res.alternatives] if c.plan.num_gpus == world)


def test_replans_from_the_previous_plan_after_a_loss(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTOR_PROCS_PER_NODE", raising=False)
    folder = tmp_path / "ck"
    folder.mkdir()
    # layers dominate (as on the demo's CPU processes) and 6 micro-batches split evenly over 3 replicas:
    # every process is worth a place
    (folder / "profile.json").write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.01, "2": 0.006},
                                                     "step_time_s": 0.01}))
    _save_previous(folder, Layout.uniform(2, 2, 1, 4, micro_batches=6), 4, monkeypatch)
    layout, info = _auto(folder, 3, monkeypatch, "--global-batch-size", "12")
    assert info["plan_search"].startswith(f"re-plan from {folder / 'plan.json'}"), info["plan_search"]
    assert layout.world_size == 3
    # never worse than the full search's best plan on all 3 processes (priced by the same model)
    assert info["predicted_iter_s"] <= _best_full_search(folder, 3, "--global-batch-size", "12") * (1 + 1e-9)


def test_falls_back_to_the_full_search_when_the_replan_would_leave_processes_idle(tmp_path, monkeypatch):
    # with this profile the planner's best plan on 5 processes is 4 x TP1, leaving one idle
    monkeypatch.delenv("ELASTOR_PROCS_PER_NODE", raising=False)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "profile.json").write_text(json.dumps({"version": 1, "layer_time_s": {"1": 0.01, "2": 0.009}}))
    _save_previous(folder, Layout.uniform(1, 1, 4, 4, micro_batches=1), 4, monkeypatch)
    layout, info = _auto(folder, 5, monkeypatch)
    assert info["plan_search"].startswith("full search (the re-plan from"), info["plan_search"]
    assert "uses 4 of the 5 processes" in info["plan_search"]
    assert layout.world_size == 5 and info["idle_best_processes"] == 4
    assert info["predicted_iter_s"] == pytest.approx(_best_full_search(folder, 5))


def test_no_previous_plan_is_a_full_search(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTOR_PROCS_PER_NODE", raising=False)
    layout, info = _auto(tmp_path / "empty", 3, monkeypatch)
    assert info["plan_search"] == "full search (no previous plan)" and layout.world_size == 3
