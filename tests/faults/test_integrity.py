"""Integrity on every read path: a flipped byte is caught under every read pattern (full, row half,
column half, strided TP slice, unaligned slice, 3-D box, reshard across ranks), names the tensor and
the file, and triggers the fallback; a load never returns wrong bytes; the manifest's own checksum;
format-1 checkpoints keep loading and stay protected (whole-chunk checks)."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from dist_utils import run_world
from elastor_ds.checkpoint import CheckpointEngine, TensorShard
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.planning.manifest import DTYPE_SIZES
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.cli import main as cli_main
from elastor_ds.errors import CorruptCheckpointError, IncompleteCheckpointError, ManifestError, UnsafeCheckpointError
from elastor_ds.layout.region import Region

pytestmark = pytest.mark.integration

SHAPES = {"w": (64, 4096), "cube": (6, 10, 300), "big": (128, 4096)}


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _save_two_steps(root: str) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1 and 2; ``w`` written as two row halves (two chunks), ``cube`` as two dim-1 halves."""
    eng = CheckpointEngine(root, keep=3)
    out = {}
    for step in (1, 2):
        st = _state(step)
        w, c = st["w"], st["cube"]
        eng.save(step, [TensorShard("w", SHAPES["w"], Region((0, 0), (32, 4096)), w[:32]),
                        TensorShard("w", SHAPES["w"], Region((32, 0), (32, 4096)), w[32:]),
                        TensorShard("cube", SHAPES["cube"], Region((0, 0, 0), (6, 5, 300)), c[:, :5]),
                        TensorShard("cube", SHAPES["cube"], Region((0, 5, 0), (6, 5, 300)), c[:, 5:]),
                        full_shard("big", st["big"])])  # 2 MiB: stored as 4 column tiles
        eng.wait()
        out[step] = st
    return out


def _byte_of(step_dir: str, name: str, index: tuple[int, ...]) -> tuple[str, int]:
    """(file, absolute byte offset) of element ``index`` of tensor ``name``, computed from the manifest's
    chunk boxes (row-major inside each chunk) without the load planner."""
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    t = man["tensors"][name]
    for ch in t["chunks"]:
        offs, sizes = ch["region"]
        if all(o <= i < o + s for i, o, s in zip(index, offs, sizes)):
            lin = 0
            for i, o, s in zip(index, offs, sizes):
                lin = lin * s + (i - o)
            return ch["file"], ch["offset"] + lin * DTYPE_SIZES[t["dtype"]]
    raise AssertionError(f"{name}{index} is in no chunk")


def _flip(path: str, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


# (tensor, requested box): full, row half, column half, TP8 column slice (strided), an unaligned slice,
# a 3-D box cutting dims 0 and 2
PATTERNS = {
    "full": ("w", Region((0, 0), (64, 4096))),
    "row_half": ("w", Region((32, 0), (32, 4096))),
    "column_half": ("w", Region((0, 2048), (64, 2048))),
    "tp8_slice": ("w", Region((0, 1536), (64, 512))),
    "unaligned": ("w", Region((5, 333), (50, 1001))),
    "cube_box": ("cube", Region((1, 2, 17), (4, 6, 200))),
    "tiled_column_half": ("big", Region((0, 2048), (128, 2048))),
    "tiled_rows": ("big", Region((10, 0), (50, 4096))),
    "tiled_unaligned": ("big", Region((3, 700), (100, 2500))),
}


def _box(t: torch.Tensor, box: Region) -> torch.Tensor:
    return t[tuple(slice(o, e) for o, e in zip(box.offsets, box.ends))]


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_flipped_byte_detected_under_every_read_pattern(tmp_path, pattern):
    root = str(tmp_path / "ck")
    states = _save_two_steps(root)
    name, box = PATTERNS[pattern]
    step_dir = commit_mod.resolve(root)
    rng = random.Random(pattern)
    # a needed element at the start, at the end and somewhere inside the requested box
    picks = [box.offsets, tuple(e - 1 for e in box.ends),
             tuple(rng.randrange(o, e) for o, e in zip(box.offsets, box.ends))]
    for idx in picks:
        fname, off = _byte_of(step_dir, name, idx)
        path = os.path.join(step_dir, fname)
        original = open(path, "rb").read()
        _flip(path, off + rng.randrange(DTYPE_SIZES["float32"]))
        dst = torch.zeros(box.sizes)
        with pytest.raises(CorruptCheckpointError) as ei:
            CheckpointEngine(root).load(None, [TensorShard(name, SHAPES[name], box, dst)])
        msg = str(ei.value)
        assert f"tensor {name!r}" in msg and fname in msg and "CRC32" in msg, msg
        res = CheckpointEngine(root).load(None, [TensorShard(name, SHAPES[name], box, dst)], fallback=True)
        assert res.step == 1 and res.fell_back and torch.equal(dst, _box(states[1][name], box))
        with open(path, "wb") as f:
            f.write(original)
    dst = torch.zeros(box.sizes)
    res = CheckpointEngine(root).load(None, [TensorShard(name, SHAPES[name], box, dst)])
    assert res.step == 2 and not res.fell_back and torch.equal(dst, _box(states[2][name], box))


def _element_at(man: dict, name: str, pos: int):
    """The global index of the element of ``name`` whose bytes include file offset ``pos`` (or None)."""
    for ch in man["tensors"][name]["chunks"]:
        if ch["offset"] <= pos < ch["offset"] + ch["length"]:
            lin = (pos - ch["offset"]) // DTYPE_SIZES[man["tensors"][name]["dtype"]]
            co, cs = ch["region"]
            rel = []
            for s in reversed(cs):
                rel.append(lin % s)
                lin //= s
            return tuple(o + i for o, i in zip(co, reversed(rel)))
    return None


def test_column_tiles_make_a_column_split_read_exactly_its_bytes(tmp_path):
    root = str(tmp_path / "ck")
    states = _save_two_steps(root)
    man = json.load(open(os.path.join(commit_mod.resolve(root), "manifest.json")))
    assert [c["region"] for c in man["tensors"]["big"]["chunks"]] == [[[0, c], [128, 1024]] for c in (0, 1024, 2048,
                                                                                                          3072)]
    box = Region((0, 2048), (128, 2048))
    dst = torch.zeros(box.sizes)
    res = CheckpointEngine(root).load(None, [TensorShard("big", SHAPES["big"], box, dst)])
    assert torch.equal(dst, _box(states[2]["big"], box))
    # two whole tiles + the whole block-CRC table of their file (read whole: it is checked against
    # the manifest's CRC of it before any entry is trusted), nothing else
    table = os.path.getsize(os.path.join(commit_mod.resolve(root), man["tensors"]["big"]["chunks"][0]["blocks"]["table"]))
    assert res.bytes_read == res.bytes_needed + table


def test_a_load_never_returns_wrong_bytes(tmp_path):
    """Random single-bit flips anywhere in a data file (header, other chunks, needed bytes) under random
    requested boxes: every load either raises CorruptCheckpointError or returns exactly the saved
    values, and it always raises when the flipped byte belongs to an element it needs."""
    root = str(tmp_path / "ck")
    states = _save_two_steps(root)
    step_dir = commit_mod.resolve(root)
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    path = os.path.join(step_dir, "data_00000.safetensors")
    original = open(path, "rb").read()
    rng = random.Random(11)
    raised = needed_hits = 0
    for trial in range(150):
        name = rng.choice(sorted(SHAPES))
        shape = SHAPES[name]
        offs = tuple(rng.randrange(s) for s in shape)
        box = Region(offs, tuple(rng.randint(1, s - o) for s, o in zip(shape, offs)))
        if trial % 2:
            pos = rng.randrange(len(original))
        else:  # aim at a needed element half of the time
            idx = tuple(rng.randrange(o, e) for o, e in zip(box.offsets, box.ends))
            pos = _byte_of(step_dir, name, idx)[1] + rng.randrange(4)
        el = _element_at(man, name, pos)
        needed = el is not None and all(o <= x < e for x, o, e in zip(el, box.offsets, box.ends))
        with open(path, "r+b") as f:
            f.seek(pos)
            f.write(bytes([original[pos] ^ (1 << rng.randrange(8))]))
        dst = torch.full(box.sizes, float("nan"))
        try:
            CheckpointEngine(root).load(None, [TensorShard(name, shape, box, dst)])
        except CorruptCheckpointError:
            raised += 1
        else:
            assert not needed, f"trial {trial}: a flipped needed byte at {pos} was not detected"
            assert torch.equal(dst, _box(states[2][name], box)), f"trial {trial}: wrong data returned"
        needed_hits += needed
        with open(path, "r+b") as f:
            f.seek(pos)
            f.write(original[pos:pos + 1])
    assert needed_hits >= 60 and raised >= needed_hits


def test_reshard_across_ranks_falls_back_on_every_rank(tmp_path):
    run_world(_reshard_worker, 2, str(tmp_path / "ck"), timeout_s=120)


def _reshard_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    from elastor_ds.comm import TorchComm
    eng = CheckpointEngine(root, TorchComm.create(60), keep=3)
    full = {s: torch.arange(64 * 4096, dtype=torch.float32).view(64, 4096) * s for s in (1, 2)}
    for step in (1, 2):  # saved as row halves (TP over rows, one file per rank)
        eng.save(step, [TensorShard("w", (64, 4096), Region((32 * rank, 0), (32, 4096)),
                                    full[step][32 * rank:32 * rank + 32].clone())])
        eng.wait()
    dist.barrier()
    if rank == 0:  # corrupt one byte in rank 1's file of step 2, inside what rank 0 will read
        d = commit_mod.resolve(root)
        fname, off = _byte_of(d, "w", (40, 10))
        assert fname == "data_00001.safetensors"
        _flip(os.path.join(d, fname), off + 1)
    dist.barrier()
    dst = torch.zeros(64, 2048)  # column halves: rank 0 reads columns 0..2047 of both files
    box = Region((0, 2048 * rank), (64, 2048))
    with pytest.raises(CorruptCheckpointError, match="data_00001.safetensors"):
        eng.load(None, [TensorShard("w", (64, 4096), box, dst)])  # raised on both ranks
    res = eng.load(None, [TensorShard("w", (64, 4096), box, dst)], fallback=True)
    assert res.step == 1 and res.fell_back
    assert torch.equal(dst, _box(full[1], box))
    assert res.bytes_read <= 1.01 * res.bytes_needed


def _tamper_manifest(step_dir: str, fn) -> None:
    p = os.path.join(step_dir, "manifest.json")
    d = json.load(open(p))
    fn(d)
    with open(p, "w") as f:
        json.dump(d, f)


def test_manifest_checksum_detects_edits_and_falls_back(tmp_path, capsys):
    root = str(tmp_path / "ck")
    states = _save_two_steps(root)
    d = commit_mod.resolve(root)
    assert cli_main(["verify", root]) == 0
    _tamper_manifest(d, lambda m: m["extra"].update(iteration=99))
    with pytest.raises(ManifestError, match="checksum"):
        commit_mod.read_manifest(d)
    capsys.readouterr()
    assert cli_main(["verify", root]) == 1
    err = capsys.readouterr().err
    assert "checksum" in err and "Traceback" not in err
    dst = torch.zeros(64, 4096)
    res = CheckpointEngine(root).load(None, [full_shard("w", dst)], fallback=True)
    assert res.step == 1 and torch.equal(dst, states[1]["w"])


def _as_format_1(step_dir: str) -> None:
    """Rewrite a step as format 1 wrote it: no block tables, no manifest checksum."""
    def strip(m):
        m["format_version"] = 1
        m.pop("checksum")
        for t in m["tensors"].values():
            for c in t["chunks"]:
                c.pop("blocks")
        for name in [n for n in m["files"] if n.endswith(".crc32")]:
            m["files"].pop(name)
            os.remove(os.path.join(step_dir, name))
    _tamper_manifest(step_dir, strip)


def test_format_1_checkpoints_load_and_partial_reads_stay_verified(tmp_path, capsys):
    root = str(tmp_path / "ck")
    states = _save_two_steps(root)
    d = commit_mod.resolve(root)
    _as_format_1(d)
    assert cli_main(["verify", root]) == 0
    assert cli_main(["inspect", root]) == 0
    assert "elastor v1" in capsys.readouterr().out
    box = Region((0, 2048), (64, 2048))
    dst = torch.zeros(box.sizes)
    CheckpointEngine(root).load(None, [TensorShard("w", SHAPES["w"], box, dst)])
    assert torch.equal(dst, _box(states[2]["w"], box))
    fname, off = _byte_of(d, "w", (3, 3000))
    _flip(os.path.join(d, fname), off)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'.*CRC32"):
        CheckpointEngine(root).load(None, [TensorShard("w", SHAPES["w"], box, dst)])


@pytest.mark.parametrize("pointer,error", [(b"\x00\xff garbage\n", IncompleteCheckpointError),
                                           (b"not a step dir", UnsafeCheckpointError),
                                           (b"../elsewhere/step_2", UnsafeCheckpointError),
                                           (b"step_2/../../x", UnsafeCheckpointError)])
def test_garbage_latest_is_never_followed_and_fallback_uses_the_roots_own_steps(tmp_path, pointer, error):
    root = str(tmp_path / "ck")
    states = _save_two_steps(root)
    with open(os.path.join(root, "latest"), "wb") as f:
        f.write(pointer)
    dst = torch.zeros(64, 4096)
    with pytest.raises(error, match="latest"):
        CheckpointEngine(root).load(None, [full_shard("w", dst)])
    assert not dst.any()
    res = CheckpointEngine(root).load(None, [full_shard("w", dst)], fallback=True)
    assert res.step == 2 and torch.equal(dst, states[2]["w"])
