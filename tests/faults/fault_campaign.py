"""Fault campaign: real faults against the checkpoint engine, the converters and the CLI.

Usage: python tests/faults/fault_campaign.py [--seed 0] [--kills 220] [--corruptions 120] [--malformed 1]
       [--classes a,b,...] [--workdir DIR] [--markdown]

Every trial runs in a forked child (fork after the imports: a trial costs milliseconds, not an
interpreter start) that is a real process: the CLI's ``main`` with its exit code and its stderr,
or a save that SIGKILLs itself before its n-th file-system call. One row per class:

* trials; **detected**: the fault was reported as it should be (a non-zero exit code of the right
  kind with a message, a typed error, or, for kills, a root that still loads a committed step);
* **data lost**: a committed checkpoint, a source, or a destination's prior content changed or
  stopped loading, or a bad value was returned as good;
* **hangs**: a trial ran past its timeout (SIGKILLed);
* **tracebacks**: a Python traceback shown to the user.

Classes: ``cli-malformed`` (elastor plan/convert/inspect/verify with malformed flags and files),
``ds-config`` (malformed ``"elastor"`` DeepSpeed config sections), ``trainer-flags`` (Megatron-LM
``--elastor*`` flags and plan files), ``path-escape`` (manifests, ``latest`` and rank state that
name paths outside the checkpoint, symlinks out, tensor names that escape on export),
``malicious-pickle`` (DeepSpeed / Megatron files whose unpickling writes a marker file),
``non-empty-destination`` (conversions into directories that hold data), ``corruption`` (bit
flips, truncations, deleted files under each read pattern through load, verify and convert),
``sigkill-save`` (the whole job killed before each file-system call of a save, a re-save, and an
import), ``enospc`` (saves into a small tmpfs that fills up), ``eacces`` (saves and loads by an
unprivileged user into directories it may not write or read); and, as another local user or a
forger (:mod:`security_faults`): ``standby-handoff``, ``snapshot-server``, ``forged-table``,
``peer-sender``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from elastor_ds.checkpoint import CheckpointEngine, TensorShard  # noqa: E402
from elastor_ds.checkpoint import commit as commit_mod  # noqa: E402
from elastor_ds.layout.region import Region  # noqa: E402
from elastor_ds.testing.faults import wait_or_kill  # noqa: E402

TRACEBACK = "Traceback (most recent call last)"


# ---------------------------------------------------------------------------------- running trials
@dataclass
class Outcome:
    rc: int              # exit code; negative: killed by that signal; HANG: timed out
    out: str = ""
    err: str = ""

    @property
    def hang(self) -> bool:
        return self.rc == HANG

    @property
    def traceback(self) -> bool:
        return TRACEBACK in self.err or TRACEBACK in self.out


HANG = -10_000


def forked(fn: Callable[[], int], timeout_s: float = 60.0, uid: Optional[int] = None) -> Outcome:
    """Run ``fn`` (returns an exit code) in a forked child with stdout/stderr captured; an
    uncaught exception prints its traceback (as the interpreter would) and exits 1."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(fo.fileno(), 1)
                os.dup2(fe.fileno(), 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
                import logging
                for h in logging.root.handlers[:]:
                    logging.root.removeHandler(h)
                if uid is not None:
                    os.setgid(uid)
                    os.setuid(uid)
                try:
                    code = int(fn() or 0)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:  # noqa: BLE001 - what an uncaught exception shows the user
                    import traceback
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        status = wait_or_kill(pid, timeout_s)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    if status is None:
        return Outcome(HANG, out, err)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return Outcome(rc, out, err)


def cli(argv: list[str], timeout_s: float = 120.0, uid: Optional[int] = None) -> Outcome:
    if len(argv) > 2 and argv[0] == "convert" and not str(argv[2]).startswith("-"):
        # as a user would: the destination's parent exists (convert creates no parents: exit 2), so
        # each trial reaches the fault it injects
        os.makedirs(os.path.dirname(os.path.abspath(str(argv[2]))), exist_ok=True)
    def run() -> int:
        from elastor_ds.cli import main
        return main([str(a) for a in argv])
    return forked(run, timeout_s, uid)


def fingerprint(*paths: str) -> str:
    """Hash of every file (name, bytes) and symlink under ``paths``: 'did anything change?'."""
    h = hashlib.sha256()
    for p in paths:
        if not os.path.lexists(p):
            h.update(f"absent:{p}".encode())
            continue
        if os.path.isfile(p) or os.path.islink(p):
            walk = [(os.path.dirname(p), [], [os.path.basename(p)])]
        else:
            walk = os.walk(p)
        for d, dirs, files in walk:
            dirs.sort()
            for f in sorted(files + [x for x in dirs if os.path.islink(os.path.join(d, x))]):
                fp = os.path.join(d, f)
                h.update(fp.encode())
                if os.path.islink(fp):
                    h.update(os.readlink(fp).encode())
                elif os.path.isfile(fp):
                    with open(fp, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


@dataclass
class Row:
    trials: int = 0
    detected: int = 0
    lost: int = 0
    hangs: int = 0
    tracebacks: int = 0
    misses: list = field(default_factory=list)

    def add(self, name: str, detected: bool, lost: bool = False, hang: bool = False, tb: bool = False) -> None:
        self.trials += 1
        self.detected += bool(detected)
        self.lost += bool(lost)
        self.hangs += bool(hang)
        self.tracebacks += bool(tb)
        if not detected or lost or hang or tb:
            self.misses.append(name)


# ---------------------------------------------------------------------------------- fixtures
SHAPE = (48, 40)
NAMES = ("w", "v", "u")


def _value(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
    return torch.randn(SHAPE, generator=g)


def save_ckpt(root: str, step: int, halves: bool = True, keep: int = 10, **kw) -> str:
    """A committed step whose tensors are saved as two row halves (as two ranks would)."""
    shards = []
    for n in NAMES:
        t = _value(n, step)
        if halves:
            h = SHAPE[0] // 2
            shards += [TensorShard(n, SHAPE, Region((0, 0), (h, SHAPE[1])), t[:h].clone()),
                       TensorShard(n, SHAPE, Region((h, 0), (SHAPE[0] - h, SHAPE[1])), t[h:].clone())]
        else:
            shards.append(TensorShard(n, SHAPE, Region.full(SHAPE), t.clone()))
    stats = CheckpointEngine(root, async_save=False, keep=keep, **kw).save(step, shards, extra={"iteration": step})
    return stats.committed_dir


READ_PATTERNS = {
    "full": lambda: [Region.full(SHAPE)],
    "row": lambda: [Region((SHAPE[0] // 2, 0), (SHAPE[0] // 2, SHAPE[1]))],
    "column": lambda: [Region((0, SHAPE[1] // 2), (SHAPE[0], SHAPE[1] // 2))],
    "strided": lambda: [Region((0, c), (SHAPE[0], SHAPE[1] // 4)) for c in (SHAPE[1] // 4, 3 * SHAPE[1] // 4)],
    "reshard": lambda: [Region((r, c), (SHAPE[0] // 3, SHAPE[1] // 2))
                        for r in range(0, SHAPE[0], SHAPE[0] // 3) for c in (0, SHAPE[1] // 2)],
}


def load_regions(root: str, step: int, pattern: str, fallback: bool = False) -> tuple[bool, int]:
    """Load every tensor under ``pattern``; (values equal to step's, step loaded)."""
    shards = [TensorShard(n, SHAPE, r, torch.empty(r.sizes)) for n in NAMES for r in READ_PATTERNS[pattern]()]
    res = CheckpointEngine(root, async_save=False).load(None, shards, fallback=fallback)
    ok = all(torch.equal(s.tensor, _value(s.name, res.step)[tuple(slice(o, o + z) for o, z in
                                                                  zip(s.region.offsets, s.region.sizes))])
             for s in shards)
    return ok, res.step


def loads_ok(root: str, step: Optional[int] = None) -> bool:
    """Does ``root`` load (full pattern) with the right values (of ``step`` if given)?"""
    def run() -> int:
        ok, got = load_regions(root, -1, "full")
        return 0 if ok and (step is None or got == step) else 3
    return forked(run, 60).rc == 0


# ---------------------------------------------------------------------------------- classes
PLAN_OK = ["plan", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
           "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size", "8", "--gpus-per-node", "2,2"]


def _with(argv: list[str], flag: str, value: Optional[str]) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (added if absent; removed when value is None)."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        del out[i:i + 2]
    if flag == "--cluster" and "--gpus-per-node" in out:
        i = out.index("--gpus-per-node")
        del out[i:i + 2]
    return out + ([flag, value] if value is not None else [])


def write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def malformed_cli_cases(work: str, ckpt: str) -> list[tuple[str, list[str], int]]:
    """(name, argv, expected exit code)."""
    cases = []
    for flag, vals in (("--num-layers", ["0", "-4", "nan", "1e3", "abc"]), ("--hidden-size", ["0", "-1"]),
                       ("--num-attention-heads", ["0", "3"]), ("--seq-length", ["0", "-128"]),
                       ("--vocab-size", ["0", "-5"]), ("--micro-batch-size", ["0", "-1"]),
                       ("--global-batch-size", ["0", "-8"]), ("--gpus-per-node", ["a,b", "-1,2", ",", "2,,x"]),
                       ("--gpu-memory-gb", ["nan", "inf", "-1", "0"]),
                       ("--intra-node-bandwidth-gbs", ["nan", "0", "-3", "inf"]),
                       ("--inter-node-bandwidth-gbs", ["nan", "-1"]),
                       ("--gpu-tflops", ["nan", "inf", "0", "-1"]), ("--top-k", ["0", "-3"]),
                       ("--tensor-model-parallel-size", ["0", "-2", "3"]), ("--dtype-bytes", ["0", "-2"]),
                       ("--num-query-groups", ["0", "3", "-1"]), ("--ffn-hidden-size", ["0", "-7"])):
        for v in vals:
            cases.append((f"plan {flag} {v}", _with(PLAN_OK, flag, v), 2))
    bad_files = {
        "cluster-missing": None, "cluster-list": "[1, 2]", "cluster-nan": '{"gpus_per_node": [2, 2], "gpu_memory_gb": NaN}',
        "cluster-str": '{"gpus_per_node": "two"}', "cluster-neg": '{"gpus_per_node": [-2, 2]}',
        "cluster-garbage": "{{{ not yaml or json", "cluster-unknown": '{"gpus_per_node": [2], "x": 1}',
        "cluster-bw-inf": '{"gpus_per_node": [2, 2], "inter_node_bandwidth_gbs": Infinity}',
    }
    for name, text in bad_files.items():
        path = os.path.join(work, "in", name + ".json")
        if text is not None:
            write(path, text)
        cases.append((f"plan --cluster {name}", _with(PLAN_OK, "--cluster", path), 2))
    for name, text in {"profile-missing": None, "profile-list": "[]", "profile-garbage": "nope{",
                       "profile-nan": '{"layer_time_s": NaN}', "profile-neg": '{"layer_time_s": -1}'}.items():
        path = os.path.join(work, "in", name + ".json")
        if text is not None:
            write(path, text)
        cases.append((f"plan --profile {name}", _with(PLAN_OK, "--profile", path), 2))
    dst = os.path.join(work, "out", "never")
    for flag, v in (("--tensor-model-parallel-size", "0"), ("--tensor-model-parallel-size", "-1"),
                    ("--tensor-model-parallel-size", "x"), ("--pipeline-model-parallel-size", "0"),
                    ("--pipeline-model-parallel-size", "nan")):
        cases.append((f"convert --to megatron {flag} {v}", ["convert", ckpt, dst, "--to", "megatron", flag, v], 2))
    script = write(os.path.join(work, "in", "ok_script.py"), "import sys\nsys.exit(0)\n")
    for flag, v in (("--monitor-interval", "nan"), ("--monitor-interval", "0"), ("--hang-timeout", "-1"),
                    ("--hang-timeout", "inf"), ("--nnodes", "0"), ("--nnodes", "3:1"), ("--nproc-per-node", "0"),
                    ("--nproc-per-node", "x"), ("--max-restarts", "-1"), ("--shutdown-timeout", "nan"),
                    ("--probe-timeout", "inf"), ("--gpu-memory-gb", "-8")):
        cases.append((f"run {flag} {v}", ["run", flag, v, "--standalone", script], 2))
    cases.append(("run missing script", ["run", "--standalone", os.path.join(work, "nope.py")], 2))
    cases += [
        ("convert --to nonsense", ["convert", ckpt, dst, "--to", "nonsense"], 2),
        ("convert --from nonsense", ["convert", ckpt, dst, "--from", "nonsense"], 2),
        ("convert missing source", ["convert", os.path.join(work, "nope"), dst, "--to", "consolidated"], 2),
        ("convert src == dst", ["convert", ckpt, ckpt, "--to", "consolidated"], 2),
        ("convert --model-config missing", ["convert", ckpt, dst, "--to", "megatron", "--model-config",
                                            os.path.join(work, "nope.json")], 2),
        ("convert --model-config list", ["convert", ckpt, dst, "--to", "megatron", "--model-config",
                                         write(os.path.join(work, "in", "mc_list.json"), "[1]")], 2),
        ("convert --model-config bad field", ["convert", ckpt, dst, "--to", "megatron", "--model-config",
                                              write(os.path.join(work, "in", "mc_bad.json"), '{"num_layers": "x"}')], 2),
        ("convert --from consolidated empty dir", ["convert", os.makedirs(os.path.join(work, "in", "emptycons"),
                                                   exist_ok=True) or os.path.join(work, "in", "emptycons"),
                                                   dst, "--from", "consolidated"], 1),
        ("inspect missing", ["inspect", os.path.join(work, "nope")], 2),
        ("verify missing", ["verify", os.path.join(work, "nope")], 2),
        ("inspect a file", ["inspect", write(os.path.join(work, "in", "file.txt"), "x")], 1),
        ("verify an empty dir", ["verify", os.path.join(work, "in", "emptycons")], 1),
        ("no subcommand", [], 2),
        ("unknown subcommand", ["frobnicate"], 2),
        ("convert no args", ["convert"], 2),
    ]
    for name, text in {"manifest-list": "[]", "manifest-no-tensors": '{"format": "elastor", "format_version": 1, '
                       '"step": 1, "files": {}}', "manifest-step-abc": None, "manifest-neg-shape": None,
                       "manifest-garbage": "{", "manifest-shape-str": None, "manifest-version-99": None}.items():
        d = os.path.join(work, "in", name)
        shutil.copytree(ckpt, d)
        mp = os.path.join(d, "manifest.json")
        if text is None:
            m = json.load(open(mp))
            if name == "manifest-step-abc":
                m["step"] = "abc"
            elif name == "manifest-neg-shape":
                next(iter(m["tensors"].values()))["shape"] = [-48, 40]
            elif name == "manifest-shape-str":
                next(iter(m["tensors"].values()))["shape"] = "big"
            else:
                m["format_version"] = 99
            text = json.dumps(resign(m))
        write(mp, text)
        for sub in ("verify", "inspect"):
            cases.append((f"{sub} {name}", [sub, d], 1))
        cases.append((f"convert {name}", ["convert", d, dst, "--to", "consolidated"], 1))
    return cases


def run_cli_malformed(work: str, rng: random.Random, reps: int) -> Row:
    row = Row()
    ckpt = save_ckpt(os.path.join(work, "ck"), 3)
    before = fingerprint(os.path.join(work, "ck"))
    for name, argv, want in malformed_cli_cases(work, ckpt) * max(1, reps):
        o = cli(argv)
        lost = fingerprint(os.path.join(work, "ck")) != before or os.path.exists(os.path.join(work, "out", "never"))
        detected = o.rc == want and bool(o.err.strip())
        row.add(f"{name} (rc {o.rc}, want {want}: {o.err.strip().splitlines()[-1][:160] if o.err.strip() else ''})",
                detected, lost, o.hang, o.traceback)
    return row


def ds_config_cases() -> list[tuple[str, object]]:
    ok_ck = {"dir": "/tmp/x"}
    cases = [("section is a list", []), ("section is a string", "yes"), ("unknown key", {"planz": "auto"}),
             ("plan is a number", {"plan": 3}), ("plan is a list", {"plan": [1]}),
             ("plan file missing", {"plan": "/nonexistent/plan.json"}),
             ("checkpoint is a list", {"checkpoint": []}), ("checkpoint without dir", {"checkpoint": {}})]
    for key, vals in (("interval_steps", [-1, "5", 1.5, True, None, float("nan")]),
                      ("min_interval_s", [-1.0, float("nan"), float("inf"), "1"]),
                      ("keep", [0, -2, "2", 2.5]), ("async", ["yes", 1, None]),
                      ("load", [5, [], {}]), ("timeout_s", [0, -5, float("nan"), float("inf")]),
                      ("verify_on_load", ["true"]), ("dir", ["", 5, None]), ("bogus", [1])):
        for v in vals:
            cases.append((f"checkpoint.{key} = {v!r}", {"checkpoint": dict(ok_ck, **{key: v})}))
    return cases


def run_ds_config(work: str, rng: random.Random, reps: int) -> Row:
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.deepspeed.config import split_ds_config
    row = Row()
    for name, section in ds_config_cases() * max(1, reps):
        def run(section=section) -> int:
            from elastor_ds.integrations.deepspeed.config import load_plan_document
            try:
                _, cfg = split_ds_config({"train_batch_size": 8, "elastor": section})
                if cfg.plan not in (None, "auto"):  # what initialize does next
                    load_plan_document(cfg.plan)
            except ConfigError as e:
                print(f"ConfigError: {e}", file=sys.stderr)
                return 2
            return 0
        o = forked(run, 30)
        row.add(f"ds-config {name} (rc {o.rc})", o.rc == 2, False, o.hang, o.traceback)
    return row


def run_trainer_flags(work: str, rng: random.Random, reps: int) -> Row:
    from elastor_ds.errors import ElastorError
    from elastor_ds.integrations.megatron import training_hooks as th
    plans = {"missing": None, "list": "[]", "garbage": "{", "empty-object": "{}",
             "nan-layers": '{"replicas": NaN}', "wrong-world": None}
    cases: list[tuple[str, list[str]]] = [("--elastor-keep 0", ["--elastor", "--elastor-keep", "0"]),
                                          ("--elastor-keep -1", ["--elastor", "--elastor-keep", "-1"]),
                                          ("--elastor-keep x", ["--elastor", "--elastor-keep", "x"]),
                                          ("--elastor-keep nan", ["--elastor", "--elastor-keep", "nan"])]
    for name, text in plans.items():
        p = os.path.join(work, "in", f"plan_{name}.json")
        if name == "wrong-world":
            from elastor_ds.layout import Layout
            text = json.dumps(Layout.uniform(2, 2, 2, 8).to_json())
        if text is not None:
            write(p, text)
        cases.append((f"--elastor-plan {name}", ["--elastor", "--elastor-plan", p]))
    row = Row()
    for name, argv in cases * max(1, reps):
        def run(argv=argv) -> int:
            parser = th.add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
            args = parser.parse_args(argv)
            args.num_layers, args.world_size = 8, 4
            args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
            try:
                th.configure(args)
            except ElastorError as e:
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                return 2
            return 0
        o = forked(run, 30)
        row.add(f"trainer {name} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == 2, False, o.hang, o.traceback)
    return row


def resign(m: dict) -> dict:
    """Recompute an edited manifest's checksum, as an attacker would (it is not a signature)."""
    if "checksum" in m:
        from elastor_ds.checkpoint.planning.manifest import document_checksum
        m["checksum"] = document_checksum(m)
    return m


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def run_path_escape(work: str, rng: random.Random, reps: int) -> Row:
    """Checkpoints that name paths outside themselves; every read must refuse (exit 1)."""
    row = Row()
    root = os.path.join(work, "ck")
    step_dir = save_ckpt(root, 3)
    fname = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))[0]
    secret = write(os.path.join(work, "secret", "data.safetensors"), "")
    shutil.copy(os.path.join(step_dir, fname), secret)  # a valid file, so a leak would "work"
    crafted: list[tuple[str, str]] = []

    def manifest_edit(name: str, edit: Callable[[dict, str], None]) -> None:
        r = _copy(root, os.path.join(work, "esc", name))
        sd = commit_mod.resolve(r)
        m = json.load(open(os.path.join(sd, "manifest.json")))
        edit(m, sd)
        resign(m)
        write(os.path.join(sd, "manifest.json"), json.dumps(m))
        crafted.append((name, r))

    def rename_file(m: dict, new: str) -> None:
        m["files"][new] = m["files"].pop(fname)
        for t in m["tensors"].values():
            for ch in t["chunks"]:
                if ch["file"] == fname:
                    ch["file"] = new

    rel = os.path.relpath(secret, os.path.join(work, "esc", "x", commit_mod.step_dirname(3)))
    manifest_edit("file-dotdot", lambda m, sd: rename_file(m, rel))
    manifest_edit("file-absolute", lambda m, sd: rename_file(m, secret))
    manifest_edit("file-dotdot-deep", lambda m, sd: rename_file(m, "../" * 12 + secret.lstrip("/")))
    manifest_edit("chunk-file-escape", lambda m, sd: [ch.update(file=rel) for t in m["tensors"].values()
                                                      for ch in t["chunks"] if ch["file"] == fname])
    manifest_edit("rank-state-escape", lambda m, sd: m.update(rank_state_files={"0": "../../secret/data.safetensors"}))
    manifest_edit("rank-state-absolute", lambda m, sd: m.update(rank_state_files={"0": "/etc/hostname"}))
    r = _copy(root, os.path.join(work, "esc", "symlink-out"))
    sd = commit_mod.resolve(r)
    os.unlink(os.path.join(sd, fname))
    os.symlink(secret, os.path.join(sd, fname))
    crafted.append(("symlink-out", r))
    for name, target in (("latest-dotdot", "../ck/" + commit_mod.step_dirname(3)), ("latest-absolute", step_dir),
                         ("latest-inner-dotdot", commit_mod.step_dirname(3) + "/../../ck/" + commit_mod.step_dirname(3)),
                         ("latest-garbage", "\x00\x01")):
        r = _copy(root, os.path.join(work, "esc", name))
        write(os.path.join(r, "latest"), target)
        shutil.rmtree(os.path.join(r, commit_mod.step_dirname(3)))  # only the escape would find data
        os.makedirs(os.path.join(r, commit_mod.step_dirname(1)))
        crafted.append((name, r))
    r = _copy(root, os.path.join(work, "esc", "step-dir-symlink"))
    shutil.move(os.path.join(r, commit_mod.step_dirname(3)), os.path.join(work, "esc", "elsewhere"))
    os.symlink(os.path.join(work, "esc", "elsewhere"), os.path.join(r, commit_mod.step_dirname(3)))
    crafted.append(("step-dir-symlink", r))
    before = fingerprint(os.path.join(work, "secret"))
    for _ in range(max(1, reps)):
        for name, r in crafted:
            for op in ("verify", "convert", "load"):
                dst = os.path.join(work, "esc_out", f"{name}_{op}_{rng.randrange(10**9)}")
                if op == "verify":
                    o = cli(["verify", r])
                elif op == "convert":
                    o = cli(["convert", r, dst, "--to", "consolidated", "--no-progress"])
                else:
                    def run(r=r) -> int:
                        from elastor_ds.errors import ElastorError
                        try:
                            ok, step = load_regions(r, 3, "full")
                        except ElastorError as e:
                            print(f"{type(e).__name__}: {e}", file=sys.stderr)
                            return 1
                        return 0
                    o = forked(run, 60)
                leaked = os.path.exists(dst)
                lost = leaked or fingerprint(os.path.join(work, "secret")) != before
                row.add(f"{name} via {op} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == 1 and not leaked, lost,
                        o.hang, o.traceback)
    # export side: a tensor name that would escape the destination
    from elastor_ds.checkpoint.convert import write_single_writer_checkpoint
    evil = os.path.join(work, "esc", "evil-names")
    t = torch.ones(4, 4)
    for name in ("../../../escaped.weight", "/abs/escaped.weight", "model.../../x"):
        d = f"{evil}_{zlib.crc32(name.encode())}"
        try:  # bypass the importer's name check to build the crafted checkpoint
            import elastor_ds.checkpoint.convert as cv
            orig = cv.check_tensor_name
            cv.check_tensor_name = lambda n, where="": n
            write_single_writer_checkpoint(d, 1, ["model." + name], {"model." + name: (4, 4)},
                                           {"model." + name: "float32"}, lambda n: t, progress=False)
        finally:
            cv.check_tensor_name = orig
        for _ in range(max(1, reps)):
            out = os.path.join(work, "esc_out", f"uni_{rng.randrange(10**9)}")
            o = cli(["convert", d, out, "--to", "deepspeed-universal"])
            escaped = any("escaped" in f for _, _, fs in os.walk(work) for f in fs)
            row.add(f"export tensor {name!r} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == 1 and not escaped,
                    escaped, o.hang, o.traceback)
    return row


class _Evil:
    """Unpickling this writes ``marker`` (what a crafted checkpoint could do with any code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def run_malicious_pickle(work: str, rng: random.Random, reps: int) -> Row:
    import pickle
    for heavy in ("deepspeed", "megatron.core", "elastor_ds.integrations.deepspeed.convert",
                  "elastor_ds.integrations.megatron.convert"):  # import once, before the forks
        with contextlib.suppress(ImportError):
            __import__(heavy)
    row = Row()
    cases = []
    for i in range(max(1, reps)):
        base = os.path.join(work, "pk", str(i))
        marker = os.path.join(work, "pk_marker", f"{i}")
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        evil = _Evil(marker)
        good_mp = {"module": {"w": torch.ones(2)}, "param_shapes": [{}], "global_steps": 1, "ds_config": {}}
        # DeepSpeed native: a layer file, the mp_rank file, a ZeRO optimizer file
        for which in ("layer", "mp_rank", "zero"):
            d = os.path.join(base, f"ds_{which}", "global_step1")
            os.makedirs(d)
            torch.save({"weight": torch.ones(2)} if which != "layer" else {"weight": evil},
                       os.path.join(d, "layer_00-model_states.pt"))
            torch.save(good_mp if which != "mp_rank" else {"module": evil}, os.path.join(d, "mp_rank_00_model_states.pt"))
            if which == "zero":
                torch.save({"optimizer_state_dict": evil}, os.path.join(d, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
            cases.append((f"deepspeed {which} file", ["convert", d, "--from", "deepspeed"], marker))
        d = os.path.join(base, "ds_universal", "global_step1", "zero", "w")
        os.makedirs(d)
        torch.save({"param": evil}, os.path.join(d, "fp32.pt"))
        cases.append(("deepspeed universal fp32.pt", ["convert", os.path.dirname(os.path.dirname(d)), "--from",
                                                      "deepspeed-universal"], marker))
        # Megatron legacy and torch_dist
        m = os.path.join(base, "mg_legacy")
        os.makedirs(os.path.join(m, "iter_0000001", "mp_rank_00"))
        write(os.path.join(m, "latest_checkpointed_iteration.txt"), "1")
        torch.save({"model": {}, "args": evil}, os.path.join(m, "iter_0000001", "mp_rank_00", "model_optim_rng.pt"))
        cases.append(("megatron legacy model_optim_rng.pt", ["convert", m, "--from", "megatron"], marker))
        for which in ("metadata", "common"):
            m = os.path.join(base, f"mg_td_{which}")
            it = os.path.join(m, "iter_0000001")
            os.makedirs(it)
            write(os.path.join(m, "latest_checkpointed_iteration.txt"), "1")
            write(os.path.join(it, "metadata.json"), '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
            from torch.distributed.checkpoint.metadata import Metadata
            with open(os.path.join(it, ".metadata"), "wb") as f:
                pickle.dump(Metadata(state_dict_metadata={"x": evil}) if which == "metadata" else
                            Metadata(state_dict_metadata={}), f)
            torch.save({"args": evil} if which == "common" else {}, os.path.join(it, "common.pt"))
            cases.append((f"megatron torch_dist {which}", ["convert", m, "--from", "megatron"], marker))
    for name, argv, marker in cases:
        dst = os.path.join(work, "pk_out", f"{rng.randrange(10**9)}")
        o = cli(argv[:2] + [dst] + argv[2:] + ["--no-progress"])
        ran = os.path.exists(marker)
        if ran:
            os.unlink(marker)
        one_line = len([x for x in o.err.strip().splitlines() if x.startswith("ERROR")]) == 1
        row.add(f"{name} (rc {o.rc}: {o.err.strip()[-200:]})", o.rc == 1 and not ran and one_line, ran, o.hang,
                o.traceback)
    return row


def run_non_empty_destination(work: str, rng: random.Random, reps: int) -> Row:
    row = Row()
    src_root = os.path.join(work, "src")
    save_ckpt(src_root, 5)
    cons = os.path.join(work, "cons")
    assert cli(["convert", src_root, cons, "--to", "consolidated", "--no-progress"]).rc == 0
    for i in range(max(1, reps)):
        target = os.path.join(work, f"target{i}")
        for s in (3, 9):
            save_ckpt(target, s)
        files_dir = os.path.join(work, f"files{i}")
        write(os.path.join(files_dir, "mine.txt"), "precious")
        a_file = write(os.path.join(work, f"afile{i}"), "precious")
        cases = [
            ("import into an elastor root", ["convert", cons, target, "--from", "consolidated"], target, 2),
            ("import into a dir of files", ["convert", cons, files_dir, "--from", "consolidated"], files_dir, 2),
            ("import --force into a dir of files", ["convert", cons, files_dir, "--from", "consolidated", "--force"],
             files_dir, 2),
            ("export consolidated into files", ["convert", src_root, files_dir, "--to", "consolidated"], files_dir, 2),
            ("export megatron into an elastor root", ["convert", src_root, target, "--to", "megatron"], target, 2),
            ("export deepspeed-universal into files", ["convert", src_root, files_dir, "--to", "deepspeed-universal"],
             files_dir, 2),
            ("export consolidated onto a file", ["convert", src_root, a_file, "--to", "consolidated"], a_file, 2),
        ]
        for name, argv, dst, want in cases:
            before = fingerprint(dst)
            o = cli(argv + ["--no-progress"])
            lost = fingerprint(dst) != before
            row.add(f"{name} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == want and not lost, lost, o.hang,
                    o.traceback)
        # --force adds step 5 between 3 and 9: latest stays at 9, 3 and 9 untouched
        before = {s: fingerprint(os.path.join(target, commit_mod.step_dirname(s))) for s in (3, 9)}
        o = cli(["convert", cons, target, "--from", "consolidated", "--force", "--no-progress"])
        kept = all(fingerprint(os.path.join(target, commit_mod.step_dirname(s))) == h for s, h in before.items())
        latest_ok = os.path.basename(commit_mod.resolve(target)) == commit_mod.step_dirname(9)
        added = os.path.isdir(os.path.join(target, commit_mod.step_dirname(5)))
        row.add(f"import --force adds a step (rc {o.rc})", o.rc == 0 and kept and latest_ok and added,
                not (kept and latest_ok), o.hang, o.traceback)
        before = fingerprint(target)
        o = cli(["convert", cons, target, "--from", "consolidated", "--force", "--no-progress"])
        row.add(f"import --force onto an existing step (rc {o.rc})", o.rc == 2 and fingerprint(target) == before,
                fingerprint(target) != before, o.hang, o.traceback)
    return row


def _byte_in_pattern(step_dir: str, pattern: str, rng: random.Random) -> tuple[str, int, str]:
    """(file, byte offset, tensor) of a random byte that ``pattern`` reads."""
    man = commit_mod.read_manifest(step_dir)
    name = rng.choice(NAMES)
    reg = rng.choice(READ_PATTERNS[pattern]())
    idx = [o + rng.randrange(z) for o, z in zip(reg.offsets, reg.sizes)]
    for ch in man.tensors[name].chunks:
        r = ch.region
        if all(o <= i < o + z for i, o, z in zip(idx, r.offsets, r.sizes)):
            flat = (idx[0] - r.offsets[0]) * r.sizes[1] + (idx[1] - r.offsets[1])
            return ch.file, ch.offset + flat * 4 + rng.randrange(4), name
    raise AssertionError("element not covered")


def run_corruption(work: str, rng: random.Random, count: int) -> Row:
    row = Row()
    template = os.path.join(work, "tmpl")
    save_ckpt(template, 2)
    save_ckpt(template, 3)
    kinds = ("bitflip", "truncate", "delete")
    ops = ("load", "load+fallback", "verify", "convert")
    patterns = tuple(READ_PATTERNS)
    for i in range(count):
        kind, op = kinds[i % 3], ops[(i // 3) % 4]
        pattern = patterns[(i // 12) % len(patterns)] if op.startswith("load") else "full"
        root = _copy(template, os.path.join(work, "c", str(i)))
        sd = os.path.join(root, commit_mod.step_dirname(3))
        fname, off, tname = _byte_in_pattern(sd, pattern, rng)
        path = os.path.join(sd, fname)
        if kind == "bitflip":
            with open(path, "r+b") as f:
                f.seek(off)
                b = f.read(1)[0]
                f.seek(off)
                f.write(bytes([b ^ (1 << rng.randrange(8))]))
        elif kind == "truncate":
            os.truncate(path, rng.randrange(0, off + 1))
        else:
            os.unlink(path)
        name = f"{kind} {fname}@{off} ({tname}) / {op} / {pattern}"
        if op.startswith("load"):
            fallback = op == "load+fallback"

            def run(root=root, pattern=pattern, fallback=fallback) -> int:
                from elastor_ds.errors import ElastorError
                try:
                    ok, step = load_regions(root, 3, pattern, fallback=fallback)
                except ElastorError as e:
                    print(f"{type(e).__name__}: {e}", file=sys.stderr)
                    return 1
                if not ok:
                    return 4      # wrong values returned as good: data lost
                return 0 if step == 2 else 5   # fallback landed on the good step / corrupt step 3 "loaded"
            o = forked(run, 60)
            detected = (o.rc == 0) if fallback else (o.rc == 1)
            lost = o.rc in (4, 5)
        elif op == "verify":
            o = cli(["verify", root])
            detected, lost = o.rc == 1, o.rc == 0
        else:
            dst = os.path.join(work, "c_out", str(i))
            o = cli(["convert", root, dst, "--to", "consolidated", "--no-progress"])
            left = [n for n in os.listdir(os.path.dirname(dst))] if os.path.isdir(os.path.dirname(dst)) else []
            detected = o.rc == 1 and not os.path.exists(dst) and not any(".tmp" in n for n in left)
            lost = o.rc == 0
        row.add(f"{name} (rc {o.rc}: {o.err.strip()[-160:]})", detected, lost, o.hang, o.traceback)
        shutil.rmtree(root, ignore_errors=True)
    return row


# ---------------------------------------------------------------------------------- kills
def _kill_scenarios(work: str):
    """name -> (template root, operation run in the child, check(root) -> (ok, lost))."""
    from elastor_ds.checkpoint.convert import from_consolidated, to_consolidated
    t12 = os.path.join(work, "k_tmpl12")
    save_ckpt(t12, 1, keep=2)
    save_ckpt(t12, 2, keep=2)
    cons = os.path.join(work, "k_cons")
    to_consolidated(t12, cons, progress=False)  # holds step 2's values, imported as step 5
    meta_path = os.path.join(cons, "elastor_metadata.json")
    meta = json.load(open(meta_path))
    meta["step"] = 5
    write(meta_path, json.dumps(meta))

    def values_ok(root: str, step_dir: str, seeds: dict[int, tuple[int, ...]]) -> bool:
        """Every tensor of ``step_dir`` holds the values of one of the step's seeds (never a mix)."""
        step = commit_mod.step_of(os.path.basename(step_dir))
        shards = [TensorShard(n, SHAPE, Region.full(SHAPE), torch.empty(SHAPE)) for n in NAMES]
        try:
            CheckpointEngine(root, async_save=False).load(step_dir, shards)
        except Exception:  # noqa: BLE001
            return False
        return any(all(torch.equal(s.tensor, _value(s.name, seed)) for s in shards)
                   for seed in seeds.get(step, (step,)))

    def check_root(root: str, allowed_latest: set[int], must_keep: Callable[[int], set[int]],
                   seeds: Callable[[int], dict[int, int]]) -> tuple[bool, bool]:
        try:
            latest = commit_mod.resolve(root)
        except Exception:  # noqa: BLE001
            return False, True
        lstep = commit_mod.step_of(os.path.basename(latest))
        sd = seeds(lstep)
        if lstep not in allowed_latest or not values_ok(root, latest, sd):
            return False, True
        have = {s for s, _ in commit_mod.list_committed(root)} | {lstep}  # latest may name a complete temp dir
        # (re-save without exchange, killed mid-swap)
        if not must_keep(lstep) <= have:
            return False, True
        ok = all(values_ok(root, p, sd) for s, p in commit_mod.list_committed(root))
        return ok, not ok

    def save3(root: str) -> None:
        save_ckpt(root, 3, keep=2)

    def resave2(root: str) -> None:  # step 2 again, with other values (seed 12)
        shards = [TensorShard(n, SHAPE, Region.full(SHAPE), _value(n, 12)) for n in NAMES]
        CheckpointEngine(root, async_save=False, keep=2).save(2, shards)

    def save3_async(root: str) -> None:
        eng = CheckpointEngine(root, async_save=True, keep=1)
        eng.save(3, [TensorShard(n, SHAPE, Region.full(SHAPE), _value(n, 3)) for n in NAMES],
                 rank_state={"rng": 3})
        eng.wait()

    def import5(root: str) -> None:
        from_consolidated(cons, root, progress=False, force=True)

    def export(root: str) -> None:
        to_consolidated(root, os.path.join(root, "..", os.path.basename(root) + "_export"), progress=False)

    def check_export(root: str) -> tuple[bool, bool]:
        dst = os.path.join(os.path.dirname(root), os.path.basename(root) + "_export")
        if not os.path.exists(dst):
            return True, False
        from safetensors.torch import load_file
        try:
            got = load_file(os.path.join(dst, "model.safetensors"))
            ok = all(torch.equal(got[n], _value(n, 2)) for n in NAMES)
        except Exception:  # noqa: BLE001
            ok = False
        return ok, not ok

    same = lambda s: {}  # noqa: E731
    resaved = lambda s: {2: (2, 12)}  # noqa: E731  step 2 holds the old or the new values, never a mix
    return {
        "save (new step + retention)": (t12, save3, lambda r: check_root(r, {2, 3}, lambda l: {2, 3} if l == 3 else
                                                                          {1, 2}, same)),
        "async save with rank state, keep=1": (t12, save3_async, lambda r: check_root(
            r, {2, 3}, lambda l: {3} if l == 3 else {1, 2}, same)),
        "re-save (exchange)": (t12, resave2, lambda r: check_root(r, {2}, lambda l: {1, 2}, resaved)),
        "re-save (no exchange)": (t12, ("noexchange", resave2), lambda r: check_root(r, {2}, lambda l: {1, 2},
                                                                                      resaved)),
        "import --force": (t12, import5, lambda r: check_root(r, {2, 5}, lambda l: {1, 2}, lambda l: {5: (2,)})),
        "export consolidated": (t12, export, check_export),
    }


def run_sigkill(work: str, rng: random.Random, budget: int) -> Row:
    from elastor_ds.testing.faults import kill_at_io
    row = Row()
    scen = _kill_scenarios(work)
    totals = {}
    for name, (tmpl, op, _) in scen.items():
        exch = None
        if isinstance(op, tuple):
            exch, op = False, op[1]
        root = _copy(tmpl, os.path.join(work, "k_count", name.replace(" ", "_")))
        cfile = root + ".count"

        def count(op=op, root=root, cfile=cfile, exch=exch) -> int:
            c = kill_at_io(0, exchange_supported=exch)
            op(root)
            n = c.count
            with open(cfile, "w") as f:
                f.write(str(n))
            return 0
        o = forked(count, 120)
        assert o.rc == 0, (name, o.err)
        totals[name] = int(open(cfile).read())
    print(f"# sigkill-save: file-system calls per scenario {totals}", file=sys.stderr)
    total = sum(totals.values())
    for name, (tmpl, op, check) in scen.items():
        exch = None
        if isinstance(op, tuple):
            exch, op = False, op[1]
        n = totals[name]
        # every call once when the budget allows; else an even, deterministic spread over the calls
        per = n if total <= budget else max(1, (budget * n) // total)
        points = sorted({1 + (j * n) // per for j in range(per)})
        for k in points:
            root = _copy(tmpl, os.path.join(work, "k", f"{name.replace(' ', '_')}_{k}_{rng.randrange(10**6)}"))

            def run(op=op, root=root, k=k, exch=exch) -> int:
                kill_at_io(k, exchange_supported=exch)
                op(root)
                return 0
            o = forked(run, 120)
            killed = o.rc == -signal.SIGKILL
            ok, lost = check(root)
            row.add(f"{name} killed before I/O call {k}/{n} (rc {o.rc})", ok and (killed or o.rc == 0), lost,
                    o.hang, o.traceback)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(root + "_export", ignore_errors=True)
    return row


def _rank_shards(step: int, rank: int, world: int, seed: Optional[int] = None) -> list[TensorShard]:
    rows = SHAPE[0] // world
    return [TensorShard(n, SHAPE, Region((rank * rows, 0), (rows, SHAPE[1])),
                        _value(n, step if seed is None else seed)[rank * rows:(rank + 1) * rows].clone())
            for n in NAMES]


def world_job(root: str, steps: tuple[int, ...], kill_at: dict[int, int], world: int = 2, timeout_s: float = 60.0,
              count_file: Optional[str] = None) -> list[int]:
    """A ``world``-rank gloo job (forked processes) that saves ``steps`` with rank state, async; rank r
    SIGKILLs itself before its ``kill_at[r]``-th file-system call. When any rank dies, the job's
    launcher kills the others (as torchrun does): the whole job goes down. Returns exit statuses."""
    from elastor_ds.testing.faults import kill_at_io
    store = tempfile.mktemp(prefix="elastor_store_")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                import datetime
                import torch.distributed as dist
                from elastor_ds.comm import TorchComm
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 2)
                dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                        timeout=datetime.timedelta(seconds=timeout_s))
                comm = TorchComm.create(timeout_s=timeout_s)
                counter = kill_at_io(kill_at.get(rank, 0))
                eng = CheckpointEngine(root, comm=comm, async_save=True, keep=2)
                for step in steps:
                    eng.save(step, _rank_shards(step, rank, world), extra={"iteration": step},
                             rank_state={"rank": rank, "step": step})
                eng.wait()
                if count_file:
                    with open(f"{count_file}.{rank}", "w") as f:
                        f.write(str(counter.count))
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    status = {}
    deadline = time.monotonic() + timeout_s + 30
    while len(status) < world:
        for pid in pids:
            if pid in status:
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
                if status[pid] != 0:  # the launcher tears the whole job down
                    for other in pids:
                        if other not in status:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(other, signal.SIGKILL)
        if time.monotonic() > deadline:
            for other in pids:
                if other not in status:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
                    os.waitpid(other, 0)
                    status[other] = HANG
        time.sleep(0.002)
    with contextlib.suppress(OSError):
        os.unlink(store)
    return [status[p] for p in pids]


def run_sigkill_world(work: str, rng: random.Random, budget: int) -> Row:
    """The whole 2-rank job killed at rank 0's n-th file-system call (then the launcher kills rank 1)
    and at rank 1's n-th call, for every n over two async saves with rank state and retention."""
    row = Row()
    tmpl = os.path.join(work, "w_tmpl")
    save_ckpt(tmpl, 1, keep=2)
    save_ckpt(tmpl, 2, keep=2)
    counts = {}
    root = _copy(tmpl, os.path.join(work, "w_count"))
    st = world_job(root, (3, 4), {}, count_file=os.path.join(work, "w_count"))
    assert st == [0, 0], st
    for r in (0, 1):
        counts[r] = int(open(os.path.join(work, f"w_count.{r}")).read())
    print(f"# sigkill-world: file-system calls per rank {counts}", file=sys.stderr)
    points = [(r, k) for r in (0, 1) for k in range(1, counts[r] + 1)]
    if len(points) > budget:
        points = [points[(j * len(points)) // budget] for j in range(budget)]
    for r, k in points:
        root = _copy(tmpl, os.path.join(work, "w", f"{r}_{k}_{rng.randrange(10**6)}"))
        st = world_job(root, (3, 4), {r: k})
        hang = HANG in st
        try:
            latest = commit_mod.resolve(root)
            lstep = commit_mod.step_of(os.path.basename(latest))
            ok = lstep in (2, 3, 4) and loads_ok(root, lstep)
            have = {s for s, _ in commit_mod.list_committed(root)}
            ok = ok and {lstep - 1, lstep} <= have  # the newest and the one before survive
        except Exception:  # noqa: BLE001
            ok = False
        row.add(f"2-rank job, rank {r} killed before I/O call {k}/{counts[r]} (statuses {st})", ok, not ok, hang)
        shutil.rmtree(root, ignore_errors=True)
    return row


def peer_job(root: str, victim: int, mode: str, at_call: int, timeout_s: float) -> tuple[int, str, float]:
    """2 ranks save step 3 (async, rank state); rank ``victim`` is SIGKILLed or SIGSTOPped (``mode``)
    before its ``at_call``-th file-system call and the launcher does NOT tear the job down: the
    survivor must fail on its own, with a typed error, within about ``timeout_s`` (the comm timeout).
    Returns (survivor exit code or HANG, its error line, seconds from the fault to its exit)."""
    from elastor_ds.testing.faults import kill_at_io
    store = tempfile.mktemp(prefix="elastor_store_")
    errfile = tempfile.mktemp(prefix="elastor_err_")
    marker = tempfile.mktemp(prefix="elastor_fault_")
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                import datetime
                import torch.distributed as dist
                from elastor_ds.comm import TorchComm
                from elastor_ds.errors import ElastorError
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 2)
                dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                                        timeout=datetime.timedelta(seconds=timeout_s))
                comm = TorchComm.create(timeout_s=timeout_s)
                if rank == victim:
                    c = kill_at_io(0)
                    orig = c.hit

                    def hit(what: str, c=c, orig=orig) -> None:
                        if c.count + 1 == at_call:
                            with open(marker, "w") as f:
                                f.write(str(time.time()))
                            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
                        orig(what)
                    c.hit = hit  # type: ignore[method-assign]
                try:
                    eng = CheckpointEngine(root, comm=comm, async_save=True, keep=2)
                    eng.save(3, _rank_shards(3, rank, 2), rank_state={"rank": rank})
                    eng.wait()
                    code = 0
                except ElastorError as e:
                    with open(errfile, "w") as f:
                        f.write(f"{type(e).__name__}: {e}"[:300])
                except BaseException as e:  # noqa: BLE001 - an untyped error reaches the user as a traceback
                    with open(errfile, "w") as f:
                        f.write(f"UNTYPED {type(e).__name__}: {e}"[:300])
                    code = 3
            finally:
                os._exit(code)
        pids.append(pid)
    survivor = pids[1 - victim]
    deadline = time.monotonic() + 3 * timeout_s + 30
    rc = HANG
    while time.monotonic() < deadline:
        done, st = os.waitpid(survivor, os.WNOHANG)
        if done:
            rc = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
            break
        time.sleep(0.01)
    end = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    fault_t = float(open(marker).read()) if os.path.exists(marker) else end
    err = open(errfile).read() if os.path.exists(errfile) else ""
    for f in (store, errfile, marker):
        with contextlib.suppress(OSError):
            os.unlink(f)
    return rc, err, end - fault_t


def run_peers(work: str, rng: random.Random, reps: int, timeout_s: float = 10.0) -> Row:
    """A peer killed (SIGKILL) or hung (SIGSTOP) mid-save while the survivor keeps running: the
    survivor must raise a typed error within ~3x the comm timeout; its previous checkpoint stays."""
    row = Row()
    tmpl = os.path.join(work, "p_tmpl")
    save_ckpt(tmpl, 2)
    for i in range(max(1, reps)):
        for mode in ("kill", "stop"):
            for at_call in (1 + rng.randrange(3), 4 + rng.randrange(5)):
                root = _copy(tmpl, os.path.join(work, "p", f"{mode}_{at_call}_{i}"))
                rc, err, secs = peer_job(root, 1, mode, at_call, timeout_s)
                intact = loads_ok(root)
                row.add(f"peer {mode} at I/O call {at_call}: survivor rc {rc} after {secs:.1f} s ({err[:160]})",
                        rc == 1, not intact, rc == HANG, rc == 3)
    return row


# ---------------------------------------------------------------------------------- ENOSPC, EACCES
@contextlib.contextmanager
def small_fs(path: str, size_kib: int):
    """A tmpfs of ``size_kib`` at ``path`` (needs root); yields False when it cannot be mounted."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", path], capture_output=True)
    try:
        yield r.returncode == 0
    finally:
        if r.returncode == 0:
            subprocess.run(["umount", "-l", path], capture_output=True)


def _fill(mnt: str, leave_bytes: int) -> None:
    """Fill the file system at ``mnt`` until about ``leave_bytes`` are free."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(mnt, "filler"), "ab") as f:
        f.write(b"\0" * max(0, free - leave_bytes))


def run_enospc(work: str, rng: random.Random, reps: int) -> Row:
    """A tmpfs filled up to a few KiB (seeded), then a save, an export or an import into it: a full
    disk at a different point of the write each time (data, manifest, rename, ``latest``)."""
    from elastor_ds.errors import ElastorError
    row = Row()
    mnt = os.path.join(work, "fs")
    big = os.path.join(work, "big")
    save_ckpt(big, 7)
    cons = os.path.join(work, "big_cons")
    assert cli(["convert", big, cons, "--to", "consolidated", "--no-progress"]).rc == 0
    for i in range(max(1, reps) * 9):
        leave = rng.randrange(0, 20) * 1024  # one step needs ~24 KiB of data plus its manifest
        which = ("save", "convert-export", "convert-import")[i % 3]
        with small_fs(mnt, 512) as mounted:
            if not mounted:
                row.add("tmpfs mount refused (needs root)", False)
                return row
            root = os.path.join(mnt, "ck")
            save_ckpt(root, 1, halves=False)
            before = fingerprint(os.path.join(root, commit_mod.step_dirname(1)))
            _fill(mnt, leave)
            if which == "save":
                def run(root=root) -> int:
                    try:
                        save_ckpt(root, 2, halves=True)
                    except (ElastorError, OSError) as e:
                        print(f"{type(e).__name__}: {e}", file=sys.stderr)
                        return 1
                    return 0
                o = forked(run, 60)
            elif which == "convert-export":
                o = cli(["convert", big, os.path.join(mnt, "export"), "--to", "consolidated", "--no-progress"])
            else:
                o = cli(["convert", cons, os.path.join(mnt, "import"), "--from", "consolidated", "--no-progress"])
            intact = fingerprint(os.path.join(root, commit_mod.step_dirname(1))) == before and loads_ok(root, 1)
            leftovers = [n for n in os.listdir(mnt) if ".tmp" in n] + \
                [n for n in os.listdir(root) if n.startswith(commit_mod.TMP_PREFIX)] + \
                ([n for n in os.listdir(os.path.join(mnt, "import")) if n.startswith(commit_mod.TMP_PREFIX)]
                 if os.path.isdir(os.path.join(mnt, "import")) else [])
            full = "No space left" in o.err or "Errno 28" in o.err
            detected = o.rc == 1 and full and not leftovers and not os.path.exists(os.path.join(mnt, "export"))
            row.add(f"{which} with {leave // 1024} KiB free (rc {o.rc}: {o.err.strip()[-160:]}; leftovers "
                    f"{leftovers})", detected, not intact, o.hang, o.traceback)
    return row


def run_eacces(work: str, rng: random.Random, reps: int) -> Row:
    from elastor_ds.errors import ElastorError
    row = Row()
    if os.getuid() != 0:
        row.add("needs root to drop to an unprivileged user", False)
        return row
    nobody = 65534
    base = os.path.join(work, "perm")
    os.makedirs(base)
    p = work
    while p not in ("/", tempfile.gettempdir()):  # let the unprivileged user reach the files
        os.chmod(p, os.stat(p).st_mode | 0o055)
        p = os.path.dirname(p)
    ro_root = os.path.join(base, "ro")
    save_ckpt(ro_root, 1)
    for dirpath, dirs, files in os.walk(ro_root):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    hidden = os.path.join(base, "hidden")
    save_ckpt(hidden, 1)
    for dirpath, dirs, files in os.walk(hidden):
        for f in files:
            if f.endswith(".safetensors"):
                os.chmod(os.path.join(dirpath, f), 0o600)
    for dirpath, dirs, files in os.walk(hidden):
        os.chmod(dirpath, 0o755)
    os.chmod(hidden, 0o755)
    for i in range(max(1, reps)):
        before = fingerprint(ro_root)

        def save_ro() -> int:
            try:
                save_ckpt(ro_root, 2)
            except (ElastorError, OSError) as e:
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                return 1
            return 0
        trials = [("save into a read-only root", lambda: forked(save_ro, 60, uid=nobody), 1),
                  ("verify unreadable data", lambda: cli(["verify", hidden], uid=nobody), 1),
                  ("convert unreadable data", lambda: cli(["convert", hidden, os.path.join(base, f"x{i}"), "--to",
                                                           "consolidated", "--no-progress"], uid=nobody), 1),
                  ("export into a read-only dir", lambda: cli(["convert", ro_root, os.path.join(ro_root, "out"),
                                                               "--to", "consolidated", "--no-progress"], uid=nobody), 1),
                  ("import into a read-only root", lambda: cli(["convert", ro_root, os.path.join(ro_root, "imp"),
                                                                "--to", "consolidated"], uid=nobody), 1)]
        for name, fn, want in trials:
            o = fn()
            denied = "Permission denied" in o.err or "EACCES" in o.err or "Errno 13" in o.err
            lost = fingerprint(ro_root) != before or not loads_ok(ro_root, 1)
            row.add(f"{name} (rc {o.rc}: {o.err.strip()[-160:]})", o.rc == want and denied, lost, o.hang,
                    o.traceback)
    return row


# ---------------------------------------------------------------------------------- main
CLASSES = ("cli-malformed", "ds-config", "trainer-flags", "path-escape", "malicious-pickle", "non-empty-destination",
           "corruption", "sigkill-save", "sigkill-job", "peers", "enospc", "eacces",
           # another local user or a forger (tests/faults/security_faults.py)
           "standby-handoff", "snapshot-server", "forged-table", "peer-sender",
           # data loss and careless users (tests/faults/trust_faults.py)
           "final-save", "snapshot-dir", "overlap-roots", "convert-into-ckpt", "non-regular", "run-flags")


def _security():
    import security_faults   # imports this module: loaded on first use
    return security_faults


def _trust():
    import trust_faults   # imports this module: loaded on first use
    return trust_faults


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=200, help="most SIGKILL trials over the one-process save, "
                    "re-save, import and export scenarios (every file-system call of each once when it allows)")
    ap.add_argument("--job-kills", type=int, default=120, help="SIGKILL trials of a whole 2-rank job")
    ap.add_argument("--corruptions", type=int, default=120)
    ap.add_argument("--malformed", type=int, default=1, help="repetitions of the malformed-input sets")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the other small classes")
    ap.add_argument("--classes", default=",".join(CLASSES))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--show-misses", type=int, default=5, help="misses listed per class")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.CRITICAL)
    work = args.workdir or tempfile.mkdtemp(prefix="elastor_faults_")
    rng = random.Random(args.seed)
    runners = {"cli-malformed": lambda w: run_cli_malformed(w, rng, args.malformed),
               "ds-config": lambda w: run_ds_config(w, rng, args.malformed),
               "trainer-flags": lambda w: run_trainer_flags(w, rng, args.malformed),
               "path-escape": lambda w: run_path_escape(w, rng, args.reps),
               "malicious-pickle": lambda w: run_malicious_pickle(w, rng, args.reps),
               "non-empty-destination": lambda w: run_non_empty_destination(w, rng, args.reps),
               "corruption": lambda w: run_corruption(w, rng, args.corruptions),
               "sigkill-save": lambda w: run_sigkill(w, rng, args.kills),
               "sigkill-job": lambda w: run_sigkill_world(w, rng, args.job_kills),
               "peers": lambda w: run_peers(w, rng, args.reps),
               "enospc": lambda w: run_enospc(w, rng, args.reps),
               "eacces": lambda w: run_eacces(w, rng, args.reps),
               "standby-handoff": lambda w: _security().run_standby_handoff(w, rng, args.reps),
               "snapshot-server": lambda w: _security().run_snapshot_server(w, rng, args.reps),
               "forged-table": lambda w: _security().run_forged_table(w, rng, args.reps),
               "peer-sender": lambda w: _security().run_peer_sender(w, rng, args.reps),
               **{name: (lambda w, name=name: _trust().RUNNERS[name](w, rng, args.reps))
                  for name in ("final-save", "snapshot-dir", "overlap-roots", "convert-into-ckpt", "non-regular",
                               "run-flags")}}
    rows: dict[str, Row] = {}
    t0 = time.time()
    for name in [c for c in args.classes.split(",") if c]:
        if name not in runners:
            print(f"unknown class {name!r}; choose from {', '.join(CLASSES)}", file=sys.stderr)
            return 2
        w = os.path.join(work, name)
        os.makedirs(w, exist_ok=True)
        t = time.time()
        rows[name] = runners[name](w)
        print(f"# {name}: {rows[name].trials} trials in {time.time() - t:.1f} s", file=sys.stderr)
    print(f"\nfault campaign, seed {args.seed}, {time.time() - t0:.0f} s\n")
    print("| class | trials | detected | data lost | hangs | tracebacks |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r.trials} | {r.detected} | {r.lost} | {r.hangs} | {r.tracebacks} |")
    for name, r in rows.items():
        for m in r.misses[:args.show_misses]:
            print(f"  miss [{name}] {m}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {k: v for k, v in r.__dict__.items()} for n, r in rows.items()}, f, indent=1)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    bad = any(r.detected < r.trials or r.lost or r.hangs or r.tracebacks for r in rows.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
