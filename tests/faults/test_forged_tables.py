"""Forged data with a recomputed block-CRC table entry (issue 19, "forged data passes the checks").

An attacker (or a careless tool) edits bytes of a data file and rewrites the matching entries of
its block-CRC table so that the block checks pass. The table's own CRC in the manifest no longer
matches, so a load must refuse those bytes, whatever source the table comes from (the only one, or
the last of several) and whatever the read pattern (a partial read reads only some entries).

Oracle: the tensors that were saved (kept here) and zlib's CRC32 (the attacker's tool), never the
reader under test."""
from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.sources import LOCAL_MEMORY, STORAGE, DirSource
from elastor_ds.errors import CorruptCheckpointError
from elastor_ds.layout.region import Region

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SHAPE = (64, 1024)   # 256 KiB of float32


def _save(root: str) -> torch.Tensor:
    w = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(3))
    eng = CheckpointEngine(root, async_save=False)
    eng.save(5, [TensorShard("w", SHAPE, Region((0, 0), (32, 1024)), w[:32]),
                 TensorShard("w", SHAPE, Region((32, 0), (32, 1024)), w[32:])])
    eng.wait()
    return w


def _forge(step_dir: str, row: int) -> None:
    """Set w[row, 0] to 1e6 in the data file and recompute, with zlib, the cumulative block CRCs of
    its chunk in the table file (the manifest is left alone: its checksum would show an edit)."""
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    chunk = next(c for c in man["tensors"]["w"]["chunks"] if c["region"][0][0] <= row < c["region"][0][0]
                 + c["region"][1][0])
    data_path = os.path.join(step_dir, chunk["file"])
    at = chunk["offset"] + (row - chunk["region"][0][0]) * SHAPE[1] * 4
    with open(data_path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<f", 1e6))
        f.seek(chunk["offset"])
        body = f.read(chunk["length"])
    blk = chunk["blocks"]
    crc, entries = 0, []
    for a in range(0, len(body), blk["size"]):
        crc = zlib.crc32(body[a:a + blk["size"]], crc)
        entries.append(crc)
    with open(os.path.join(step_dir, blk["table"]), "r+b") as f:
        f.seek(blk["index"] * 4)
        f.write(struct.pack(f"<{len(entries)}I", *entries))


@pytest.mark.parametrize("pattern", ["row", "column", "full"])
def test_edited_bytes_with_a_recomputed_table_entry_are_refused(tmp_path, pattern):
    root = str(tmp_path / "ck")
    _save(root)
    step = commit_mod.resolve(root)
    _forge(step, row=40)
    box = {"row": Region((32, 0), (32, 1024)), "column": Region((0, 0), (64, 512)), "full": Region.full(SHAPE)}[pattern]
    dst = torch.zeros(box.sizes)
    with pytest.raises(CorruptCheckpointError, match="CRC32"):
        CheckpointEngine(root).load(None, [TensorShard("w", SHAPE, box, dst)])
    assert not (dst == 1e6).any()


def test_forged_table_in_memory_and_in_storage_is_refused_from_both(tmp_path):
    """Two sources, both forged the same way: neither table matches the manifest, so the load fails
    as corrupt (the last source's table is checked too), it does not return the forged value."""
    mem, st = str(tmp_path / "mem"), str(tmp_path / "st")
    _save(mem)
    _save(st)
    _forge(commit_mod.resolve(mem), row=40)
    _forge(commit_mod.resolve(st), row=40)
    st_step = commit_mod.resolve(st)
    dst = torch.zeros(32, 1024)
    with pytest.raises(CorruptCheckpointError):
        CheckpointEngine(mem).load(None, [TensorShard("w", SHAPE, Region((32, 0), (32, 1024)), dst)],
                                   sources=lambda d, m: [DirSource(d, LOCAL_MEMORY), DirSource(st_step, STORAGE)])
    assert not (dst == 1e6).any()


def test_forged_memory_copy_falls_back_to_the_good_storage_copy(tmp_path):
    mem, st = str(tmp_path / "mem"), str(tmp_path / "st")
    w = _save(mem)
    _save(st)
    _forge(commit_mod.resolve(mem), row=40)
    st_step = commit_mod.resolve(st)
    dst = torch.zeros(32, 1024)
    CheckpointEngine(mem).load(None, [TensorShard("w", SHAPE, Region((32, 0), (32, 1024)), dst)],
                               sources=lambda d, m: [DirSource(d, LOCAL_MEMORY), DirSource(st_step, STORAGE)])
    assert torch.equal(dst, w[32:])
