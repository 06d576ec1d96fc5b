"""A save's JSON state carries enum members as their plain values (the object collectives that
gather per-rank extras take plain data only, comm/wire.py)."""
from __future__ import annotations

import enum
import json

import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint.engine import RankExtra
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.checkpoint.state import to_jsonable
from elastor_ds.comm.collectives import LocalComm


class Stage(enum.IntEnum):
    WARMUP = 2


class Mode(str, enum.Enum):
    TRAIN = "train"


def test_to_jsonable_gives_exact_plain_types():
    got = to_jsonable({"stage": Stage.WARMUP, "modes": [Mode.TRAIN, True, Stage.WARMUP]})
    assert got == {"stage": 2, "modes": ["train", True, 2]}
    assert type(got["stage"]) is int
    assert [type(v) for v in got["modes"]] == [str, bool, int]
    # what json would have written for these members anyway
    assert json.loads(json.dumps({"stage": Stage.WARMUP, "m": Mode.TRAIN})) == {"stage": 2, "m": "train"}


def test_save_with_enum_in_rank_extra_and_extra(tmp_path):
    eng = CheckpointEngine(str(tmp_path), comm=LocalComm(), async_save=True)
    extra = {"mode": Mode.TRAIN}
    eng.save(3, [full_shard("w", torch.arange(6.0))], extra=extra,
             rank_extra=RankExtra({"stage": Stage.WARMUP}, lambda ex, vals: dict(ex, stages=vals)))
    eng.wait()
    eng.finalize()
    man = json.loads((tmp_path / "step_000000003" / "manifest.json").read_text())
    assert man["extra"] == {"mode": "train", "stages": [{"stage": 2}]}


def test_fallback_never_takes_a_step_newer_than_the_one_named(tmp_path):
    """A run that started over (load none) beside an earlier run's step 200 saves 40 and 50; its
    step 50 is corrupt: the fallback loads 40, not the other run's 200."""
    from elastor_ds.checkpoint.shards import full_shard as fs

    root = str(tmp_path)
    old_run = CheckpointEngine(root, comm=LocalComm(), async_save=False)
    old_run.save(200, [fs("w", torch.full((256,), 200.0))])
    old_run.finalize()
    new_run = CheckpointEngine(root, comm=LocalComm(), async_save=False)
    for step in (40, 50):
        new_run.save(step, [fs("w", torch.full((256,), float(step)))])
    new_run.finalize()
    assert (tmp_path / "latest").read_text().strip().endswith("50")
    data = tmp_path / "step_000000050" / "data_00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-8] ^= 0xFF     # a byte of the tensor's data
    data.write_bytes(bytes(raw))
    dst = torch.zeros(256)
    res = CheckpointEngine(root, comm=LocalComm()).load(root, [fs("w", dst)], fallback=True)
    assert res.step == 40
    assert torch.equal(dst, torch.full((256,), 40.0))

