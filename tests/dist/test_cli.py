"""`elastor inspect | verify | convert` on real checkpoints written by two gloo ranks."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_world
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.cli import main
from elastor_ds.comm import TorchComm
from elastor_ds.layout import Layout
from elastor_ds.testing.synthetic import GPTShape, global_tensors, gpt_specs, optimizer_specs, rank_state

SHAPE = GPTShape()


def _save(rank: int, world: int, root: str) -> None:
    lay = Layout.uniform(2, 1, 1, SHAPE.num_layers)
    specs = gpt_specs(SHAPE)
    globs = global_tensors(specs + optimizer_specs(specs), seed=3)
    eng = CheckpointEngine(root, TorchComm.create(60))
    st = rank_state(lay, rank, specs, globs, zero=False, fill=0.0)
    eng.save(42, st.shards, extra={"iteration": 42}, layout=lay.to_json())
    eng.finalize()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cli") / "ck")
    run_world(_save, 2, root, timeout_s=60)
    return root


def test_inspect_and_verify(ckpt, capsys):
    assert main(["inspect", ckpt, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["step"] == 42 and d["world_size"] == 2 and d["format_version"] == 2
    assert d["tensors"]["embedding.word_embeddings.weight"]["shape"] == [SHAPE.vocab, SHAPE.hidden]
    assert main(["inspect", ckpt]) == 0
    out = capsys.readouterr().out
    assert "tp2.pp1.dp1" in out and "step        42" in out
    assert main(["verify", ckpt]) == 0
    assert main(["verify", str(os.path.dirname(ckpt))]) == 2  # not a checkpoint: a usage error (issue 19), not "corrupt"
    with pytest.raises(SystemExit) as e:
        main(["verify"])
    assert e.value.code == 2


def test_convert_consolidated_roundtrip(ckpt, tmp_path, capsys):
    specs = gpt_specs(SHAPE)
    globs = global_tensors(specs + optimizer_specs(specs), seed=3)
    cons = str(tmp_path / "cons")
    assert main(["convert", ckpt, cons, "--to", "consolidated", "--no-progress"]) == 0
    model = load_file(os.path.join(cons, "model.safetensors"))
    optim = load_file(os.path.join(cons, "optimizer.safetensors"))
    assert set(model) == {s.name for s in specs}
    for name, t in {**model, **optim}.items():
        if name in globs:
            assert torch.equal(t, globs[name]), name  # canonical full tensor, bit-identical
    back = str(tmp_path / "back")
    assert main(["convert", cons, back, "--from", "consolidated", "--no-progress"]) == 0
    assert main(["verify", back]) == 0
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    got = torch.empty(globs[name].shape)
    res = CheckpointEngine(back).load(None, [full_shard(name, got)])
    assert torch.equal(got, globs[name]) and res.step == 42 and res.extra == {"iteration": 42}
    assert main(["convert", ckpt, str(tmp_path / "x"), "--to", "nonsense"]) == 2
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "y"), "--to", "consolidated"]) == 2
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
