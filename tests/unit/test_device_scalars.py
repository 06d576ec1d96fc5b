"""One-element CUDA tensors in a save's JSON state (Adam's ``step``, a loss scale) are read by the
engine's writer thread, never on the training thread, where ``.item()`` waits for every queued
kernel, once per snapshot. Without a GPU here, a stand-in for :class:`DeviceScalar` (its host
copy already there, its event a recorder) checks the engine's side: the value reaches the manifest
and the rank state, and the wait happens on the writer thread, after save() returned. The CUDA
half (pinned copy, event, no sync under ``torch.cuda.set_sync_debug_mode("error")``) is in
``tests/gpu/test_gpu_snapshot.py``."""
from __future__ import annotations

import threading

import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.planning.manifest import Manifest
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.checkpoint.state import DeviceScalar, resolve_deferred, to_jsonable


class _Event:
    """Records the thread that waited on it; the writer may wait only after save() returned."""

    def __init__(self, gate: threading.Event):
        self.gate = gate
        self.threads: list[str] = []

    def synchronize(self) -> None:
        self.gate.wait(10)
        self.threads.append(threading.current_thread().name)


def _stand_in(value: float, dtype: torch.dtype, gate: threading.Event) -> DeviceScalar:
    d = DeviceScalar.__new__(DeviceScalar)
    d._host = torch.tensor(value, dtype=dtype)
    d._event = _Event(gate)
    return d


def test_cpu_scalars_are_numbers_at_once_and_nothing_is_deferred():
    deferred: list = []
    out = to_jsonable({"step": torch.tensor(7.0), "v": [torch.tensor(3), 1, "x"]}, "extra", deferred)
    assert out == {"step": 7.0, "v": [3, 1, "x"]} and deferred == []
    assert resolve_deferred(out) == out


def test_device_scalars_are_resolved_by_the_writer_after_save_returns(tmp_path):
    gate = threading.Event()
    step = _stand_in(41.0, torch.float32, gate)
    scale = _stand_in(65536.0, torch.float32, gate)
    eng = CheckpointEngine(str(tmp_path), keep=1, async_save=True)
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    eng.save(5, [full_shard("w", w)], extra={"optimizer": [{"scalars": {"step": {"value": step}}}]},
             rank_state={"grad_scaler": [{"scale": scale}]})
    # save() returned: nothing has waited on a device event yet (the gate holds the writer)
    assert step._event.threads == [] and scale._event.threads == []
    gate.set()
    eng.wait()
    assert step._event.threads == ["elastor-writer"] and scale._event.threads == ["elastor-writer"]
    step_dir = commit_mod.resolve(str(tmp_path))
    with open(f"{step_dir}/manifest.json", encoding="utf-8") as f:
        man = Manifest.loads(f.read())
    assert man.extra["optimizer"][0]["scalars"]["step"]["value"] == 41.0
    res = eng.load(None, [full_shard("w", torch.zeros(8, 8))])
    assert res.rank_state == {"grad_scaler": [{"scale": 65536.0}]}
    eng.finalize()
