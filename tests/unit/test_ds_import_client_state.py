"""``elastor convert --from deepspeed``: a native checkpoint's client_state tensors come back as
tensors (dtype, shape and bytes), as DeepSpeed's own ``load_checkpoint`` returns them; one over the
JSON state's tensor limit stays a list of numbers, with a warning naming it, instead of failing the
import. Oracle: the tensors put in."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from elastor_ds.checkpoint.state import MAX_JSON_TENSOR_BYTES, from_jsonable, to_jsonable
from elastor_ds.integrations.deepspeed.convert import _engine_extra

pytestmark = pytest.mark.unit


def test_client_state_tensors_survive_an_import(caplog):
    small = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    bf = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    big = torch.zeros(MAX_JSON_TENSOR_BYTES // 4 + 1)
    mp_sd = {"module": {}, "global_steps": 5, "epoch": 7, "sampler": {"pos": small, "w": [bf, 3]}, "big": big}
    with caplog.at_level(logging.WARNING):
        extra = _engine_extra(mp_sd, [])
    back = from_jsonable(json.loads(json.dumps(to_jsonable(extra, "extra"))))["client_state"]
    assert back["epoch"] == 7
    pos, w = back["sampler"]["pos"], back["sampler"]["w"]
    assert pos.dtype == torch.int16 and torch.equal(pos, small)
    assert w[0].dtype == torch.bfloat16 and torch.equal(w[0], bf) and w[1] == 3
    assert isinstance(back["big"], list) and len(back["big"]) == big.numel()
    assert "client_state.big: a tensor of" in caplog.text and "kept as a list" in caplog.text


def test_universal_export_names_tensors_fp32_cannot_hold(tmp_path, caplog):
    """QA round 5, Q5-7: the universal format keeps fp32 copies, so an int64 above 2**24 changed in
    the export without a word. The export now names such tensors in a warning; int8 and bf16
    values, which fp32 holds exactly, are not named."""
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    from elastor_ds.integrations.deepspeed.convert import to_universal
    src = str(tmp_path / "ck")
    CheckpointEngine(src, async_save=False).save(3, [
        full_shard("w", torch.randn(4)), full_shard("big", torch.tensor([2 ** 62 + 1, 5])),
        full_shard("small", torch.tensor([-3, 7], dtype=torch.int8)), full_shard("h", torch.randn(3).bfloat16())])
    with caplog.at_level(logging.WARNING):
        to_universal(src, str(tmp_path / "u"))
    warned = [r.getMessage() for r in caplog.records if "does not hold" in r.getMessage()]
    assert len(warned) == 1 and "1 of them exactly" in warned[0] and ": big;" in warned[0], warned


def test_universal_export_of_a_name_too_long_for_a_folder_is_named(tmp_path):
    """QA round 5, Q5-8: a 10,000-character tensor name (save() takes it) failed the universal
    export with a bare 'File name too long'; it is now named, with the fix, before anything is written."""
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import full_shard
    from elastor_ds.errors import CheckpointError
    from elastor_ds.integrations.deepspeed.convert import to_universal
    src = str(tmp_path / "ck")
    CheckpointEngine(src, async_save=False).save(1, [full_shard("x" * 10000, torch.ones(2))])
    with pytest.raises(CheckpointError, match="cannot be a folder name .*--to consolidated"):
        to_universal(src, str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()
