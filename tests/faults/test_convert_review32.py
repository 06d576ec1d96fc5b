"""Review 32 of the checkpoint CLI: imports that committed a step no reader accepts, a FIFO that
hung an import, a full disk that printed a traceback, Adam hyperparameters lost on export,
terminal escapes in messages, world-readable exports, temp names that collide in containers, a
concurrent --force import deleting another's step, leftovers of a killed import, verify missing a
block-CRC table that disagrees with its data. Real files, the CLI in subprocesses as a user runs
it; the oracles read the files directly (json, torch.load, os.stat), not through the code tested."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from cli_utils import assert_one_line_failure, elastor, tree_hash

INT64_MAX = 2 ** 63 - 1
TRACKER = "latest_checkpointed_iteration.txt"


def consolidated(path, step=None, n=4096) -> str:
    """A consolidated directory as a user hands one over (safetensors + metadata JSON)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file({"w": torch.arange(n, dtype=torch.float32), "v": torch.ones(3, 5)}, os.path.join(path, "model.safetensors"))
    if step is not None:
        with open(os.path.join(path, "elastor_metadata.json"), "w") as f:
            f.write('{"step": %d}' % step)
    return str(path)


def tiny_cfg():
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig
    return GPTSpecConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, vocab_size=50,
                         ffn_hidden_size=24, gated_linear_unit=True, make_vocab_size_divisible_by=4,
                         max_sequence_length=8)


def gpt_checkpoint(root: str, step: int = 6, hyper: list | None = None, adam: dict | None = None,
                   counters: dict | None = None) -> str:
    """An elastor checkpoint of a tiny megatron-core GPT with Adam moments, written as the DeepSpeed
    integration records its optimizer (``extra["optimizer"][i]["hyper"]``)."""
    from elastor_ds.checkpoint.convert import write_single_writer_checkpoint
    from elastor_ds.integrations.megatron.specs import gpt_tensor_specs
    cfg = tiny_cfg()
    g = torch.Generator().manual_seed(0)
    full = {}
    for s in gpt_tensor_specs(cfg):
        full[s.name] = torch.randn(s.shape, generator=g)
        full[f"optimizer.exp_avg.{s.name}"] = torch.randn(s.shape, generator=g)
        full[f"optimizer.exp_avg_sq.{s.name}"] = torch.rand(s.shape, generator=g)
    extra: dict = {}
    if hyper is not None:
        extra["optimizer"] = [{"hyper": h, "scalars": {"step": {"value": float(step), "tensor": True,
                                                               "dtype": "float32"}}} for h in hyper]
    if adam is not None:
        extra["adam"] = adam
    extra.update(counters or {})
    write_single_writer_checkpoint(root, step, sorted(full), {n: t.shape for n, t in full.items()},
                                   {n: "float32" for n in full}, full.__getitem__, extra=extra,
                                   model=cfg.to_json(), progress=False)
    return root


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    return gpt_checkpoint(str(tmp_path_factory.mktemp("gpt") / "el"))


@pytest.fixture(scope="module")
def meg_legacy(tmp_path_factory, gpt):
    out = str(tmp_path_factory.mktemp("meg") / "legacy")
    p = elastor("convert", gpt, out, "--to", "megatron", "--no-progress")
    assert p.returncode == 0, p.stderr
    return out


# ---------------------------------------------------------------------------------- 1: step bounds
def test_an_import_never_commits_a_step_above_int64_nor_moves_latest_to_it(tmp_path):
    """elastor_metadata.json with step 2**63: the import committed step_9223372036854775808, exit 0,
    and with --force moved the root's ``latest`` onto it; every reader then refused the root."""
    root = str(tmp_path / "root")
    assert elastor("convert", consolidated(tmp_path / "c7", 7), root, "--from", "consolidated",
                   "--no-progress").returncode == 0
    before = tree_hash(root)
    for step in (2 ** 63, 10 ** 30):
        src = consolidated(tmp_path / f"c{step}", step)
        line = assert_one_line_failure(elastor("convert", src, root, "--from", "consolidated", "--force",
                                               "--no-progress"), 1, "elastor_metadata.json", "2**63-1")
        assert str(step)[:20] in line
        assert tree_hash(root) == before
        assert open(os.path.join(root, "latest")).read().strip() == "step_000000007"
        new = str(tmp_path / f"new{step}")
        assert_one_line_failure(elastor("convert", src, new, "--from", "consolidated", "--no-progress"), 1, "2**63-1")
        assert not os.path.lexists(new)
    # the largest step a manifest holds is still imported, and read back by verify
    src = consolidated(tmp_path / "cmax", INT64_MAX)
    p = elastor("convert", src, root, "--from", "consolidated", "--force", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert open(os.path.join(root, "latest")).read().strip() == f"step_{INT64_MAX}"
    assert json.load(open(os.path.join(root, f"step_{INT64_MAX}", "manifest.json")))["step"] == INT64_MAX
    assert elastor("verify", root).returncode == 0


def test_a_megatron_iteration_above_int64_is_refused(tmp_path, meg_legacy):
    src = str(tmp_path / "meg")
    import shutil
    shutil.copytree(meg_legacy, src)
    it = next(n for n in os.listdir(src) if n.startswith("iter_"))
    os.rename(os.path.join(src, it), os.path.join(src, "iter_99999999999999999999999"))
    with open(os.path.join(src, TRACKER), "w") as f:
        f.write("99999999999999999999999")
    dst = str(tmp_path / "out")
    assert_one_line_failure(elastor("convert", src, dst, "--from", "megatron", "--no-progress"), 1, TRACKER, "2**63-1")
    assert not os.path.lexists(dst)
    # the iteration dir given directly: its name is the step
    assert_one_line_failure(elastor("convert", os.path.join(src, "iter_99999999999999999999999"), dst, "--from",
                                    "megatron", "--no-progress"), 1, "2**63-1")
    assert not os.path.lexists(dst)


def test_a_commit_with_check_parses_its_manifest_back_before_the_rename(tmp_path):
    """Imports commit with ``check``: a manifest the readers refuse (here a tensor name with a
    control character, which the schema refuses) is never renamed into place."""
    from elastor_ds.checkpoint import commit as commit_mod
    from elastor_ds.checkpoint.planning.manifest import Manifest
    from elastor_ds.errors import CheckpointError
    root = str(tmp_path / "root")
    c = commit_mod.StepCommit.create(root, 4, latest=commit_mod.LatestPolicy.FORWARD, check=True)
    with pytest.raises(CheckpointError, match="refused by every reader"):
        with c:
            c.finalize(Manifest(step=4, tensors={}, files={}, layout=None, model=None, extra={}, world_size=1,
                                created_unix=1.0, rank_state_files={0: "rank_state/\x1b[31m.json"}))
    assert os.listdir(root) == []


# ---------------------------------------------------------------------------------- 2: DCP storage files
@pytest.fixture(scope="module")
def meg_dist(tmp_path_factory, gpt):
    out = str(tmp_path_factory.mktemp("megd") / "td")
    p = elastor("convert", gpt, out, "--to", "megatron", "--megatron-format", "torch_dist", "--no-progress")
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.parametrize("how", ["fifo", "link"])
def test_a_torch_dist_storage_file_that_is_a_fifo_or_a_link_is_refused_not_waited_on(tmp_path, meg_dist, how):
    """A ``__0_0.distcp`` that is a FIFO blocked ``--from megatron`` in open() for ever; one that is a
    link was read through. Each is refused in one line, nothing written."""
    import shutil
    src = str(tmp_path / "td")
    shutil.copytree(meg_dist, src)
    it = os.path.join(src, next(n for n in os.listdir(src) if n.startswith("iter_")))
    storage = sorted(n for n in os.listdir(it) if n.endswith(".distcp"))
    assert storage
    victim = os.path.join(it, storage[0])
    if how == "fifo":
        os.unlink(victim)
        os.mkfifo(victim)
    else:   # a link inside the checkpoint (one out of it is refused by name already)
        os.rename(victim, os.path.join(it, "moved.bin"))
        os.symlink("moved.bin", victim)
    dst = str(tmp_path / "out")
    p = elastor("convert", src, dst, "--from", "megatron", "--no-progress", timeout=90)
    assert_one_line_failure(p, 1, storage[0], "FIFO" if how == "fifo" else "symbolic link")
    assert not os.path.lexists(dst)
    assert os.listdir(tmp_path) == ["td"]


def test_a_dcp_failure_is_unwrapped_stops_and_elastor_errors_as_themselves():
    """torch's CheckpointException maps ranks to (exception, traceback) pairs: the inner error was
    never found, so a stop (SIGTERM's exception, Ctrl-C) became "reading ... failed", exit 1."""
    from torch.distributed.checkpoint.api import CheckpointException

    from elastor_ds.errors import CheckpointError, UnsafeCheckpointError
    from elastor_ds.integrations.safe_load import raise_dcp_failure
    for inner in (KeyboardInterrupt(), SystemExit(143), UnsafeCheckpointError("x is a FIFO")):
        with pytest.raises(type(inner)) as ei:
            raise_dcp_failure(CheckpointException("read", {0: (inner, None)}), "reading k")
        assert ei.value is inner
    with pytest.raises(CheckpointError, match=r"reading k failed \(ValueError: bad bytes\)") as ei:
        raise_dcp_failure(CheckpointException("read", {0: (ValueError("bad bytes\nmore"), None)}), "reading k")
    assert type(ei.value) is CheckpointError


# ---------------------------------------------------------------------------------- 3: torch_dist full disk
def test_a_full_disk_during_a_torch_dist_export_is_one_line_and_leaves_nothing(tmp_path, gpt):
    """EFBIG (a file-size limit, as a full disk would fail) inside megatron's torch_dist writer: torch's
    CheckpointException (a BaseException) escaped every handler and printed a traceback."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / "td")
    p = elastor("convert", gpt, dst, "--to", "megatron", "--megatron-format", "torch_dist", "--no-progress",
                preexec_fn=limit)
    assert_one_line_failure(p, 1, "File too large", dst)
    assert "CheckpointException" not in p.stderr and "RuntimeError" not in p.stderr, p.stderr
    assert os.listdir(out) == []


# ---------------------------------------------------------------------------------- 4: Adam hyperparameters
def _written_adam(meg: str) -> set:
    out = set()
    for d, _, files in os.walk(meg):
        for f in files:
            if f == "model_optim_rng.pt":
                sd = torch.load(os.path.join(d, f), weights_only=False)
                for g in sd["optimizer"]["optimizer"]["param_groups"] if "optimizer" in sd["optimizer"] \
                        else sd["optimizer"]["param_groups"]:
                    out.add((tuple(g["betas"]), g["eps"], g["amsgrad"]))
    return out


def test_megatron_export_writes_the_adam_hyperparameters_the_deepspeed_integration_records(tmp_path):
    """extra.optimizer[*].hyper records betas (0.9, 0.95), eps 1e-6: the export wrote Megatron-LM's
    defaults (0.9, 0.999)/1e-8 and warned the checkpoint "does not record" them."""
    src = gpt_checkpoint(str(tmp_path / "el"), hyper=[{"betas": [0.9, 0.95], "eps": 1e-6, "amsgrad": False,
                                                       "lr": 1e-3}] * 2)
    meg = str(tmp_path / "meg")
    p = elastor("convert", src, meg, "--to", "megatron", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "does not record" not in p.stderr, p.stderr
    assert _written_adam(meg) == {((0.9, 0.95), 1e-6, False)}
    # groups that disagree: refused, nothing written (Megatron's optimizer keeps one set)
    src2 = gpt_checkpoint(str(tmp_path / "el2"), hyper=[{"betas": [0.9, 0.95], "eps": 1e-6},
                                                        {"betas": [0.9, 0.999], "eps": 1e-6}])
    meg2 = str(tmp_path / "meg2")
    assert_one_line_failure(elastor("convert", src2, meg2, "--to", "megatron", "--no-progress"), 1,
                            "different Adam hyperparameters")
    assert not os.path.lexists(meg2)
    # nothing recorded: Megatron-LM's defaults, with the warning
    src3 = gpt_checkpoint(str(tmp_path / "el3"))
    meg3 = str(tmp_path / "meg3")
    p = elastor("convert", src3, meg3, "--to", "megatron", "--no-progress")
    assert p.returncode == 0 and "does not record" in p.stderr, p.stderr
    assert _written_adam(meg3) == {((0.9, 0.999), 1e-8, False)}


# ---------------------------------------------------------------------------------- 5: terminal escapes
ESC = "/tmp/\x1b[31mRED\x1b[0m\x1b]0;pwned-title\x07/x"


def test_a_link_target_with_terminal_escapes_is_printed_escaped(tmp_path):
    """A symlink in a checkpoint whose target holds an OSC title sequence and colours: verify,
    inspect and convert printed it raw in their "resolves to <path>" error."""
    from safetensors.torch import save_file
    root = str(tmp_path / "ck")
    cons = str(tmp_path / "cons")
    os.makedirs(cons)
    save_file({"w": torch.ones(8)}, os.path.join(cons, "model.safetensors"))
    assert elastor("convert", cons, root, "--from", "consolidated", "--no-progress").returncode == 0
    step = os.path.join(root, "step_000000000")
    data = next(n for n in os.listdir(step) if n.endswith(".safetensors"))
    os.unlink(os.path.join(step, data))
    os.symlink(ESC, os.path.join(step, data))
    for argv, code in ((("verify", root), 1), (("inspect", root), 1),
                       (("convert", root, str(tmp_path / "out"), "--to", "consolidated", "--no-progress"), 1)):
        p = elastor(*argv)
        assert p.returncode == code, (argv, p.stderr)
        assert not any(c in p.stderr + p.stdout for c in "\x1b\x07"), (argv, p.stderr)
        assert "\\x1b]0;pwned-title\\x07" in p.stderr and "Traceback" not in p.stderr, (argv, p.stderr)


def test_the_cli_error_line_escapes_non_printable_characters(tmp_path):
    """Any one-line error (here a usage error naming a path the user gave) is printed escaped."""
    src = consolidated(tmp_path / "c", 1)
    for argv in (("convert", src, str(tmp_path / "no\x1b]0;t\x07dir" / "dst"), "--from", "consolidated"),
                 ("convert", str(tmp_path / "gone\x1b[2J"), str(tmp_path / "d"), "--from", "consolidated"),
                 ("verify", str(tmp_path / "gone\x1b[2J"))):
        p = elastor(*argv, "--no-progress") if argv[0] == "convert" else elastor(*argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert "\x1b" not in p.stderr and "\x07" not in p.stderr and "\\x1b" in p.stderr, (argv, p.stderr)


# ---------------------------------------------------------------------------------- 6: export modes
_KILLED_BEFORE_FINALIZE = (
    "import os, sys\n"
    "from elastor_ds.checkpoint import commit\n"
    "commit.DirCommit.finalize = lambda self: os._exit(137)   # a kill -9 once every file is written\n"
    "from elastor_ds.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.parametrize("to", ["consolidated", "megatron"])
def test_an_export_is_private_while_written_and_gets_its_mode_at_the_end(tmp_path, gpt, to):
    """The temporary copy of an export was 0755 (files 0644) while written, and a killed export left
    it world-readable for good; now the temp dir is 0700 and the final dir gets the mode a mkdir
    under the user's umask gives (or the empty destination's own)."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_FINALIZE, "convert", gpt, str(out / "dst"), "--to", to,
                        "--no-progress"], env=env, capture_output=True, text=True, timeout=180,
                       preexec_fn=lambda: os.umask(0o022))
    assert p.returncode == 137, p.stderr
    left = os.listdir(out)
    assert len(left) == 1 and left[0].startswith(".dst.tmp-"), left
    tmp = out / left[0]
    assert any(f for _, _, f in os.walk(tmp)), "the export wrote its files"
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o700
    # a whole export: the final directory's mode is the umask's (022 -> 0755, 027 -> 0750)
    for mask, want in ((0o022, 0o755), (0o027, 0o750)):
        dst = str(out / f"final{mask:o}")
        p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "convert", gpt, dst, "--to", to, "--no-progress"],
                           env=env, capture_output=True, text=True, timeout=180, preexec_fn=lambda m=mask: os.umask(m))
        assert p.returncode == 0, p.stderr
        assert stat.S_IMODE(os.stat(dst).st_mode) == want, (oct(os.stat(dst).st_mode), mask)


# ---------------------------------------------------------------------------------- 7: temp dir nonce
def universal(tmp_path, step: int, n: int = 4) -> str:
    """A DeepSpeed universal checkpoint, exported from an elastor one the DeepSpeed integration's way."""
    from elastor_ds.checkpoint.convert import write_single_writer_checkpoint
    el = str(tmp_path / f"el_u{step}")
    t = {"model.w": torch.arange(n * n, dtype=torch.float32).reshape(n, n), "optimizer.exp_avg.w": torch.ones(n, n),
         "optimizer.exp_avg_sq.w": torch.ones(n, n)}
    write_single_writer_checkpoint(el, step, sorted(t), {k: v.shape for k, v in t.items()},
                                   {k: "float32" for k in t}, t.__getitem__, extra={"global_steps": step},
                                   progress=False)
    out = str(tmp_path / f"uni{step}")
    p = elastor("convert", el, out, "--to", "deepspeed-universal", "--no-progress")
    assert p.returncode == 0, p.stderr
    return out


def _pid_one_works() -> bool:
    try:
        return subprocess.run(["unshare", "-p", "-f", sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, timeout=30).stdout.strip() == "1"
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("fmt", ["consolidated", "deepspeed-universal"])
def test_an_import_in_a_container_is_not_blocked_by_a_killed_imports_leftover(tmp_path, fmt):
    """Imports named their temp dir ``.tmp_step_<N>_import<pid>``: in a container every run is pid 1,
    so the leftover of one killed import made every later import of that step fail with a bare
    "FileExistsError: File exists". (``unshare -p`` gives the CLI pid 1, as a container does.)"""
    if not _pid_one_works():
        pytest.skip("unshare -p (a pid namespace) is not allowed here")
    if fmt == "consolidated":
        src = consolidated(tmp_path / "src", 9)
    else:
        src = universal(tmp_path, 9)
    root = str(tmp_path / "root")
    assert elastor("convert", consolidated(tmp_path / "c7", 7), root, "--from", "consolidated",
                   "--no-progress").returncode == 0
    leftover = os.path.join(root, ".tmp_step_000000009_import1")
    os.mkdir(leftover)   # what a kill -9'd import (pid 1) leaves
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run(["unshare", "-p", "-f", sys.executable, "-m", "elastor_ds.cli", "convert", src, root, "--from",
                        fmt, "--force", "--no-progress"], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    assert json.load(open(os.path.join(root, "step_000000009", "manifest.json")))["step"] == 9
    assert os.path.isdir(leftover) and os.listdir(leftover) == []   # not ours to touch


# ---------------------------------------------------------------------------------- 8: DeepSpeed import cleanup
def test_a_failed_deepspeed_import_removes_the_destination_it_created(tmp_path):
    """A --from deepspeed-universal import that failed while writing (a file-size limit here, as a
    full disk) left the empty destination directory it had created (the other importers remove it)."""
    import resource
    src = universal(tmp_path, 5, n=128)   # 64 KiB tensors

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
    dst = str(tmp_path / "out")
    p = elastor("convert", src, dst, "--from", "deepspeed-universal", "--no-progress", preexec_fn=limit)
    assert p.returncode == 1 and "File too large" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not os.path.lexists(dst)
    # an existing empty destination is the user's: it stays
    os.mkdir(dst)
    p = elastor("convert", src, dst, "--from", "deepspeed-universal", "--no-progress", preexec_fn=limit)
    assert p.returncode == 1, p.stderr
    assert os.path.isdir(dst) and os.listdir(dst) == []


# ---------------------------------------------------------------------------------- 9: concurrent --force imports
_IMPORT_A_WHILE_B_COMMITS = (
    "import subprocess, sys\n"
    "from elastor_ds.checkpoint import convert\n"
    "orig = convert._stream_tensors\n"
    "def slow(*a, **k):   # while import A writes, import B (another user's process) runs to its end\n"
    "    p = subprocess.run([sys.executable, '-m', 'elastor_ds.cli', 'convert', sys.argv[1], sys.argv[3], '--from',\n"
    "                        'consolidated', '--force', '--no-progress'], capture_output=True, text=True)\n"
    "    print('B', p.returncode, flush=True)\n"
    "    return orig(*a, **k)\n"
    "convert._stream_tensors = slow\n"
    "from elastor_ds.cli import main\n"
    "sys.exit(main(['convert', sys.argv[2], sys.argv[3], '--from', 'consolidated', '--force', '--no-progress']))\n")


def test_two_concurrent_force_imports_of_one_step_never_delete_the_first(tmp_path):
    """Each --force import checked "step absent" before writing; the one that committed second
    exchanged the first one's committed step out and deleted it. Now the second fails in one line,
    exit 2, and the first one's step stays."""
    from safetensors.torch import save_file
    root = str(tmp_path / "root")
    assert elastor("convert", consolidated(tmp_path / "c3", 3), root, "--from", "consolidated",
                   "--no-progress").returncode == 0
    b = tmp_path / "b"
    b.mkdir()
    save_file({"only_b": torch.zeros(4)}, str(b / "model.safetensors"))
    (b / "elastor_metadata.json").write_text('{"step": 8}')
    a = consolidated(tmp_path / "a", 8)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _IMPORT_A_WHILE_B_COMMITS, str(b), a, root], env=env,
                       capture_output=True, text=True, timeout=300)
    assert "B 0" in p.stdout, (p.stdout, p.stderr)
    assert_one_line_failure(p, 2, "step_000000008", "never replaces")
    man = json.load(open(os.path.join(root, "step_000000008", "manifest.json")))
    assert sorted(man["tensors"]) == ["only_b"]   # B's step, whole
    assert open(os.path.join(root, "latest")).read().strip() == "step_000000008"
    assert sorted(os.listdir(root)) == ["latest", "step_000000003", "step_000000008"]


# ---------------------------------------------------------------------------------- 10: a killed import's leftovers
_IMPORT_KILLED_BEFORE_COMMIT = (
    "import os, sys\n"
    "from elastor_ds.checkpoint import commit\n"
    "commit.StepCommit.finalize = lambda self, *a, **k: os._exit(137)   # kill -9 just before the commit\n"
    "from elastor_ds.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.parametrize("fmt", ["consolidated", "deepspeed-universal"])
def test_a_rerun_after_a_killed_import_names_its_leftovers(tmp_path, fmt):
    """kill -9 of an import into a new DST left only ``.tmp_step_*_import*`` there; every rerun was
    refused ("not empty" / "not an elastor checkpoint root") without saying what they are."""
    src = consolidated(tmp_path / "c", 7) if fmt == "consolidated" else universal(tmp_path, 7)
    dst = str(tmp_path / "dst")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _IMPORT_KILLED_BEFORE_COMMIT, "convert", src, dst, "--from", fmt,
                        "--no-progress"], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 137, p.stderr
    left = sorted(os.listdir(dst))
    assert left and all(n.startswith(".tmp_step_000000007_import") for n in left), left
    for force in ([], ["--force"]):
        line = assert_one_line_failure(elastor("convert", src, dst, "--from", fmt, "--no-progress", *force), 2,
                                       "interrupted import", "delete")
        assert all(n in line for n in left), line
        assert sorted(os.listdir(dst)) == left
    import shutil
    for n in left:
        shutil.rmtree(os.path.join(dst, n))
    assert elastor("convert", src, dst, "--from", fmt, "--no-progress").returncode == 0


# ---------------------------------------------------------------------------------- 11: verify checks block tables
@pytest.mark.parametrize("block", [1, 3])
def test_verify_checks_each_chunks_blocks_against_its_crc_table(tmp_path, block):
    """A block-CRC table that disagrees with its data, the manifest's file CRC of the table made to
    match (a writer bug or an edit): verify said "OK ... checksums match" while reads failed (every
    read for the last block's entry, the chunk's CRC; reads of a part for a middle one)."""
    import shutil
    import zlib
    from elastor_ds.checkpoint import CheckpointEngine, TensorShard
    from elastor_ds.layout.region import Region
    root = str(tmp_path / "ck")
    shape = (64, 64)   # 16 KiB: four 4 KiB blocks
    shards = [TensorShard(n, shape, Region.full(shape), torch.full(shape, float(i))) for i, n in enumerate("ab")]
    step = CheckpointEngine(root, async_save=False).save(3, shards).committed_dir
    p = elastor("verify", root)
    assert p.returncode == 0 and "checksums match" in p.stdout, p.stderr
    bad = str(tmp_path / "bad")
    shutil.copytree(root, bad)
    sd = os.path.join(bad, os.path.basename(step))
    man_path = os.path.join(sd, "manifest.json")
    man = json.load(open(man_path))
    ch = man["tensors"]["b"]["chunks"][0]
    table = ch["blocks"]["table"]
    raw = bytearray(open(os.path.join(sd, table), "rb").read())
    entry = ch["blocks"]["index"] + block   # a block of tensor b
    raw[4 * entry] ^= 0xFF
    open(os.path.join(sd, table), "wb").write(raw)
    man["files"][table]["crc32"] = f"{zlib.crc32(raw):08x}"
    body = {k: v for k, v in man.items() if k != "checksum"}
    man["checksum"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                                            allow_nan=False).encode()).hexdigest()
    open(man_path, "w").write(json.dumps(man))
    p = elastor("verify", bad)
    assert p.returncode == 1 and "checksums match" not in p.stdout, (p.stdout, p.stderr)
    corrupt = [x for x in p.stderr.splitlines() if x.startswith("CORRUPT:")]
    assert len(corrupt) == 1 and "'b'" in corrupt[0] and f"block at byte {ch['offset'] + block * 4096}" in corrupt[0], \
        p.stderr
    if block == 3:   # the reader agrees: the tensor cannot be read back
        p = elastor("convert", bad, str(tmp_path / "out"), "--to", "consolidated", "--no-progress")
        assert p.returncode == 1 and "CRC32" in p.stderr, p.stderr
    # --no-checksums skips it (as it skips the file CRCs)
    assert elastor("verify", bad, "--no-checksums").returncode == 0


# ---------------------------------------------------------------------------------- 12: megatron flags
def test_torch_dist_refuses_a_pipeline_size_and_megatron_lm_flag_names_work(tmp_path, gpt):
    """--megatron-format torch_dist ignored --pipeline-model-parallel-size (7 on a 2-layer model,
    exit 0); Megatron-LM's own names (--ckpt-format, 'torch' for legacy) were unknown."""
    dst = str(tmp_path / "td")
    assert_one_line_failure(elastor("convert", gpt, dst, "--to", "megatron", "--megatron-format", "torch_dist",
                                    "--pipeline-model-parallel-size", "2", "--no-progress"), 2,
                            "--pipeline-model-parallel-size")
    assert not os.path.lexists(dst)
    for argv, want in ((("--ckpt-format", "torch_dist"), "metadata.json"),
                       (("--ckpt-format", "torch"), "mp_rank_00"), (("--megatron-format", "torch"), "mp_rank_00")):
        out = str(tmp_path / ("o" + "_".join(argv)))
        p = elastor("convert", gpt, out, "--to", "megatron", *argv, "--no-progress")
        assert p.returncode == 0, (argv, p.stderr)
        assert want in os.listdir(os.path.join(out, "iter_0000006")), (argv, os.listdir(os.path.join(out, "iter_0000006")))
    # still refused where it does not apply
    assert_one_line_failure(elastor("convert", gpt, str(tmp_path / "c"), "--to", "consolidated", "--ckpt-format",
                                    "torch", "--no-progress"), 2, "--megatron-format")


# ---------------------------------------------------------------------------------- 13: malformed inputs
def _native_ds(tmp_path, name: str, edit=None) -> str:
    """A minimal native DeepSpeed ZeRO checkpoint tag dir (one parameter ``w`` of 4x4, one group),
    as DeepSpeed's engine lays it out; ``edit(mp_sd, zero_sd)`` breaks it."""
    from deepspeed.utils.tensor_fragment import fragment_address
    tag = tmp_path / name / "global_step3"
    tag.mkdir(parents=True)
    flat = torch.arange(16, dtype=torch.float32)
    mp = {"module": {"w": flat.reshape(4, 4).clone()}, "param_shapes": [{"w": torch.Size([4, 4])}],
          "global_steps": 3, "global_samples": 12, "skipped_steps": 0, "optimizer": None,
          "ds_config": {"train_batch_size": 4, "zero_optimization": {"stage": 1}}}
    zero = {"optimizer_state_dict": {
        "base_optimizer_state": {"state": {0: {"exp_avg": flat * 2, "exp_avg_sq": flat * 3, "step": torch.tensor(3.0)}},
                                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-6, "params": [0]}]},
        "single_partition_of_fp32_groups": [flat.clone()],
        "param_slice_mappings": [{"w": fragment_address(numel=16, start=0)}]}}
    if edit is not None:
        edit(mp, zero)
    torch.save(mp, str(tag / "mp_rank_00_model_states.pt"))
    torch.save(zero, str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    return str(tag)


def _frag(numel: int, start: int):
    from deepspeed.utils.tensor_fragment import fragment_address
    return fragment_address(numel=numel, start=start)


@pytest.mark.parametrize("case,words", [
    ("bigfrag", ["fragment", "partition of 16"]),
    ("negfrag", ["fragment", "start -5"]),
    ("badgroup", ["2 fp32 partitions"]),
    ("steps", ["global_steps", "'x'"]),
    ("negstep", ["global_steps", "-3"]),
    ("samples", ["global_samples"]),
])
def test_a_malformed_native_deepspeed_checkpoint_is_named_not_unexpected(tmp_path, case, words):
    """Malformed values ended as "unexpected ValueError/IndexError ... (rerun with -v)"; each is now
    a one-line error naming the file and the field, exit 1, nothing written."""
    good = _native_ds(tmp_path, "good")
    p = elastor("convert", good, str(tmp_path / "good_out"), "--from", "deepspeed", "--no-progress")
    assert p.returncode == 0, p.stderr   # the crafted layout is DeepSpeed's: it imports

    def edit(mp, zero):
        osd = zero["optimizer_state_dict"]
        if case == "bigfrag":
            osd["param_slice_mappings"][0]["w"] = _frag(10 ** 6, 0)
        elif case == "negfrag":
            osd["param_slice_mappings"][0]["w"] = _frag(16, -5)
        elif case == "badgroup":
            osd["single_partition_of_fp32_groups"].append(torch.zeros(3))
        elif case == "steps":
            mp["global_steps"] = "x"
        elif case == "negstep":
            mp["global_steps"] = -3
        elif case == "samples":
            mp["global_samples"] = 1.5
    src = _native_ds(tmp_path, case, edit)
    dst = str(tmp_path / "out")
    p = elastor("convert", src, dst, "--from", "deepspeed", "--no-progress")
    line = assert_one_line_failure(p, 1, ".pt", *words)
    assert "unexpected" not in line, line
    assert not os.path.lexists(dst)


@pytest.mark.parametrize("case,words", [
    ("dictnoparam", ["fp32.pt", "without 'param'"]),
    ("string", ["fp32.pt", "str", "expected a tensor"]),
    ("stepstr", ["step.pt", "'abc'"]),
    ("steptensor", ["step.pt", "Adam's step"]),
])
def test_a_malformed_universal_checkpoint_is_named_not_unexpected(tmp_path, case, words):
    src = universal(tmp_path, 7)
    zdir = os.path.join(src, "global_step7", "zero")
    (param,) = [n for n in os.listdir(zdir) if os.path.isdir(os.path.join(zdir, n))]
    z = os.path.join(zdir, param)
    if case == "dictnoparam":
        torch.save({"x": 1}, os.path.join(z, "fp32.pt"))
    elif case == "string":
        torch.save("hello", os.path.join(z, "fp32.pt"))
    elif case == "stepstr":
        torch.save("abc", os.path.join(z, "step.pt"))
    else:
        torch.save(torch.zeros(3), os.path.join(z, "step.pt"))
    dst = str(tmp_path / "out")
    line = assert_one_line_failure(elastor("convert", src, dst, "--from", "deepspeed-universal", "--no-progress"),
                                   1, *words)
    assert "unexpected" not in line, line
    assert not os.path.lexists(dst)


def test_a_legacy_megatron_import_with_a_config_that_does_not_match_names_the_tensor(tmp_path, meg_legacy):
    """--model-config with hidden_size 32 for a hidden-16 checkpoint: "unexpected RuntimeError: The
    size of tensor a (32) must match the size of tensor b (16) ..." half way through the import."""
    cfg = tiny_cfg().to_json()
    cfg["hidden_size"] = 32
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    dst = str(tmp_path / "out")
    line = assert_one_line_failure(elastor("convert", meg_legacy, dst, "--from", "megatron", "--model-config", str(path),
                                           "--no-progress"), 1, "model_optim_rng.pt", "--model-config", "(")
    assert "unexpected" not in line and "does not describe" in line, line
    assert not os.path.lexists(dst)
    # the right config (the checkpoint's own) imports
    assert elastor("convert", meg_legacy, dst, "--from", "megatron", "--no-progress").returncode == 0


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_megatron_export_says_its_notes_on_stderr_and_only_its_result_on_stdout(tmp_path, gpt, fmt):
    """Review of the thirty-second session: the Megatron paths printed their notes ("weights only;
    start Megatron with ...") to stdout, between a script's lines reading the result path."""
    out = str(tmp_path / fmt)
    p = elastor("convert", gpt, out, "--to", "megatron", "--megatron-format", fmt, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"wrote {out}/iter_0000006"], p.stdout
    note = ("Megatron-LM's non-distributed optimizers load" if fmt == "legacy"
            else "start Megatron with --no-load-optim --no-load-rng")
    assert note in p.stderr, p.stderr


def _on_a_terminal(*argv: str) -> tuple[int, str]:
    """``elastor ARGV`` with its stderr on a pseudo-terminal (tqdm draws bars only there): exit code, stderr."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))   # 0 columns: tqdm draws nothing
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "elastor_ds.cli", *argv], env=env, stdout=subprocess.DEVNULL,
                         stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            k = os.read(master, 65536)
        except OSError:   # EIO: the child closed the terminal
            break
        if not k:
            break
        out += k
    os.close(master)
    return p.wait(timeout=180), out.decode("utf-8", "replace")


@pytest.mark.parametrize("to", ["deepspeed-universal", "megatron"])
def test_the_exports_draw_a_progress_bar_on_a_terminal_and_none_with_no_progress(tmp_path, gpt, to):
    """Review of the thirty-second session: ``--to deepspeed-universal`` and ``--to megatron`` drew
    no progress bar (the consolidated export and the imports did)."""
    src = gpt
    if to == "deepspeed-universal":   # a checkpoint of the DeepSpeed integration's names
        from elastor_ds.checkpoint.convert import write_single_writer_checkpoint
        src = str(tmp_path / "el")
        t = {"model.w": torch.ones(64, 64), "optimizer.exp_avg.w": torch.ones(64, 64),
             "optimizer.exp_avg_sq.w": torch.ones(64, 64)}
        write_single_writer_checkpoint(src, 3, sorted(t), {k: v.shape for k, v in t.items()},
                                       {k: "float32" for k in t}, t.__getitem__, extra={"global_steps": 3},
                                       progress=False)
    rc, err = _on_a_terminal("convert", src, str(tmp_path / "bar"), "--to", to)
    assert rc == 0 and "100%|" in err, err[-2000:]
    rc, err = _on_a_terminal("convert", src, str(tmp_path / "quiet"), "--to", to, "--no-progress")
    assert rc == 0 and "100%|" not in err and "%|" not in err, err[-2000:]


def test_a_deepspeed_import_draws_a_progress_bar_on_a_terminal_and_none_with_no_progress(tmp_path):
    """The third direction without a bar (review of the thirty-second session): ``--from deepspeed``
    and ``--from deepspeed-universal`` read every file of the checkpoint with no sign of progress."""
    src = universal(tmp_path, 5)
    rc, err = _on_a_terminal("convert", src, str(tmp_path / "bar"), "--from", "deepspeed-universal")
    assert rc == 0 and "read: " in err and "B/s]" in err, err[-2000:]
    rc, err = _on_a_terminal("convert", src, str(tmp_path / "quiet"), "--from", "deepspeed-universal", "--no-progress")
    assert rc == 0 and "read: " not in err, err[-2000:]


def test_a_torch_dist_export_carries_what_megatrons_loader_needs_to_resume(tmp_path):
    """The torch_dist export's common state was empty: stock Megatron-LM, started as the export
    advised (--no-load-optim --no-load-rng), printed "unable to load iteration from checkpoint" and
    exited 0 without training (a reviewer's run against Megatron-LM core_v0.16.1). It now holds the
    iteration, the checkpoint version and args with the sample counters, read back here by
    megatron-core's own loader of the common state; an import takes the counters back."""
    from megatron.core import dist_checkpointing
    src = gpt_checkpoint(str(tmp_path / "el"), step=6, counters={
        "consumed_train_samples": 48, "skipped_train_samples": 1, "consumed_valid_samples": 8,
        "num_floating_point_operations_so_far": 1.5e9})
    out = str(tmp_path / "td")
    p = elastor("convert", src, out, "--to", "megatron", "--megatron-format", "torch_dist", "--no-progress")
    assert p.returncode == 0, p.stderr
    common = dist_checkpointing.load_common_state_dict(os.path.join(out, "iter_0000006"))
    assert common["iteration"] == 6 and common["checkpoint_version"] == 3.0, common
    a = common["args"]
    assert (a.num_layers, a.hidden_size, a.num_attention_heads) == (tiny_cfg().num_layers, tiny_cfg().hidden_size,
                                                                    tiny_cfg().num_attention_heads)
    assert (a.consumed_train_samples, a.skipped_train_samples, a.consumed_valid_samples) == (48, 1, 8)
    assert common["num_floating_point_operations_so_far"] == 1.5e9
    back = str(tmp_path / "back")
    p = elastor("convert", out, back, "--from", "megatron", "--no-progress")
    assert p.returncode == 0, p.stderr
    man = json.loads(open(os.path.join(back, "step_000000006", "manifest.json")).read())
    assert man["extra"]["consumed_train_samples"] == 48 and man["extra"]["consumed_valid_samples"] == 8
