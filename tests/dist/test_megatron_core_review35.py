"""Review 35 of the megatron-core library API (``save_gpt`` / ``load_gpt`` / ``initialize_from_layout`` /
``build_gpt``) as a user of megatron.core in their own loop, on 2 gloo ranks per world:

* save under TP2 x PP1 (one Adam step), load in new processes under TP1 x PP2 and under DP2: every weight
  and Adam moment (and the step) bit-identical to an oracle gathered by hand at save time from the TP2
  ranks' own tensors (megatron's ``partition_dim`` attributes; the gated ``linear_fc1`` halves
  re-joined; vocabulary padding cut), not through elastor;
* bad input fails with one typed error on *every* rank, promptly: a layout of another world size given
  to ``save_gpt`` / ``load_gpt``, a model that disagrees with the config on one pipeline stage only (the
  other stage used to wait in the engine's collective until the peer-liveness timeout), ``build_gpt``
  before ``initialize_from_layout`` / after ``teardown`` / with a grid parallel_state does not run.
"""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

pytest.importorskip("megatron.core")

from dist_utils import run_world  # noqa: E402

SAVE_STEP = 3


def _oracle_full(name: str, pieces, p, cfg):
    """The canonical (TP=1) tensor of ``name`` from the TP ranks' local tensors ``pieces`` (rank order)."""
    import torch

    if not getattr(p, "tensor_model_parallel", False):
        assert all(torch.equal(pieces[0], x) for x in pieces[1:]), name
        return pieces[0]
    dim = p.partition_dim
    if name.endswith("mlp.linear_fc1.weight") or name.endswith("mlp.linear_fc1.bias"):
        gates = [x.chunk(2, dim=0)[0] for x in pieces]
        ups = [x.chunk(2, dim=0)[1] for x in pieces]
        return torch.cat(gates + ups, dim=0)
    full = torch.cat(pieces, dim=dim)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = full[:cfg.vocab_size]
    return full


def _wrap(model, kind: str):
    """(model to hand to save_gpt/load_gpt, torch Adam, param -> its Adam state dict)."""
    import torch

    if kind == "torch":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt, lambda p: opt.state[p]
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)   # names: module.<name>
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    return ddp, opt, lambda p: opt.state[p]


def _fixed_grad_step(model, opt) -> None:
    """One Adam step on fixed gradients (the same on every TP rank: replicated parameters stay equal)."""
    import torch

    g = torch.Generator().manual_seed(11)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _save_tp2(rank: int, world: int, root: str, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.integrations.megatron import initialize_from_layout, save_gpt
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import fixed_batch, tiny_gpt_config, train_step

    cfg = tiny_gpt_config(num_layers=2)
    layout = Layout.uniform(2, 1, 1, cfg.num_layers)
    grid = initialize_from_layout(layout)
    model = build_gpt(cfg, grid, parallel_output=False)
    handed, opt, state_of = _wrap(model, kind)
    torch.manual_seed(0)
    if kind == "torch":
        train_step(model, cfg, fixed_batch(cfg), opt)
    else:
        _fixed_grad_step(model, opt)
    eng = CheckpointEngine(os.path.join(root, "ckpt"), TorchComm.create(120))
    save_gpt(eng, SAVE_STEP, handed, cfg, layout, opt)
    eng.wait()
    oracle = {}
    for name, p in model.named_parameters():
        st = state_of(p)
        for key, t in (("", p.detach()), ("optimizer.exp_avg.", st["exp_avg"]),
                       ("optimizer.exp_avg_sq.", st["exp_avg_sq"])):
            got = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(got, t.contiguous())
            oracle[key + name] = _oracle_full(name, got, p, cfg).clone()
        oracle["optimizer.step"] = torch.as_tensor(st["step"]).float().clone()
    if rank == 0:
        torch.save(oracle, os.path.join(root, "oracle.pt"))
    eng.finalize()


def _load_check(rank: int, world: int, root: str, tp: int, pp: int, dp: int, kind: str) -> None:
    import torch

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.integrations.megatron import initialize_from_layout, load_gpt
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.integrations.megatron.specs import local_to_global
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import tiny_gpt_config

    cfg = tiny_gpt_config(num_layers=2)
    layout = Layout.uniform(tp, pp, dp, cfg.num_layers)
    grid = initialize_from_layout(layout)
    torch.manual_seed(100 + rank)
    model = build_gpt(cfg, grid, parallel_output=False)
    handed, opt, state_of = _wrap(model, kind)
    eng = CheckpointEngine(os.path.join(root, "ckpt"), TorchComm.create(120))
    res = load_gpt(eng, None, handed, cfg, layout, opt)
    assert res.step == SAVE_STEP
    oracle = torch.load(os.path.join(root, "oracle.pt"))
    first = layout.position(rank).layers[0]
    seen = 0
    for name, p in model.named_parameters():
        g = local_to_global(name, first)
        st = state_of(p)
        for key, t in (("", p.detach()), ("optimizer.exp_avg.", st["exp_avg"]),
                       ("optimizer.exp_avg_sq.", st["exp_avg_sq"])):
            want = oracle[key + g]
            assert t.shape == want.shape, (key + g, t.shape, want.shape)
            assert torch.equal(t, want), f"rank {rank}: {key + g} differs from the oracle"
            seen += 1
        assert float(st["step"]) == float(oracle["optimizer.step"]) == 1.0
    assert seen == 3 * len(list(model.parameters())) > 0
    eng.finalize()


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 1), (1, 1, 2)], ids=["tp1pp2", "dp2"])
def test_save_tp2_load_other_layout_matches_a_hand_gathered_oracle(tmp_path, tp, pp, dp):
    run_world(_save_tp2, 2, str(tmp_path), "torch", timeout_s=180)
    run_world(_load_check, 2, str(tmp_path), tp, pp, dp, "torch", timeout_s=180)


def test_model_inside_megatron_ddp_saves_tp2_and_loads_pp2(tmp_path):
    """The model handed over inside megatron-core's DistributedDataParallel (parameter names
    ``module.<name>``; was: a ShardingError saying the config does not describe the model), with torch
    Adam: bit-identical to the hand-gathered oracle."""
    run_world(_save_tp2, 2, str(tmp_path), "ddp", timeout_s=180)
    run_world(_load_check, 2, str(tmp_path), 1, 2, 1, "ddp", timeout_s=180)


# ---------------------------------------------------------------- bad input: one typed error, every rank
PROMPT_S = 20.0   # the engine's comm below times out after 45 s: an error sooner than this was not a wait


def _bad_input(rank: int, world: int, root: str, case: str) -> None:
    import torch

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.errors import ConfigError, RanksFailedError, ShardingError
    from elastor_ds.integrations.megatron import initialize_from_layout, load_gpt, save_gpt, teardown
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.integrations.megatron.parallel import check_layout
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import tiny_gpt_config

    cfg = tiny_gpt_config(num_layers=2)
    layout = Layout.uniform(1, 2, 1, cfg.num_layers)
    if case.startswith("build_"):
        if case == "build_before_init":
            grid = check_layout(layout)
            want = "parallel_state is not initialised"
        elif case == "build_after_teardown":
            grid = initialize_from_layout(layout)
            teardown()
            want = "parallel_state is not initialised"
        else:   # a grid parallel_state does not run: TP2 x PP1 while it runs TP1 x PP2
            initialize_from_layout(layout)
            grid = check_layout(Layout.uniform(2, 1, 1, cfg.num_layers))
            want = r"grid tp 2 x pp 1 x dp 1 is not the one megatron-core's parallel_state runs \(tp 1 x pp 2"
        with pytest.raises(ConfigError, match=want):
            build_gpt(cfg, grid)
        return
    grid = initialize_from_layout(layout)
    model = build_gpt(cfg, grid, parallel_output=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    eng = CheckpointEngine(os.path.join(root, "ckpt"), TorchComm.create(45))
    if case == "load_mismatch":
        save_gpt(eng, 1, model, cfg, layout)
        eng.wait()
    t0 = time.monotonic()
    if case == "world_mismatch":    # a layout of 1 rank on a world of 2: rank 1 has no place in it
        with pytest.raises(ShardingError, match=r"has 1 ranks but the checkpoint engine's comm has 2"):
            save_gpt(eng, 1, model, cfg, Layout.uniform(1, 1, 1, cfg.num_layers), opt)
        with pytest.raises(ShardingError, match=r"has 1 ranks but the checkpoint engine's comm has 2"):
            load_gpt(eng, None, model, cfg, Layout.uniform(1, 1, 1, cfg.num_layers), opt)
    else:
        # a config with rotary positions: stage 0's model holds a position table the config lacks, stage 1
        # matches; every rank gets one error naming rank 0 and the parameter
        rope = dataclasses.replace(cfg, position_embedding_type="rope")
        fn = save_gpt if case == "save_mismatch" else load_gpt
        args = (eng, 2, model, rope, layout) if case == "save_mismatch" else (eng, None, model, rope, layout, opt)
        with pytest.raises(ShardingError, match=r"failed on 1 of 2 ranks: rank 0: ShardingError: rank 0: model "
                                                 r"parameters \['embedding.position_embeddings.weight'\]") as e:
            fn(*args)
        assert isinstance(e.value, RanksFailedError)
    assert time.monotonic() - t0 < PROMPT_S, f"rank {rank} waited {time.monotonic() - t0:.1f} s for the error"
    save_gpt(eng, 5, model, cfg, layout)   # the engine is still usable: every rank left together
    eng.finalize()
    assert sorted(os.listdir(os.path.join(root, "ckpt"))).count("step_000000005") == 1


@pytest.mark.parametrize("case", ["world_mismatch", "save_mismatch", "load_mismatch"])
def test_save_load_misfit_is_one_error_on_every_rank(tmp_path, case):
    run_world(_bad_input, 2, str(tmp_path), case, timeout_s=120)


@pytest.mark.parametrize("case", ["build_before_init", "build_after_teardown", "build_grid_mismatch"])
def test_build_gpt_without_a_matching_parallel_state_is_a_config_error(tmp_path, case):
    run_world(_bad_input, 2, str(tmp_path), case, timeout_s=120)


# ---------------------------------------------------------------- the docs' example, as written
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "megatron-lm.md")


def _docs_example() -> str:
    text = open(DOCS, encoding="utf-8").read()
    section = text.split("## megatron-core in your own trainer", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _launch(script: str, cwd: str, tp: int, pp: int) -> list[str]:
    """``torchrun --nproc-per-node 2 script tp pp``, as two processes with torchrun's environment."""
    import subprocess
    import sys

    from dist_utils import free_port

    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, script, str(tp), str(pp)], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


def test_docs_megatron_core_example_runs_as_written_and_resumes_under_another_layout(tmp_path):
    script = tmp_path / "gpt_loop.py"
    script.write_text(_docs_example())
    first = _launch(str(script), str(tmp_path), 2, 1)
    assert "trained steps 1..3 under tp2 x pp1" in first[0]
    second = _launch(str(script), str(tmp_path), 1, 2)
    assert "trained steps 4..6 under tp1 x pp2" in second[0]
    assert open(tmp_path / "ckpt" / "latest").read().strip() == "step_000000006"


# ---------------------------------------------------------------- an optimizer whose state is not on the model's params
def _optimizer_on_copies(rank: int, world: int, root: str) -> None:
    import torch

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.errors import ShardingError
    from elastor_ds.integrations.megatron import initialize_from_layout, save_gpt
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import tiny_gpt_config

    cfg = tiny_gpt_config(num_layers=2)
    layout = Layout.uniform(2, 1, 1, cfg.num_layers)
    model = build_gpt(cfg, initialize_from_layout(layout), parallel_output=False)
    # what megatron-core's mixed-precision optimizer does: Adam over fp32 main copies of the parameters
    main = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.Adam(main, lr=1e-2)
    for q in main:
        q.grad = torch.ones_like(q)
    opt.step()
    eng = CheckpointEngine(os.path.join(root, "ckpt"), TorchComm.create(45))
    with pytest.raises(ShardingError, match=rf"rank {rank}: the optimizer \(Adam\) holds none of this rank's "
                                            rf"\d+ trainable parameters .* so its Adam state would not be saved"):
        save_gpt(eng, 1, model, cfg, layout, opt)
    eng.finalize()
    assert not any(n.startswith("step_") for n in os.listdir(os.path.join(root, "ckpt")))


def test_optimizer_holding_none_of_the_model_params_is_refused_not_dropped(tmp_path):
    """Was: the save committed the weights alone, silently (every parameter counted as frozen)."""
    run_world(_optimizer_on_copies, 2, str(tmp_path), timeout_s=120)
