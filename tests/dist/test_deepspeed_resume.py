"""Resume a PP2 x DP2 ZeRO-1 DeepSpeed run under other PP/DP degrees, boundaries and ZeRO stages.

Pass condition: the resumed runs reproduce the per-step losses of the uninterrupted run (fp32).
One spawned world per world size; several scenarios per world.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402
from ds_scenarios import run_specs  # noqa: E402
from elastor_ds.checkpoint.commit import step_dirname  # noqa: E402
from elastor_ds.layout import Layout  # noqa: E402

K, M = 3, 3  # save after K steps, then M more


def _read(outdir, name):
    with open(os.path.join(outdir, name + ".json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_resume")
    out, ck, native = str(d / "out"), str(d / "ckpt"), str(d / "native")
    os.makedirs(out)
    step_dir = os.path.join(ck, step_dirname(K))

    def resume(name, pp, dp, gas, zero, boundaries=None, extra_ckpt=None):
        c = {"dir": str(d / f"ck_{name}"), "load": ck, "async": True}
        c.update(extra_ckpt or {})
        return dict(name=name, pp=pp, dp=dp, mb=2, gas=gas, zero=zero, boundaries=boundaries, steps=M,
                    elastor={"checkpoint": c})

    base = dict(name="ref", pp=2, dp=2, mb=2, gas=2, zero=1, steps=K + M, save_at=[K], native_dir=native,
                # the save at K reads the live tensors until the fence before step K + 1 (live_write):
                # every resume below checks the values it wrote
                elastor={"plan": "auto", "checkpoint": {"dir": ck, "load": "latest", "async": True,
                                                        "live_write": True}})
    run_world(run_specs, 4, [base, resume("pp4_dp1_zero0", 4, 1, 4, 0, [0, 1, 4, 6, 8],
                                          {"interval_steps": 2})], out, timeout_s=120)
    from elastor_ds.integrations.deepspeed.convert import convert
    conv = str(d / "converted")
    convert(native, conv, source="deepspeed")  # what `elastor convert native conv --from deepspeed` runs
    from_native = resume("pp3_from_native", 3, 1, 4, 1, [0, 3, 5, 8])
    from_native["elastor"]["checkpoint"]["load"] = conv
    pp3 = resume("pp3_dp1_uneven", 3, 1, 4, 1, None, {"min_interval_s": 0.001})
    plan = Layout.uniform(1, 3, 1, 8, boundaries=[0, 2, 5, 8], micro_batches=4).to_json()  # a planner's plan
    pp3["plan"] = plan                        # the module is partitioned from it ...
    pp3["elastor"]["plan"] = plan             # ... and initialize checks the module against it
    run_world(run_specs, 3, [pp3, from_native], out, timeout_s=120)
    from elastor_ds.integrations.deepspeed.convert import to_universal
    uni = str(d / "universal")
    to_universal(ck, uni)  # `elastor convert ckpt uni --to deepspeed-universal`
    back = resume("pp2_ds_universal", 2, 1, 4, 1, [0, 3, 8])
    back.update(elastor=None, ds_universal_load=uni)
    run_world(run_specs, 2, [resume("pp1_dp2", 1, 2, 2, 1), back], out, timeout_s=120)
    return out, ck, native, step_dir


@pytest.mark.parametrize("name", ["pp4_dp1_zero0", "pp3_dp1_uneven", "pp1_dp2", "pp3_from_native",
                                  "pp2_ds_universal"])
def test_resume_reproduces_losses(runs, name):
    out = runs[0]
    ref = _read(out, "ref")
    got = _read(out, name)
    assert got["start"] == K
    assert got["client_state"] == {"epoch": 7}
    assert got["losses"] == pytest.approx(ref["losses"][K:], rel=1e-5, abs=1e-6), (name, got, ref)
    assert got["lr"] == pytest.approx(ref["lr"], rel=1e-7)
    assert got["global_samples"] == ref["global_samples"]


def test_the_reference_runs_save_was_a_live_write(runs):
    assert _read(runs[0], "ref")["live_saves"] == [True]


def test_periodic_save_and_native_files(runs):
    out, ck, native, step_dir = runs
    assert os.path.isdir(step_dir)
    assert os.path.isdir(os.path.join(os.path.dirname(out), "ck_pp4_dp1_zero0", step_dirname(K + 2)))
    assert any(n.startswith("global_step") for n in os.listdir(native))
    # reference policy (interval_steps 0, min_interval_s > 0): saves whenever the previous one finished
    ref_policy = os.path.join(os.path.dirname(out), "ck_pp3_dp1_uneven")
    assert any(n.startswith("step_") for n in os.listdir(ref_policy))


def test_cli_convert_from_deepspeed(runs, tmp_path):
    from elastor_ds.checkpoint import commit as commit_mod
    from elastor_ds.cli import main

    native = runs[2]
    assert main(["convert", native, str(tmp_path / "c"), "--from", "deepspeed"]) == 0
    man = commit_mod.read_manifest(commit_mod.resolve(str(tmp_path / "c")))
    assert man.step == K and man.extra["client_state"] == {"epoch": 7}
    assert "optimizer.exp_avg_sq.7.out.weight" in man.tensors and "0.emb.weight" in man.tensors
    assert main(["convert", native, str(tmp_path / "d"), "--from", "nonsense"]) != 0


def test_universal_export_reads_back_from_its_root(runs, tmp_path):
    """QA round 5, Q5-14: `--to deepspeed-universal DST` writes DST/global_stepN and
    DST/latest_universal; `--from deepspeed-universal DST` (the root, as printed for the export)
    failed with "no zero/ directory". Every tensor comes back bit-identical (fp32 run), compared
    through safetensors' own loader."""
    from safetensors.torch import load_file

    from elastor_ds.cli import main

    ck = runs[1]
    uni, back = str(tmp_path / "uni"), str(tmp_path / "back")
    assert main(["convert", ck, uni, "--to", "deepspeed-universal", "--no-progress"]) == 0
    assert main(["convert", uni, back, "--from", "deepspeed-universal", "--no-progress"]) == 0
    for src, dst in ((ck, "c1"), (back, "c2")):
        assert main(["convert", src, str(tmp_path / dst), "--to", "consolidated", "--no-progress"]) == 0
    a = load_file(str(tmp_path / "c1" / "model.safetensors"))
    b = load_file(str(tmp_path / "c2" / "model.safetensors"))
    common = sorted(set(a) & set(b))
    assert "0.emb.weight" in common and len(common) == len(a), sorted(set(a) - set(b))[:5]
    for name in common:
        assert a[name].dtype == b[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name
