"""The reader's O_DIRECT path (``DirSource.read_direct``): staged reads of storage files of 256 KiB
or more go from the disk into page-aligned buffers, widened to whole 4 KiB pages, bypassing the
page cache. Checked against the tensors themselves (bit for bit), with a read that starts inside a
page, a flipped byte (still caught by the block CRCs and named), and a file system that refuses
O_DIRECT (the buffered path, same bytes)."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from elastor_ds.checkpoint import reader as reader_mod
from elastor_ds.checkpoint import sources as sources_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard, full_shard
from elastor_ds.errors import CorruptCheckpointError
from elastor_ds.layout.region import Region


def _save(root: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # "a_odd" (3 x 333 floats): a chunk of 3,996 bytes, so the chunks after it in the data file
    # start inside a page and their O_DIRECT reads are widened
    ts = {"a_odd": torch.randn(3, 333, generator=g), "w": torch.randn(512, 2048, generator=g),
          "v": torch.randn(700_001, generator=g)}
    eng = CheckpointEngine(root)
    eng.save(1, [full_shard(n, t) for n, t in ts.items()])
    eng.finalize()
    return ts


def _load(root: str, ts) -> dict[str, torch.Tensor]:
    """All of ``w`` (its column tiles land as column blocks of the destination: staged reads), all
    of ``v`` into a strided destination (staged too) and ``a_odd``."""
    out = {"w": torch.zeros(512, 2048), "v2": torch.zeros(700_001, 2), "a_odd": torch.zeros(3, 333)}
    eng = CheckpointEngine(root)
    eng.load(None, [full_shard("w", out["w"]), TensorShard("v", (700_001,), Region((0,), (700_001,)), out["v2"][:, 0]),
                    full_shard("a_odd", out["a_odd"])])
    out["v"] = out["v2"][:, 0]
    return out


def _data_file(root: str) -> str:
    step = os.path.join(root, "step_000000001")
    return os.path.join(step, next(f for f in os.listdir(step) if f.endswith(".safetensors")))


def test_staged_reads_use_o_direct_and_are_exact(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    ts = _save(root)
    calls: list[tuple[int, int]] = []
    orig = sources_mod.DirSource.read_direct

    def spy(self, relpath, offset, view):
        got = orig(self, relpath, offset, view)
        assert got is not None and got > 0, (offset, len(view), got)   # O_DIRECT worked, not refused
        calls.append((offset, len(view)))
        return got
    monkeypatch.setattr(sources_mod.DirSource, "read_direct", spy)
    out = _load(root, ts)
    assert torch.equal(out["w"], ts["w"]) and torch.equal(out["v"], ts["v"])
    assert torch.equal(out["a_odd"], ts["a_odd"])
    assert calls, "no read went through O_DIRECT"
    assert all(off % 4096 == 0 and n % 4096 == 0 for off, n in calls), calls
    # every byte of w and v came that way, and their chunks start inside pages (widened reads)
    assert sum(n for _, n in calls) >= (512 * 2048 + 700_001) * 4, calls
    import json
    with open(os.path.join(root, "step_000000001", "manifest.json")) as f:
        tensors = json.load(f)["tensors"]
    chunks = [c for n in ("w", "v") for c in tensors[n]["chunks"]]
    assert all(c["offset"] % 4096 for c in chunks), chunks


def test_a_flipped_byte_read_with_o_direct_is_caught_and_named(tmp_path):
    root = str(tmp_path / "ck")
    ts = _save(root)
    path = _data_file(root)
    size = os.path.getsize(path)
    at = size - 100_000   # inside "v" (the last chunk), read with O_DIRECT
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        _load(root, ts)


def test_a_file_system_that_refuses_o_direct_reads_through_the_page_cache(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    ts = _save(root)
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(sources_mod.os, "open", no_direct)
    used = []
    orig = reader_mod._Reader._read_direct

    def spy(self, *a):
        job = orig(self, *a)
        used.append(job is not None)
        return job
    monkeypatch.setattr(reader_mod._Reader, "_read_direct", spy)
    out = _load(root, ts)
    assert torch.equal(out["w"], ts["w"]) and torch.equal(out["v"], ts["v"])
    assert used and not any(used)   # tried once, refused, then the buffered path
