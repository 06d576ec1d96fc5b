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
