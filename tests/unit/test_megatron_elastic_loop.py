"""Megatron-LM's training loop under ``elastor run`` (elastor_ds/integrations/megatron/elastic.py,
called by patches/megatron-lm/0007): no Megatron-LM checkout, no process group.

1. Not under ``elastor run`` (no worker): attach returns None and the per-iteration hook does nothing.
2. With ``elastor run``'s real worker hooks (ElasticWorker from the environment): the start is
   reported (t_loaded, world, layout, resumed iteration), every iteration writes the heartbeat, and a
   SIGTERM (preemption) or SIGUSR1 (resize) makes the hook save this iteration, wait for the commit
   and return 0 or 75; without --save it returns the code without saving.
3. The e2e cases' decoding of Megatron-LM's logged losses (its second logged iteration of a launch
   is the mean of the first two), on the numbers of a recorded run.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import types

import pytest

from elastor_ds.elastic import worker as worker_mod
from elastor_ds.elastic.protocol import EXIT_OK, EXIT_RESIZE, StopCode
from elastor_ds.integrations.megatron import elastic, training_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """The environment ``elastor run`` gives a worker (heartbeat folder, events file), a fresh stop
    request, a stand-in layout description and a recording ``finalize``."""
    hb, ev = tmp_path / "hb", tmp_path / "events.jsonl"
    hb.mkdir()
    monkeypatch.setenv("ELASTOR_HEARTBEAT_DIR", str(hb))
    monkeypatch.setenv("ELASTOR_EVENTS_FILE", str(ev))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(worker_mod, "_requested", StopCode.NONE)
    monkeypatch.setattr(worker_mod, "_agreed", StopCode.NONE)
    monkeypatch.setattr(elastic, "describe_layout", lambda args: "tp1 x pp3 x dp1 (layout Ett|t|tL)")
    calls: list[str] = []
    monkeypatch.setattr(training_hooks, "finalize", lambda: calls.append("finalize"))
    return types.SimpleNamespace(hb=hb, events=ev, calls=calls)


def _args(**kw):
    return types.SimpleNamespace(save="/ckpt", elastor_plan="auto", **kw)


def test_not_under_elastor_run_does_nothing():
    assert elastic.attach(None, _args(), 10) is None
    saved = []
    assert elastic.stop_point(None, 11, lambda: saved.append(11)) is None
    assert saved == []


def test_attach_reports_the_start_and_each_iteration_beats(launched):
    loop = elastic.attach(worker_mod.ElasticWorker.from_env(), _args(), 6)
    assert loop is not None and loop.rank == 0 and loop.saves
    (rec,) = [json.loads(x) for x in launched.events.read_text().splitlines()]
    assert rec["event"] == "worker_started" and rec["resumed_from"] == 6 and rec["world_size"] == 1
    assert rec["layout"] == "tp1 x pp3 x dp1 (layout Ett|t|tL)" and rec["plan_source"] == "auto"
    assert rec["t_loaded"] <= rec["time"]
    saved = []
    for it in (7, 8):
        assert elastic.stop_point(loop, it, lambda: saved.append(it)) is None
        assert (launched.hb / "heartbeat_0").read_text().split()[0] == str(it)
    assert saved == [] and launched.calls == []


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, EXIT_OK), (signal.SIGINT, EXIT_OK),
                                       (signal.SIGUSR1, EXIT_RESIZE)])
def test_a_stop_saves_this_iteration_waits_for_the_commit_and_returns_the_code(launched, sig, code):
    loop = elastic.attach(worker_mod.ElasticWorker.from_env(), _args(), 0)
    order: list[str] = launched.calls
    assert elastic.stop_point(loop, 3, lambda: order.append("save 3")) is None
    worker_mod._on_signal(sig, None)          # what the handler worker_main installs does
    assert elastic.stop_point(loop, 4, lambda: order.append("save 4")) == code
    assert order == ["save 4", "finalize"]
    assert (launched.hb / "heartbeat_0").read_text().split()[0] == "4"


def test_a_stop_without_save_dir_exits_without_saving(launched):
    loop = elastic.attach(worker_mod.ElasticWorker.from_env(), types.SimpleNamespace(save=None), 0)
    assert loop is not None and not loop.saves
    worker_mod._on_signal(signal.SIGTERM, None)
    saved = []
    assert elastic.stop_point(loop, 2, lambda: saved.append(2)) == EXIT_OK
    assert saved == [] and launched.calls == []
    (rec,) = [json.loads(x) for x in launched.events.read_text().splitlines()]
    assert rec["plan_source"] == "flags"


def test_decode_losses_undoes_megatron_lms_first_two_iteration_mean():
    sys.path.insert(0, os.path.join(ROOT, "examples", "megatron_lm"))
    try:
        from elastic_cases import decode_losses
    finally:
        sys.path.remove(os.path.join(ROOT, "examples", "megatron_lm"))
    # a recorded resume from iteration 10 (patches/README.md): 11 logged 4.068249, 12 logged
    # 4.086055 (the mean of 11 and 12); the uninterrupted run logged 4.103861 for 12
    got = decode_losses({11: 4.068249, 12: 4.086055, 13: 4.0})
    assert got[11] == 4.068249 and got[13] == 4.0
    assert abs(got[12] - 4.103861) < 2e-6
    assert decode_losses({}) == {} and decode_losses({5: 1.5}) == {5: 1.5}
