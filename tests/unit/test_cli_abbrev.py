"""``elastor`` never expands an abbreviated flag: argparse's default would read ``--gpus 8`` as
``--gpus-per-node 8`` (and ``--mod`` as whatever flag it prefixes) without a word."""
from __future__ import annotations

import pytest

from elastor_ds.cli import main

PLAN = ["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "8"]


def test_a_prefix_of_a_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(PLAN + ["--gpus-per-node", "4", "--gpus", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --gpus 8" in err and "Traceback" not in err


def test_the_whole_flag_still_works(capsys):
    assert main(PLAN + ["--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 4 GPUs on 1 node" in out and "predicted iteration" in out, out


@pytest.mark.parametrize("argv, flag", [(["run", "--nproc", "2", "x.py"], "--nproc"),
                                        (["verify", "--no-check", "d"], "--no-check")])
def test_subcommands_refuse_prefixes_too(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_version_prints_the_installed_version(capsys):
    """``elastor --version``, as pip-installed tools answer it: the distribution's version, exit 0."""
    from importlib.metadata import version
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"elastor {version('elastor_ds')}"


@pytest.mark.parametrize("argv, prog", [(PLAN + ["--gpus-per-node", "4", "--gpus", "8"], "elastor plan"),
                                        (["verify", "A", "B"], "elastor verify"),
                                        (["inspect", "A", "B"], "elastor inspect"), (["--bogus"], "elastor")])
def test_an_unrecognized_argument_is_named_by_its_subcommand(argv, prog, capsys):
    """QA round 8, F8.4: ``elastor verify A B`` said "elastor: error: ... (see elastor --help)"; the
    subcommand whose arguments they are names the error and its own --help."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: unrecognized arguments: ") and err.endswith(f"(see {prog} --help)\n"), err


@pytest.mark.parametrize("cmd", ["verify", "inspect", "convert"])
def test_a_missing_path_is_a_usage_error_in_the_parsers_words(cmd, tmp_path, capsys):
    """F8.4: the checkpoint commands' own usage errors carry the same "elastor CMD: error:" prefix as
    argparse's (they said "error: ...")."""
    argv = [cmd, str(tmp_path / "missing")]
    if cmd == "convert":
        argv += [str(tmp_path / "out"), "--to", "consolidated"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elastor {cmd}: error: ") and str(tmp_path / "missing") in err, err
