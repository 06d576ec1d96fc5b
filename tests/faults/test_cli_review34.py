"""Review 34 of the command line: the demo's --out emptied any folder it was given; a plain
``pip install`` (no deepspeed, no megatron-core) ended two exports in "unexpected
ModuleNotFoundError"; a closed stdout or stderr turned a success into exit 1; plan errors and the
result lines printed paths raw; help and docs that said what the code does not; the synthetic
checkpoint demo's tracebacks. Each test here failed before its fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cli_utils import assert_one_line_failure, elastor, tree_hash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
ESC = "\x1b[31m"   # a terminal escape in a name: must come out as \x1b, never raw


def small_checkpoint(root: str, step: int = 5, extra: dict | None = None) -> str:
    """An elastor checkpoint as the DeepSpeed integration names its tensors (model.*, optimizer.*)."""
    from elastor_ds.checkpoint.convert import write_single_writer_checkpoint
    t = {"model.w": torch.arange(16, dtype=torch.float32).reshape(4, 4), "optimizer.exp_avg.w": torch.ones(4, 4),
         "optimizer.exp_avg_sq.w": torch.ones(4, 4)}
    write_single_writer_checkpoint(root, step, sorted(t), {k: v.shape for k, v in t.items()},
                                   {k: "float32" for k in t}, t.__getitem__,
                                   extra={"global_steps": step, **(extra or {})}, progress=False)
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(str(tmp_path_factory.mktemp("ck") / "el"))


# ---------------------------------------------------------------------------------- 1: demo --out
def _demo_main(monkeypatch, out: str) -> int:
    """examples/megatron_gpt/elastic_demo.py's main() with --out ``out``, its launch stubbed out
    (no training runs): the exit code, or "launched" once it got as far as starting the job."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples", "megatron_gpt"))
    import elastic_demo

    class Launched(Exception):
        pass

    def launch(*a, **k):
        raise Launched()
    monkeypatch.setattr(elastic_demo.subprocess, "Popen", launch)
    monkeypatch.setattr(sys, "argv", ["elastic_demo.py", "--out", out])
    try:
        return elastic_demo.main()
    except Launched:
        return "launched"


def test_demo_out_never_empties_a_folder_it_did_not_write(tmp_path, monkeypatch, capsys):
    """``--out DIR`` ran shutil.rmtree(DIR): whatever the folder held was gone without a word."""
    victim = tmp_path / "mine"
    (victim / "sub").mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    (victim / "sub" / "ckpt").write_text("mine too")
    before = tree_hash(str(victim))
    assert _demo_main(monkeypatch, str(victim)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(victim) in err and "not empty" in err, err
    assert tree_hash(str(victim)) == before and sorted(os.listdir(victim)) == ["precious.txt", "sub"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert _demo_main(monkeypatch, str(a_file)) == 2
    assert "not a directory" in capsys.readouterr().err and a_file.read_text() == "x"


def test_demo_out_rerun_replaces_only_the_demos_own_outputs(tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert _demo_main(monkeypatch, str(out)) == "launched"   # a new folder: made, marked
    import elastic_demo
    assert os.path.isfile(out / elastic_demo.OUT_MARKER)
    (out / "ckpt" / "step_1").mkdir(parents=True)
    (out / "events.jsonl").write_text("{}\n")
    (out / "overhead_abc").mkdir()
    (out / "notes.txt").write_text("the user's")          # added later by the user: kept
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("not the demo's")
    os.symlink(elsewhere, out / "logs")                    # a link is removed, never followed
    assert _demo_main(monkeypatch, str(out)) == "launched"
    left = set(os.listdir(out))
    assert {"notes.txt", elastic_demo.OUT_MARKER} <= left, left
    assert not {"ckpt", "events.jsonl", "overhead_abc", "logs"} & left, left
    assert (elsewhere / "data").read_text() == "not the demo's"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _demo_main(monkeypatch, str(empty)) == "launched"


# ---------------------------------------------------------------------------------- 2: no deepspeed / megatron-core
# a plain `pip install elastor_ds`: neither package importable (as in a venv without them)
_WITHOUT_EXTRAS = ("import sys\n"
                   "for m in ('deepspeed', 'megatron'):\n"
                   "    sys.modules[m] = None\n"
                   "from elastor_ds.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))\n")


def without_extras(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, *argv], env=ENV, capture_output=True, text=True,
                          timeout=300)


def _ds_versions(uni: str) -> set:
    from elastor_ds.integrations.safe_load import load_pt
    tag = open(os.path.join(uni, "latest_universal")).read().strip()
    return {load_pt(os.path.join(uni, tag, "zero", "optimizer_state.pt"))["ds_version"],
            load_pt(os.path.join(uni, tag, "mp_rank_00_model_states.pt"))["ds_version"]}


def test_universal_export_needs_no_deepspeed_and_writes_a_version_its_loader_accepts(tmp_path, ckpt):
    """_write_universal imported deepspeed only to write deepspeed.__version__: "unexpected
    ModuleNotFoundError" without it. DeepSpeed's ZeRO-1/2 universal load parses ds_version with
    packaging.version and needs >= 0.3.17."""
    from packaging import version
    uni = str(tmp_path / "uni")
    p = without_extras("convert", ckpt, uni, "--to", "deepspeed-universal", "--no-progress")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    (v,) = _ds_versions(uni)
    assert v == "0.16.0" and version.parse(v) >= version.parse("0.3.17")
    back = str(tmp_path / "back")   # and it reads back without deepspeed too
    p = without_extras("convert", uni, back, "--from", "deepspeed-universal", "--no-progress")
    assert p.returncode == 0, p.stderr
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        ds = installed("deepspeed")
    except PackageNotFoundError:
        return
    uni2 = str(tmp_path / "uni2")   # with deepspeed installed: its version, as before
    assert elastor("convert", ckpt, uni2, "--to", "deepspeed-universal", "--no-progress").returncode == 0
    assert _ds_versions(uni2) == {ds}


def test_torch_dist_export_without_megatron_core_names_the_extra_and_writes_nothing(tmp_path, ckpt):
    dst = str(tmp_path / "meg")
    p = without_extras("convert", ckpt, dst, "--to", "megatron", "--megatron-format", "torch_dist", "--no-progress")
    assert_one_line_failure(p, 2, "megatron-core", "pip install 'elastor_ds[megatron]'", "legacy")
    assert not os.path.lexists(dst) and os.listdir(tmp_path) == []


def test_a_native_deepspeed_import_without_deepspeed_names_the_extra(tmp_path):
    """A ZeRO file pickles DeepSpeed's fragment_address: refused as "outside the allow-list ... rerun
    with --trust-checkpoint", which then ended in "unexpected ModuleNotFoundError"."""
    from collections import OrderedDict
    tf = pytest.importorskip("deepspeed.utils.tensor_fragment")
    d = tmp_path / "ds" / "global_step3"
    d.mkdir(parents=True)
    w = torch.arange(6.0).view(2, 3)
    torch.save({"weight": w}, d / "layer_00-model_states.pt")
    torch.save({"module": None, "global_steps": 3, "ds_config": {"zero_optimization": {"stage": 1}},
                "param_shapes": [OrderedDict([("0.weight", torch.Size([2, 3]))])]}, d / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {
        "base_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(6), "exp_avg_sq": torch.ones(6)}},
                                 "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "single_partition_of_fp32_groups": [w.flatten()],
        "param_slice_mappings": [OrderedDict([("0.weight", tf.fragment_address(numel=6, start=0))])]}},
        d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "ds" / "latest").write_text("global_step3")
    for trust in ([], ["--trust-checkpoint"]):
        dst = str(tmp_path / f"out{len(trust)}")
        p = without_extras("convert", str(tmp_path / "ds"), dst, "--from", "deepspeed", "--no-progress", *trust)
        assert_one_line_failure(p, 2, "needs deepspeed", "pip install 'elastor_ds[deepspeed]'")
        assert not os.path.lexists(dst)


# ---------------------------------------------------------------------------------- 3: closed stdout / stderr
PLAN = ["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "100", "--micro-batch-size", "1", "--global-batch-size", "8", "--gpus-per-node", "4"]


@pytest.mark.parametrize("cmd,closed", [(c, fd) for c in ("inspect", "inspect --json", "verify", "plan", "plan --json",
                                                            "convert") for fd in (1, 2)] + [("convert", (1, 2))])
def test_a_closed_stdout_or_stderr_is_taken_as_devnull(tmp_path, ckpt, cmd, closed):
    """``elastor convert ... >&-`` wrote its output, then "unexpected AttributeError: 'NoneType' object
    has no attribute 'flush'", exit 1; ``elastor verify GOOD 2>&-`` exit 1 (sys.stderr.isatty())."""
    words = cmd.split()
    argv = {"inspect": ["inspect", ckpt], "verify": ["verify", ckpt], "plan": PLAN,
            "convert": ["convert", ckpt, str(tmp_path / "out"), "--to", "consolidated"]}[words[0]] + words[1:]
    fds = closed if isinstance(closed, tuple) else (closed,)

    def close():
        for fd in fds:
            os.close(fd)
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", *argv], env=ENV, preexec_fn=close, timeout=300,
                       stdout=None if 1 in fds else subprocess.PIPE, stderr=None if 2 in fds else subprocess.PIPE)
    assert p.returncode == 0, (p.stdout, p.stderr)
    if words[0] == "convert":
        assert os.path.isfile(tmp_path / "out" / "model.safetensors")


# ---------------------------------------------------------------------------------- 4: paths printed escaped
def _no_raw_escape(p: subprocess.CompletedProcess, *must: str) -> None:
    out = p.stdout + p.stderr
    assert "\x1b" not in out, out
    for m in must:
        assert m in out, (m, out)


@pytest.mark.parametrize("flag", ["--cluster", "--profile", "--from-plan"])
def test_plan_errors_escape_the_path_given(tmp_path, flag):
    bad = str(tmp_path / f"x{ESC}.json")
    argv = PLAN[:-2] + (["--cluster", bad] if flag == "--cluster" else ["--gpus-per-node", "4", flag, bad])
    p = elastor(*argv)
    assert_one_line_failure(p, 2, "\\x1b[31m")
    _no_raw_escape(p)


def test_result_lines_escape_the_paths(tmp_path):
    """inspect's "checkpoint <path>", verify's "OK <path>", convert's "wrote <dst>" and its INFO line
    printed a path from the command line or the disk raw."""
    d = tmp_path / f"ck{ESC}"
    d.mkdir()
    src = small_checkpoint(str(d / "el"))
    shown = f"ck\\x1b[31m{os.sep}el"
    p = elastor("inspect", src)
    assert p.returncode == 0 and "checkpoint  " in p.stdout, p.stderr
    _no_raw_escape(p, shown)
    p = elastor("verify", src)
    assert p.returncode == 0 and p.stdout.startswith("OK "), p.stderr
    _no_raw_escape(p, shown)
    p = elastor("convert", src, str(d / "out"), "--to", "consolidated", "--no-progress")
    assert p.returncode == 0 and "wrote " in p.stdout and "INFO" in p.stderr, p.stderr
    _no_raw_escape(p, f"ck\\x1b[31m{os.sep}out")


# ---------------------------------------------------------------------------------- 5: --from-plan's uniform baseline
def test_from_plan_help_and_docs_say_what_it_prints(tmp_path):
    """Help and docs/cli.md said "no uniform baseline is computed"; a re-plan up to 4,096 GPUs prints
    "best uniform: ... -> plan is 1.098x uniform"."""
    prev = tmp_path / "prev.json"
    p = elastor(*PLAN[:-1], "4,4", "--json")
    assert p.returncode == 0, p.stderr
    prev.write_text(p.stdout)
    p = elastor(*PLAN[:-1], "4,3", "--from-plan", str(prev))
    assert p.returncode == 0 and "best uniform:" in p.stdout, p.stdout + p.stderr
    from elastor_ds.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.choices and "plan" in a.choices).choices
    text = sub["plan"].format_help()
    doc = open(os.path.join(ROOT, "docs", "cli.md")).read()
    for said in (" ".join(text.split()), doc):
        assert "no uniform baseline is computed" not in said and "best uniform grid" in said


# ---------------------------------------------------------------------------------- 6: elastor_ds.demo
@pytest.mark.parametrize("layout,words", [("tp2", ["--layout tp2", "tp=2,pp=2"]),
                                          ("tp=2,pp=2", ["torchrun --nproc-per-node 4"])])
def test_the_synthetic_demo_refuses_bad_input_in_one_line(tmp_path, layout, words):
    """``--layout tp2``: ValueError traceback from parse_layout; without torchrun: torch's traceback
    about the RANK environment variable."""
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "elastor_ds.demo", "--phase", "save", "--ckpt", str(tmp_path / "ck"),
                        "--layout", layout], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), p.stderr
    assert not os.path.lexists(tmp_path / "ck")
    import elastor_ds.demo as demo
    assert "until the example trainer lands" not in demo.__doc__ and "elastic_demo.py" in demo.__doc__


# ---------------------------------------------------------------------------------- 7: help and messages
def _subparsers():
    from elastor_ds.cli import build_parser
    return next(a for a in build_parser()._actions if a.choices and "convert" in a.choices).choices


def test_help_texts(capsys):
    from elastor_ds.checkpoint import cli as ck
    subs = _subparsers()
    assert set(ck.SOURCE_FORMATS) == {"elastor", "consolidated", *ck.IMPORTERS}
    assert set(ck.TARGET_FORMATS) == {"elastor", "consolidated", *ck.EXPORTERS}
    conv = " ".join(subs["convert"].format_help().split()).replace("- ", "-")
    for name in ck.SOURCE_FORMATS + ck.TARGET_FORMATS:
        assert name in conv
    for cmd, arg in (("verify", "ckpt"), ("convert", "src"), ("convert", "dst")):
        act = next(a for a in subs[cmd]._actions if a.dest == arg)
        assert act.help, (cmd, arg)
    plan = subs["plan"].format_help()
    assert "``" not in plan and "(default 200)" in " ".join(plan.split())
    with pytest.raises(SystemExit):
        subs["run"].parse_args([])
    err = capsys.readouterr().err
    assert "required: script (" in err and "script_args" not in err, err


def test_convert_names_only_real_directions(ckpt, tmp_path):
    from elastor_ds.errors import ConfigError
    subs = _subparsers()
    args = subs["convert"].parse_args([ckpt, str(tmp_path / "o"), "--from", "elastor", "--to", "elastor"])
    with pytest.raises(ConfigError) as e:
        args.func(args)
    msg = str(e.value)
    assert "--from one of consolidated, deepspeed" in msg and "'elastor'" not in msg, msg


def test_inspect_cuts_a_long_extra_line_with_an_ellipsis(tmp_path):
    src = small_checkpoint(str(tmp_path / "el"), extra={"notes": {f"key{i}": "v" * 20 for i in range(20)}})
    p = elastor("inspect", src)
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("extra")]
    assert line.endswith("... (--json shows all)") and len(line) < 260, line
    assert line[:-len(", ... (--json shows all)")].endswith('"'), line   # cut between entries


def test_verify_names_a_bad_headers_file_once(tmp_path, ckpt):
    import shutil
    step = os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read().strip())
    bad = str(tmp_path / "bad")
    shutil.copytree(step, bad)
    data = next(n for n in sorted(os.listdir(bad)) if n.endswith(".safetensors"))
    with open(os.path.join(bad, data), "r+b") as f:
        f.write(b"garbage!")
    p = elastor("verify", bad)
    line = assert_one_line_failure(p, 1, "header")
    assert line.count(data) == 1, line
