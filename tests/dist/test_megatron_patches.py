"""patches/ (Megatron-LM diffs) and the trainer hooks they call.

1. Every patch has the required header sections and is a well-formed unified diff touching only
   the files it is meant to (parsed here; ``git apply --check`` against the pinned release is
   recorded in patches/README.md because tests cannot fetch Megatron-LM).
2. The hooks' save -> load round trip on a real megatron-core GPTModel (2 gloo ranks, CPU), saved at
   TP2 and loaded at PP2 (uneven boundaries from the model), with a torch Adam, Megatron's
   FP32Optimizer and a mixed-precision (fp32 main params) optimizer: identical consolidated
   tensors, same eval loss, iteration / FLOPs / consumed samples / scheduler restored.
"""
from __future__ import annotations

import argparse
import os
import re

import pytest

from dist_utils import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH_DIR = os.path.join(ROOT, "patches")
# patch file -> the upstream files it may touch
INTENDED = {
    "megatron-lm/0001-pretrain_gpt-elastor-flags.patch": {"pretrain_gpt.py"},
    "megatron-lm/0002-arguments-elastor-plan.patch": {"megatron/training/arguments.py"},
    "megatron-lm/0003-initialize-elastor-check.patch": {"megatron/training/initialize.py"},
    "megatron-lm/0004-checkpointing-elastor-save-load.patch": {"megatron/training/checkpointing.py"},
    "megatron-lm/0005-async_utils-elastor-finalize.patch": {"megatron/training/async_utils.py"},
    "megatron-lm/0006-yaml_arguments-elastor-plan.patch": {"megatron/training/yaml_arguments.py"},
    "megatron-lm/0007-training-elastor-loop.patch": {"megatron/training/training.py"},
}
# what the patches may import from elastor_ds: the hooks (and, for the training loop, the worker
# hooks of `elastor run` it hands to them)
HOOK_MODULES = {"elastor_ds.integrations.megatron.training_hooks", "elastor_ds.integrations.megatron.elastic",
                "elastor_ds.elastic.worker"}
IMPORT_RE = re.compile(r"from (elastor_ds[\w.]*) import (\w+)|import (elastor_ds[\w.]*)")
HEADER_KEYS = ("What:", "Why:", "Upstream:", "Drop:")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(text: str) -> tuple[str, dict[str, list[tuple[int, int, int, int]]]]:
    """(header, {path: [hunks]}) of a unified diff; raise ValueError when it is malformed."""
    lines = text.splitlines()
    i = 0
    while i < len(lines) and not lines[i].startswith("diff --git ") and not lines[i].startswith("--- "):
        i += 1
    header = "\n".join(lines[:i])
    files: dict[str, list] = {}
    cur = None
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("diff --git ") or ln.startswith("index "):
            i += 1
            continue
        if ln.startswith("--- "):
            a = ln[4:].split("\t")[0]
            b = lines[i + 1][4:].split("\t")[0] if lines[i + 1].startswith("+++ ") else None
            if b is None or not a.startswith("a/") or not b.startswith("b/") or a[2:] != b[2:]:
                raise ValueError(f"bad file header at line {i + 1}: {ln!r} / {lines[i + 1]!r}")
            cur = a[2:]
            files.setdefault(cur, [])
            i += 2
            continue
        m = HUNK_RE.match(ln)
        if not m or cur is None:
            raise ValueError(f"line {i + 1}: expected a hunk header, got {ln!r}")
        o0, on, n0, nn = (int(m.group(k)) if m.group(k) is not None else 1 for k in (1, 2, 3, 4))
        i += 1
        old = new = 0
        while i < len(lines) and (old < on or new < nn):
            body = lines[i]
            if body.startswith("\\"):
                i += 1
                continue
            tag = body[:1] if body else " "
            if tag == " ":
                old, new = old + 1, new + 1
            elif tag == "-":
                old += 1
            elif tag == "+":
                new += 1
            else:
                raise ValueError(f"line {i + 1}: bad hunk line {body!r}")
            i += 1
        if (old, new) != (on, nn):
            raise ValueError(f"{cur}: hunk at -{o0} has {old}/{new} lines, header says {on}/{nn}")
        files[cur].append((o0, on, n0, nn))
    return header, files


def test_patch_set_is_complete_and_documented():
    found = sorted(os.path.relpath(os.path.join(d, f), PATCH_DIR)
                   for d, _, fs in os.walk(PATCH_DIR) for f in fs if f.endswith(".patch"))
    assert found == sorted(INTENDED)
    readme = open(os.path.join(PATCH_DIR, "README.md")).read()
    for name in INTENDED:
        assert os.path.basename(name) in readme
    assert "core_v0.16.1" in readme and "git apply --check" in readme
    assert os.access(os.path.join(PATCH_DIR, "apply.sh"), os.X_OK)


@pytest.mark.parametrize("name", sorted(INTENDED))
def test_patch_header_and_shape(name):
    text = open(os.path.join(PATCH_DIR, name)).read()
    header, files = parse_patch(text)
    for key in HEADER_KEYS:
        assert key in header, f"{name}: header lacks {key!r}"
    assert "core_v0.16.1" in header and "55ac708" in header
    assert set(files) == INTENDED[name], f"{name} touches {sorted(files)}"
    added = [ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert 0 < len(added) <= 30, f"{name}: {len(added)} added lines; host patches stay small"
    # the patches only call into elastor_ds, and only when --elastor is on
    body = "\n".join(added)
    imports = IMPORT_RE.findall(body)   # (from-module, name, "") or ("", "", module)
    imported = {m[0] if m[0] in HOOK_MODULES else f"{m[0]}.{m[1]}" if m[0] else m[2] for m in imports}
    assert imported <= HOOK_MODULES, f"{name} imports {sorted(imported - HOOK_MODULES)} (not a hook module)"
    assert ("elastor_ds" in body) == bool(imported), "every use of elastor_ds goes through an import of the hooks"
    for ln in added:
        assert "import elastor_ds" not in ln or ln.startswith((" ", "\t")), "elastor is imported lazily"


def _added(name: str) -> list[str]:
    text = open(os.path.join(PATCH_DIR, name)).read()
    return [ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]


def test_extra_args_provider_imports_elastor_only_with_the_flag(monkeypatch):
    """0001's function, executed as written: no --elastor -> elastor_ds is not imported at all."""
    import subprocess
    import sys

    text = open(os.path.join(PATCH_DIR, "megatron-lm/0001-pretrain_gpt-elastor-flags.patch")).read()
    first_hunk = text.split("\n@@")[1]  # the function; the second hunk passes it to pretrain()
    src = "\n".join(ln[1:] for ln in first_hunk.splitlines()[1:] if ln.startswith("+"))
    prog = ("import argparse, sys\nhas_nvidia_modelopt = False\n" + src + "\n"
            "p = extra_args_provider(argparse.ArgumentParser())\n"
            "print(sorted(m for m in sys.modules if m.startswith('elastor_ds')).__len__(),\n"
            "      any(a.dest == 'elastor_plan' for a in p._actions))\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    plain = subprocess.run([sys.executable, "-c", prog, "--lr", "1"], capture_output=True, text=True, env=env)
    flagged = subprocess.run([sys.executable, "-c", prog, "--elastor"], capture_output=True, text=True, env=env)
    assert plain.stdout.split() == ["0", "False"], plain.stderr
    n, has = flagged.stdout.split()
    assert int(n) > 0 and has == "True", flagged.stderr
    # --elastor without elastor_ds installed: a message, not an ImportError traceback
    missing = subprocess.run([sys.executable, "-c", "import sys; sys.modules['elastor_ds'] = None\n" + prog,
                              "--elastor"], capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "--elastor needs elastor_ds" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_parallel_state_check_is_not_gated_on_device_count():
    """0003 calls the check at function level (4 spaces), after the `if device_count > 0:` block."""
    added = _added("megatron-lm/0003-initialize-elastor-check.patch")
    first = next(ln for ln in added if "getattr(args, 'elastor'" in ln)
    assert first.startswith("    if ") and not first.startswith("     ")


def test_parse_patch_rejects_bad_hunk():
    bad = "What: x\n--- a/f.py\n+++ b/f.py\n@@ -1,2 +1,3 @@\n a\n+b\n"
    with pytest.raises(ValueError, match="hunk"):
        parse_patch(bad)


def test_flags_and_configure(tmp_path):
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import training_hooks as th
    from elastor_ds.layout import Layout

    p = th.add_arguments(argparse.ArgumentParser())
    a = p.parse_args([])
    assert not th.enabled(a) and a.elastor_async and a.elastor_keep == 2 and a.elastor_plan is None
    a = p.parse_args(["--elastor", "--no-elastor-async", "--elastor-keep", "3"])
    assert th.enabled(a) and not a.elastor_async and a.elastor_keep == 3
    plan = tmp_path / "plan.json"
    plan.write_text(__import__("json").dumps(Layout.uniform(2, 2, 1, 5, [0, 1, 5]).to_json()))
    a = p.parse_args(["--elastor", "--elastor-plan", str(plan)])
    a.num_layers, a.world_size = 5, 4
    a.tensor_model_parallel_size = a.pipeline_model_parallel_size = 1
    th.configure(a)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (2, 2)
    assert a.pipeline_model_parallel_layout == "Et|ttttL"
    a.world_size = 3
    with pytest.raises(ConfigError, match="WORLD_SIZE=3"):
        th.configure(a)
    b = p.parse_args(["--elastor"])
    b.context_parallel_size = 2
    with pytest.raises(ConfigError, match="context-parallel"):
        th.configure(b)


# ---------------------------------------------------------------- round trip on 2 gloo ranks
from megatron_standins import _Sched, _Stepper, _make_opt  # noqa: E402 - tests/helpers


def _worker(rank: int, world: int, root: str, kind: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.checkpoint.convert import to_consolidated
    from elastor_ds.integrations.megatron import initialize_from_layout, training_hooks as th
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import (consolidated_differences, eval_loss, fixed_batch,
                                                 tiny_gpt_config, train_step)

    cfg = tiny_gpt_config(num_layers=3)
    batch = fixed_batch(cfg)
    args = argparse.Namespace(elastor=True, elastor_async=True, elastor_keep=2, elastor_plan=None,
                              vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                              num_layers=cfg.num_layers, save=os.path.join(root, "ck"), load=os.path.join(root, "ck"),
                              consumed_train_samples=96, skipped_train_samples=0, consumed_valid_samples=8,
                              global_batch_size=4, finetune=False, no_load_optim=False, no_load_rng=False,
                              distributed_timeout_minutes=2)

    # source: TP2, two steps, save through the hooks (async), finalize
    grid = initialize_from_layout(Layout.uniform(2, 1, 1, cfg.num_layers))
    m = build_gpt(cfg, grid, parallel_output=False)
    opt = _make_opt(kind, m)
    torch.manual_seed(0)
    for _ in range(2):
        train_step(m, cfg, batch, _Stepper(opt))
    loss_src = eval_loss(m, cfg, batch)
    th.save_checkpoint(7, [m], opt, _Sched(7), 123.0, args)
    th.finalize()

    # target: TP1 x PP2 (boundaries 0|1|3 from megatron's own split), fresh args
    grid = initialize_from_layout(Layout.uniform(1, 2, 1, cfg.num_layers, [0, 1, 3]))
    m2 = build_gpt(cfg, grid, parallel_output=False)
    opt2 = _make_opt(kind, m2)
    sched = _Sched(0)
    args2 = argparse.Namespace(**vars(args))
    args2.consumed_train_samples = args2.consumed_valid_samples = 0
    args2.save = os.path.join(root, "ck2")
    it, flops = th.load_checkpoint([m2], opt2, sched, args2)
    loss_dst = eval_loss(m2, cfg, batch)
    th.save_checkpoint(it, [m2], opt2, sched, flops, args2)
    th.finalize()
    th.reset()
    dist.barrier()
    if rank == 0:
        to_consolidated(os.path.join(root, "ck"), os.path.join(root, "c1"), progress=False)
        to_consolidated(os.path.join(root, "ck2"), os.path.join(root, "c2"), progress=False)
        from safetensors.torch import load_file
        names = set(load_file(os.path.join(root, "c1", "optimizer.safetensors")))
        res = {"it": it, "flops": flops, "consumed": args2.consumed_train_samples,
               "valid": args2.consumed_valid_samples, "sched": sched.num_steps, "loss_src": loss_src,
               "loss_dst": loss_dst, "diff": consolidated_differences(os.path.join(root, "c1"), os.path.join(root, "c2")),
               "main": any(n.startswith(th.MAIN_PREFIX) for n in names),
               "moments": any(n.startswith("optimizer.exp_avg.") for n in names)}
        with open(os.path.join(root, "res.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()


@pytest.mark.parametrize("kind", ["adam", "fp32", "mixed"])
def test_hooks_round_trip_tp2_to_pp2(tmp_path, kind):
    pytest.importorskip("megatron.core")
    import json

    if kind == "fp32":
        try:
            from megatron.core.optimizer.optimizer import FP32Optimizer  # noqa: F401
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"megatron FP32Optimizer not importable on CPU: {e}")
    run_world(_worker, 2, str(tmp_path), kind, timeout_s=120)
    r = json.load(open(tmp_path / "res.json"))
    assert (r["it"], r["flops"], r["consumed"], r["valid"], r["sched"]) == (7, 123.0, 96, 8, 7)
    assert r["diff"] == []
    assert r["moments"] and r["main"] == (kind == "mixed")
    assert abs(r["loss_src"] - r["loss_dst"]) <= 1e-5 * abs(r["loss_src"])
