"""examples/megatron_gpt/pretrain_gpt.py end to end: megatron-core TP layers in DeepSpeed's pipeline
engine, saved under TP2 x PP2 and resumed under TP1 x PP3 (uneven) and TP2 x PP1 x DP2; the resumed
losses reproduce the uninterrupted run's. Bad flags exit 2 with a message."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer_utils import COMMON, ROOT, TRAINER, losses, torchrun  # noqa: F401 - tests/helpers


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer")
    # through torchrun itself (the other launches of the suite fork their ranks from the forkserver)
    torchrun(4, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--save",
             str(d / "ck"), "--save-interval", "3", "--metrics-file", str(d / "ref.jsonl"), real_torchrun=True)
    return d


@pytest.mark.parametrize("nproc,tp,pp", [(3, 1, 3), (4, 2, 1)], ids=["tp1pp3-uneven", "tp2pp1dp2"])
def test_resume_under_new_layout_reproduces_losses(reference, nproc, tp, pp):
    out = reference / f"res_{tp}_{pp}.jsonl"
    torchrun(nproc, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--load", str(reference / "ck" / "step_000000003"), "--save", str(reference / f"ck_{tp}_{pp}"),
             "--metrics-file", str(out))
    ref, got = losses(str(reference / "ref.jsonl")), losses(str(out))
    assert sorted(got) == [4, 5, 6]
    rec = [json.loads(line) for line in open(out)]
    assert rec[0]["consumed_samples"] == 32 and rec[0]["world_size"] == nproc
    for it in got:
        assert got[it] == pytest.approx(ref[it], rel=2e-5), (it, got[it], ref[it])
    assert ref[6] < ref[1]  # it learns


def test_bad_flags_exit_2_with_message():
    import pretrain_gpt
    cases = [
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6, "not divisible by TP (2) x PP (2)"),
        (["--global-batch-size", "10", "--micro-batch-size", "4"], 1, "--global-batch-size 10 is not divisible"),
        (["--num-attention-heads", "4", "--num-query-groups", "3"], 1, "not divisible by --num-query-groups 3"),
        (["--pipeline-model-parallel-size", "8", "--num-layers", "4"], 8, "every stage needs a layer"),
        (["--seq-length", "128", "--max-position-embeddings", "64"], 1, "--seq-length 128 > --max-position-embeddings 64"),
        (["--elastor-plan", "/nonexistent.json"], 1, "no such file"),
        (["--elastor-plan", "/tmp"], 1, "--elastor-plan /tmp: is not a file"),
        (["--elastor-plan", ""], 1, "--elastor-plan '': empty"),   # was ignored: the flags' layout ran
    ]
    for argv, world, msg in cases:
        args = pretrain_gpt.parse_args(argv)
        with pytest.raises(pretrain_gpt.UsageError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            pretrain_gpt.derive(args, world)
    p = subprocess.run([sys.executable, TRAINER, "--global-batch-size", "7"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, WORLD_SIZE="1"))
    assert p.returncode == 2 and "--global-batch-size 7 is not divisible" in p.stderr


def test_trainer_checkpoint_exports_to_megatron_and_back(reference, tmp_path):
    """The trainer's checkpoint carries its megatron-core model description: `elastor convert --to
    megatron` works without --model-config, and importing the result gives the same weights."""
    from safetensors.torch import load_file
    import torch

    src = str(reference / "ck")

    def cli(*a):
        p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", *a], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
    cli("convert", src, str(tmp_path / "mlm"), "--to", "megatron", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--no-progress")
    # Adam's step travels with the moments (QA Q3: the export wrote step 0 beside moments of step N)
    import glob
    from elastor_ds.checkpoint import commit as commit_mod
    want = commit_mod.read_manifest(commit_mod.resolve(src)).extra["optimizer"][0]["scalars"]["step"]["value"]
    files = sorted(glob.glob(str(tmp_path / "mlm" / "iter_*" / "mp_rank_*" / "model_optim_rng.pt")))
    assert len(files) == 4 and want > 0
    for f in files:
        steps = {float(v["step"]) for v in torch.load(f, weights_only=False)["optimizer"]["state"].values()}
        assert steps == {float(want)}, (f, steps, want)
    cli("convert", str(tmp_path / "mlm"), str(tmp_path / "back"), "--from", "megatron", "--no-progress")
    cli("convert", src, str(tmp_path / "c1"), "--to", "consolidated", "--no-progress")
    cli("convert", str(tmp_path / "back"), str(tmp_path / "c2"), "--to", "consolidated", "--no-progress")
    a = load_file(str(tmp_path / "c1" / "model.safetensors"))
    b = load_file(str(tmp_path / "c2" / "model.safetensors"))
    assert set(b) <= set(a) and "decoder.layers.3.mlp.linear_fc1.weight" in b
    for k in b:
        assert torch.equal(a[k], b[k]), k
    # torch_dist on a host without CUDA (QA Q2: megatron's writer synchronised CUDA and failed),
    # through megatron's own dist_checkpointing, and back: the same weights
    import dataclasses

    from elastor_ds.integrations.megatron.specs import GPTSpecConfig
    model = commit_mod.read_manifest(commit_mod.resolve(src)).model
    (tmp_path / "gpt.json").write_text(json.dumps({f.name: model[f.name] for f in dataclasses.fields(GPTSpecConfig)}))
    cli("convert", src, str(tmp_path / "td"), "--to", "megatron", "--megatron-format", "torch_dist",
        "--tensor-model-parallel-size", "2", "--no-progress")
    cli("convert", str(tmp_path / "td"), str(tmp_path / "td_back"), "--from", "megatron", "--model-config",
        str(tmp_path / "gpt.json"), "--no-progress")
    # and back without --model-config: the export leaves its model config beside the tracker file
    # (QA round 5, Q5-14: "carries no Megatron args: pass --model-config")
    cli("convert", str(tmp_path / "td"), str(tmp_path / "td_back2"), "--from", "megatron", "--no-progress")
    for back in ("td_back", "td_back2"):
        cli("convert", str(tmp_path / back), str(tmp_path / f"c3{back}"), "--to", "consolidated", "--no-progress")
        c = load_file(str(tmp_path / f"c3{back}" / "model.safetensors"))
        assert set(c) == set(b)
        for k in c:
            assert torch.equal(a[k], c[k]), k
    # that file is read as untrusted input: a symlink or a NaN is refused naming the file, nothing written
    side = tmp_path / "td" / "elastor_model_config.json"
    doc = json.loads(side.read_text())
    # a valid file that does not describe the checkpoint (QA round 7, Q7-4: a halved hidden size
    # imported [192, 32] weights from [192, 64] tensors; one layer fewer dropped a layer) is refused too
    for bad in (dict(doc, num_layers=float("nan")), dict(doc, hidden_size=doc["hidden_size"] // 2),
                dict(doc, num_layers=doc["num_layers"] - 1), dict(doc, num_layers=doc["num_layers"] + 1)):
        side.write_text(json.dumps(bad))   # json.dumps writes NaN
        p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "convert", str(tmp_path / "td"),
                            str(tmp_path / "td_bad"), "--from", "megatron", "--no-progress"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert p.returncode != 0 and "elastor_model_config.json" in p.stderr and "--model-config" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and "unexpected" not in p.stderr and not os.path.exists(tmp_path / "td_bad")


@pytest.mark.parametrize("flags, msg", [
    (["--micro-batch-size", "0"], "argument --micro-batch-size: 0 must be >= 1"),
    (["--log-interval", "0"], "argument --log-interval: 0 must be >= 1"),
    # named by the config key they became ("elastor.memory_snapshot.interval_steps"), after the set-up
    (["--save", "{tmp}/ck", "--elastor-memory-snapshot-interval", "0"],
     "argument --elastor-memory-snapshot-interval: 0 must be >= 1"),
    (["--save-interval", "-3"], "argument --save-interval: -3 must be >= 0"),
    (["--elastor-memory-snapshot-peer-copies", "2"], "argument --elastor-memory-snapshot-peer-copies: invalid choice"),
    (["--num-attention-heads", "0"], "argument --num-attention-heads: 0 must be >= 1"),
    (["--deepspeed_config", "{tmp}/nope.json"], "--deepspeed_config {tmp}/nope.json: cannot read it"),
    (["--deepspeed_config", "{tmp}/bad.json"], "--deepspeed_config {tmp}/bad.json: not valid JSON"),
    (["--save", "{tmp}/afile"], "checkpoint directory {tmp}/afile is a file, not a directory"),
    # review of the thirty-third session: a traceback from the data worker after the set-up, or numpy's
    (["--data-path", "{tmp}/nope.txt"], "--data-path {tmp}/nope.txt does not exist"),
    (["--data-path", "{tmp}"], "--data-path {tmp} is a directory"),
    (["--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["--data-path", "{tmp}/list.jsonl"], "a JSONL record is an object with a 'text' string (it is a JSON list)"),
], ids=["mbs0", "log-interval0", "snap-interval0", "save-interval-neg", "peer-copies2", "heads0",
         "ds-config-missing", "ds-config-not-json", "save-is-a-file", "data-missing", "data-dir", "seed-neg",
         "data-not-objects"])
def test_user_errors_exit_2_in_one_line_on_every_rank(tmp_path, flags, msg):
    """These divided by zero, or raised FileExistsError / FileNotFoundError / JSONDecodeError with
    a traceback (exit 1, which `elastor run` retried until --max-restarts ran out)."""
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n" * 64)
    flags = [f.format(tmp=tmp_path) for f in flags]
    p = torchrun(2, *flags, "--train-iters", "2", check=False, timeout=180)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert msg.format(tmp=tmp_path) in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (tmp_path / "afile").read_text() == "x"


def test_a_resume_with_another_global_batch_is_refused_naming_the_one_to_give(tmp_path):
    """Review of the thirty-third session: iteration i reads from sample i x --global-batch-size, so a
    resume with another global batch skipped (8 -> 16: samples 16-31 never read) or repeated samples,
    with only a warning. It is refused now; the same global batch resumes."""
    ck = str(tmp_path / "ck")
    torchrun(2, "--save", ck, "--save-interval", "2", "--train-iters", "2", "--global-batch-size", "8")
    p = torchrun(2, "--load", ck, "--save", ck, "--train-iters", "4", "--global-batch-size", "16", check=False,
                 timeout=180)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert ("--global-batch-size 16: the checkpoint of iteration 2 was trained with 8" in p.stderr and
            "resume with --global-batch-size 8" in p.stderr and "Traceback" not in p.stderr), p.stderr[-3000:]
    torchrun(2, "--load", ck, "--save", ck, "--train-iters", "3", "--global-batch-size", "8", "--metrics-file",
             str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in map(json.loads, open(tmp_path / "m.jsonl"))] == [3]
    # another --seed reads another order: said (the data settings travel in the client state)
    p = torchrun(2, "--load", ck, "--save", ck, "--train-iters", "4", "--global-batch-size", "8", "--seed", "99")
    assert "resumed with other data settings (seed 1234 -> 99)" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("flag, value, words", [("--pipeline-model-parallel-size", "99", "the model has 4 layers"),
                                                ("--tensor-model-parallel-size", "3", "does not divide")])
def test_export_sizes_the_model_cannot_take_are_usage_errors(reference, tmp_path, flag, value, words):
    """QA round 4, Q4-9: a pp the model cannot split exited 1 while a bad tp exited 2; both are bad
    flag values (exit 2, one line naming the flag's value, nothing written)."""
    dst = tmp_path / "mlm"
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "convert", str(reference / "ck"), str(dst), "--to",
                        "megatron", flag, value, "--no-progress"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    assert words in p.stderr and value in p.stderr and "Traceback" not in p.stderr
    assert not dst.exists()


def test_the_built_in_corpus_is_never_taken_from_beside_the_checkpoints(tmp_path, monkeypatch):
    """QA round 8, F4: without --data-path the trainer used ``dirname(--save)/corpus_seed<seed>.jsonl``
    when it existed, whoever made it: another user could plant it in a shared folder (/tmp, /scratch)
    and it was trained on, silently. It also left a 2 MB file outside any folder the user named. Now
    the corpus is made in this user's private cache folder; the planted file is neither read nor
    touched, and nothing appears beside the checkpoint root."""
    import stat
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    planted = tmp_path / "corpus_seed4242.jsonl"
    planted.write_text(json.dumps({"text": "ATTACKER CONTROLLED TEXT " * 4}) + "\n")
    os.chown(planted, 1001, 1001)
    before = planted.read_bytes()
    p = torchrun(2, "--save", str(tmp_path / "ck"), "--seed", "4242", "--train-iters", "2", "--metrics-file",
                 str(tmp_path / "m.jsonl"), check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert planted.read_bytes() == before and planted.stat().st_uid == 1001
    folder = cache / "elastor_ds"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [f.name for f in folder.iterdir()] == ["corpus_seed4242_chars64.jsonl"]
    assert sorted(os.listdir(tmp_path)) == ["cache", "ck", "corpus_seed4242.jsonl", "m.jsonl"]


def test_a_corpus_cache_folder_of_another_user_is_refused_with_the_fixes_that_apply(tmp_path, monkeypatch):
    """QA round 9, N3: the refusal suggested "name a new directory (on /dev/shm for memory speed)",
    the memory snapshots' fix; no flag names this folder."""
    import pretrain_gpt

    from elastor_ds.errors import ConfigError
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    planted = tmp_path / "elastor_ds"
    planted.mkdir(mode=0o700)
    os.chown(planted, 1001, 1001)
    with pytest.raises(ConfigError) as ei:
        pretrain_gpt.builtin_corpus(1, 32, 0)
    msg = str(ei.value)
    assert "belongs to uid 1001" in msg and "set XDG_CACHE_HOME to a folder of your own" in msg, msg
    assert "--data-path" in msg and "/dev/shm" not in msg and "snapshots" not in msg, msg
    assert os.listdir(planted) == []
