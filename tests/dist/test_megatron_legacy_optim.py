"""Legacy Megatron optimizer state through ``elastor convert --from/--to megatron`` (issue 12).

On 2 gloo ranks (PP2; tied embeddings on PP2 call .cuda(): the e2e covers them) a real megatron-core GPTModel gets its optimizer groups from
megatron-core's own ``_get_param_groups`` and a torch Adam (what ``FP32Optimizer`` wraps; for bf16,
Adam over fp32 main copies as ``Float16OptimizerWithFloat16Params`` builds them), takes two steps,
and each stage writes ``mp_rank_00_00S/model_optim_rng.pt`` the way Megatron-LM's legacy save does
(``optimizer.state_dict()``). Oracles: the moments (and fp32 main params) of every named parameter
read by hand from the live optimizer; after ``--from megatron`` they are bit-identical in the
consolidated checkpoint; after ``--to megatron`` a fresh model + Adam (new groups from
megatron-core) loads the exported rank file through megatron-core's own group matching
(``MegatronOptimizer._filter_and_reorder_param_groups``) and torch's ``load_state_dict`` (as
``FP32Optimizer.load_state_dict`` does) and holds bit-identical state. A distributed-optimizer
checkpoint (``distrib_optim.pt``) imports weights only and says why. The real Megatron-LM load of
an export is in scripts/megatron_lm_e2e.sh (patches/README.md).
"""
from __future__ import annotations

import os

import pytest

from dist_utils import run_world

pytest.importorskip("megatron.core")

LAYERS = 4


def _cfg(dtype: str):
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig

    return GPTSpecConfig(num_layers=LAYERS, hidden_size=16, num_attention_heads=4, vocab_size=50,
                         ffn_hidden_size=32, make_vocab_size_divisible_by=8, max_sequence_length=16,
                         share_embeddings_and_output_weights=False, dtype=dtype)


def _model_and_adam(cfg, mixed: bool):
    import torch
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from elastor_ds.integrations.megatron import initialize_from_layout
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout

    grid = initialize_from_layout(Layout.uniform(1, 2, 1, cfg.num_layers))
    model = build_gpt(cfg, grid)
    groups = _get_param_groups([model], OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.01), None)
    mains: list = []
    if mixed:  # Float16OptimizerWithFloat16Params: Adam over fp32 copies, group by group
        for g in groups:
            fp32 = [p.detach().clone().float() for p in g["params"]]
            for p, m in zip(g["params"], fp32):
                p.main_param = m
            mains.append(fp32)
            g["params"] = fp32
    adam = torch.optim.Adam(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    return model, adam, mains


def _state_by_name(model, adam, mixed: bool, first_layer: int) -> dict:
    from elastor_ds.integrations.megatron.specs import local_to_global

    out = {}
    for n, p in model.named_parameters():
        key = p.main_param if mixed else p
        g = local_to_global(n, first_layer)
        st = adam.state[key]
        out[f"optimizer.exp_avg.{g}"] = st["exp_avg"].clone()
        out[f"optimizer.exp_avg_sq.{g}"] = st["exp_avg_sq"].clone()
        if mixed:
            out[f"optimizer.fp32_param.{g}"] = key.detach().clone()
    return out


def _rank(rank: int, world: int, root: str, mixed: bool) -> None:
    import argparse

    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    cfg = _cfg("bfloat16" if mixed else "float32")
    torch.manual_seed(3)
    model, adam, mains = _model_and_adam(cfg, mixed)
    first = rank * LAYERS // 2
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        for group in adam.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        adam.step()
    want = _state_by_name(model, adam, mixed, first)
    torch.save(want, os.path.join(root, f"want_{rank}.pt"))
    opt_sd = adam.state_dict()
    if mixed:
        opt_sd = {"optimizer": opt_sd, "fp32_from_fp16_params": mains}
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=16, num_attention_heads=4, vocab_size=50,
                              padded_vocab_size=cfg.padded_vocab(1), ffn_hidden_size=32,
                              make_vocab_size_divisible_by=8, max_position_embeddings=16,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                              consumed_train_samples=64, untie_embeddings_and_output_weights=True)
    d = os.path.join(root, "meg", "iter_0000007", f"mp_rank_00_{rank:03d}")
    os.makedirs(d, exist_ok=True)
    sched = {"max_lr": 1e-3, "min_lr": 1e-4, "num_steps": 56, "lr_warmup_steps": 0, "lr_decay_steps": 160,
             "lr_decay_style": "cosine", "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant",
             "wd_incr_steps": 160}
    torch.save({"model": model.state_dict(), "optimizer": opt_sd, "opt_param_scheduler": sched, "args": args,
                "iteration": 7, "checkpoint_version": 3.0}, os.path.join(d, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(root, "meg", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")
    dist.barrier()
    if rank == 0:  # the user's side: import, export (no process group needed)
        from elastor_ds.cli import main
        assert main(["convert", os.path.join(root, "meg"), os.path.join(root, "el"), "--from", "megatron",
                     "--no-progress"]) == 0
        assert main(["convert", os.path.join(root, "el"), os.path.join(root, "cons"), "--to", "consolidated",
                     "--no-progress"]) == 0
        assert main(["convert", os.path.join(root, "el"), os.path.join(root, "exp"), "--to", "megatron",
                     "--pipeline-model-parallel-size", "2", "--no-progress"]) == 0
    dist.barrier()
    # the framework's side: a fresh model + Adam loads the exported rank file like FP32Optimizer does
    torch.manual_seed(99)
    model2, adam2, mains2 = _model_and_adam(cfg, mixed)
    path = os.path.join(root, "exp", "iter_0000007", f"mp_rank_00_{rank:03d}", "model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):  # Megatron's args, as its loader reads them
        sd = torch.load(path, weights_only=True)
    inner = sd["optimizer"]["optimizer"] if mixed else sd["optimizer"]
    inner["param_groups"] = MegatronOptimizer._filter_and_reorder_param_groups(adam2.param_groups,
                                                                               inner["param_groups"])
    adam2.load_state_dict(inner)
    if mixed:
        for cur, saved in zip(mains2, sd["optimizer"]["fp32_from_fp16_params"]):
            for c, s in zip(cur, saved):
                c.data.copy_(s)
    got = _state_by_name(model2, adam2, mixed, first)
    rows = lambda k, t: t[:50] if ("word_embeddings" in k or "output_layer" in k) else t  # noqa: E731
    bad = [k for k in want if not torch.equal(rows(k, want[k]), rows(k, got[k]))]  # padding rows: not carried
    assert not bad, f"rank {rank}: {len(bad)} optimizer tensors differ after export -> load: {bad[:4]}"
    assert sd["opt_param_scheduler"] == sched and sd["args"].consumed_train_samples == 64
    assert all(float(s["step"]) == 2.0 for s in inner["state"].values())
    assert adam2.param_groups[0]["betas"] == (0.9, 0.95)  # Adam's betas travel with the state


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16_main_params"])
def test_legacy_optimizer_import_export_against_megatron_core(tmp_path, mixed):
    import torch
    from safetensors.torch import load_file

    run_world(_rank, 2, str(tmp_path), mixed, timeout_s=240)
    want = {}
    for r in range(2):
        want.update(torch.load(os.path.join(tmp_path, f"want_{r}.pt"), weights_only=True))
    got = load_file(os.path.join(tmp_path, "cons", "optimizer.safetensors"))
    vocab = 50
    bad = []
    for k, t in want.items():
        if "word_embeddings" in k or "output_layer" in k:
            t = t[:vocab]  # padding rows are not carried
        if k not in got or not torch.equal(got[k], t):
            bad.append(k)
    assert not bad, f"{len(bad)} of {len(want)} imported optimizer tensors differ: {bad[:4]}"
    assert float(got["optimizer.step"]) == 2.0
    assert set(got) == set(want) | {"optimizer.step"}


def test_distributed_optimizer_checkpoint_imports_weights_only_and_says_why(tmp_path, caplog):
    import argparse
    import logging

    import torch

    from elastor_ds.integrations.megatron.convert import import_megatron
    from elastor_ds.integrations.megatron.specs import gpt_tensor_specs

    cfg = _cfg("float32")
    d = tmp_path / "meg" / "iter_0000003" / "mp_rank_00"
    d.mkdir(parents=True)
    model = {s.name: torch.zeros(s.shape if s.shape[0] != 50 else (cfg.padded_vocab(1), 16))
             for s in gpt_tensor_specs(cfg)}
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=16, num_attention_heads=4, vocab_size=50,
                              ffn_hidden_size=32, make_vocab_size_divisible_by=8, max_position_embeddings=16)
    torch.save({"model": model, "optimizer": {"param_state_sharding_type": "dp_reshardable"}, "args": args,
                "iteration": 3}, str(d / "model_optim_rng.pt"))
    torch.save({}, str(d / "distrib_optim.pt"))
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("3")
    with caplog.at_level(logging.WARNING):
        res = import_megatron(str(tmp_path / "meg"), str(tmp_path / "el"))
    assert res["optimizer"] is False
    assert "distrib_optim.pt" in caplog.text and "weights only" in caplog.text


def test_parse_refuses_state_that_does_not_fit_and_names_it():
    """Hand-made Megatron optimizer entries: a fitting one maps by Megatron's grouping; a wrong group
    size, a wrong shape or a non-tensor moment is a CheckpointError naming it (the importer then
    imports weights only)."""
    import torch

    from elastor_ds.errors import CheckpointError
    from elastor_ds.integrations.megatron import legacy_optim as lo

    params = {"embedding.word_embeddings.weight": (8, 4), "decoder.layers.0.input_layernorm.weight": (4,),
              "decoder.layers.0.input_layernorm.bias": (4,), "decoder.layers.0.self_attention.linear_proj.weight": (4, 4),
              "decoder.layers.0.self_attention.linear_proj.bias": (4,)}
    # megatron-core: group 0 = weights with decay [emb, proj.weight], group 1 = [ln.weight, ln.bias, proj.bias]
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_proj.weight",
             "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.bias",
             "decoder.layers.0.self_attention.linear_proj.bias"]

    def entry():
        state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.full(params[n], float(i)),
                     "exp_avg_sq": torch.full(params[n], 10.0 + i)} for i, n in enumerate(names)}
        return {"state": state, "param_groups": [{"params": [0, 1], "wd_mult": 1.0, "lr_mult": 1.0},
                                                 {"params": [2, 3, 4], "wd_mult": 0.0, "lr_mult": 1.0}]}
    st = lo.parse(entry(), params, "f")
    assert {n: float(st.exp_avg[n].flatten()[0]) for n in names} == {n: float(i) for i, n in enumerate(names)}
    assert st.step == 3.0
    bad = entry()
    bad["param_groups"][0]["params"] = [0]
    with pytest.raises(CheckpointError, match="param_groups\\[0\\].*holds 1 parameters"):
        lo.parse(bad, params, "f")
    bad = entry()
    bad["state"][1]["exp_avg"] = torch.zeros(3, 4)
    with pytest.raises(CheckpointError, match="state\\[1\\].exp_avg of decoder.layers.0.self_attention.linear_proj.weight"):
        lo.parse(bad, params, "f")
    bad = entry()
    bad["state"][2]["exp_avg_sq"] = "x"
    with pytest.raises(CheckpointError, match="exp_avg_sq"):
        lo.parse(bad, params, "f")
    bad = entry()
    bad["state"][4]["step"] = torch.tensor(2.0)
    with pytest.raises(CheckpointError, match="different Adam steps"):
        lo.parse(bad, params, "f")
    with pytest.raises(CheckpointError, match="distrib_optim.pt"):
        lo.parse({"param_state_sharding_type": "dp_reshardable"}, params, "f")
