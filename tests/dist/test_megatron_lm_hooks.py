"""The Megatron-LM trainer hooks' fixes, exercised without a Megatron-LM checkout.

1. Padded vocabulary: Megatron's padding rule, the divisor that keeps the padded size under a TP
   change (hand-computed values), and the warning text.
2. ``configure``: a plan that contradicts an explicit TP/PP size or pipeline layout is an error;
   the ``--yaml-cfg`` namespace (``args.model_parallel``) gets the plan; local non-persistent
   checkpoints are refused.
3. ``load_checkpoint`` refuses a stock Megatron checkpoint directory (never a silent restart) and a
   missing ``--ckpt-step``.
4. On 2 gloo ranks with a real megatron-core GPTModel: a distributed-optimizer state (contiguous
   DP-sharded ranges of the flattened params, crossing row boundaries) saved at TP1 x DP2 equals
   the state gathered by hand (independent oracle) and reloads bit-identically at TP2; a checkpoint
   without optimizer state still restores the scheduler and reloads the fp32 main params from the
   loaded weights (``--no-load-optim`` too); ``--ckpt-step`` picks an older step; non-persistent
   saves go to their own root and keep one.
"""
from __future__ import annotations

import argparse
import json
import os
import types

import pytest

from dist_utils import run_world


# ---------------------------------------------------------------- 1. padded vocabulary
def test_padded_vocab_and_divisor_fix():
    from elastor_ds.integrations.megatron import training_hooks as th

    assert th.padded_vocab(128, 128, 1) == 128 and th.padded_vocab(128, 128, 2) == 256
    assert th.padded_vocab(50257, 128, 8) == 51200
    # 128 rows at TP1 (divisor 128): divisor 64 keeps 128 rows at TP 1 and 2
    assert th.vocab_divisor_fix(128, 128, [1, 2]) == 64
    assert th.vocab_divisor_fix(50257, 50304, [1, 2, 4, 8]) == 6288  # 50304 = 8 * 6288, 50257 > 50304 - 8
    assert th.vocab_divisor_fix(100, 100, [3]) is None  # 3 does not divide 100
    msg = th.check_padded_vocab({"make_vocab_size_divisible_by": 128}, 1, 128, 128, 2)
    assert "128 rows" in msg and "256" in msg and "--make-vocab-size-divisible-by 64" in msg
    assert th.check_padded_vocab({"make_vocab_size_divisible_by": 64}, 1, 128, 64, 2) is None


def test_true_vocab_prefers_the_tokenizer(monkeypatch):
    """NullTokenizer's vocab_size is --vocab-size + 1: Megatron pads from the tokenizer's size."""
    import sys

    from elastor_ds.integrations.megatron import training_hooks as th

    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=128)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    assert th._true_vocab(argparse.Namespace(vocab_size=127), types.SimpleNamespace(vocab_size=128)) == 128


# ---------------------------------------------------------------- 2. configure
def _plan(tmp_path, tp, pp, dp, layers, bounds):
    from elastor_ds.layout import Layout

    p = tmp_path / f"plan_{tp}_{pp}_{dp}.json"
    p.write_text(json.dumps(Layout.uniform(tp, pp, dp, layers, bounds).to_json()))
    return str(p)


def _args(**kw):
    base = dict(elastor=True, elastor_keep=2, elastor_plan=None, num_layers=4, world_size=4,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, pipeline_model_parallel_layout=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_configure_refuses_a_plan_that_contradicts_the_flags(tmp_path):
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import training_hooks as th

    plan = _plan(tmp_path, 2, 2, 1, 4, [0, 1, 4])
    with pytest.raises(ConfigError, match="TP=2 but --tensor-model-parallel-size 4"):
        th.configure(_args(elastor_plan=plan, tensor_model_parallel_size=4))
    with pytest.raises(ConfigError, match="PP=2 but --pipeline-model-parallel-size 4"):
        th.configure(_args(elastor_plan=plan, pipeline_model_parallel_size=4))
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-layout Ett|ttL"):
        th.configure(_args(elastor_plan=plan, pipeline_model_parallel_layout="Ett|ttL"))
    a = _args(elastor_plan=plan, tensor_model_parallel_size=2, pipeline_model_parallel_layout="Et|tttL")
    th.configure(a)  # agreeing flags are fine
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.pipeline_model_parallel_layout) == \
        (2, 2, "Et|tttL")
    with pytest.raises(ConfigError, match="non-persistent-ckpt-type local"):
        th.configure(_args(non_persistent_ckpt_type="local"))


def test_configure_on_the_yaml_namespace(tmp_path):
    """--yaml-cfg: validate_yaml's args keep the parallel sizes in args.model_parallel."""
    from elastor_ds.integrations.megatron import training_hooks as th

    plan = _plan(tmp_path, 1, 2, 2, 4, [0, 3, 4])
    mp = types.SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                               expert_model_parallel_size=1)
    a = types.SimpleNamespace(elastor=True, elastor_plan=plan, world_size=4, model_parallel=mp,
                              language_model=types.SimpleNamespace(num_layers=4))
    th.configure(a)
    assert (mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size) == (1, 2)
    assert mp.pipeline_model_parallel_layout == "Ettt|tL"


# ---------------------------------------------------------------- 3. what load refuses
@pytest.mark.parametrize("mark", ["latest_checkpointed_iteration.txt", "iter_0000010"])
def test_load_refuses_a_stock_megatron_directory(tmp_path, mark):
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import training_hooks as th

    stock = tmp_path / "stock"
    (stock / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    if mark.endswith(".txt"):
        (stock / mark).write_text("10")
    with pytest.raises(ConfigError) as e:
        th.load_checkpoint(None, None, None, argparse.Namespace(load=str(stock), finetune=False))
    assert "stock Megatron checkpoint" in str(e.value) and f"elastor convert {stock}" in str(e.value)
    assert sorted(os.listdir(stock)) == sorted({"iter_0000010", mark})  # nothing written
    th.reset()


def test_missing_ckpt_step_is_an_error(tmp_path):
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import training_hooks as th

    (tmp_path / "ck").mkdir()
    with pytest.raises(ConfigError, match="--ckpt-step 5"):
        th.load_checkpoint(None, None, None, argparse.Namespace(load=str(tmp_path / "ck"), ckpt_step=5))


# ---------------------------------------------------------------- 4. on 2 gloo ranks
class _Sched:
    def __init__(self, n=0):
        self.num_steps = n

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd):
        self.num_steps = sd["num_steps"]


class DistributedOptimizer:
    """Duck-typed megatron DistributedOptimizer (the real one is run by the Megatron-LM e2e): the
    params are laid end to end in one flat buffer split into DP-equal contiguous ranges; each rank
    keeps fp32 main shards and Adam state for its range only, steps it and all-gathers the params."""

    def __init__(self, params, dp_group):
        import torch
        import torch.distributed as dist

        self.params = list(params)
        self.group = dp_group
        dp, r = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        total = sum(p.numel() for p in self.params)
        # split point: the middle of row 1 of the first 2-D param, so the ranges cut a row
        off = 0
        for p in self.params:
            if p.dim() == 2 and p.shape[0] > 2:
                break
            off += p.numel()
        cut = off + p.shape[1] + p.shape[1] // 2
        bounds = [0] + [cut * (i + 1) for i in range(dp - 1)] + [total] if dp > 1 else [0, total]
        lo, hi = bounds[r], bounds[r + 1]
        self.ranges, base = {}, 0
        self.model_float16_groups, self.shard_fp32_from_float16_groups = [[]], [[]]
        self.model_fp32_groups, self.shard_fp32_groups = [[]], [[]]
        self.offsets = {}
        for p in self.params:
            self.offsets[p] = base
            a, b = max(lo, base) - base, min(hi, base + p.numel()) - base
            if a < b:
                self.ranges[p] = (a, b)
                self.model_float16_groups[0].append(p)
                self.shard_fp32_from_float16_groups[0].append(p.detach().view(-1)[a:b].clone().float())
            base += p.numel()
        self.optimizer = torch.optim.Adam(self.shard_fp32_from_float16_groups[0], lr=1e-2)
        self.lo, self.total = lo, total

    def _get_model_param_range_map(self, p):
        a, b = self.ranges[p]
        return {"param": types.SimpleNamespace(start=a, end=b)}

    def reload_model_params(self):
        for p, m in zip(self.model_float16_groups[0], self.shard_fp32_from_float16_groups[0]):
            a, b = self.ranges[p]
            m.data.copy_(p.detach().view(-1)[a:b])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        import torch
        import torch.distributed as dist

        for p, m in zip(self.model_float16_groups[0], self.shard_fp32_from_float16_groups[0]):
            a, b = self.ranges[p]
            m.grad = p.grad.detach().view(-1)[a:b].float().clone()
        self.optimizer.step()
        flat = torch.zeros(self.total)
        for p, m in zip(self.model_float16_groups[0], self.shard_fp32_from_float16_groups[0]):
            a, b = self.ranges[p]
            off = self.offsets[p]
            flat[off + a: off + b] = m.data
        dist.all_reduce(flat, group=self.group)  # disjoint ranges: the sum is the gather
        base = 0
        for p in self.params:
            p.data.copy_(flat[base: base + p.numel()].view_as(p))
            base += p.numel()

    def gathered(self, key):
        """Full flat state ``key`` ("main" or an Adam moment) per param, gathered by hand."""
        import torch
        import torch.distributed as dist

        flat = torch.zeros(self.total)
        for p, m in zip(self.model_float16_groups[0], self.shard_fp32_from_float16_groups[0]):
            a, b = self.ranges[p]
            off = self.offsets[p]
            flat[off + a: off + b] = m.data if key == "main" else self.optimizer.state[m][key]
        dist.all_reduce(flat, group=self.group)
        out, base = {}, 0
        for p in self.params:
            out[p] = flat[base: base + p.numel()].view_as(p).clone()
            base += p.numel()
        return out


def _worker(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from megatron.core import parallel_state as ps

    from elastor_ds.checkpoint.convert import to_consolidated
    from elastor_ds.integrations.megatron import initialize_from_layout, training_hooks as th
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.integrations.megatron.state import named_local_params
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import consolidated_differences, fixed_batch, tiny_gpt_config, train_step

    cfg = tiny_gpt_config(num_layers=2)
    batch = fixed_batch(cfg)
    ck, ck2 = os.path.join(root, "ck"), os.path.join(root, "ck2")
    args = argparse.Namespace(elastor=True, elastor_async=False, elastor_keep=5, vocab_size=cfg.vocab_size,
                              make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, num_layers=cfg.num_layers,
                              save=ck, load=ck, consumed_train_samples=40, global_batch_size=4, finetune=False,
                              no_load_optim=False, no_load_rng=False, distributed_timeout_minutes=2,
                              non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=None)
    out: dict = {}

    # source: TP1 x DP2, the flat ranges split params mid-row; 2 steps; save at 5 (and 6, non-persistent)
    grid = initialize_from_layout(Layout.uniform(1, 1, 2, cfg.num_layers))
    m = build_gpt(cfg, grid, parallel_output=False)
    opt = DistributedOptimizer(m.parameters(), ps.get_data_parallel_group())
    out["split_mid_row"] = any((a % p.shape[-1] or b % p.shape[-1]) and p.dim() == 2 for p, (a, b) in opt.ranges.items())
    for _ in range(2):
        train_step(m, cfg, batch, opt)
    th.save_checkpoint(5, [m], opt, _Sched(5), 1.0, args)
    oracle = {k: opt.gathered(k) for k in ("main", "exp_avg", "exp_avg_sq")}
    th.save_checkpoint(6, [m], opt, _Sched(6), 1.0, args, non_persistent_ckpt=True)
    th.save_checkpoint(7, [m], opt, _Sched(7), 1.0, args, non_persistent_ckpt=True)
    th.save_checkpoint(8, [m], None, _Sched(8), 1.0, args)  # no optimizer state in this one
    th.finalize()
    th.reset()
    # Megatron-LM's --no-save-optim --no-save-rng: the same step without optimizer, scheduler, RNG
    a9 = argparse.Namespace(**vars(args))
    a9.save, a9.no_save_optim, a9.no_save_rng = os.path.join(root, "ck9"), True, True
    th.save_checkpoint(9, [m], opt, _Sched(9), 1.0, a9)
    th.finalize()
    th.reset()
    if rank == 0:
        from elastor_ds.checkpoint import commit as commit_mod
        man = commit_mod.read_manifest(os.path.join(root, "ck9", "step_000000009"))
        states = [json.load(open(os.path.join(root, "ck9", "step_000000009", f)))
                  for f in man.rank_state_files.values()]
        out["no_save"] = [sorted(n for n in man.tensors if n.startswith("optimizer.")), man.extra.get("optimizer_state"),
                          man.extra.get("opt_param_scheduler"), sorted({k for st in states for k in st}),
                          "embedding.word_embeddings.weight" in man.tensors]
    if rank == 0:
        to_consolidated(os.path.join(ck, "step_000000005"), os.path.join(root, "c1"), progress=False)
        opt_t = load_file(os.path.join(root, "c1", "optimizer.safetensors"))
        bad = []
        for name, p in named_local_params(m, cfg, 0).items():
            for key, pre in (("main", th.MAIN_PREFIX), ("exp_avg", "optimizer.exp_avg."),
                             ("exp_avg_sq", "optimizer.exp_avg_sq.")):
                got, want = opt_t.get(pre + name), oracle[key][p]
                if got is None or not torch.equal(got, want[:got.shape[0]]):
                    bad.append(pre + name)
        out["oracle_bad"] = bad
        out["np_steps"] = sorted(x for x in os.listdir(os.path.join(ck, "non_persistent")) if x.startswith("step_"))
        out["persistent_steps"] = sorted(x for x in os.listdir(ck) if x.startswith("step_"))

    # target: TP2 x DP1, --ckpt-step 5; the load goes into the DP1 flat ranges (whole params)
    grid = initialize_from_layout(Layout.uniform(2, 1, 1, cfg.num_layers))
    m2 = build_gpt(cfg, grid, parallel_output=False)
    opt2 = DistributedOptimizer(m2.parameters(), ps.get_data_parallel_group())
    s2 = _Sched()
    a2 = argparse.Namespace(**vars(args))
    a2.save, a2.ckpt_step, a2.consumed_train_samples = ck2, 5, 0
    it, _ = th.load_checkpoint([m2], opt2, s2, a2)
    out["ckpt_step"] = (it, s2.num_steps, a2.consumed_train_samples)
    th.save_checkpoint(5, [m2], opt2, s2, 1.0, a2)
    th.finalize()
    # newest: the non-persistent step 7 beats the persistent 5 and ... 8 (persistent, weights only) wins
    a3 = argparse.Namespace(**vars(args))
    m3 = build_gpt(cfg, grid, parallel_output=False)
    with torch.no_grad():
        for p in m3.parameters():
            p.add_(1.0)  # main params of opt3 now differ from what the checkpoint holds
    opt3 = DistributedOptimizer(m3.parameters(), ps.get_data_parallel_group())
    s3 = _Sched()
    it3, _ = th.load_checkpoint([m3], opt3, s3, a3)
    mains_ok = all(torch.equal(mm, p.detach().view(-1)[opt3.ranges[p][0]:opt3.ranges[p][1]])
                   for p, mm in zip(opt3.model_float16_groups[0], opt3.shard_fp32_from_float16_groups[0]))
    out["no_opt_state"] = (it3, s3.num_steps, mains_ok)
    # --no-load-optim: weights, main params reloaded, scheduler untouched (as Megatron-LM)
    m4 = build_gpt(cfg, grid, parallel_output=False)
    opt4 = DistributedOptimizer(m4.parameters(), ps.get_data_parallel_group())
    with torch.no_grad():
        for mm in opt4.shard_fp32_from_float16_groups[0]:
            mm.add_(1.0)
    s4 = _Sched()
    a4 = argparse.Namespace(**vars(args))
    a4.no_load_optim, a4.ckpt_step = True, 5
    it4, _ = th.load_checkpoint([m4], opt4, s4, a4)
    mains_ok = all(torch.equal(mm, p.detach().view(-1)[opt4.ranges[p][0]:opt4.ranges[p][1]])
                   for p, mm in zip(opt4.model_float16_groups[0], opt4.shard_fp32_from_float16_groups[0]))
    out["no_load_optim"] = (it4, s4.num_steps, mains_ok)
    # --pretrained-checkpoint: used (as --finetune) when --load holds nothing
    a5 = argparse.Namespace(**vars(args))
    a5.load, a5.pretrained_checkpoint = os.path.join(root, "empty"), ck
    os.makedirs(a5.load, exist_ok=True)
    m5 = build_gpt(cfg, grid, parallel_output=False)
    it5, _ = th.load_checkpoint([m5], None, None, a5)
    same = all(torch.equal(x, y) for x, y in zip(m5.parameters(), m3.parameters()))  # m3 holds step 8
    out["pretrained"] = (it5, a5.finetune, same)
    th.finalize()
    th.reset()
    dist.barrier()
    if rank == 0:
        to_consolidated(os.path.join(ck2, "step_000000005"), os.path.join(root, "c2"), progress=False)
        out["diff"] = consolidated_differences(os.path.join(root, "c1"), os.path.join(root, "c2"))
        out["n_opt"] = len(load_file(os.path.join(root, "c1", "optimizer.safetensors")))
        with open(os.path.join(root, "res.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()


def test_distributed_optimizer_state_reshards_and_missing_state_paths(tmp_path):
    pytest.importorskip("megatron.core")
    run_world(_worker, 2, str(tmp_path), timeout_s=150)
    r = json.load(open(tmp_path / "res.json"))
    assert r["split_mid_row"]  # the DP ranges really cut rows
    assert r["oracle_bad"] == []  # saved state == the state gathered by hand
    assert r["n_opt"] > 0 and r["diff"] == []  # TP1xDP2 -> TP2xDP1 -> saved again: bit-identical
    assert r["ckpt_step"] == [5, 5, 40]
    assert r["np_steps"] == ["step_000000007"]  # non-persistent: its own root, only the newest kept
    assert r["persistent_steps"] == ["step_000000005", "step_000000008"]
    assert r["no_opt_state"] == [8, 8, True]  # scheduler restored, main params = loaded weights
    assert r["no_load_optim"] == [5, 0, True]
    assert r["pretrained"] == [0, True, True]
    assert r["no_save"] == [[], False, None, [], True]   # weights only, no RNG: as Megatron-LM writes with those flags


def test_converter_vocab_from_a_null_tokenizer_run():
    """Megatron-LM's saved args say --vocab-size 127 but NullTokenizer trains 128 rows (EOD)."""
    from elastor_ds.integrations.megatron.convert import config_from_args

    a = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=127,
                           padded_vocab_size=128, tokenizer_type="NullTokenizer", make_vocab_size_divisible_by=64)
    assert config_from_args(a).vocab_size == 128
    a.tokenizer_type = "HuggingFaceTokenizer"
    assert config_from_args(a).vocab_size == 127


def test_legacy_counters_are_carried_and_filtered():
    from elastor_ds.integrations.megatron.convert import legacy_counters

    sd = {"args": argparse.Namespace(consumed_train_samples=80, skipped_train_samples=0, consumed_valid_samples=True),
          "num_floating_point_operations_so_far": 12, "opt_param_scheduler": {"num_steps": 80, "max_lr": 1e-3}}
    assert legacy_counters(sd) == {"consumed_train_samples": 80, "skipped_train_samples": 0,
                                   "num_floating_point_operations_so_far": 12.0,
                                   "opt_param_scheduler": {"num_steps": 80, "max_lr": 1e-3}}
    assert legacy_counters({"args": None, "opt_param_scheduler": {"num_steps": object()}}) == {}
