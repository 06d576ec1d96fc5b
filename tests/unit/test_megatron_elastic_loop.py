"""Megatron-LM's training loop under ``elastor run`` (elastor_ds/integrations/megatron/elastic.py,
called by patches/megatron-lm/0007): no Megatron-LM checkout, no process group.

1. Not under ``elastor run`` (no worker): every iteration only asks for a memory snapshot
   (``training_hooks.after_iteration``); no heartbeat, no collective, no stop.
2. With ``elastor run``'s real worker hooks (ElasticWorker from the environment): the start is
   reported (t_loaded, world, layout, resumed iteration, the session's restore record), every
   iteration writes the heartbeat, and a SIGTERM (preemption) or SIGUSR1 (resize) makes the hook
   save this iteration, wait for the commit and return 0 or 75 (no snapshot then); without --save
   it returns the code without saving.
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
from elastor_ds.elastic import protocol
from elastor_ds.elastic.protocol import EXIT_OK, EXIT_RESIZE, StopCode
from elastor_ds.integrations.megatron import elastic, training_hooks
from elastor_ds.layout import Layout

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
    monkeypatch.setattr(training_hooks, "after_iteration", lambda it, *a: calls.append(f"snapshot? {it}"))
    return types.SimpleNamespace(hb=hb, events=ev, calls=calls)


def _args(**kw):
    return types.SimpleNamespace(save="/ckpt", elastor_plan="auto", **kw)


def _end(loop, it, save):
    return elastic.iteration_end(loop, it, "model", "optimizer", "scheduler", 1.0, save)


def test_not_under_elastor_run_only_snapshots(launched, monkeypatch):
    loop = elastic.attach(None, _args(), 10)
    assert loop.worker is None and loop.rank == 0
    saved = []
    assert _end(loop, 11, lambda: saved.append(11)) is None
    # a stop request recorded (as in a process that has hooks elsewhere; one without any ends on the
    # signal itself, see worker._on_signal): the loop has no worker, so it is not ours to act on
    monkeypatch.setattr(protocol, "_HOOKS_EXPECTED", True)
    worker_mod._on_signal(signal.SIGTERM, None)
    assert _end(loop, 12, lambda: saved.append(12)) is None
    assert saved == [] and launched.calls == ["snapshot? 11", "snapshot? 12"]
    assert not launched.events.exists() and not os.listdir(launched.hb)


def test_attach_reports_the_start_and_each_iteration_beats(launched, monkeypatch):
    restore = {"step": 6, "tier": "memory", "bytes": {"local-memory": 123}, "seconds": 0.5}
    monkeypatch.setitem(training_hooks._S.sessions, os.path.abspath("/ckpt"), types.SimpleNamespace(restore=restore))
    plan = Layout.uniform(1, 3, 1, 4, [0, 2, 3, 4])
    loop = elastic.attach(worker_mod.ElasticWorker.from_env(), _args(elastor_plan_layout=plan), 6)
    assert loop.worker is not None and loop.rank == 0 and loop.saves
    (rec,) = [json.loads(x) for x in launched.events.read_text().splitlines()]
    assert rec["event"] == "worker_started" and rec["resumed_from"] == 6 and rec["world_size"] == 1
    assert rec["layout"] == "tp1 x pp3 x dp1 (layout Ett|t|tL)" and rec["plan_source"] == "auto"
    assert [st["layers"] for st in rec["plan"]["replicas"][0]["stages"]] == [[0, 2], [2, 3], [3, 4]]
    assert rec["t_loaded"] <= rec["time"] and rec["restore"] == restore
    saved = []
    for it in (7, 8):
        assert _end(loop, it, lambda: saved.append(it)) is None
        assert (launched.hb / "heartbeat_0").read_text().split()[0] == str(it)
    assert saved == [] and launched.calls == ["snapshot? 7", "snapshot? 8"]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, EXIT_OK), (signal.SIGINT, EXIT_OK),
                                       (signal.SIGUSR1, EXIT_RESIZE)])
def test_a_stop_saves_this_iteration_waits_for_the_commit_and_returns_the_code(launched, sig, code):
    loop = elastic.attach(worker_mod.ElasticWorker.from_env(), _args(), 0)
    order: list[str] = launched.calls
    assert _end(loop, 3, lambda: order.append("save 3")) is None
    worker_mod._on_signal(sig, None)          # what the handler worker_main installs does
    assert _end(loop, 4, lambda: order.append("save 4")) == code
    assert order == ["snapshot? 3", "save 4", "finalize"]
    assert (launched.hb / "heartbeat_0").read_text().split()[0] == "4"


def test_a_stop_without_save_dir_exits_without_saving(launched):
    loop = elastic.attach(worker_mod.ElasticWorker.from_env(), types.SimpleNamespace(save=None), 0)
    assert not loop.saves
    worker_mod._on_signal(signal.SIGTERM, None)
    saved = []
    assert _end(loop, 2, lambda: saved.append(2)) == EXIT_OK
    assert saved == [] and launched.calls == []
    (rec,) = [json.loads(x) for x in launched.events.read_text().splitlines()]
    assert rec["plan_source"] == "flags" and rec["plan"] is None and rec["restore"] is None


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


@pytest.mark.parametrize("expect", [False, True], ids=["no-hooks", "hooks-expected"])
def test_a_stop_signal_ends_a_process_without_hooks_and_waits_for_expected_ones(expect):
    """worker_main's handlers in a process that never attaches an ElasticWorker: SIGTERM ends it as
    the signal would (it waited for --shutdown-timeout before). A trainer that attaches late
    (Megatron-LM's train(), after check_parallel_state) keeps the request for its agree_stop."""
    import subprocess
    import sys
    code = ("import os, signal\nfrom elastor_ds.elastic import protocol, worker\nworker.install_signal_handlers()\n"
            + ("protocol.expect_worker_hooks()\n" if expect else "")
            + "os.kill(os.getpid(), signal.SIGTERM)\nprint('requested', worker.requested().name)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if expect:
        assert p.returncode == 0 and "requested PREEMPT" in p.stdout, p.stderr
    else:
        assert p.returncode == -signal.SIGTERM and "requested" not in p.stdout, (p.returncode, p.stdout, p.stderr)
