"""An independent reader written from docs/checkpoint-format.md alone (json/struct/zlib/numpy only):
checkpoints written by the engine must read back bit for bit, and the CRCs the doc describes (file
CRCs in ``files``, the cumulative per-block tables, the manifest checksum) must catch a flipped byte.
Nothing of elastor_ds's reader or manifest code is used; the engine only writes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine, TensorShard
from elastor_ds.checkpoint.shards import full_shard
from elastor_ds.layout.region import Region

pytestmark = pytest.mark.unit

# -- the reader, from the doc ---------------------------------------------------------------------
# "dtype: one of float64 ... float8_e5m2 (safetensors codes F64 ... F8_E5M2)"; bf16/fp8 as raw words
DTYPES = {"float64": (np.float64, "F64"), "float32": (np.float32, "F32"), "float16": (np.float16, "F16"),
          "bfloat16": (np.uint16, "BF16"), "int64": (np.int64, "I64"), "int32": (np.int32, "I32"),
          "int16": (np.int16, "I16"), "int8": (np.int8, "I8"), "uint8": (np.uint8, "U8"),
          "bool": (np.bool_, "BOOL"), "float8_e4m3fn": (np.uint8, "F8_E4M3"), "float8_e5m2": (np.uint8, "F8_E5M2")}


class Corrupt(Exception):
    pass


def resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    with open(os.path.join(path, "latest"), "rb") as f:
        raw = f.read()
    name = raw.decode("ascii").strip()
    assert raw == (name + "\n").encode() and name.startswith("step_") and name[5:].isdigit() and len(name) >= 14, raw
    return os.path.join(path, name)


def read_manifest(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "manifest.json"), encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise Corrupt(f"manifest: {e}") from None
    assert doc["format"] == "elastor" and doc["format_version"] == 2
    body = {k: v for k, v in doc.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    if doc.get("checksum") != "sha256:" + hashlib.sha256(canon.encode()).hexdigest():
        raise Corrupt("manifest checksum")
    assert set(doc) == {"format", "format_version", "step", "world_size", "created_unix", "layout", "model",
                        "extra", "rank_state_files", "files", "tensors", "checksum"}, sorted(doc)
    return doc


def check_files(step_dir: str, doc: dict) -> None:
    for name, meta in doc["files"].items():
        assert "/" not in name or name.startswith("rank_state/"), name
        with open(os.path.join(step_dir, name), "rb") as f:
            data = f.read()
        assert re_hex8(meta["crc32"]) and len(data) == meta["size"], (name, meta)
        if zlib.crc32(data) != int(meta["crc32"], 16):
            raise Corrupt(f"file {name}")


def re_hex8(s: str) -> bool:
    return len(s) == 8 and all(c in "0123456789abcdef" for c in s)


def chunk_bytes(step_dir: str, tensor: dict, c: dict) -> bytes:
    path = os.path.join(step_dir, c["file"])
    with open(path, "rb") as f:   # cross-check the manifest's absolute offsets with the safetensors header
        hlen = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(hlen))
        entry = header[c["key"]]
        f.seek(c["offset"])
        data = f.read(c["length"])
    offs, sizes = c["region"]
    assert header["__metadata__"]["format"] == "elastor" and c["key"].rpartition("#")[2] == ",".join(map(str, offs))
    assert entry["dtype"] == DTYPES[tensor["dtype"]][1] and entry["shape"] == sizes
    start, end = entry["data_offsets"]   # relative to the data section, which follows the header
    assert 8 + hlen + start == c["offset"] and end - start == c["length"]
    assert c["length"] == int(np.prod(sizes, dtype=np.int64)) * np.dtype(DTYPES[tensor["dtype"]][0]).itemsize
    assert len(data) == c["length"]
    b = c["blocks"]
    n = -(-len(data) // b["size"])
    with open(os.path.join(step_dir, b["table"]), "rb") as f:
        f.seek(4 * b["index"])
        table = struct.unpack(f"<{n}I", f.read(4 * n))
    crc = 0
    for i in range(n):   # cumulative CRC32 from the chunk's first byte, one little-endian uint32 per block
        crc = zlib.crc32(data[i * b["size"]:(i + 1) * b["size"]], crc)
        if crc != table[i]:
            raise Corrupt(f"{c['file']}: block {i} of {c['key']}")
    if (n and table[-1] != int(c["crc32"], 16)) or zlib.crc32(data) != int(c["crc32"], 16):
        raise Corrupt(f"{c['file']}: chunk {c['key']}")
    return data


def read_checkpoint(path: str, file_crcs: bool = True) -> tuple[dict, dict]:
    step_dir = resolve(path)
    doc = read_manifest(step_dir)
    if file_crcs:
        check_files(step_dir, doc)
    out = {}
    for name, t in doc["tensors"].items():
        arr = np.zeros(t["shape"], dtype=DTYPES[t["dtype"]][0])
        seen = np.zeros(t["shape"], dtype=np.int8)
        for c in t["chunks"]:
            offs, sizes = c["region"]
            box = tuple(slice(o, o + s) for o, s in zip(offs, sizes))
            arr[box] = np.frombuffer(chunk_bytes(step_dir, t, c), dtype=arr.dtype).reshape(sizes)
            seen[box] += 1
        assert (seen == 1).all(), f"{name}: chunks do not cover the tensor exactly once"
        out[name] = (t["dtype"], arr)
    return doc, out


# -- the checkpoints --------------------------------------------------------------------------------
def tensors() -> dict:
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "tiled.f32": r(64, 8192),                          # 2 MiB: 8 column tiles of 1024 columns
        "tiled.bf16": r(32, 16384).to(torch.bfloat16),     # 1 MiB: 8 tiles
        "rows.f32": r(64, 48), "f64.3d": r(3, 5, 7).double(), "half": r(33, 7).half(),
        "i64": torch.randint(-2**62, 2**62, (17,), generator=g), "i32": torch.randint(-9, 9, (9, 3), generator=g).int(),
        "i16": torch.randint(-9, 9, (11,), generator=g).short(), "i8": torch.randint(-9, 9, (13,), generator=g).to(torch.int8),
        "u8": torch.randint(0, 255, (5, 5), generator=g).to(torch.uint8), "mask": torch.rand(19, generator=g) > 0.5,
        "f8a": r(6, 4).to(torch.float8_e4m3fn), "f8b": r(6, 4).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.25), "scalar.bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 5), "empty.i32": torch.zeros(0, dtype=torch.int32),
        "noncontig": r(40, 30).t(), "layers.0.w#odd": r(4, 4),
    }


def shards(T: dict) -> list:
    out = []
    for name, t in T.items():
        if name == "tiled.f32":     # column shards: [0, 3000) is < 1 MiB (one chunk), [3000, 8192) tiles at 3072, 4096, ...
            for o, s in ((0, 3000), (3000, 5192)):
                out.append(TensorShard(name, tuple(t.shape), Region((0, o), (64, s)), t[:, o:o + s]))
        elif name == "rows.f32":    # two row shards
            for o, s in ((0, 20), (20, 44)):
                out.append(TensorShard(name, tuple(t.shape), Region((o, 0), (s, 48)), t[o:o + s]))
        else:
            out.append(full_shard(name, t))
    return out


def raw(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    return t.numpy()


EXTRA = {"iteration": 7, "best": float("inf"), "text": "é☃"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fmt") / "ckpt")
    T = tensors()
    eng = CheckpointEngine(root)
    eng.save(1, [full_shard("old", torch.ones(3))])
    eng.save(12, shards(T), extra=EXTRA, rank_state={"seed": 5})
    eng.finalize()
    return root, T


def test_doc_reader_reads_every_tensor_bit_for_bit(ckpt):
    root, T = ckpt
    with open(os.path.join(root, "latest"), "rb") as f:
        assert f.read() == b"step_000000012\n"
    doc, out = read_checkpoint(root)
    assert doc["step"] == 12 and doc["world_size"] == 1
    assert doc["extra"] == {"iteration": 7, "best": {"__elastor_float__": "inf"}, "text": "é☃"}
    assert set(out) == set(T)
    for name, t in T.items():
        dtype, arr = out[name]
        assert dtype == str(t.dtype).replace("torch.", ""), name
        want = raw(t)
        assert arr.shape == want.shape and arr.dtype == want.dtype and arr.tobytes() == want.tobytes(), name
    chunks = doc["tensors"]["tiled.f32"]["chunks"]
    assert sorted(c["region"][0][1] for c in chunks) == [0, 3000, 3072, 4096, 5120, 6144, 7168]
    assert len(doc["tensors"]["tiled.bf16"]["chunks"]) == 8
    assert doc["tensors"]["empty"]["chunks"] == []   # a tensor with no elements has no chunk
    assert doc["tensors"]["scalar"]["chunks"][0]["key"] == "scalar#"
    assert all(c["blocks"]["size"] == 4096 for t in doc["tensors"].values() for c in t["chunks"])
    state_file = os.path.join(resolve(root), doc["rank_state_files"]["0"])
    with open(state_file) as f:
        assert json.load(f) == {"seed": 5}


def _flip(path: str, at: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


@pytest.mark.parametrize("where", ["chunk", "table", "manifest"])
def test_doc_crcs_detect_a_flipped_byte(ckpt, tmp_path, where):
    root, _ = ckpt
    step = os.path.join(tmp_path, "step_000000012")
    shutil.copytree(resolve(root), step)
    doc = read_manifest(step)
    c = max(doc["tensors"]["tiled.f32"]["chunks"], key=lambda c: c["length"])
    if where == "chunk":      # a byte in the third block of a chunk: its block and the file CRC fail
        _flip(os.path.join(step, c["file"]), c["offset"] + 2 * c["blocks"]["size"] + 5)
    elif where == "table":    # that block's table entry
        _flip(os.path.join(step, c["blocks"]["table"]), 4 * (c["blocks"]["index"] + 2) + 1)
    else:                     # the last digit of a chunk offset in the manifest (still valid JSON)
        with open(os.path.join(step, "manifest.json"), "rb") as f:
            text = f.read()
        field = b'"offset":%d,' % c["offset"]
        _flip(os.path.join(step, "manifest.json"), text.index(field) + len(field) - 2, mask=0x01)
    if where != "manifest":
        with pytest.raises(Corrupt, match="block 2 of tiled.f32"):
            read_checkpoint(step, file_crcs=False)   # the block tables alone catch it
    with pytest.raises(Corrupt, match="file data_00000" if where != "manifest" else "manifest checksum"):
        read_checkpoint(step)
