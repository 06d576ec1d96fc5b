"""The Megatron-LM end-to-end sequence: patched ``pretrain_gpt.py --elastor`` trains, saves and
resumes under new layouts (CPU through ``cpu_pretrain_gpt.py``, or a GPU with ``--gpu``).

usage: python examples/megatron_lm/e2e.py MEGATRON_LM_DIR WORKDIR [--gpu] [--only NAME,...]
(run by ``scripts/megatron_lm_e2e.sh``, which applies the patches and installs the extras first).
Names: fp32, stock, bf16, distopt, distopt_bf16, fp16, and the ``elastor run`` cases (CPU only,
``elastic_cases.py``): elastic_kill, elastic_sigterm, elastic_memory.

Every scenario is a real launch (torchrun, one process per rank). Oracles: the uninterrupted run's
logged losses (Megatron's own log lines), and consolidated checkpoints compared tensor by tensor
(``elastor convert --to consolidated``): a checkpoint loaded under a new layout and saved again
without a step must be bit-identical to the one it came from (weights, fp32 main params, Adam
moments and steps). Prints one line per check and a summary; exit 0 only when all pass.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RUNNER = os.path.join(HERE, "cpu_pretrain_gpt.py")
WORLD = 4
LAYERS = 4
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")

MODEL = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
         "--lr-decay-iters", "20", "--weight-decay", "0.01",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64", "--mock-data", "--split", "1,0,0",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
         "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]
CPU = ["--distributed-backend", "gloo", "--use-cpu-initialization", "--clip-grad", "0"]
GPU = ["--distributed-backend", "nccl", "--bf16", "--use-distributed-optimizer"]


class Failed(Exception):
    pass


class E2E:
    def __init__(self, mlm: str, work: str, gpu: bool, te: bool = False) -> None:
        self.mlm, self.work, self.gpu, self.te = os.path.abspath(mlm), os.path.abspath(work), gpu, te
        self.results: list[tuple[str, bool, str]] = []
        self.reuse = bool(os.environ.get("E2E_REUSE"))
        self.losses: dict[str, dict[int, str]] = {}
        self.commands: list[str] = []
        os.makedirs(self.work, exist_ok=True)

    # ---------------------------------------------------------------- launching
    def launch(self, name: str, flags: list[str], world: int = WORLD, expect_rc: int = 0,
               timeout: float = 900) -> str:
        log = os.path.join(self.work, name + ".log")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        entry = ([os.path.join(self.mlm, "pretrain_gpt.py")] if self.gpu
                 else [RUNNER, "--megatron-lm", self.mlm])
        model = list(MODEL)
        if self.te:  # Transformer Engine layers (elastor maps their fused layer-norm names)
            model[model.index("--transformer-impl") + 1] = "transformer_engine"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(port), *entry, *model, *(GPU if self.gpu else CPU), *flags]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([self.mlm, REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        env["PYENV_VERSION"] = "%d.%d.%d" % sys.version_info[:3]
        self.commands.append(f"[{name}] torchrun --nproc-per-node {world} "
                             f"{'pretrain_gpt.py' if self.gpu else 'cpu_pretrain_gpt.py'} <model flags> "
                             + " ".join(flags))
        t0 = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -9
        text = open(log, errors="replace").read()
        print(f"  launched {name}: rc {rc} in {time.time() - t0:.0f}s ({log})", flush=True)
        if rc != expect_rc:
            tail = "\n".join(text.splitlines()[-25:])
            raise Failed(f"{name}: exit code {rc}, expected {expect_rc}; log {log}:\n{tail}")
        self.losses[name] = {int(i): v for i, v in LOSS_RE.findall(text)}
        return text

    def ck(self, name: str) -> str:
        return os.path.join(self.work, "ckpt_" + name)

    def plan(self, name: str, tp: int, pp: int, dp: int, bounds: list[int]) -> str:
        from elastor_ds.layout import Layout

        path = os.path.join(self.work, f"plan_{name}.json")
        with open(path, "w") as f:
            json.dump(Layout.uniform(tp, pp, dp, LAYERS, bounds).to_json(), f)
        return path

    def consolidate(self, root: str, step: int) -> str:
        from elastor_ds.checkpoint import commit as commit_mod
        from elastor_ds.checkpoint.convert import to_consolidated

        dirs = dict(commit_mod.list_committed(root))
        if step not in dirs:
            raise Failed(f"{root}: no committed step {step} (has {sorted(dirs)})")
        out = os.path.join(self.work, "cons", f"{os.path.basename(root)}_{step}")
        if os.path.exists(out):
            shutil.rmtree(out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        return to_consolidated(dirs[step], out, progress=False)

    # ---------------------------------------------------------------- checks
    def check(self, name: str, ok: bool, detail: str) -> None:
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    def same_losses(self, name: str, run: str, ref: str, iters: list[int], exact: bool, rtol: float = 0.0) -> None:
        a, b = self.losses[run], self.losses[ref]
        bad = []
        for i in iters:
            if i not in a or i not in b:
                bad.append(f"iteration {i} not logged ({run}: {i in a}, {ref}: {i in b})")
            elif exact and a[i] != b[i]:
                bad.append(f"iteration {i}: {a[i]} vs {b[i]}")
            elif not exact and abs(float(a[i]) - float(b[i])) > rtol * abs(float(b[i])):
                bad.append(f"iteration {i}: {a[i]} vs {b[i]} (rtol {rtol})")
        shown = ", ".join(f"{i}: {a.get(i)} vs {b.get(i)}" for i in iters[:2])
        self.check(name, not bad, "; ".join(bad) if bad else f"{'identical' if exact else f'rtol {rtol}'} ({shown})")

    def same_checkpoint(self, name: str, a: tuple[str, int], b: tuple[str, int], optimizer: bool = True) -> None:
        from safetensors.torch import load_file

        from elastor_ds.testing.megatron_gpt import consolidated_differences

        ca, cb = self.consolidate(*a), self.consolidate(*b)
        bad = consolidated_differences(ca, cb) if optimizer else []
        if not optimizer:
            x, y = load_file(os.path.join(ca, "model.safetensors")), load_file(os.path.join(cb, "model.safetensors"))
            bad = [k for k in x if k not in y or not x[k].equal(y[k])]
        nopt = 0
        if os.path.exists(os.path.join(ca, "optimizer.safetensors")):
            nopt = len(load_file(os.path.join(ca, "optimizer.safetensors")))
        if optimizer and nopt == 0:
            bad.append("no optimizer state in the checkpoint")
        self.check(name, not bad, f"{len(bad)} tensors differ: {bad[:4]}" if bad else
                   f"bit-identical ({nopt} optimizer tensors)" if optimizer else "weights bit-identical")

    # ---------------------------------------------------------------- the sequence
    def base(self, tag: str, extra: list[str]) -> str:
        """Uninterrupted 20 iterations at TP1 x PP1 x DP4, saving iterations 10 and 20."""
        name = f"{tag}uninterrupted"
        log = os.path.join(self.work, name + ".log")
        if self.reuse and os.path.exists(log) and os.path.isdir(os.path.join(self.ck(name), "step_000000020")):
            self.losses[name] = {int(i): v for i, v in LOSS_RE.findall(open(log, errors="replace").read())}
            print(f"  reusing {name} ({log})", flush=True)
            return name
        if os.path.exists(self.ck(name)):
            shutil.rmtree(self.ck(name))
        self.launch(name, ["--train-iters", "20", "--save-interval", "10", "--save", self.ck(name),
                           "--elastor", "--elastor-keep", "4", *extra])
        return name

    def resume(self, tag: str, base: str, name: str, extra: list[str], iters: int = 20) -> str:
        run = f"{tag}{name}"
        if os.path.exists(self.ck(run)):
            shutil.rmtree(self.ck(run))
        # iters == 10: load iteration 10 and save it again at once (Megatron-LM saves at the end when
        # the iteration is not a multiple of --save-interval); the scheduler keeps --train-iters 20's
        self.launch(run, ["--train-iters", str(iters), "--save-interval", "7" if iters == 10 else "10",
                          "--load", self.ck(base), "--ckpt-step", "10", "--save", self.ck(run),
                          "--elastor", *(["--override-opt_param-scheduler"] if iters == 10 else []), *extra])
        return run

    def layouts(self, tag: str, base: str, extra: list[str], rtol: float) -> None:
        cases = [("tp2", ["--tensor-model-parallel-size", "2"]),
                 ("pp2_uneven_plan", ["--elastor-plan", self.plan("pp2", 1, 2, 2, [0, 1, 4])]),
                 ("tp2pp2_plan", ["--elastor-plan", self.plan("tp2pp2", 2, 2, 1, [0, 3, 4])])]
        for name, flags in cases:
            run = self.resume(tag, base, name, flags + extra)
            self.same_losses(f"{run}: first iteration after the resume", run, base, [11], exact=False, rtol=rtol)
            # the TP2 round trip also pads the vocabulary differently (128 x 2 = 256 rows instead of 128)
            pad = ["--make-vocab-size-divisible-by", "128"] if name == "tp2" else []
            rt = self.resume(tag, base, name + "_roundtrip", flags + extra + pad, iters=10)
            self.same_checkpoint(f"{rt}: loaded at {name}, saved again", (self.ck(base), 10), (self.ck(rt), 10))
            if pad:
                text = open(os.path.join(self.work, rt + ".log"), errors="replace").read()
                ok = "--make-vocab-size-divisible-by 64" in text and "padded vocabulary of 128 rows" in text
                self.check(f"{rt}: warns that TP2 pads the vocabulary to 256 rows, names divisor 64", ok,
                           "warning logged" if ok else "no padded-vocabulary warning with the fix")

    def run(self, only: Optional[set]) -> bool:
        want = lambda n: only is None or n in only  # noqa: E731
        steps = []
        if want("fp32"):
            steps.append(("fp32", self.seq_fp32))
        if want("stock"):
            steps.append(("stock", self.seq_stock))
        if want("bf16") and not self.gpu:
            steps.append(("bf16", self.seq_bf16))
        if want("distopt"):
            steps.append(("distopt", self.seq_distopt))
        if want("distopt_bf16") and not self.gpu:
            steps.append(("distopt_bf16", self.seq_distopt_bf16))
        if want("fp16") and not self.gpu:
            steps.append(("fp16", self.seq_fp16))
        steps += self.elastic_steps(want)
        for name, fn in steps:
            print(f"== {name}", flush=True)
            try:
                fn()
            except Failed as e:
                self.check(name, False, str(e))
        n_ok = sum(ok for _, ok, _ in self.results)
        print(f"\n{n_ok} passed, {len(self.results) - n_ok} failed")
        with open(os.path.join(self.work, "summary.json"), "w") as f:
            json.dump({"results": self.results, "commands": self.commands, "losses": self.losses}, f, indent=1)
        return n_ok == len(self.results) and bool(self.results)

    def elastic_steps(self, want) -> list:  # noqa: ANN001
        """The ``elastor run`` cases (CPU: the fault is injected through the CPU runner)."""
        if self.gpu:
            return []
        from elastic_cases import ElasticCases, hooks_have_memory_flags

        cases = ElasticCases(self, MODEL, CPU, RUNNER, REPO, Failed)
        steps = [(n, fn) for n, fn in (("elastic_kill", cases.case_kill), ("elastic_sigterm", cases.case_sigterm))
                 if want(n)]
        if want("elastic_memory"):
            if hooks_have_memory_flags():
                steps.append(("elastic_memory", cases.case_memory))
            else:
                print("SKIP elastic_memory: the Megatron hooks have no --elastor-memory-snapshot-* flags yet",
                      flush=True)
        return steps

    def seq_fp32(self) -> None:
        """fp32, Megatron's FP32Optimizer (CPU); on a GPU this is the bf16 + distributed optimizer run."""
        base = self.base("", [])
        run = self.resume("", base, "same_layout", [])
        # Megatron-LM's log does not reset its loss average after a resume: only the first logged
        # iteration compares; the checkpoint at iteration 20 covers the rest
        self.same_losses(f"{run}: iteration 11", run, base, [11], exact=True)
        self.same_checkpoint(f"{run}: iteration 20 vs uninterrupted", (self.ck(base), 20), (self.ck(run), 20))
        self.layouts("", base, [], rtol=1e-4)
        ft = self.resume("", base, "no_load_optim", ["--no-load-optim"])
        self.same_losses(f"{ft}: iteration 11 (weights loaded)", ft, base, [11], exact=True)
        self.check(f"{ft}: iteration stays at 10", min(self.losses[ft]) == 11, f"first logged {min(self.losses[ft])}")
        if not self.gpu:  # a --use-distributed-optimizer run reads distrib_optim.pt, which an export does not write
            self.export_to_stock(base, run)
        ft = self.resume("", base, "finetune", ["--finetune"])
        first = min(self.losses[ft])
        self.check(f"{ft}: starts at iteration 1 from the loaded weights",
                   first == 1 and float(self.losses[ft][1]) < float(self.losses[base][1]) - 0.1,
                   f"iteration {first}: loss {self.losses[ft].get(first)} (fresh start {self.losses[base][1]})")

    def convert(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "elastor_ds.cli", "convert", *args, "--no-progress"]
        self.commands.append(f"[{name}] elastor convert " + " ".join(args))
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO + os.pathsep
                                                                          + os.environ.get("PYTHONPATH", "")))
        if r.returncode != 0:
            raise Failed(f"{name}: elastor convert {' '.join(args)}: exit {r.returncode}: {r.stderr[-2000:]}")

    def export_to_stock(self, base: str, resumed: str) -> None:
        """`elastor convert --to megatron` with optimizer state: stock Megatron-LM (no --elastor) loads it.
        ``resumed``: the elastor resume at the same layout (Megatron-LM's logged loss after iteration 11
        of a resumed run differs from the uninterrupted run's: its average is not reset)."""
        from elastor_ds.checkpoint import commit as commit_mod

        src = dict(commit_mod.list_committed(self.ck(base)))[10]
        # TP1: stock Megatron resumes from the export; iteration 12 needs the Adam state
        exp = self.ck("export_tp1")
        shutil.rmtree(exp, ignore_errors=True)
        self.convert("export_tp1", [src, exp, "--to", "megatron"])
        run = "export_tp1_stock_resume"
        self.launch(run, ["--train-iters", "20", "--save-interval", "100", "--load", exp, "--ckpt-format", "torch",
                          "--no-load-rng"])
        self.same_losses(f"{run}: stock Megatron-LM from the export, iterations 11-12 as the elastor resume", run,
                         resumed, [11, 12], exact=True)
        # TP2 x PP2: stock Megatron loads the export and saves it again at once (its own load_state_dict
        # and state_dict); imported back, it equals the elastor checkpoint, optimizer state included
        exp = self.ck("export_tp2pp2")
        shutil.rmtree(exp, ignore_errors=True)
        self.convert("export_tp2pp2", [src, exp, "--to", "megatron", "--tensor-model-parallel-size", "2",
                                       "--pipeline-model-parallel-size", "2"])
        run = "export_tp2pp2_stock_roundtrip"
        stock = self.ck(run)
        shutil.rmtree(stock, ignore_errors=True)
        self.launch(run, ["--train-iters", "10", "--save-interval", "7", "--load", exp, "--save", stock,
                          "--ckpt-format", "torch", "--no-load-rng", "--override-opt_param-scheduler",
                          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
        back = self.ck("export_tp2pp2_back")
        shutil.rmtree(back, ignore_errors=True)
        self.convert("export_tp2pp2_back", [os.path.join(stock, "iter_0000010"), back, "--from", "megatron"])
        self.same_checkpoint(f"{run}: saved by stock Megatron-LM at TP2xPP2, imported back", (self.ck(base), 10),
                             (back, 10))

    def seq_bf16(self) -> None:
        """bf16 with Float16OptimizerWithFloat16Params (fp32 main params), CPU."""
        base = self.base("bf16_", ["--bf16"])
        run = self.resume("bf16_", base, "same_layout", ["--bf16"])
        # Megatron-LM's log does not reset its loss average after a resume: only the first logged
        # iteration compares; the checkpoint at iteration 20 covers the rest
        self.same_losses(f"{run}: iteration 11", run, base, [11], exact=True)
        self.same_checkpoint(f"{run}: iteration 20 vs uninterrupted", (self.ck(base), 20), (self.ck(run), 20))
        run = self.resume("bf16_", base, "tp2pp2_plan", ["--bf16", "--elastor-plan",
                                                         self.plan("tp2pp2", 2, 2, 1, [0, 3, 4])], iters=10)
        self.same_checkpoint(f"{run}: loaded at TP2xPP2, saved again", (self.ck(base), 10), (self.ck(run), 10))
        nl = self.resume("bf16_", base, "no_load_optim", ["--bf16", "--no-load-optim"])
        a, b = float(self.losses[nl].get(12, "nan")), float(self.losses[base][12])
        fresh = float(self.losses[base][1])
        self.check(f"{nl}: iteration 12 continues from the loaded weights (fp32 main params reloaded)",
                   abs(a - b) < 0.25 * abs(fresh - b), f"{a} vs uninterrupted {b} (fresh start {fresh})")

    def seq_stock(self) -> None:
        """A --load directory holding a stock Megatron checkpoint (torch format): refused with the fix,
        never a silent restart; converted with `elastor convert --from megatron`, it resumes."""
        stock = self.ck("stock_megatron")
        if os.path.exists(stock):
            shutil.rmtree(stock)
        # 12 iterations (the scheduler's totals must match the resumes'), iterations 10 and 12 saved
        self.launch("stock_save", ["--train-iters", "12", "--save-interval", "10", "--save", stock,
                                   "--ckpt-format", "torch"])
        run = "stock_load_elastor"
        if os.path.exists(self.ck(run)):
            shutil.rmtree(self.ck(run))
        text = self.launch(run, ["--train-iters", "12", "--save-interval", "10", "--load", stock,
                                 "--save", self.ck(run), "--elastor"], expect_rc=1)
        ok = "holds a stock Megatron checkpoint" in text and "elastor convert" in text
        wrote = os.path.isdir(self.ck(run)) and bool(os.listdir(self.ck(run)))
        self.check(f"{run}: stops with the fix, trains nothing, writes nothing", ok and not wrote and not self.losses[run],
                   f"message {'found' if ok else 'missing'}, wrote {wrote}, logged iterations {sorted(self.losses[run])[:3]}")
        conv = self.ck("stock_converted")
        if os.path.exists(conv):
            shutil.rmtree(conv)
        cmd = [sys.executable, "-m", "elastor_ds.cli", "convert", os.path.join(stock, "iter_0000010"), conv,
               "--from", "megatron", "--no-progress"]
        self.commands.append("[stock_convert] elastor convert " + " ".join(cmd[5:]))
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO + os.pathsep
                                                                          + os.environ.get("PYTHONPATH", "")))
        if r.returncode != 0:
            raise Failed(f"elastor convert --from megatron: exit {r.returncode}: {r.stderr[-2000:]}")
        run = "stock_converted_resume"
        if os.path.exists(self.ck(run)):
            shutil.rmtree(self.ck(run))
        self.launch(run, ["--train-iters", "12", "--save-interval", "100", "--load", conv, "--save", self.ck(run),
                          "--elastor"])
        first = min(self.losses[run], default=None)
        self.check(f"{run}: continues at iteration 11", first == 11, f"first logged iteration {first}")
        # oracle: stock Megatron's own resume from the same checkpoint (the converted checkpoint has no
        # sample counter; Megatron-LM then takes iteration x global batch, i.e. the same data)
        ref = "stock_resume_stock"
        self.launch(ref, ["--train-iters", "12", "--save-interval", "100", "--load", stock, "--ckpt-format", "torch",
                          "--ckpt-step", "10"])
        # iteration 11's loss depends on the weights only; 12's also on the Adam state carried over
        # (on GPUs the stock run uses the distributed optimizer: its distrib_optim.pt is not imported)
        self.same_losses(f"{run}: iterations 11-12 equal stock Megatron's own resume (weights and Adam state "
                         f"converted)" if not self.gpu else f"{run}: iteration 11 equals stock Megatron's own resume",
                         run, ref, [11, 12] if not self.gpu else [11], exact=True)

    def seq_distopt(self) -> None:
        """--use-distributed-optimizer: Adam state resharded through the flat ranges."""
        extra = [] if self.gpu else ["--use-distributed-optimizer"]
        base = self.base("distopt_", extra)
        run = self.resume("distopt_", base, "same_layout", extra)
        # Megatron-LM's log does not reset its loss average after a resume: only the first logged
        # iteration compares; the checkpoint at iteration 20 covers the rest
        self.same_losses(f"{run}: iteration 11", run, base, [11], exact=True)
        self.same_checkpoint(f"{run}: iteration 20 vs uninterrupted", (self.ck(base), 20), (self.ck(run), 20))
        self.layouts("distopt_", base, extra, rtol=1e-4)


    def seq_distopt_bf16(self) -> None:
        """bf16 + --use-distributed-optimizer (the GPU default): fp32 main shards in the flat ranges."""
        extra = ["--bf16", "--use-distributed-optimizer"]
        base = self.base("distopt_bf16_", extra)
        run = self.resume("distopt_bf16_", base, "same_layout", extra)
        self.same_losses(f"{run}: iteration 11", run, base, [11], exact=True)
        self.same_checkpoint(f"{run}: iteration 20 vs uninterrupted", (self.ck(base), 20), (self.ck(run), 20))
        run = self.resume("distopt_bf16_", base, "tp2pp2_plan", extra + [
            "--elastor-plan", self.plan("tp2pp2", 2, 2, 1, [0, 3, 4])], iters=10)
        self.same_checkpoint(f"{run}: loaded at TP2xPP2, saved again", (self.ck(base), 10), (self.ck(run), 10))

    def seq_fp16(self) -> None:
        """fp16: Float16OptimizerWithFloat16Params with a dynamic loss scaler, whose state is carried."""
        # a small initial scale that grows every 2 iterations: at iteration 10 it is far from the
        # initial one, so a scaler that was not restored shows at once
        extra = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2"]
        base = self.base("fp16_", extra)
        run = self.resume("fp16_", base, "same_layout", extra)
        self.same_losses(f"{run}: iteration 11", run, base, [11], exact=True)
        pat = r"iteration\s+(\d+)/.*?loss scale: ([0-9.E+-]+)"
        sa = dict(re.findall(pat, open(os.path.join(self.work, run + ".log")).read()))
        sb = dict(re.findall(pat, open(os.path.join(self.work, base + ".log")).read()))
        want = {str(i): sb.get(str(i)) for i in range(11, 21)}
        self.check(f"{run}: loss scale at iterations 11-20 as uninterrupted (initial 1024)",
                   bool(sa) and {k: sa.get(k) for k in want} == want and sb.get("10") != "1024.0",
                   f"resumed {[sa.get(str(i)) for i in (11, 12, 13)]}, uninterrupted {[sb.get(str(i)) for i in (10, 11, 12, 13)]}")
        self.same_checkpoint(f"{run}: iteration 20 vs uninterrupted", (self.ck(base), 20), (self.ck(run), 20))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("megatron_lm")
    ap.add_argument("workdir")
    ap.add_argument("--gpu", action="store_true", help="run on GPUs (nccl, --bf16 --use-distributed-optimizer)")
    ap.add_argument("--only", default=None, help="comma-separated: fp32,stock,bf16,distopt,distopt_bf16,fp16,"
                                                 "elastic_kill,elastic_sigterm,elastic_memory")
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    if a.gpu:
        import torch

        if torch.cuda.device_count() < WORLD:
            print(f"--gpu: the sequence runs {WORLD} ranks (TP2 x PP2) and needs {WORLD} GPUs; this machine has "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
    te = False
    if a.gpu:
        import importlib.util

        te = importlib.util.find_spec("transformer_engine") is not None
        print(f"--gpu: nccl, --bf16 --use-distributed-optimizer, --transformer-impl "
              f"{'transformer_engine' if te else 'local (Transformer Engine is not installed)'}", flush=True)
    e = E2E(a.megatron_lm, a.workdir, a.gpu, te)
    return 0 if e.run(set(a.only.split(",")) if a.only else None) else 1


if __name__ == "__main__":
    sys.exit(main())
