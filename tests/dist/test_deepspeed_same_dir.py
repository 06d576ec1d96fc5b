"""``engine.save_checkpoint(dir)`` into the elastor ``checkpoint.dir`` (what a DeepSpeed user
migrating writes: ``save_checkpoint(args.save)`` with ``"dir": args.save``). Before (QA Q1), the
two ``latest`` files were one: DeepSpeed's tag replaced elastor's step pointer (a resume then
refused the root as "crafted") or elastor's replaced DeepSpeed's (``load_checkpoint(dir)`` died on
a bare AssertionError inside DeepSpeed), depending on timing. Now elastor's ``latest`` stays;
DeepSpeed's own files are written beside it without DeepSpeed's ``latest``; DeepSpeed's loader
takes them with ``tag=``, and without it says what to do. Oracle: the files on disk and the
step each loader reports."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402


def _worker(rank: int, world: int, ck: str, out: str) -> None:
    import torch.distributed as dist

    from ds_scenarios import build
    from elastor_ds.errors import ConfigError
    from elastor_ds.testing import toy_pipe as toy

    spec = dict(pp=2, dp=1, mb=2, gas=2, zero=1, elastor={"checkpoint": {"dir": ck, "load": "latest", "async": True}})
    engine = build(spec)
    it = toy.batches(0, 0, 1, 2, 2)
    for _ in range(3):
        engine.train_batch(it)
    import torch
    client = {"epoch": 7, "best_val_loss": float("inf"), "seen": torch.arange(5, dtype=torch.int16),
              "ema": torch.tensor([0.5, -1.25], dtype=torch.bfloat16)}
    engine.save_checkpoint(ck, client_state=client)   # DeepSpeed's files + an elastor checkpoint
    engine.elastor.wait()
    res: dict = {}
    try:
        engine.load_checkpoint(ck)
    except ConfigError as e:
        res["untagged"] = str(e)
    path, client = engine.load_checkpoint(ck, tag="global_step3")
    res["tagged"] = [os.path.relpath(path or "", ck), (client or {}).get("epoch")]
    engine.elastor.finalize()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()


def _resume(rank: int, world: int, ck: str, out: str) -> None:
    import torch.distributed as dist

    from ds_scenarios import build
    engine = build(dict(pp=2, dp=1, mb=2, gas=2, zero=1, elastor={"checkpoint": {"dir": ck, "load": "latest"}}))
    if rank == 0:
        import math

        import torch
        cs = engine.elastor_client_state()
        # QA Q5: tensors came back as lists and an inf failed the save; oracle: the values saved above
        tensors_ok = (isinstance(cs["seen"], torch.Tensor) and cs["seen"].dtype == torch.int16
                      and torch.equal(cs["seen"], torch.arange(5, dtype=torch.int16))
                      and cs["ema"].dtype == torch.bfloat16
                      and torch.equal(cs["ema"], torch.tensor([0.5, -1.25], dtype=torch.bfloat16)))
        with open(out, "w") as f:
            json.dump({"start": int(engine.global_steps), "epoch": cs["epoch"],
                       "best_is_inf": cs["best_val_loss"] == math.inf, "tensors_ok": bool(tensors_ok)}, f)
    engine.elastor.finalize()
    dist.barrier()


def test_save_checkpoint_into_the_elastor_dir_keeps_both_loadable(tmp_path):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out.json")
    run_world(_worker, 2, ck, out, timeout_s=180)
    with open(out) as f:
        res = json.load(f)
    with open(os.path.join(ck, "latest")) as f:
        assert f.read().strip() == "step_000000003"          # elastor's pointer, not DeepSpeed's tag
    assert os.path.isdir(os.path.join(ck, "global_step3"))   # DeepSpeed's own files, beside it
    assert "names the elastor step step_000000003" in res["untagged"] and "tag='global_step<N>'" in res["untagged"]
    assert res["tagged"] == [os.path.join("global_step3", "mp_rank_00_model_states.pt"), 7]
    run_world(_resume, 2, ck, out, timeout_s=180)
    with open(out) as f:
        got = json.load(f)
    assert got == {"start": 3, "epoch": 7, "best_is_inf": True, "tensors_ok": True}
