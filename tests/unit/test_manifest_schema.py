"""Malformed manifests (as a crafter would write them, with a recomputed checksum) give a typed
ManifestError naming the field, and `elastor verify` / `elastor inspect` print one line and exit 1."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.cli import main as cli_main
from elastor_ds.errors import ManifestError

pytestmark = pytest.mark.unit


def _rechecksum(d):
    """What a crafter does: recompute the manifest checksum by hand (canonical JSON, sha256)."""
    if isinstance(d, dict) and "checksum" in d:
        body = {k: v for k, v in d.items() if k != "checksum"}
        d["checksum"] = "sha256:" + hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return d


def _chunk(m):
    return m["tensors"]["w"]["chunks"][0]


CASES = {
    "json_list": (lambda m: [1, 2], "document: expected a JSON object"),
    "no_tensors": (lambda m: m.pop("tensors") and m, "missing required field 'tensors'"),
    "step_abc": (lambda m: m.update(step="abc") or m, "step: expected an integer"),
    "negative_shape": (lambda m: m["tensors"]["w"].update(shape=[-3, 8]) or m, "shape[0]: expected an integer in 0.."),
    "dtype_type": (lambda m: m["tensors"]["w"].update(dtype=5) or m, ".dtype: expected one of"),
    "chunks_type": (lambda m: m["tensors"]["w"].update(chunks="x") or m, ".chunks: expected a list"),
    "size_type": (lambda m: next(iter(m["files"].values())).update(size="big") or m, ".size: expected an integer"),
    "file_traversal": (lambda m: _chunk(m).update(file="../../etc/passwd") or m, "expected a plain file name"),
    "files_absolute": (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "crc32": "00000000"}}) or m,
                       "expected a file name inside the step directory"),
    "region_outside": (lambda m: _chunk(m)["region"][0].__setitem__(0, 60) or m, "a box inside the tensor's shape"),
    "offset_outside": (lambda m: _chunk(m).update(offset=10 ** 9) or m, "a byte range inside data_00000"),
    "length_wrong": (lambda m: _chunk(m).update(length=12) or m, "region elements x float32 size"),
    "table_outside": (lambda m: _chunk(m)["blocks"].update(index=10 ** 6) or m, "entries inside data_00000.crc32"),
    "crc_type": (lambda m: _chunk(m).update(crc32=17) or m, ".crc32: expected 8 hex digits"),
    # numbers no real checkpoint holds: refused by name (they were "unexpected OverflowError" in
    # inspect, or accepted: a world of 10^30 ranks)
    "size_huge": (lambda m: next(iter(m["files"].values())).update(size=10 ** 400) or m,
                  ".size: expected an integer in 0..9,223,372,036,854,775,807"),
    "step_huge": (lambda m: m.update(step=10 ** 400) or m, "step: expected an integer in 0.."),
    "created_huge": (lambda m: m.update(created_unix=10 ** 400) or m, "created_unix: expected a finite number"),
    "world_huge": (lambda m: m.update(world_size=10 ** 30) or m, "world_size: expected an integer in 1..262,144"),
    "writer_huge": (lambda m: next(iter(m["files"].values())).update(writer_rank=10 ** 30) or m,
                    ".writer_rank: expected an integer in -1..262,143"),
    "dim_huge": (lambda m: m["tensors"]["w"].update(shape=[10 ** 30, 8]) or m, "shape[0]: expected an integer in 0.."),
    "rank_key_not_ascii": (lambda m: m.update(rank_state_files={"\u00b2": next(iter(m["files"]))}) or m,
                           "rank_state_files key: expected a rank number"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("schema") / "ck")
    eng = CheckpointEngine(root)
    eng.save(3, [full_shard("w", torch.randn(64, 8))])
    eng.wait()
    d = commit_mod.resolve(root)
    return root, d, open(os.path.join(d, "manifest.json")).read()


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_manifest_is_a_typed_one_line_error(good, case, capsys):
    root, d, text = good
    fn, msg = CASES[case]
    path = os.path.join(d, "manifest.json")
    try:
        with open(path, "w") as f:
            json.dump(_rechecksum(fn(json.loads(text))), f)
        with pytest.raises(ManifestError) as ei:
            commit_mod.read_manifest(d)
        assert msg in str(ei.value) and "invalid manifest" in str(ei.value), str(ei.value)
        with pytest.raises(ManifestError):
            CheckpointEngine(root).load(None, [full_shard("w", torch.zeros(64, 8))])
        for cmd in ("verify", "inspect"):
            capsys.readouterr()
            assert cli_main([cmd, root]) == 1
            out = capsys.readouterr()
            lines = [ln for ln in out.err.splitlines() if ln.strip()]
            assert len(lines) == 1 and msg in lines[0] and "Traceback" not in out.err, (cmd, out.err)
    finally:
        with open(path, "w") as f:
            f.write(text)


def test_cli_process_exit_code_and_message(good):
    root, d, text = good
    path = os.path.join(d, "manifest.json")
    try:
        with open(path, "w") as f:
            json.dump(_rechecksum(CASES["step_abc"][0](json.loads(text))), f)
        p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "verify", root], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 1 and "step: expected an integer in 0..9,223,372,036,854,775,807, got 'abc'" in p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    finally:
        with open(path, "w") as f:
            f.write(text)
    assert cli_main(["verify", root]) == 0


_FILE_CASES = {"json_list", "size_type", "files_absolute", "size_huge", "writer_huge"}   # faults in what files_of reads


@pytest.mark.parametrize("case", sorted(CASES))
def test_files_of_checks_what_it_reads_like_a_full_parse(good, case):
    """``Manifest.files_of`` (a peer-copy receiver's file list) raises the full parse's error for
    a fault in the document or its files, and skips the tensors: their faults are not its to see."""
    from elastor_ds.checkpoint.planning.manifest import Manifest
    _, _, text = good
    fn, msg = CASES[case]
    bad = json.dumps(_rechecksum(fn(json.loads(text))))
    if case in _FILE_CASES:
        with pytest.raises(ManifestError) as ei:
            Manifest.files_of(bad, where="m")
        assert msg in str(ei.value) and "invalid manifest" in str(ei.value), str(ei.value)
    else:
        assert Manifest.files_of(bad, where="m") == Manifest.loads(text).files


def test_files_of_refuses_a_changed_document_an_unknown_version_and_non_json(good):
    from elastor_ds.checkpoint.planning.manifest import Manifest
    from elastor_ds.errors import FormatVersionError
    _, _, text = good
    files = Manifest.files_of(text, where="m")
    assert files == Manifest.loads(text).files and set(files) == {"data_00000.safetensors", "data_00000.crc32"}
    d = json.loads(text)
    d["files"]["data_00000.safetensors"]["size"] += 1          # not re-checksummed: a corrupt document
    with pytest.raises(ManifestError, match="checksum"):
        Manifest.files_of(json.dumps(d), where="m")
    with pytest.raises(FormatVersionError, match="not readable"):
        Manifest.files_of(json.dumps(_rechecksum({**json.loads(text), "format_version": 99})), where="m")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.files_of(text[:-5], where="m")
