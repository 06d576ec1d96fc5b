"""Review 36 of the DeepSpeed integration, used as a DeepSpeed user would use it: gloo ranks on CPU,
a plain ``nn.Module``, ``engine.save_checkpoint`` calls a DeepSpeed script already has.

Oracles: the files on disk (DeepSpeed's own folder written or not), the steps elastor committed,
and the client state a resume hands back.
"""
from __future__ import annotations

import argparse
import os

import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402


def _engine(ck: str, world: int, load: str = "latest"):
    from elastor_ds import deepspeed as eds
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world, "zero_optimization": {"stage": 1},
           "steps_per_print": 10 ** 9, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "elastor": {"checkpoint": {"dir": ck, "interval_steps": 2, "keep": 5, "load": load, "async": False,
                                      "timeout_s": 20}}}
    engine, *_ = eds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine, n: int) -> None:
    for _ in range(n):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def _steps(ck: str) -> list[str]:
    return sorted(n for n in os.listdir(ck) if n.startswith("step_"))


# --- 1. a client_state JSON cannot hold ----------------------------------------------------------

def _client_state_worker(rank: int, world: int, d: str) -> None:
    from elastor_ds.errors import ConfigError, RanksFailedError
    ck, native = os.path.join(d, "ck"), os.path.join(d, "native")
    engine = _engine(ck, world)
    _train(engine, 3)                                              # step 2 committed
    engine.save_checkpoint(native, client_state={"epoch": 1})     # a good one first: elastor step 3
    with pytest.raises(ConfigError) as ei:                         # argparse args, as DeepSpeed scripts pickle
        engine.save_checkpoint(native, tag="bad", client_state={"args": argparse.Namespace(lr=1.0)})
    msg = str(ei.value)
    assert "client_state.args" in msg and "Namespace" in msg and "on_save_checkpoint" in msg, msg
    assert not os.path.exists(os.path.join(native, "bad")), "DeepSpeed's files were written before the refusal"
    # one rank's value only: every rank raises, naming it, instead of the other waiting in the save
    cs = {"args": argparse.Namespace(lr=1.0)} if rank == 1 else {"epoch": 2}
    with pytest.raises(RanksFailedError) as ei:
        engine.save_checkpoint(native, tag="bad1", client_state=cs)
    assert "rank 1" in str(ei.value) and "Namespace" in str(ei.value), str(ei.value)
    assert isinstance(ei.value, ConfigError)
    assert not os.path.exists(os.path.join(native, "bad1"))
    _train(engine, 2)             # the periodic save of step 5 (2 after 3) carries the last good client state
    engine.elastor.finalize()
    assert _steps(ck) == ["step_000000002", "step_000000003", "step_000000005"], _steps(ck)
    del engine
    again = _engine(ck, world)
    assert int(again.global_steps) == 5
    assert again.elastor_client_state() == {"epoch": 1}


def test_unstorable_client_state_is_refused_before_anything_is_written(tmp_path):
    """Was: DeepSpeed's files written, then the refusal; the bad client state stayed the session's, so
    every later periodic save was refused too (training with it caught stopped saving)."""
    run_world(_client_state_worker, 2, str(tmp_path), timeout_s=180)


# --- 2. save_checkpoint into elastor's own folder: the warning once per job ----------------------

def _same_dir_worker(rank: int, world: int, d: str) -> None:
    import logging
    ck = os.path.join(d, "ck")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("elastor_ds.integrations.deepspeed.api").addHandler(Keep(level=logging.WARNING))
    engine = _engine(ck, world)
    _train(engine, 1)
    engine.save_checkpoint(ck)      # the usual migration: DeepSpeed's save_dir is elastor's folder
    _train(engine, 1)
    engine.save_checkpoint(ck)
    engine.elastor.finalize()
    mine = [m for m in records if "is also the elastor checkpoint directory" in m]
    with open(os.path.join(d, f"warnings_{rank}.txt"), "w") as f:
        f.write(str(len(mine)))
    assert sorted(os.listdir(os.path.join(ck, "global_step2"))), "DeepSpeed's own files are still written"


def test_same_dir_warning_once_per_job_not_per_rank(tmp_path):
    """Was: every rank logged it (512 copies on 512 GPUs); the docs say once."""
    run_world(_same_dir_worker, 2, str(tmp_path), timeout_s=180)
    counts = [int((tmp_path / f"warnings_{r}.txt").read_text()) for r in range(2)]
    assert counts == [1, 0], counts


# --- 3. "plan": "auto" used as the docs say: no warning that it had no effect --------------------

def _auto_plan_worker(rank: int, world: int, d: str) -> None:
    import logging
    from elastor_ds import deepspeed as eds
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("elastor_ds").addHandler(Keep(level=logging.WARNING))
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1},
           "elastor": {"plan": "auto", "model": {"hidden_size": 16, "num_attention_heads": 2, "seq_length": 8,
                                                 "vocab_size": 32},
                       "checkpoint": {"dir": os.path.join(d, "ck"), "interval_steps": 2, "async": False}}}
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    layout = eds.resolve_plan(cfg, num_layers=len(layers))          # docs/deepspeed.md, "Heterogeneous plans"
    model = eds.PipelineModule(layers, loss_fn=lambda y, t: (y - t).pow(2).mean(), plan=layout,
                               num_stages=len(layout.replicas[0].stages))
    engine, *_ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    g = torch.Generator().manual_seed(1)
    it = iter(lambda: (torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)), None)
    for _ in range(2):
        engine.train_batch(it)
    engine.elastor.finalize()
    assert engine.module.parts == layout.boundaries(layout.position(rank).replica)   # the planner's boundaries
    bad = [m for m in records if "has no effect" in m]
    assert not bad, bad


def test_plan_auto_with_the_module_built_from_it_does_not_warn_it_had_no_effect(tmp_path):
    """Was: initialize warned on rank 0 that "plan": "auto" had no effect and the module was not built
    from the plan, for a module built exactly as the docs say, from resolve_plan(config, ...)."""
    run_world(_auto_plan_worker, 2, str(tmp_path), timeout_s=180)


# --- 4. a plain module under ZeRO-2 with accumulation and a scheduler, resumed at another DP and stage ----

def _zero2_worker(rank: int, world: int, d: str, name: str, zero: int, steps: int, load: str) -> None:
    from elastor_ds import deepspeed as eds
    gas = 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": gas,
           "train_batch_size": 4 * gas,
           "zero_optimization": {"stage": zero}, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10}},
           "elastor": {"checkpoint": {"dir": os.path.join(d, name), "interval_steps": 3, "async": False,
                                      "load": load}}}
    engine, *_ = eds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(steps * gas):   # the same 4 samples per micro-step whatever the DP degree
        micro = int(engine.global_steps) * gas + int(engine.micro_steps) % gas
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(micro))[rank * 4 // world:(rank + 1) * 4 // world]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    if rank == 0:
        torch.save({k: v.clone() for k, v in engine.module.state_dict().items()}, os.path.join(d, f"{name}.pt"))


def test_zero2_accumulation_and_scheduler_resume_at_another_dp_and_stage(tmp_path):
    """docs/deepspeed.md: a plain module's resume under another DP degree and ZeRO stage, ZeRO-2 included
    (DeepSpeed runs ZeRO-2 on one pipeline stage only). Oracle: the uninterrupted run's weights."""
    d = str(tmp_path)
    run_world(_zero2_worker, 2, d, "ref", 2, 6, "none", timeout_s=180)      # ZeRO-2, DP2: 6 steps
    run_world(_zero2_worker, 2, d, "a", 2, 3, "none", timeout_s=180)        # ZeRO-2, DP2: 3 steps, saved
    run_world(_zero2_worker, 1, d, "b", 0, 3, os.path.join(d, "a"), timeout_s=180)   # ZeRO-0, DP1: 3 more
    ref, got = torch.load(os.path.join(d, "ref.pt")), torch.load(os.path.join(d, "b.pt"))
    for k in ref:
        assert torch.allclose(ref[k], got[k], rtol=0, atol=1e-6), (k, (ref[k] - got[k]).abs().max())


# --- 5. an "elastor" section that differs between ranks ------------------------------------------

def _dir_differs_worker(rank: int, world: int, d: str, case: str) -> None:
    from elastor_ds.errors import ConfigError
    ck, every = os.path.join(d, "ck"), 1
    if case == "per_rank":
        ck = os.path.join(d, f"ck_{rank}")      # e.g. a config made per node, or a relative path per cwd
        want = ["elastor.checkpoint.dir (rank 0: " + repr(os.path.join(d, "ck_0")),
                "rank 1: " + repr(os.path.join(d, "ck_1"))]
    elif case == "missing_on_one":               # one node's copy of the config has no checkpoint section
        ck = ck if rank == 0 else None
        want = ["elastor.checkpoint (rank 0: 'set'; rank 1: 'none')"]
    else:                                        # one node's copy is older: another interval
        every = 2 if rank == 0 else 3
        want = ["elastor.checkpoint.interval_steps (rank 0: 2; rank 1: 3)"]
    from elastor_ds import deepspeed as eds
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "elastor": {"checkpoint": {"dir": ck, "interval_steps": every}} if ck else {}}
    with pytest.raises(ConfigError) as ei:
        eds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    msg = str(ei.value)
    assert msg.startswith('the "elastor" section differs between ranks: ') and all(w in msg for w in want), msg
    assert not [n for n in os.listdir(d) if n.startswith("ck")], os.listdir(d)   # nothing created


@pytest.mark.parametrize("case", ["per_rank", "missing_on_one", "interval"])
def test_elastor_section_that_differs_between_ranks_is_refused_at_initialize(tmp_path, case):
    """Was: initialize passed; the first save failed as 'another writer removed this save's temporary
    folder' (per_rank), or the ranks waited for each other in the checkpoint set-up (missing_on_one)
    or in the first save only some ranks made (interval) until the timeout."""
    run_world(_dir_differs_worker, 2, str(tmp_path), case, timeout_s=60)
