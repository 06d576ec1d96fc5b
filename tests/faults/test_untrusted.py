"""Untrusted checkpoints through the real CLI (subprocesses): names that escape their directory,
tensor names that would escape an export, crafted pickles that run code, malformed plan and
convert flags. Each must exit non-zero with a one-line message, no traceback, nothing read or
written outside, and no code run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from cli_utils import assert_one_line_failure, elastor
from elastor_ds.checkpoint import CheckpointEngine, TensorShard
from elastor_ds.errors import ElastorError
from elastor_ds.layout.region import Region

SHAPE = (16, 8)


@pytest.fixture()
def ckpt(tmp_path):
    root = str(tmp_path / "ck")
    shards = [TensorShard(n, SHAPE, Region.full(SHAPE), torch.full(SHAPE, float(i))) for i, n in enumerate("ab")]
    step_dir = CheckpointEngine(root, async_save=False).save(3, shards).committed_dir
    data = next(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    secret = tmp_path / "outside" / "secret.safetensors"
    secret.parent.mkdir()
    shutil.copy(os.path.join(step_dir, data), secret)  # a valid data file: a leak would "work"
    return root, step_dir, data, str(secret)


def _edit_manifest(step_dir: str, fn) -> None:
    """Edit the manifest as an attacker would: the checksum is recomputed (it is not a signature)."""
    from elastor_ds.checkpoint.planning.manifest import document_checksum
    p = os.path.join(step_dir, "manifest.json")
    m = json.load(open(p))
    fn(m)
    if "checksum" in m:
        m["checksum"] = document_checksum(m)
    with open(p, "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_manifest_file_name_outside_the_step_dir_is_refused(ckpt, tmp_path, how):
    root, step_dir, data, secret = ckpt
    name = os.path.relpath(secret, step_dir) if how == "dotdot" else secret

    def rename(m):
        m["files"][name] = m["files"].pop(data)
        for t in m["tensors"].values():
            for ch in t["chunks"]:
                ch["file"] = name
    _edit_manifest(step_dir, rename)
    os.unlink(os.path.join(step_dir, data))  # the data now lives only outside
    dst = str(tmp_path / "cons")
    # refused by the manifest schema or by safe_join; either way the message names the file
    assert_one_line_failure(elastor("convert", root, dst, "--to", "consolidated", "--no-progress"), 1,
                            "secret.safetensors")
    assert not os.path.exists(dst) and not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    assert_one_line_failure(elastor("verify", root), 1)


def test_symlinked_data_file_and_latest_outside_are_refused(ckpt, tmp_path):
    root, step_dir, data, secret = ckpt
    os.unlink(os.path.join(step_dir, data))
    os.symlink(secret, os.path.join(step_dir, data))
    assert_one_line_failure(elastor("verify", root), 1, "outside")
    # `latest` naming a step dir of another root
    other = str(tmp_path / "other")
    os.makedirs(other)
    with open(os.path.join(other, "latest"), "w") as f:
        f.write("../ck/" + os.path.basename(step_dir))
    assert_one_line_failure(elastor("verify", other), 1, "latest")
    assert_one_line_failure(elastor("inspect", other), 1, "latest")


def test_rank_state_file_outside_is_refused_on_load(ckpt):
    root, step_dir, _, secret = ckpt
    _edit_manifest(step_dir, lambda m: m.update(rank_state_files={"0": "../../outside/secret.safetensors"}))
    out = [TensorShard("a", SHAPE, Region.full(SHAPE), torch.empty(SHAPE))]
    with pytest.raises(ElastorError, match="rank_state"):
        CheckpointEngine(root, async_save=False).load(None, out)


def test_escaping_tensor_names_are_refused_on_export_and_import(tmp_path):
    import elastor_ds.checkpoint.convert as cv

    evil = "model.../../../escaped.weight"
    src = str(tmp_path / "el")
    orig = cv.check_tensor_name
    cv.check_tensor_name = lambda n, where="": n  # build the crafted checkpoint behind the check's back
    try:
        cv.write_single_writer_checkpoint(src, 1, [evil], {evil: (4, 4)}, {evil: "float32"},
                                          lambda n: torch.ones(4, 4), progress=False)
    finally:
        cv.check_tensor_name = orig
    dst = str(tmp_path / "a" / "b" / "uni")
    os.makedirs(os.path.dirname(dst))   # the parents exist: an escape would have somewhere to land
    assert_one_line_failure(elastor("convert", src, dst, "--to", "deepspeed-universal", "--no-progress"), 1,
                            "escaped.weight")
    escaped = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if "escaped" in f]
    assert escaped == [] and not os.path.exists(dst)
    # import side: a consolidated file carrying the name
    from safetensors.torch import save_file
    cons = tmp_path / "cons"
    cons.mkdir()
    save_file({"../../../escaped.weight": torch.ones(2)}, str(cons / "model.safetensors"))
    assert_one_line_failure(elastor("convert", str(cons), str(tmp_path / "imp"), "--from", "consolidated",
                                    "--no-progress"), 1, "escaped.weight")
    assert not os.path.exists(tmp_path / "imp")


class _Payload:
    """Unpickling this writes a marker file: what any code in a crafted checkpoint could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _crafted_deepspeed(tmp_path, marker: str) -> str:
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"weight": torch.ones(2)}, str(tag / "layer_00-model_states.pt"))
    torch.save({"module": None, "global_steps": 1, "client": _Payload(marker)}, str(tag / "mp_rank_00_model_states.pt"))
    return str(tag)


def _crafted_megatron(tmp_path, marker: str) -> str:
    it = tmp_path / "mg" / "iter_0000001" / "mp_rank_00"
    it.mkdir(parents=True)
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"model": {}, "args": _Payload(marker)}, str(it / "model_optim_rng.pt"))
    return str(tmp_path / "mg")


@pytest.mark.parametrize("fmt", ["deepspeed", "megatron"])
def test_crafted_pickle_does_not_run_without_trust(tmp_path, fmt):
    marker = str(tmp_path / "PWNED")
    src = _crafted_deepspeed(tmp_path, marker) if fmt == "deepspeed" else _crafted_megatron(tmp_path, marker)
    dst = str(tmp_path / "out")
    p = elastor("convert", src, dst, "--from", fmt, "--no-progress")
    assert not os.path.exists(marker), "the checkpoint's code ran"
    assert_one_line_failure(p, 1, "--trust-checkpoint")
    # megatron-core's import-time notes are not the CLI's output (QA F18: four UserWarnings came first)
    assert "Transformer Engine" not in p.stderr and "warnings.warn" not in p.stderr, p.stderr
    assert not os.path.exists(dst)
    # the payload is real: with the explicit flag the code runs (and a warning says so)
    p = elastor("convert", src, dst, "--from", fmt, "--no-progress", "--trust-checkpoint")
    assert os.path.exists(marker)
    assert "--trust-checkpoint: fully unpickling" in p.stderr


def test_dcp_metadata_payload_is_refused(tmp_path):
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata
    marker = str(tmp_path / "PWNED")
    it = tmp_path / "td" / "iter_0000001"
    it.mkdir(parents=True)
    (tmp_path / "td" / "latest_checkpointed_iteration.txt").write_text("1")
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    with open(it / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={"x": _Payload(marker)}), f)
    p = elastor("convert", str(tmp_path / "td"), str(tmp_path / "out"), "--from", "megatron", "--no-progress")
    assert not os.path.exists(marker)
    assert_one_line_failure(p, 1, "--trust-checkpoint")


@pytest.mark.parametrize("fmt,where", [("deepspeed", "model states"), ("megatron", "legacy"),
                                        ("megatron", "torch_dist .metadata"), ("megatron", ".metadata link")])
def test_a_fifo_or_link_planted_in_a_checkpoint_to_import_is_refused_not_waited_on(tmp_path, fmt, where):
    """``torch.load`` and ``open`` of a FIFO block until someone writes to it: an import of a
    checkpoint holding one hung for ever. A link named like the DCP ``.metadata`` was followed (to
    /etc/passwd here). Now each is refused in one line, exit 1, nothing written."""
    if where == "model states":
        tag = tmp_path / "src" / "global_step1"
        tag.mkdir(parents=True)
        os.mkfifo(tag / "mp_rank_00_model_states.pt")
        src = str(tag)
    else:
        it = tmp_path / "src" / "iter_0000001"
        it.mkdir(parents=True)
        (tmp_path / "src" / "latest_checkpointed_iteration.txt").write_text("1")
        src = str(tmp_path / "src")
        if where == "legacy":
            (it / "mp_rank_00").mkdir()
            os.mkfifo(it / "mp_rank_00" / "model_optim_rng.pt")
        else:
            (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
            if where.endswith("link"):
                os.symlink("/etc/passwd", it / ".metadata")
            else:
                os.mkfifo(it / ".metadata")
    dst = str(tmp_path / "out")
    p = elastor("convert", src, dst, "--from", fmt, "--no-progress", timeout=60)
    assert_one_line_failure(p, 1, "symbolic link" if where.endswith("link") else "FIFO")
    assert not os.path.exists(dst)


class _System:
    """A pickle that runs ``touch MARKER`` when loaded with weights_only=False."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("dressed", [True, False], ids=["bytes-dressed-as-tensor", "plain-bytes"])
def test_dcp_bytes_records_are_never_unpickled_without_trust(tmp_path, dressed):
    """Only DCP metadata classes unpickle, but a crafted ``.metadata`` can give a bytes record a
    tensor's size and dtype (attributes a pickle may set on any object): the importer took it for
    a tensor, and DCP read its storage with ``torch.load(weights_only=False)``, running the code
    stored there. Refused now, dressed up or not, with no code run and nothing written; with
    ``--trust-checkpoint`` the same checkpoint does run it (the payload is real)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties)

    from elastor_ds.integrations.megatron.convert import torch_dist_key
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig, gpt_tensor_specs
    marker = str(tmp_path / "PWNED")
    root = tmp_path / "mg"
    d = root / "iter_0000001"
    d.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    cfgd = dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16, ffn_hidden_size=16)
    (root / "elastor_model_config.json").write_text(json.dumps(cfgd))
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    payload = pickle.dumps(_System(marker))
    (d / "__0_0.distcp").write_bytes(payload)
    cfg = GPTSpecConfig.from_json(cfgd)
    sdm, storage = {}, {}
    for s in gpt_tensor_specs(cfg):
        key, layer = torch_dist_key(s.name)
        shape = tuple(s.shape) if layer is None else (cfg.num_layers, *s.shape)
        if "word_embeddings" in key or "output_layer" in key:
            shape = (max(shape[0], 128), *shape[1:])
        b = BytesStorageMetadata()
        if dressed:
            b.size = torch.Size(shape)
            b.properties = TensorProperties(dtype=torch.float32)
        sdm[key] = b
        storage[MetadataIndex(key)] = _StorageInfo(relative_path="__0_0.distcp", offset=0, length=len(payload))
    (d / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=sdm, storage_data=storage)))
    dst = str(tmp_path / "out")
    p = elastor("convert", str(root), dst, "--from", "megatron", "--no-progress")
    assert not os.path.exists(marker), "the checkpoint's code ran"
    assert_one_line_failure(p, 1, "not a plain DCP tensor" if dressed else "not a tensor")
    assert not os.path.exists(dst)


def test_a_dcp_read_of_a_bytes_record_is_refused_without_trust(tmp_path):
    """The reader itself refuses to read any DCP bytes record (read back with
    ``torch.load(weights_only=False)``) unless trusted; tensors of the same checkpoint read fine."""
    import torch.distributed.checkpoint as dcp

    from elastor_ds.errors import UnsafeCheckpointError
    from elastor_ds.integrations.safe_load import safe_dcp_reader
    marker = str(tmp_path / "PWNED")
    d = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(6.0), "obj": _System(marker)}, checkpoint_id=d, no_dist=True)
    w = torch.zeros(6)
    dcp.load({"w": w}, storage_reader=safe_dcp_reader(d), no_dist=True)
    assert torch.equal(w, torch.arange(6.0))
    with pytest.raises(BaseException) as ei:   # torch wraps the reader's error in its CheckpointException
        dcp.load({"obj": None}, storage_reader=safe_dcp_reader(d), no_dist=True)
    assert "refusing" in str(ei.value) and not os.path.exists(marker)
    assert isinstance(ei.value, UnsafeCheckpointError) or "UnsafeCheckpointError" in repr(ei.value)


@pytest.mark.parametrize("flag,value", [("--gpu-memory-gb", "nan"), ("--gpu-tflops", "inf"),
                                        ("--inter-node-bandwidth-gbs", "-1"), ("--num-layers", "0"),
                                        ("--micro-batch-size", "-2"), ("--gpus-per-node", ","),
                                        # out of the cost model's range (these crashed with ZeroDivisionError /
                                        # "cannot convert float NaN", or printed 1e299 s plans with exit 0)
                                        ("--gpu-tflops", "1e300"), ("--gpu-memory-gb", "1e300"),
                                        ("--intra-node-bandwidth-gbs", "1e-300"), ("--gpu-tflops", "1e-300"),
                                        # an empty field is a typo, not a node dropped; no GPU at all
                                        ("--gpus-per-node", "8,,8"), ("--gpus-per-node", "0"),
                                        ("--gpus-per-node", "0,0"), ("--from-plan", "/dev/zero"),
                                        # int() takes these (QA round 5, Q5-11); not a byte width
                                        ("--num-layers", "\uff18"), ("--num-layers", "1_6"),
                                        ("--dtype-bytes", "3"), ("--zero-stage", "1_0")])
def test_malformed_plan_flags_exit_2_in_one_line(flag, value):
    argv = ["plan", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
            "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size", "8", "--gpus-per-node", "2,2"]
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    assert_one_line_failure(elastor(*argv), 2, value)


def test_convert_tp_zero_exits_2(ckpt, tmp_path):
    root = ckpt[0]
    assert_one_line_failure(elastor("convert", root, str(tmp_path / "m"), "--to", "megatron",
                                    "--tensor-model-parallel-size", "0"), 2, "--tensor-model-parallel-size")
    assert not os.path.exists(tmp_path / "m")


# ---------------------------------------------------------------- fixed names, sizes, permissions
def test_symlinked_manifest_and_latest_are_refused_without_reading_their_target(ckpt, tmp_path):
    """``manifest.json`` and ``latest`` are written as regular files: a symlink at either is
    refused (O_NOFOLLOW), even one to a valid manifest, and the target's text is not echoed."""
    root, step_dir, _, _ = ckpt
    outside = tmp_path / "outside" / "manifest.json"
    shutil.move(os.path.join(step_dir, "manifest.json"), outside)
    os.symlink(outside, os.path.join(step_dir, "manifest.json"))
    assert_one_line_failure(elastor("verify", root), 1, "symbolic link")
    assert_one_line_failure(elastor("inspect", step_dir), 1, "symbolic link")
    shutil.move(str(outside), os.path.join(step_dir, "manifest.json"))   # back: the checkpoint is good again
    assert elastor("verify", root).returncode == 0
    marker = tmp_path / "outside" / "private.txt"
    marker.write_text("step_000000003 THE-PRIVATE-TEXT")
    os.unlink(os.path.join(root, "latest"))
    os.symlink(marker, os.path.join(root, "latest"))
    p = elastor("verify", root)
    assert_one_line_failure(p, 1, "symbolic link")
    assert "PRIVATE" not in p.stderr + p.stdout


def test_oversized_manifest_is_refused_before_it_is_read(ckpt):
    """A sparse 2 GiB manifest: refused from its size, the reader's memory stays small."""
    root, step_dir, _, _ = ckpt
    os.truncate(os.path.join(step_dir, "manifest.json"), 2 ** 31)
    # VmHWM: this process's own peak (ru_maxrss carries the parent's over exec: 800 MB under xdist)
    code = ("import sys; from elastor_ds.cli import main; rc = main(['verify', sys.argv[1]]); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
            "print('MAXRSS', hwm); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    assert p.returncode == 1 and "larger than" in p.stderr, p.stderr
    rss_kib = int(p.stdout.split("MAXRSS")[1])
    assert rss_kib < 512 * 1024, rss_kib   # reading the file first took ~1 GiB


def test_manifest_step_must_match_its_directory(ckpt, tmp_path):
    root, step_dir, _, _ = ckpt
    _edit_manifest(step_dir, lambda m: m.update(step=4))
    assert_one_line_failure(elastor("verify", root), 1, "step 4", "step 3")
    dst = str(tmp_path / "cons")
    assert_one_line_failure(elastor("convert", root, dst, "--to", "consolidated", "--no-progress"), 1, "step 4")
    assert not os.path.exists(dst)


def test_no_checksums_verify_checks_the_safetensors_header(ckpt):
    """``--no-checksums`` checks sizes and headers: a header the safetensors library cannot open
    (a renamed key, same length, so the size still matches) is reported."""
    from safetensors import safe_open
    root, step_dir, data, _ = ckpt
    path = os.path.join(step_dir, data)
    raw = bytearray(open(path, "rb").read())
    i = raw.index(b'"data_offsets"')
    raw[i + 1:i + 2] = b"X"
    with open(path, "r+b") as f:
        f.write(raw)
    with pytest.raises(Exception):
        safe_open(path, "pt")   # the oracle: safetensors itself refuses it
    assert_one_line_failure(elastor("verify", "--no-checksums", root), 1, "safetensors header")


def _as_user_without_dac(argv: list[str]) -> subprocess.CompletedProcess:
    """The CLI as root without the capabilities that bypass file permissions (as any other user)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_DAC_OVERRIDE")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner",
                           sys.executable, "-m", "elastor_ds.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def test_unreadable_step_dir_is_a_permission_error_not_an_uncommitted_save(ckpt):
    root, step_dir, data, _ = ckpt
    os.chmod(step_dir, 0)
    try:
        p = _as_user_without_dac(["verify", root])
        assert_one_line_failure(p, 1, "permission denied")
        assert "never committed" not in p.stderr and "CORRUPT" not in p.stderr
        assert_one_line_failure(_as_user_without_dac(["verify", step_dir]), 1, "permission denied")
    finally:
        os.chmod(step_dir, 0o700)
    os.chmod(os.path.join(step_dir, data), 0)
    p = _as_user_without_dac(["verify", root])
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"CORRUPT: {os.path.join(step_dir, data)}: unreadable (Permission denied)" in p.stderr, p.stderr
    assert "1 problem(s)" in p.stderr


@pytest.mark.parametrize("to", ["consolidated", "deepspeed-universal", "megatron"])
def test_export_checks_chunk_coverage_before_allocating(ckpt, tmp_path, to):
    """A crafted shape (10^18 elements) is refused from the manifest before any exporter
    allocates it: one line naming the tensor, exit 1, nothing written."""
    root, step_dir, _, _ = ckpt
    def grow(m):
        m["tensors"]["a"]["shape"] = [10 ** 17, 8]
    _edit_manifest(step_dir, grow)
    dst = str(tmp_path / f"out_{to}")
    p = elastor("convert", root, dst, "--to", to, "--no-progress")
    assert_one_line_failure(p, 1, "chunks cover 128 of 800000000000000000 elements", "nothing was written")
    assert "allocate" not in p.stderr and not os.path.exists(dst)


def test_export_of_a_truncated_file_says_truncated(ckpt, tmp_path):
    root, step_dir, data, _ = ckpt
    size = os.path.getsize(os.path.join(step_dir, data))
    os.truncate(os.path.join(step_dir, data), size - 100)
    p = elastor("convert", root, str(tmp_path / "out"), "--to", "consolidated", "--no-progress")
    assert_one_line_failure(p, 1, data, f"{size - 100} bytes, the manifest says {size} (truncated")


def test_export_needs_an_existing_parent_and_keeps_an_empty_destinations_mode(ckpt, tmp_path):
    root, _, _, _ = ckpt
    missing = tmp_path / "no" / "such" / "out"
    assert_one_line_failure(elastor("convert", root, str(missing), "--to", "consolidated"), 2,
                            "parent directory", "does not exist")
    assert not (tmp_path / "no").exists()
    priv = tmp_path / "priv"
    priv.mkdir()
    os.chmod(priv, 0o2700)   # a private directory prepared for the exported weights (setgid too)
    p = elastor("convert", root, str(priv), "--to", "consolidated", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert os.stat(priv).st_mode & 0o7777 == 0o2700
    assert sorted(os.listdir(priv)) == ["elastor_metadata.json", "model.safetensors"]


@pytest.mark.parametrize("where", ["tensor", "file"])
def test_control_characters_in_names_are_refused_not_printed(ckpt, where):
    """A tensor or file name carrying a terminal escape (clear screen, window title) is refused by
    the manifest schema; no raw escape reaches the user's terminal."""
    root, step_dir, data, _ = ckpt
    evil = "x\x1b[2J\x1b]0;pwned\x07y"

    def edit(m):
        if where == "tensor":
            m["tensors"][evil] = m["tensors"].pop("a")
        else:
            m["files"][evil] = m["files"].pop(data)
            for t in m["tensors"].values():
                for ch in t["chunks"]:
                    ch["file"] = evil
    _edit_manifest(step_dir, edit)
    for cmd in (["verify", root], ["inspect", root], ["verify", "--no-checksums", root]):
        p = elastor(*cmd)
        assert_one_line_failure(p, 1, "control characters")
        assert "\x1b" not in p.stdout + p.stderr and "\x07" not in p.stdout + p.stderr


def test_an_unlisted_file_named_with_a_terminal_escape_is_shown_escaped(ckpt):
    """``verify`` notes the entries of a step folder its manifest does not list; their names come
    from whoever wrote into the folder. One carrying a terminal escape must not reach the terminal
    raw (it printed as is)."""
    root, step_dir, _, _ = ckpt
    evil = "x\x1b[2J\x1b]0;pwned\x07y"
    with open(os.path.join(step_dir, evil), "w") as f:
        f.write("hi")
    p = elastor("verify", root)
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert "note: 1 entry" in out and "\x1b" not in out and "\x07" not in out, out
    assert ascii(evil) in out


@pytest.mark.parametrize("how, words", [("link", "symbolic link"), ("fifo", "FIFO"), ("nan", "NaN"),
                                        ("deep", "RecursionError")])
def test_a_consolidated_sources_metadata_file_is_read_as_untrusted(ckpt, tmp_path, how, words):
    """``elastor_metadata.json`` of a consolidated directory to import: a link to /etc/passwd was
    followed, a FIFO silently read as absent (step 0), NaN accepted to fail late, deep nesting an
    "unexpected RecursionError". Each is now one line, exit 1, nothing written."""
    root = ckpt[0]
    cons = str(tmp_path / "cons")
    assert elastor("convert", root, cons, "--to", "consolidated", "--no-progress").returncode == 0
    meta = os.path.join(cons, "elastor_metadata.json")
    os.unlink(meta)
    if how == "link":
        os.symlink("/etc/passwd", meta)
    elif how == "fifo":
        os.mkfifo(meta)
    else:
        with open(meta, "w") as f:
            f.write('{"step": 3, "extra": {"x": NaN}}' if how == "nan" else '{"step": 3, "extra": ' + "[" * 5000 + "]" * 5000 + "}")
    dst = str(tmp_path / "back")
    p = elastor("convert", cons, dst, "--from", "consolidated", "--no-progress", timeout=60)
    assert_one_line_failure(p, 1, words)
    assert not os.path.exists(dst)


def test_a_step_dir_that_is_a_link_out_of_the_root_is_never_taken(ckpt, tmp_path):
    """A root without ``latest`` whose newest ``step_*`` entry is a link to another checkpoint's
    step dir: ``latest`` may not name such a link, but without ``latest`` the newest step was
    taken through it, and ``verify``/``inspect``/a load read the other checkpoint. The link is not
    a step of this root: the root's own newest step is used."""
    root = ckpt[0]
    other = tmp_path / "other"
    shards = [TensorShard("z", SHAPE, Region.full(SHAPE), torch.full(SHAPE, 9.0))]
    other_step = CheckpointEngine(str(other), async_save=False).save(7, shards).committed_dir
    os.unlink(os.path.join(root, "latest"))
    os.symlink(other_step, os.path.join(root, "step_000000009"))
    p = elastor("inspect", root)
    assert p.returncode == 0 and "step_000000003" in p.stdout + p.stderr and "step_000000009" not in p.stdout, \
        p.stdout + p.stderr
    from elastor_ds.checkpoint import commit as commit_mod
    assert [s for s, _ in commit_mod.list_committed(root)] == [3]


def test_full_disk_import_and_export_leave_nothing_and_name_the_destination(tmp_path):
    """A 64 KiB tmpfs fills during an import and an export of 128 KiB of tensors: exit 1, the
    message names the destination, and nothing is left there (an import's root it made is
    removed again)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a small tmpfs: needs root (CI runs as root)")
    from safetensors.torch import save_file
    cons = tmp_path / "cons"
    cons.mkdir()
    save_file({"w": torch.arange(32768, dtype=torch.float32)}, str(cons / "model.safetensors"))
    # (--to deepspeed-universal writes through torch.save, whose zip writer turned ENOSPC into
    # "RuntimeError: ... unexpected pos ..." (QA round 4, Q4-4); the fp32 copy is 128 KiB too)
    src = str(tmp_path / "el")
    assert elastor("convert", str(cons), src, "--from", "consolidated", "--no-progress").returncode == 0
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        imp, exp = str(small / "imp"), str(small / "exp")
        p = elastor("convert", str(cons), imp, "--from", "consolidated", "--no-progress")
        assert_one_line_failure(p, 1, "No space left on device", f"importing into {imp}")
        p = elastor("convert", src, exp, "--to", "consolidated", "--no-progress")
        assert_one_line_failure(p, 1, "No space left on device", exp)
        assert os.listdir(small) == []
        p = elastor("convert", src, exp, "--to", "deepspeed-universal", "--no-progress")
        assert_one_line_failure(p, 1, "No space left on device writing", exp)
        assert "RuntimeError" not in p.stderr and os.listdir(small) == []
    finally:
        subprocess.run(["umount", "-l", str(small)])


@pytest.mark.parametrize("fmt,make,words", [
    ("deepspeed", "file", ["is not a directory"]),
    ("deepspeed", "dangling-latest", ["names tag 'global_step5'", "does not exist"]),
    ("deepspeed", "empty", ["not a DeepSpeed checkpoint"]),
    ("megatron", "empty", ["neither a torch_dist checkpoint"]),
    ("megatron", "file", ["neither a torch_dist checkpoint"]),
])
def test_import_sources_that_are_not_checkpoints_exit_2_naming_why(tmp_path, fmt, make, words):
    src = tmp_path / "src"
    if make == "file":
        src.write_text("x")
    else:
        src.mkdir()
        if make == "dangling-latest":
            (src / "latest").write_text("global_step5\n")
    dst = tmp_path / "dst"
    assert_one_line_failure(elastor("convert", str(src), str(dst), "--from", fmt, "--no-progress"), 2, *words)
    assert not dst.exists()


def test_overlapping_chunks_that_hide_a_gap_are_refused(tmp_path):
    """QA round 4, Q4-1: a manifest whose chunk 1 was made a copy of chunk 0 (checksum recomputed)
    covers as many elements as the good one, so a count passed it: verify said OK, the export wrote
    uninitialised memory into the uncovered rows and a resume took it. The parser now refuses
    overlapping chunks: verify and export fail in one line naming the chunks, nothing is written,
    and a load with fallback takes the step before it. Oracle: the tensors saved."""
    root = str(tmp_path / "ck")
    w1, w2 = torch.arange(128.0).reshape(16, 8), -torch.arange(128.0).reshape(16, 8)
    eng = CheckpointEngine(root, async_save=False)
    for step, w in ((1, w1), (2, w2)):   # two row halves: two chunks of one tensor
        eng.save(step, [TensorShard("w", SHAPE, Region((0, 0), (8, 8)), w[:8]),
                        TensorShard("w", SHAPE, Region((8, 0), (8, 8)), w[8:])])
    step_dir = os.path.join(root, "step_000000002")

    def dup(m):
        m["tensors"]["w"]["chunks"][1] = dict(m["tensors"]["w"]["chunks"][0])
    _edit_manifest(step_dir, dup)
    assert_one_line_failure(elastor("verify", step_dir), 1, "chunks whose regions do not overlap")
    dst = str(tmp_path / "out")
    assert_one_line_failure(elastor("convert", step_dir, dst, "--to", "consolidated", "--no-progress"), 1,
                            "chunks whose regions do not overlap")
    assert not os.path.exists(dst)
    out = torch.zeros(SHAPE)
    res = CheckpointEngine(root, async_save=False).load(None, [TensorShard("w", SHAPE, Region.full(SHAPE), out)],
                                                         fallback=True)
    assert res.step == 1 and torch.equal(out, w1)


@pytest.mark.parametrize("edit", ['"x":NaN,', '"x":-Infinity,', '"x":1e999,'])
def test_non_finite_numbers_in_a_manifest_are_a_corrupt_manifest(tmp_path, edit):
    """QA round 4, Q4-2: ``NaN``, ``Infinity`` or ``1e999`` in a manifest passed the JSON parser and
    failed in the checksum's ``json.dumps`` as a bare ValueError: "unexpected ValueError" from the
    CLI, a traceback instead of a fallback on resume. Now they are a ManifestError: one line naming
    the file from verify, and a load with fallback takes the step before it."""
    root = str(tmp_path / "ck")
    eng = CheckpointEngine(root, async_save=False)
    for step in (1, 2):
        eng.save(step, [TensorShard("w", SHAPE, Region.full(SHAPE), torch.full(SHAPE, float(step)))])
    p = os.path.join(root, "step_000000002", "manifest.json")
    text = open(p).read()
    assert text.startswith("{")
    with open(p, "w") as f:
        f.write("{" + edit + text[1:])
    assert_one_line_failure(elastor("verify", root), 1, p, "not valid JSON")
    out = torch.zeros(SHAPE)
    res = CheckpointEngine(root, async_save=False).load(None, [TensorShard("w", SHAPE, Region.full(SHAPE), out)],
                                                         fallback=True)
    assert res.step == 1 and torch.equal(out, torch.full(SHAPE, 1.0))


@pytest.mark.parametrize("evil", ["evil\u202eTXT.exe", "a\u200bb", "x\u2066y\u2069", "w\ufeff"])
def test_invisible_formatting_characters_in_names_are_refused(ckpt, evil):
    """QA round 4, Q4-7: a right-to-left override or a zero-width space in a tensor name passed the
    control-character check and reached ``inspect`` raw (a crafted checkpoint could make one name
    print as another). They are refused as control characters are; a plain non-ASCII name is not."""
    root, step_dir, _, _ = ckpt

    def edit(m):
        m["tensors"][evil] = m["tensors"].pop("a")
    _edit_manifest(step_dir, edit)
    for cmd in (["inspect", root], ["verify", root]):
        p = elastor(*cmd)
        assert_one_line_failure(p, 1, "invisible formatting")
        assert evil not in p.stdout + p.stderr


def test_plain_non_ascii_tensor_names_still_round_trip(tmp_path):
    root = str(tmp_path / "ck")
    name = "модель.wéight.层"
    CheckpointEngine(root, async_save=False).save(1, [TensorShard(name, SHAPE, Region.full(SHAPE), torch.ones(SHAPE))])
    out = torch.zeros(SHAPE)
    CheckpointEngine(root, async_save=False).load(None, [TensorShard(name, SHAPE, Region.full(SHAPE), out)])
    assert torch.equal(out, torch.ones(SHAPE))


def test_a_safe_load_leaves_the_processs_own_safe_globals_registered(tmp_path):
    """torch's safe_globals context manager removes on exit every global it was given, also those the
    process had registered before: after one of our safe loads, argparse.Namespace (which
    megatron-core registers at import, for its own checkpoints' args) was gone, and megatron-core's
    dist_checkpointing.load of a checkpoint holding args failed in the same process."""
    import argparse
    from elastor_ds.integrations.safe_load import load_pt
    path = tmp_path / "x.pt"
    torch.save({"args": argparse.Namespace(num_layers=2)}, path)
    before = argparse.Namespace in torch.serialization.get_safe_globals()   # megatron.core imported already?
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        assert load_pt(str(path), False)["args"].num_layers == 2
        assert argparse.Namespace in torch.serialization.get_safe_globals()
        assert torch.load(path, weights_only=True)["args"].num_layers == 2   # the process's own load
    finally:
        if not before:
            torch.serialization._weights_only_unpickler._remove_safe_globals([argparse.Namespace])
