"""bf16 + ZeRO-1 through the DeepSpeed integration: the checkpoint keeps bf16 weights *and* the fp32
master partitions (they differ in bf16 training), and a PP2 x DP2 run resumed as PP1 x DP2 continues
with the uninterrupted run's losses."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402
from ds_scenarios import run_specs  # noqa: E402
from elastor_ds.checkpoint import commit as commit_mod  # noqa: E402


def test_bf16_zero1_resume_under_new_pipeline(tmp_path):
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    os.makedirs(out)
    base = dict(name="ref", pp=2, dp=2, mb=2, gas=2, zero=1, steps=6, bf16=True,
                elastor={"checkpoint": {"dir": ck, "load": "latest", "async": True, "interval_steps": 3}})
    run_world(run_specs, 4, [base], out, timeout_s=120)
    man = commit_mod.read_manifest(os.path.join(ck, "step_000000003"))
    dtypes = {n: t.dtype for n, t in man.tensors.items()}
    assert any(n.startswith("optimizer.master.") and d == "float32" for n, d in dtypes.items())
    assert any(not n.startswith("optimizer.") and d == "bfloat16" for n, d in dtypes.items())
    res = dict(name="pp1dp2", pp=1, dp=2, mb=2, gas=2, zero=1, steps=3, bf16=True,
               elastor={"checkpoint": {"dir": str(tmp_path / "ck2"), "load": os.path.join(ck, "step_000000003"),
                                       "async": True}})
    run_world(run_specs, 2, [res], out, timeout_s=120)
    ref = json.load(open(os.path.join(out, "ref.json")))["losses"]
    got = json.load(open(os.path.join(out, "pp1dp2.json")))
    assert got["start"] == 3
    assert got["losses"] == pytest.approx(ref[3:], rel=1e-2)


def test_bf16_resumes_from_its_deepspeed_universal_export_imported_back(tmp_path):
    """The universal format keeps every tensor in fp32: a bf16 model exported ``--to
    deepspeed-universal`` and imported back holds fp32 weights, and a bf16 engine's resume refused
    them (TensorMismatchError: "pass allow_cast=True", which a config cannot give). They are cast on
    load into the bf16 parameters, as DeepSpeed's own universal load does, and the run continues with
    the uninterrupted run's losses."""
    from elastor_ds.cli import main
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    os.makedirs(out)
    base = dict(name="ref", pp=1, dp=2, mb=2, gas=2, zero=1, steps=6, bf16=True,
                elastor={"checkpoint": {"dir": ck, "load": "latest", "async": False, "interval_steps": 3}})
    run_world(run_specs, 2, [base], out, timeout_s=120)
    uni, back = str(tmp_path / "uni"), str(tmp_path / "back")
    assert main(["convert", os.path.join(ck, "step_000000003"), uni, "--to", "deepspeed-universal",
                 "--no-progress"]) == 0
    assert main(["convert", os.path.join(uni, "global_step3"), back, "--from", "deepspeed-universal",
                 "--no-progress"]) == 0
    man = commit_mod.read_manifest(commit_mod.resolve(back))
    assert {t.dtype for n, t in man.tensors.items() if not n.startswith("optimizer.")} == {"float32"}
    res = dict(name="from_universal", pp=1, dp=2, mb=2, gas=2, zero=1, steps=3, bf16=True,
               elastor={"checkpoint": {"dir": str(tmp_path / "ck2"), "load": back, "async": False}})
    run_world(run_specs, 2, [res], out, timeout_s=120)
    ref = json.load(open(os.path.join(out, "ref.json")))["losses"]
    got = json.load(open(os.path.join(out, "from_universal.json")))
    assert got["start"] == 3
    assert got["losses"] == pytest.approx(ref[3:], rel=1e-2)
