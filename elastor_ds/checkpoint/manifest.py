"""The checkpoint manifest: a versioned, human-readable JSON document written last.

A checkpoint is a step directory holding data files (safetensors) and ``manifest.json``. The
manifest says, for every saved tensor, its global shape and dtype and where each chunk (a region of
the global tensor) lives: file, safetensors key, absolute byte offset and length. It also records
per-file sizes and CRC32 checksums, the source layout, the model/sharding description, global extra
state (iteration, consumed samples, LR scheduler, user metadata) and the per-rank state files.

Format versions: 1 (current). Readers keep accepting every version listed in
``READABLE_VERSIONS``; a newer unknown version raises :class:`FormatVersionError`.

Pure: no torch, no I/O beyond (de)serialising text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import FormatVersionError, IncompleteCheckpointError
from ..layout.region import Region

FORMAT_NAME = "elastor"
FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)
MANIFEST_NAME = "manifest.json"

# safetensors dtype codes <-> torch dtype names (strings keep this module torch-free)
DTYPE_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class Chunk:
    """One region of a global tensor stored contiguously (row-major) in one file."""

    file: str
    key: str
    region: Region
    offset: int   # absolute byte offset in the file
    length: int   # bytes
    crc32: int | None = None  # of the chunk's bytes; readers that read a whole chunk check it

    def to_json(self) -> dict[str, Any]:
        d = {"file": self.file, "key": self.key, "region": self.region.to_json(),
             "offset": self.offset, "length": self.length}
        if self.crc32 is not None:
            d["crc32"] = f"{self.crc32:08x}"
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Chunk":
        crc = d.get("crc32")
        return Chunk(d["file"], d["key"], Region.from_json(d["region"]), int(d["offset"]), int(d["length"]),
                     int(crc, 16) if crc is not None else None)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "chunks": [c.to_json() for c in self.chunks]}

    @staticmethod
    def from_json(name: str, d: Mapping[str, Any]) -> "TensorEntry":
        return TensorEntry(name, tuple(d["shape"]), d["dtype"], tuple(Chunk.from_json(c) for c in d["chunks"]))


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    crc32: int
    writer_rank: int

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": f"{self.crc32:08x}", "writer_rank": self.writer_rank}

    @staticmethod
    def from_json(name: str, d: Mapping[str, Any]) -> "FileEntry":
        return FileEntry(name, int(d["size"]), int(d["crc32"], 16), int(d.get("writer_rank", -1)))


@dataclass(frozen=True)
class Manifest:
    step: int
    tensors: Mapping[str, TensorEntry]
    files: Mapping[str, FileEntry]
    layout: Mapping[str, Any] | None = None
    model: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    rank_state_files: Mapping[int, str] = field(default_factory=dict)
    world_size: int = 1
    created_unix: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "layout": self.layout,
            "model": self.model,
            "extra": self.extra,
            "rank_state_files": {str(k): v for k, v in sorted(self.rank_state_files.items())},
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False)

    @staticmethod
    def from_json(d: Mapping[str, Any], where: str = "") -> "Manifest":
        if d.get("format") != FORMAT_NAME:
            raise IncompleteCheckpointError(f"{where}: not an elastor manifest (format={d.get('format')!r})")
        v = d.get("format_version")
        if v not in READABLE_VERSIONS:
            raise FormatVersionError(f"{where}: checkpoint format version {v} is not readable by this elastor_ds "
                                     f"(reads {list(READABLE_VERSIONS)}); upgrade elastor_ds")
        return Manifest(
            step=int(d["step"]),
            tensors={k: TensorEntry.from_json(k, t) for k, t in d["tensors"].items()},
            files={k: FileEntry.from_json(k, f) for k, f in d["files"].items()},
            layout=d.get("layout"), model=d.get("model"), extra=d.get("extra", {}),
            rank_state_files={int(k): v for k, v in d.get("rank_state_files", {}).items()},
            world_size=int(d.get("world_size", 1)), created_unix=float(d.get("created_unix", 0.0)),
            format_version=v)

    @staticmethod
    def loads(text: str, where: str = "") -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise IncompleteCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        return Manifest.from_json(d, where)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())
