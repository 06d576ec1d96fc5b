"""Review 36 of the Megatron-LM patches, as a user runs them.

1. ``patches/apply.sh`` never leaves a tree half patched: a tree only partly writable is refused
   before any change (was: 0001 applied, then ``patch`` failed on 0002's file), and a patch that fails
   while applying drops those applied before it (was: left applied).
2. The ``--elastor-*`` values are Megatron-LM's own usage errors (argparse: ``pretrain_gpt.py: error:
   argument FLAG: ...``, exit 2, before any process group) naming the bound and a value to pass
   (was: ``--elastor-keep 0`` a rank error later, ``--elastor-keep 5000`` and ``--elastor-plan ''``
   accepted, the latter silently running without a plan); ``configure`` refuses the same for a
   ``--yaml-cfg`` namespace.
3. 0001: an ``--elastor-*`` flag without ``--elastor`` names the fix (was: "unrecognized arguments").

The patches are applied to a tree made of their own pre-images (each hunk's context and removed
lines, apart; ``git apply`` and ``patch --fuzz=0`` place hunks at an offset), so no Megatron-LM
checkout is needed; with ``MEGATRON_LM_DIR`` set the same runs on the checkout's files too.
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APPLY = os.path.join(ROOT, "patches", "apply.sh")
PATCHES = sorted(os.path.join(ROOT, "patches", "megatron-lm", f)
                 for f in os.listdir(os.path.join(ROOT, "patches", "megatron-lm")) if f.endswith(".patch"))
PACKAGE_INFO = "megatron/core/package_info.py"
MLM = os.environ.get("MEGATRON_LM_DIR")


def _preimages() -> dict[str, str]:
    """{path: text}: every hunk's pre-image (context and '-' lines), with filler lines between hunks."""
    files: dict[str, list[str]] = {}
    for p in PATCHES:
        cur, hunk = None, None
        for ln in open(p, encoding="utf-8").read().split("\n"):
            if ln.startswith("+++ b/"):
                cur = ln[6:]
                files.setdefault(cur, [])
            elif ln.startswith("@@") and cur is not None:
                hunk = files[cur]
                hunk.extend(f"# filler {len(hunk)} {i}" for i in range(5))
            elif hunk is not None and cur is not None and (ln.startswith(" ") or ln.startswith("-") or ln == ""):
                if not ln.startswith("---"):
                    hunk.append(ln[1:])
    return {path: "\n".join(lines) + "\n# end\n" for path, lines in files.items()}


def _tree(kind: str) -> str:
    """A Megatron-LM tree of the files apply.sh looks at, in a folder another user may enter."""
    d = tempfile.mkdtemp(prefix="mlm_review36_")
    os.chmod(d, 0o755)
    if kind == "checkout":
        for rel in list(_preimages()) + [PACKAGE_INFO]:
            os.makedirs(os.path.dirname(os.path.join(d, rel)) or d, exist_ok=True)
            shutil.copyfile(os.path.join(MLM, rel), os.path.join(d, rel))
    else:
        for rel, text in _preimages().items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)) or d, exist_ok=True)
            with open(os.path.join(d, rel), "w", encoding="utf-8") as f:
                f.write(text)
        os.makedirs(os.path.join(d, os.path.dirname(PACKAGE_INFO)), exist_ok=True)
        with open(os.path.join(d, PACKAGE_INFO), "w") as f:
            f.write("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    for base, dirs, fs in os.walk(d):
        for x in dirs:
            os.chmod(os.path.join(base, x), 0o755)
        for x in fs:
            os.chmod(os.path.join(base, x), 0o644)
    return d


def _snapshot(d: str) -> dict[str, bytes]:
    out = {}
    for base, _, fs in os.walk(d):
        for x in fs:
            p = os.path.join(base, x)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


KINDS = ["synthetic"] + (["checkout"] if MLM else [])


@pytest.fixture(params=KINDS)
def tree(request):
    d = _tree(request.param)
    yield d
    for base, dirs, _ in os.walk(d):
        for x in dirs:
            os.chmod(os.path.join(base, x), 0o755)
    shutil.rmtree(d, ignore_errors=True)


def _apply(*args: str, env: dict | None = None, as_nobody: bool = False) -> subprocess.CompletedProcess:
    cmd = ["bash", APPLY, *args]
    if as_nobody:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or dict(os.environ), timeout=120)


def test_synthetic_tree_takes_the_patches_twice_and_back(tree):
    before = _snapshot(tree)
    first = _apply(tree)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied  ") == len(PATCHES)
    assert _snapshot(tree) != before
    again = _apply(tree)
    assert again.returncode == 0 and again.stdout.count("(already)") == len(PATCHES), again.stderr
    back = _apply("--reverse", tree)
    assert back.returncode == 0, back.stderr
    assert _snapshot(tree) == before


def test_partly_writable_tree_is_refused_unchanged(tree):
    """megatron/training (the files of 0002-0007) not writable: nothing changes, the message says why."""
    training = os.path.join(tree, "megatron", "training")
    if os.geteuid() == 0:   # root writes anyway: run apply.sh as another user, the tree theirs but that folder
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot make a folder unwritable")
        for base, dirs, fs in os.walk(tree):
            for x in dirs + fs:
                os.chown(os.path.join(base, x), 65534, 65534)
        os.chown(tree, 65534, 65534)
        os.chown(training, 0, 0)
        for f in os.listdir(training):
            os.chown(os.path.join(training, f), 0, 0)
    os.chmod(training, 0o555)
    before = _snapshot(tree)
    r = _apply(tree, as_nobody=os.geteuid() == 0)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "not writable" in r.stderr and "nothing was changed" in r.stderr, r.stderr
    assert _snapshot(tree) == before, "a patch was applied to a tree apply.sh then refused"


def test_patch_failing_midway_is_rolled_back(tree, tmp_path):
    """A `patch` that fails applying 0004 (after every dry run passed): 0001-0003 are dropped again."""
    fake = tmp_path / "bin"
    fake.mkdir()
    real = shutil.which("patch")
    assert real, "GNU patch is needed"
    (fake / "patch").write_text(
        "#!/usr/bin/env bash\n"
        "data=$(cat; echo x); data=${data%x}\n"
        "case \" $* \" in *' --dry-run '*) ;; *)\n"
        "  if [[ \"$data\" == *'elastor patch 0004'* ]] && [[ \" $* \" != *' --reverse '* ]]; then\n"
        "    echo 'patch: **** write error (injected)' >&2; exit 2; fi ;; esac\n"
        f"printf %s \"$data\" | {real} \"$@\"\n")
    (fake / "patch").chmod(0o755)
    before = _snapshot(tree)
    r = _apply(tree, env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "0004" in r.stderr and "nothing was changed" in r.stderr, r.stderr
    assert _snapshot(tree) == before, "patches applied before the failing one were left in place"


# ------------------------------------------------------------------ the flags

def _parser():
    from elastor_ds.integrations.megatron import training_hooks as hooks
    return hooks.add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))


@pytest.mark.parametrize("argv,flag,fix", [
    (["--elastor-keep", "0"], "--elastor-keep", "at least 1; e.g. --elastor-keep 2"),
    (["--elastor-keep", "5000"], "--elastor-keep", "at most 1000; e.g. --elastor-keep 2"),
    (["--elastor-keep", "two"], "--elastor-keep", "not an integer; e.g. --elastor-keep 2"),
    (["--elastor-plan", ""], "--elastor-plan", "empty; pass auto, on-change or a plan file"),
    (["--elastor-plan", "  "], "--elastor-plan", "empty; pass auto, on-change or a plan file"),
    (["--elastor-memory-snapshot-interval", "0"], "--elastor-memory-snapshot-interval",
     "at least 1; e.g. --elastor-memory-snapshot-interval 1"),
    (["--elastor-memory-snapshot-peer-copies", "2"], "--elastor-memory-snapshot-peer-copies",
     "at most 1; e.g. --elastor-memory-snapshot-peer-copies 1"),
    (["--elastor-memory-snapshot-keep", "0"], "--elastor-memory-snapshot-keep", "at least 1"),
    (["--elastor-memory-snapshot-peer-copy-interval", "-3"], "--elastor-memory-snapshot-peer-copy-interval",
     "at least 1"),
])
def test_bad_values_are_megatron_usage_errors(argv, flag, fix, capsys):
    p = _parser()
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--elastor", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"pretrain_gpt.py: error: argument {flag}: " in err and fix in err, err
    assert "Traceback" not in err


def test_good_values_still_parse():
    a = _parser().parse_args(["--elastor", "--elastor-keep", "1000", "--elastor-plan", "auto",
                              "--elastor-memory-snapshot-interval", "1", "--elastor-memory-snapshot-peer-copies", "0",
                              "--elastor-memory-snapshot-keep", "3"])
    assert (a.elastor_keep, a.elastor_plan, a.elastor_memory_snapshot_interval,
            a.elastor_memory_snapshot_peer_copies, a.elastor_memory_snapshot_keep) == (1000, "auto", 1, 0, 3)


@pytest.mark.parametrize("field,value,want", [
    ("elastor_keep", 5000, "--elastor-keep 5000: must be at most 1000; e.g. --elastor-keep 2"),
    ("elastor_keep", 0, "--elastor-keep 0: must be at least 1; e.g. --elastor-keep 2"),
    ("elastor_plan", "", "--elastor-plan '': empty"),
])
def test_configure_refuses_the_same_without_argparse(field, value, want):
    """A --yaml-cfg namespace is not made by argparse: configure checks the values itself."""
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import training_hooks as hooks
    ns = types.SimpleNamespace(elastor=True, elastor_keep=2, elastor_plan=None, tensor_model_parallel_size=1,
                               pipeline_model_parallel_size=1, world_size=1, num_layers=2, save=None)
    setattr(ns, field, value)
    with pytest.raises(ConfigError) as e:
        hooks.configure(ns)
    assert want in str(e.value)


def _provider_prog() -> str:
    text = open(os.path.join(ROOT, "patches/megatron-lm/0001-pretrain_gpt-elastor-flags.patch")).read()
    first_hunk = text.split("\n@@")[1]
    src = "\n".join(ln[1:] for ln in first_hunk.splitlines()[1:] if ln.startswith("+"))
    return ("import argparse, sys\nhas_nvidia_modelopt = False\n" + src + "\n"
            "p = extra_args_provider(argparse.ArgumentParser(prog='pretrain_gpt.py'))\n"
            "p.parse_known_args()\n"
            "print(len([m for m in sys.modules if m.startswith('elastor_ds')]))\n")


@pytest.mark.parametrize("argv,flag", [(["--elastor-keep", "3"], "--elastor-keep"),
                                       (["--lr", "1", "--elastor-plan=auto"], "--elastor-plan"),
                                       (["--no-elastor-async"], "--no-elastor-async")])
def test_an_elastor_flag_without_elastor_names_the_fix(argv, flag):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", _provider_prog(), *argv], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"pretrain_gpt.py: error: {flag} needs --elastor: add --elastor" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    plain = subprocess.run([sys.executable, "-c", _provider_prog(), "--lr", "1"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert plain.returncode == 0 and plain.stdout.split() == ["0"], plain.stderr   # elastor_ds not imported


def test_preimage_tree_is_what_the_patches_expect():
    """The synthetic tree is a fair stand-in: every patch hunk's pre-image is in it verbatim."""
    pre = _preimages()
    assert set(pre) == {"pretrain_gpt.py", "megatron/training/arguments.py", "megatron/training/initialize.py",
                        "megatron/training/checkpointing.py", "megatron/training/async_utils.py",
                        "megatron/training/yaml_arguments.py", "megatron/training/training.py"}
    assert stat.S_ISREG(os.stat(APPLY).st_mode)


def test_another_version_of_a_patch_is_named(tree):
    """A tree patched by another elastor_ds version (0001's body differs): the message says so and how
    to get back, instead of only "the file differs from core_v0.16.1"; nothing changes."""
    assert _apply(tree).returncode == 0
    path = os.path.join(tree, "pretrain_gpt.py")
    text = open(path).read()
    assert "needs elastor_ds" in text
    with open(path, "w") as f:
        f.write(text.replace("needs elastor_ds", "requires elastor_ds"))
    before = _snapshot(tree)
    r = _apply(tree)
    assert r.returncode == 1
    assert "holds another version of this patch" in r.stderr and "--reverse" in r.stderr, r.stderr
    assert _snapshot(tree) == before


def test_a_symlinked_target_is_named_and_not_followed(tree, tmp_path):
    """pretrain_gpt.py a link to a file elsewhere: refused naming the link (was: "differs from the
    release"), the file it points to untouched."""
    target = tmp_path / "elsewhere.py"
    link = os.path.join(tree, "pretrain_gpt.py")
    shutil.move(link, target)
    os.symlink(target, link)
    kept = target.read_bytes()
    r = _apply(tree)
    assert r.returncode == 1
    assert "pretrain_gpt.py is a symbolic link" in r.stderr and "Nothing was changed" in r.stderr, r.stderr
    assert target.read_bytes() == kept and os.path.islink(link)


def test_a_symlinked_folder_is_named_and_not_followed(tree, tmp_path):
    """megatron/training a link to a folder elsewhere: refused naming it, nothing there changed."""
    target = tmp_path / "training"
    link = os.path.join(tree, "megatron", "training")
    shutil.move(link, target)
    os.symlink(target, link)
    kept = _snapshot(str(target))
    r = _apply(tree)
    assert r.returncode == 1
    assert "megatron/training is a symbolic link" in r.stderr and "Nothing was changed" in r.stderr, r.stderr
    assert _snapshot(str(target)) == kept
