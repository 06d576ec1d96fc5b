"""The "elastor" DeepSpeed config section: valid shapes parse, bad ones name the key and the fix."""
from __future__ import annotations

import json

import pytest

from elastor_ds.errors import ConfigError
from elastor_ds.integrations.deepspeed.config import parse_elastor_section, split_ds_config


def test_full_section_parses():
    cfg = parse_elastor_section({"plan": "auto", "checkpoint": {
        "dir": "/ckpt", "interval_steps": 0, "min_interval_s": 30, "async": False, "keep": 3, "load": "none",
        "verify_on_load": False, "fallback_to_previous": False}})
    c = cfg.checkpoint
    assert cfg.plan == "auto" and c.dir == "/ckpt" and c.min_interval_s == 30.0 and not c.async_save
    assert c.keep == 3 and c.load == "none" and c.periodic


def test_defaults():
    c = parse_elastor_section({"checkpoint": {"dir": "x"}}).checkpoint
    assert (c.interval_steps, c.min_interval_s, c.async_save, c.keep, c.load) == (0, 0.0, True, 2, "latest")
    assert c.verify_on_load and c.fallback_to_previous and not c.periodic
    assert c.direct_io   # data files written with O_DIRECT where the file system takes it
    assert c.writer_sched == "idle" and c.writer_deadline_s == 5.0
    assert c.live_write is False   # opt-in: it asks that only the optimizer step changes saved tensors


class _NoFence:
    """The one TrainerState call a session makes when it is built."""

    def fence_optimizer(self):
        return None


def test_direct_io_can_be_turned_off_and_reaches_the_storage(tmp_path):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    for value in (False, True):
        c = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / str(value)), "direct_io": value}}).checkpoint
        assert c.direct_io is value
        s = CheckpointSession(_NoFence(), c, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
        assert s.ckpt.storage.direct_io is value


class _Fence:
    def __init__(self):
        import torch
        self.opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    def fence_optimizer(self):
        return self.opt


def test_live_write_reaches_the_engine_only_with_a_fence(tmp_path, caplog):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    with pytest.raises(ConfigError, match="live_write"):
        parse_elastor_section({"checkpoint": {"dir": "x", "live_write": "yes"}})
    c = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "a"), "live_write": True}}).checkpoint
    s = CheckpointSession(_Fence(), c, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
    assert s.device_fence and s.ckpt.live_write
    c = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "b"), "live_write": True}}).checkpoint
    s = CheckpointSession(_NoFence(), c, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
    assert not s.ckpt.live_write and "no step pre-hook" in caplog.text


def test_the_writer_schedule_reaches_the_engine(tmp_path):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    for sched, deadline in (("nice", 2.5), ("idle", 30)):
        c = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / sched), "writer_sched": sched,
                                                  "writer_deadline_s": deadline}}).checkpoint
        s = CheckpointSession(_NoFence(), c, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
        prio = s.ckpt.writer_priority
        assert (prio.sched.value, prio.deadline_s) == (sched, float(deadline))


@pytest.mark.parametrize("section, words", [
    ({"checkpont": {}}, ["checkpont", "did you mean 'checkpoint'"]),
    ({"checkpoint": {"dir": "d", "intervl_steps": 3}}, ["intervl_steps", "interval_steps"]),
    ({"checkpoint": {"interval_steps": 3}}, ["missing required key 'dir'"]),
    ({"checkpoint": {"dir": "d", "interval_steps": -1}}, ["interval_steps", ">= 0", "-1"]),
    ({"checkpoint": {"dir": "d", "interval_steps": 2.5}}, ["interval_steps", "2.5"]),
    ({"checkpoint": {"dir": "d", "interval_steps": True}}, ["interval_steps", "True"]),
    ({"checkpoint": {"dir": "d", "min_interval_s": "10"}}, ["min_interval_s", "'10'"]),
    ({"checkpoint": {"dir": "d", "keep": 0}}, ["keep", ">= 1", "never deleted"]),
    ({"checkpoint": {"dir": "d", "async": "yes"}}, ["async", "true or false"]),
    ({"checkpoint": {"dir": "d", "direct_io": "no"}}, ["direct_io", "true or false"]),
    ({"checkpoint": {"dir": "d", "writer_sched": "fast"}}, ["writer_sched", '"idle", "nice"', "'fast'"]),
    ({"checkpoint": {"dir": "d", "writer_deadline_s": 0}}, ["writer_deadline_s", "> 0"]),
    ({"checkpoint": {"dir": "d", "writer_deadline_s": "5"}}, ["writer_deadline_s", "'5'"]),
    ({"checkpoint": {"dir": ""}}, ["dir", "non-empty"]),
    ({"checkpoint": {"dir": "d", "load": 3}}, ["load", "latest"]),
    ({"checkpoint": "/ckpt"}, ["elastor.checkpoint", "expected an object"]),
    # a path with spaces around it became a directory named " " in the working directory; a NUL
    # failed later with a bare ValueError
    ({"checkpoint": {"dir": " /ckpt/run1 "}}, ["elastor.checkpoint.dir", "surrounding spaces"]),
    ({"checkpoint": {"dir": "/ckpt/a\x00b"}}, ["elastor.checkpoint.dir", "control characters"]),
    # typos of the two words were taken as relative paths ("/cwd/lastest does not exist")
    ({"checkpoint": {"dir": "d", "load": "lastest"}}, ["elastor.checkpoint.load", "did you mean 'latest'"]),
    ({"checkpoint": {"dir": "d", "load": "Latest"}}, ["did you mean 'latest'"]),
    ({"checkpoint": {"dir": "d", "load": "None"}}, ["did you mean 'none'", "./None"]),
    # accepted, then an OverflowError at initialize / in the writer's deadline thread
    ({"checkpoint": {"dir": "d", "timeout_s": 1e300}}, ["timeout_s", "too large", "604800"]),
    ({"checkpoint": {"dir": "d", "writer_deadline_s": 1e300}}, ["writer_deadline_s", "too large"]),
    # derived keep of 10^9 snapshots: the budget error then suggested a keep the keep rule refused
    ({"checkpoint": {"dir": "d"}, "memory_snapshot": {"interval_steps": 1, "peer_copy_interval_steps": 10 ** 9}},
     ["peer_copy_interval_steps", "at most 999"]),
    ({"plan": 5}, ["elastor.plan", "auto"]),
    ({"plan": "AUTO"}, ["elastor.plan", "did you mean \"auto\""]),   # was taken as a file name
    ({"plan": "auto", "model": {"num_layer": 3}}, ["elastor.model", "unknown key 'num_layer'"]),
    ({"plan": {"stages": []}}, ["elastor.plan", "replicas"]),
    ("on", ["elastor", "expected an object"]),
])
def test_bad_sections_name_the_problem(section, words):
    with pytest.raises(ConfigError) as ei:
        parse_elastor_section(section)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_split_removes_section_and_reads_files(tmp_path):
    ds = {"train_batch_size": 8, "elastor": {"checkpoint": {"dir": "c", "interval_steps": 5}}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    for src in (ds, str(p)):
        rest, cfg = split_ds_config(src)
        assert rest == {"train_batch_size": 8} and cfg.checkpoint.interval_steps == 5
    assert "elastor" in ds  # the caller's dict is not modified
    rest, cfg = split_ds_config({"train_batch_size": 8})
    assert cfg.checkpoint is None and cfg.plan is None
    with pytest.raises(ConfigError, match="does not exist"):
        split_ds_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        split_ds_config(str(tmp_path / "bad.json"))


def test_boundaries_and_plan_checks():
    pytest.importorskip("deepspeed")
    from elastor_ds.integrations.deepspeed.compat import check_version
    from elastor_ds.integrations.deepspeed.pipe import check_boundaries, grid_boundaries
    from elastor_ds.layout import Layout

    assert check_boundaries([0, 2, 5, 8], 3, 8) == [0, 2, 5, 8]
    for bad in ([0, 2, 8], [0, 5, 2, 8], [1, 2, 5, 8], [0, 2, 5, 7]):
        with pytest.raises(ConfigError, match="strictly increasing"):
            check_boundaries(bad, 3, 8)
    lay = Layout.uniform(1, 3, 2, 8, boundaries=[0, 2, 5, 8])
    assert grid_boundaries(lay, 3, 6) == [0, 2, 5, 8]
    with pytest.raises(ConfigError, match="has 6 devices but WORLD_SIZE is 4"):
        grid_boundaries(lay, 3, 4)
    assert grid_boundaries(Layout.uniform(2, 2, 1, 8), 2, 4) == [0, 4, 8]
    # heterogeneous plans run: each rank gets its own replica's boundaries
    hetero = Layout.from_json({"replicas": [{"stages": [{"tp": 1, "layers": [0, 3]}, {"tp": 1, "layers": [3, 8]}]},
                                            {"stages": [{"tp": 1, "layers": [0, 8]}]}]})
    assert grid_boundaries(hetero, 2, 3, rank=1) == [0, 3, 8]
    assert grid_boundaries(hetero, 1, 3, rank=2) == [0, 8]
    with pytest.raises(ConfigError, match="replica 1 1 stages but the PipelineModule has num_stages=2"):
        grid_boundaries(hetero, 2, 3, rank=2)
    with pytest.raises(ConfigError, match="too old"):
        check_version("0.14.2")
    assert check_version("0.19.8") == (0, 19, 8)


def test_save_policy():
    from elastor_ds.integrations.deepspeed.config import parse_checkpoint, save_due

    every3 = parse_checkpoint({"dir": "d", "interval_steps": 3})
    assert [s for s in range(1, 10) if save_due(every3, s, (s - 1) // 3 * 3 or None, 0.0, True)] == [3, 6, 9]
    assert not save_due(every3, 6, 6, 99.0, True)  # already saved this step
    both = parse_checkpoint({"dir": "d", "interval_steps": 2, "min_interval_s": 10})
    assert not save_due(both, 4, 2, 5.0, True) and save_due(both, 4, 2, 10.0, False)
    ref = parse_checkpoint({"dir": "d", "min_interval_s": 10})  # the reference's policy
    assert not save_due(ref, 5, 4, 11.0, False)  # previous save still writing
    assert not save_due(ref, 5, 4, 9.0, True)
    assert save_due(ref, 5, 4, 10.0, True)
    off = parse_checkpoint({"dir": "d"})
    assert not save_due(off, 100, None, 1e9, True)


def test_a_missing_load_path_is_refused_before_any_folder_is_made(tmp_path):
    """``"load": "<path>"`` that does not exist: CheckpointNotFoundError naming it, and the checkpoint
    folder (with its missing parents) is not created (QA D8: a rejected job left it behind)."""
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    from elastor_ds.errors import CheckpointNotFoundError
    c = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "a" / "b" / "ck"),
                                              "load": str(tmp_path / "nope")}}).checkpoint
    with pytest.raises(CheckpointNotFoundError, match=f"{tmp_path / 'nope'} does not exist"):
        CheckpointSession(_NoFence(), c, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_session_rejected_after_set_up_removes_only_the_empty_folders_it_made(tmp_path):
    """A load that fails after the storage made its root: ``discard_if_unused`` removes the folders
    set-up created, while empty, and nothing that was there before or that holds a file."""
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    (tmp_path / "keep").mkdir()
    c = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "keep" / "x" / "ck")}}).checkpoint
    s = CheckpointSession(_NoFence(), c, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
    assert (tmp_path / "keep" / "x" / "ck").is_dir()
    s.discard_if_unused()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"] and list((tmp_path / "keep").iterdir()) == []
    # a root that existed, or one that got a file since, stays
    (tmp_path / "keep" / "ck2").mkdir()
    c2 = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "keep" / "ck2")}}).checkpoint
    CheckpointSession(_NoFence(), c2, comm=LocalComm(), policy_comm=LocalComm()).discard_if_unused()  # type: ignore[arg-type]
    assert (tmp_path / "keep" / "ck2").is_dir()
    c3 = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "y" / "ck3")}}).checkpoint
    s3 = CheckpointSession(_NoFence(), c3, comm=LocalComm(), policy_comm=LocalComm())   # type: ignore[arg-type]
    (tmp_path / "y" / "note.txt").write_text("user's")
    s3.discard_if_unused()
    assert (tmp_path / "y" / "note.txt").read_text() == "user's" and not (tmp_path / "y" / "ck3").exists()


@pytest.mark.parametrize("section, msg", [
    ({"plan": "auto", "model": {"num_layers": -4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                "vocab_size": 97}}, "num_layers=-4"),
    ({"plan": "auto", "model": {"hidden_size": 64}}, "elastor.model: "),
    ({"plan": "auto", "profile": "/nonexistent/profile.json"}, "elastor.profile: /nonexistent/profile.json is not a file"),
])
def test_model_and_profile_values_are_checked_at_parse_time(section, msg):
    """deepspeed.md: the section is validated once, at initialize (QA Q8: these passed initialize
    and were refused only when a plan was made)."""
    with pytest.raises(ConfigError, match=msg):
        parse_elastor_section(section)


def test_a_complete_model_without_num_layers_parses():
    cfg = parse_elastor_section({"plan": "auto", "model": {"hidden_size": 64, "num_attention_heads": 4,
                                                           "seq_length": 32, "vocab_size": 97}})
    assert cfg.model == {"hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 97}


class _FenceState(_Fence):
    def snapshot_bytes(self, comm):
        return 1 << 20


class _NoFenceState:
    def fence_optimizer(self):
        return None

    def snapshot_bytes(self, comm):
        return 1 << 20


def test_memory_snapshot_live_write_reaches_the_snapshot_engine_only_with_a_fence(tmp_path, caplog):
    """``memory_snapshot.live_write``: with the optimizer's step pre-hook, the memory tier's engine
    writes live and its writer runs on idle cycles, while storage saves keep copying first; without
    one, snapshots copy at save time and the warning names the key."""
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.checkpoint.settings import WriterSched
    from elastor_ds.comm.collectives import LocalComm
    for fence in (True, False):
        d = tmp_path / str(fence)
        el = parse_elastor_section({"checkpoint": {"dir": str(d / "ck")},
                                    "memory_snapshot": {"dir": str(d / "mem"), "peer_copies": 0, "live_write": True}})
        state = _FenceState() if fence else _NoFenceState()
        s = CheckpointSession(state, el.checkpoint, el.memory_snapshot, comm=LocalComm(),  # type: ignore[arg-type]
                              policy_comm=LocalComm(), memory_comm=LocalComm(), cross_node=False)
        assert s.memory.ckpt.live_write is fence and not s.ckpt.live_write
        assert s.memory.ckpt.writer_priority.sched is (WriterSched.IDLE if fence else WriterSched.NICE)
        s.memory.ckpt.finalize()
    assert "memory_snapshot.live_write is on, but this trainer's optimizer has no step pre-hook" in caplog.text


def test_a_model_with_batch_norm_running_statistics_does_not_write_live(tmp_path, caplog):
    """Batch norm updates its running statistics in the forward pass, before the optimizer step's
    fence, and on CPU torch does not bump their version counters (checked below), so the live
    write's guard could not see it: the DeepSpeed state names the module, and the session keeps
    both live switches off with a warning naming each key."""
    import torch

    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    from elastor_ds.integrations.deepspeed.runtime import DeepSpeedState
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    v = net[1].running_mean._version
    net(torch.randn(8, 4))
    assert net[1].running_mean._version == v and net[1].running_mean.abs().sum() > 0   # changed, counter not
    stub = DeepSpeedState.__new__(DeepSpeedState)
    stub.engine = type("Engine", (), {"module": net})()
    hazard = stub.live_write_hazard()
    assert hazard is not None and "'1' (BatchNorm1d)" in hazard
    stub.engine = type("Engine", (), {"module": torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                                   torch.nn.BatchNorm1d(4, track_running_stats=False))})()
    assert stub.live_write_hazard() is None

    class _Hazard(_Fence):
        def live_write_hazard(self):
            return hazard

        def snapshot_bytes(self, comm):
            return 1 << 20
    el = parse_elastor_section({"checkpoint": {"dir": str(tmp_path / "ck"), "live_write": True},
                                "memory_snapshot": {"dir": str(tmp_path / "mem"), "peer_copies": 0,
                                                    "live_write": True}})
    s = CheckpointSession(_Hazard(), el.checkpoint, el.memory_snapshot, comm=LocalComm(),  # type: ignore[arg-type]
                          policy_comm=LocalComm(), memory_comm=LocalComm(), cross_node=False)
    assert not s.ckpt.live_write and not s.memory.ckpt.live_write
    s.memory.ckpt.finalize()
    for key in ("checkpoint.live_write", "memory_snapshot.live_write"):
        assert f"{key} is on, but module '1' (BatchNorm1d) updates its running statistics" in caplog.text


def test_plan_auto_on_a_module_not_built_from_the_plan_warns(caplog):
    """Review of the thirty-second session: ``"plan": "auto"`` with a module built without the plan
    ran the launch's layout with an INFO line nobody saw (the planner's plan was PP2, the engine ran
    DP2). It is a warning naming the fix now."""
    import logging
    from types import SimpleNamespace

    from elastor_ds.integrations.deepspeed.api import _check_plan

    engine = SimpleNamespace(module=SimpleNamespace(), num_stages=1, dp_world_size=2, grid=None,
                             gradient_accumulation_steps=lambda: 1)
    with caplog.at_level(logging.WARNING):
        _check_plan(engine, parse_elastor_section({"plan": "auto"}))
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(msgs) == 1 and "has no effect" in msgs[0] and "resolve_plan" in msgs[0], msgs


@pytest.mark.parametrize("zero, layouts, pp", [(0, "heterogeneous", None), (1, "heterogeneous", None),
                                               (2, "uniform", 1), (3, "uniform", 1)])
def test_plan_auto_with_zero_2_or_3_searches_one_stage_grids_only(monkeypatch, zero, layouts, pp):
    """DeepSpeed's PipelineEngine refuses ZeRO-2/3 with more than one stage (and heterogeneous
    plans run ZeRO-1 at most): ``"plan": "auto"`` with those stages asks the planner for one-stage
    grids (it asked for any grid, and could pick a pipeline the engine then refused)."""
    from elastor_ds.integrations.deepspeed import autoplan
    from elastor_ds.plan import world as plan_world
    seen = []

    def fake(cost_model, cons):
        seen.append(cons)
        raise plan_world.PlanningError("stop here")
    monkeypatch.setattr("elastor_ds.plan.best_plan_for_world", fake)
    ds = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8, "zero_optimization": {"stage": zero}}
    ecfg = parse_elastor_section({"plan": "auto", "model": {"hidden_size": 64, "num_attention_heads": 4,
                                                            "seq_length": 32, "vocab_size": 97}})
    with pytest.raises(ConfigError, match="stop here"):
        autoplan.auto_layout(ds, ecfg, 4, env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert [(c.layouts, c.pp) for c in seen] == [(layouts, pp)]
