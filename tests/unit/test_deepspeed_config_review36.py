"""Review 36: the DeepSpeed config file and a plan file, read as files someone else may have made.

A directory, a FIFO, a device, JSON nested deeper than the parser goes, text that is not UTF-8: each
is one ConfigError naming the setting, the path and the fix; never a traceback of another type, a
read that blocks for good (a FIFO) or never ends (``/dev/zero``). A plan file is not followed through
a symlink (elastor_ds.user_json's rule for files someone else may have made); the DeepSpeed config
file, the user's own, is (as DeepSpeed reads it).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from elastor_ds.errors import ConfigError
from elastor_ds.integrations.deepspeed.config import load_plan_document, split_ds_config


def _bad_files(d) -> dict:
    os.makedirs(d / "adir")
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "binary.json").write_bytes(b"\xff\xfe\x00{}")
    return {"adir": str(d / "adir"), "deep": str(d / "deep.json"), "binary": str(d / "binary.json")}


@pytest.mark.parametrize("kind", ["adir", "deep", "binary"])
def test_bad_plan_or_config_file_is_one_config_error(tmp_path, kind):
    path = _bad_files(tmp_path)[kind]
    with pytest.raises(ConfigError) as ei:
        load_plan_document(path)
    assert str(ei.value).startswith(("elastor.plan: " + path, f"elastor.plan: {path!r}")), str(ei.value)
    assert "elastor plan" in str(ei.value) or "not valid JSON" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        split_ds_config(path)
    assert str(ei.value).startswith((f"DeepSpeed config file {path}", f"DeepSpeed config file {path!r}")), str(ei.value)


_CHILD = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))   # /dev/zero read whole: MemoryError, not swap
    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.deepspeed.config import load_plan_document, split_ds_config
    for f in (load_plan_document, split_ds_config):
        try:
            f(sys.argv[1])
        except ConfigError as e:
            print("ConfigError:", e)
        else:
            print("accepted")
""")


def test_plan_file_symlink_refused_config_file_symlink_followed(tmp_path):
    import json
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"train_batch_size": 8, "elastor": {"plan": str(tmp_path / "plan.json")}}))
    (tmp_path / "ds.json").symlink_to(real)
    assert split_ds_config(str(tmp_path / "ds.json"))[0] == {"train_batch_size": 8}
    (tmp_path / "plan.json").symlink_to(real)
    with pytest.raises(ConfigError, match="symlink is not followed"):
        load_plan_document(str(tmp_path / "plan.json"))


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_fifo_or_device_is_refused_not_read(tmp_path, kind):
    """Was: a FIFO blocked the rank in open() for good (the others then wait in the next collective);
    /dev/zero was read until memory ran out."""
    if kind == "fifo":
        path = str(tmp_path / "plan.json")
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path} did not return in 60 s")
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 2, (out.returncode, out.stdout, out.stderr[-2000:])
    assert lines[0].startswith(f"ConfigError: elastor.plan: {path}: not a regular file"), lines
    assert lines[1].startswith(f"ConfigError: DeepSpeed config file {path}: not a regular file"), lines


def test_auto_plan_model_num_layers_other_than_the_layer_list_is_refused_naming_it():
    """docs/deepspeed.md's config gives "model": {"num_layers": 24, ...}; a plan's layer index is the
    index in the PipelineModule's layer list (embedding and head included). Was: the section's 24
    replaced the layer list's length, a plan over 24 layers came back for a list of 26, and the
    PipelineModule then refused "the plan" without naming the key that caused it."""
    from elastor_ds.integrations.deepspeed.autoplan import resolve_plan
    model = {"num_layers": 24, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1000}
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "elastor": {"plan": "auto", "model": model}}
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError) as ei:
        resolve_plan(cfg, num_layers=26, env=env)
    assert "elastor.model.num_layers is 24" in str(ei.value) and "26 layer specs" in str(ei.value), str(ei.value)
    assert resolve_plan(cfg, num_layers=24, env=env).num_layers == 24          # the same count: as given
    del model["num_layers"]
    assert resolve_plan(cfg, num_layers=26, env=env).num_layers == 26          # left out: the list's length


def test_config_file_is_read_as_deepspeed_reads_it(tmp_path):
    """deepspeed.initialize reads a config file as hjson (comments, trailing commas), refuses a key
    given twice, and takes a base64 string for a config. Was: eds.initialize, the drop-in, refused the
    first ("not valid JSON"), took the last of two "elastor" sections silently, and refused the third
    ("does not exist")."""
    import base64
    import json
    p = tmp_path / "ds.json"
    p.write_text('{\n  // ZeRO-1 on 8 ranks\n  "train_batch_size": 8,  # per step\n'
                 '  "elastor": {"checkpoint": {"dir": "/ckpt/run1", "interval_steps": 5,},},\n}\n')
    rest, cfg = split_ds_config(str(p))
    assert rest == {"train_batch_size": 8} and cfg.checkpoint.dir == "/ckpt/run1"
    assert cfg.checkpoint.interval_steps == 5
    p.write_text('{"train_batch_size": 8, "elastor": {"checkpoint": {"dir": "/a"}}, "elastor": {}}')
    with pytest.raises(ConfigError, match="key 'elastor' given twice"):
        split_ds_config(str(p))
    doc = {"train_batch_size": 4, "elastor": {"checkpoint": {"dir": "/b", "keep": 3}}}
    b64 = base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()
    rest, cfg = split_ds_config(b64)
    assert rest == {"train_batch_size": 4} and cfg.checkpoint.keep == 3
    with pytest.raises(ConfigError, match="does not exist"):   # neither a path nor base64 of a config
        split_ds_config(str(tmp_path / "missing.json"))
