"""The checkpoint manifest: a versioned, checksummed, schema-validated JSON document written last.

A checkpoint is a step directory holding data files (safetensors), their block-CRC tables and
``manifest.json``. The manifest says, for every saved tensor, its global shape and dtype and where
each chunk (a region of the global tensor) lives: file, safetensors key, absolute byte offset and
length, the CRC32 of the whole chunk and (format 2) where its block CRCs are. It also records
per-file sizes and CRC32s, the source layout, the model description, global extra state and the
per-rank state files.

Block CRCs (format 2): a chunk is cut into fixed-size blocks of ``block.size`` bytes (the last one
shorter); its table (little-endian uint32 in the file ``block.table`` from entry ``block.index``)
holds the *cumulative* CRC32 of the chunk at the end of each block. Any run of whole blocks
``[i, j)`` is verified with one ``zlib.crc32(bytes, table[i-1])`` (0 for i == 0) that must equal
``table[j-1]``; the last entry is the chunk's CRC. Readers therefore verify every byte they read
after widening each read to block boundaries (see :mod:`.load_plan`).

The manifest carries ``checksum`` (``sha256:<hex>`` of its canonical JSON without that field);
format 1 manifests have none and stay readable.

Format versions: 1 (chunk CRCs only), 2 (current: block CRCs, manifest checksum). Readers accept
every version in ``READABLE_VERSIONS``; an unknown one raises :class:`FormatVersionError`. Every
field is validated on reading (:class:`ManifestError` names the field and the bad value).

Pure: no torch, no I/O beyond (de)serialising text.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ...errors import FormatVersionError, ManifestError
from ...layout.compact_plan import MAX_DEVICES as MAX_RANKS   # the planner's bound: no job has more ranks
from ...layout.region import Region, first_overlap
from ...cli_types import has_control_chars  # noqa: F401 - manifest names: refused with it, re-exported
from ...user_json import strict_json

FORMAT_NAME = "elastor"
INT64_MAX = (1 << 63) - 1   # every size, offset, step and dimension of a manifest fits in 64 bits
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
CRC_TABLE_SUFFIX = ".crc32"
CRC_ENTRY_BYTES = 4
# chosen by bench/crc_block_bench.py (see bench/README.md): smallest block whose table stays
# <= 0.1% of the data, so power-of-two column splits of rows >= 8 KiB read no extra byte
BLOCK_SIZE = 4096
# memory snapshots (written every step, read only after a failure, from memory): the writer's
# per-block loop dominates at 4 KiB (17 MiB: 1.56 ms vs 0.49 ms at 64 KiB, zlib-ng, this CPU), and
# a reshard reading whole 64 KiB blocks from tmpfs or a peer costs little; readers take the size
# from each chunk's ``blocks.size``
SNAPSHOT_BLOCK_SIZE = 64 * 1024

# safetensors dtype codes <-> torch dtype names (strings keep this module torch-free)
DTYPE_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def crc_table_name(data_file: str) -> str:
    """The block-CRC table file that belongs to ``data_file`` (same directory)."""
    stem = data_file[:-len(".safetensors")] if data_file.endswith(".safetensors") else data_file
    return stem + CRC_TABLE_SUFFIX


@dataclass(frozen=True)
class BlockTable:
    """Where a chunk's cumulative block CRCs live: ``table`` file, first entry ``index``."""

    size: int    # block size in bytes
    table: str   # file name (in the step dir)
    index: int   # first entry of this chunk in the table

    def count(self, length: int) -> int:
        return max(1, -(-length // self.size))

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "table": self.table, "index": self.index}


@dataclass(frozen=True)
class Chunk:
    """One region of a global tensor stored contiguously (row-major) in one file."""

    file: str
    key: str
    region: Region
    offset: int   # absolute byte offset in the file
    length: int   # bytes
    crc32: int | None = None  # of the chunk's bytes
    blocks: BlockTable | None = None  # format 2: per-block cumulative CRCs

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.file, "key": self.key, "region": self.region.to_json(),
                             "offset": self.offset, "length": self.length}
        if self.crc32 is not None:
            d["crc32"] = f"{self.crc32:08x}"
        if self.blocks is not None:
            d["blocks"] = self.blocks.to_json()
        return d


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


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    crc32: int
    writer_rank: int

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": f"{self.crc32:08x}", "writer_rank": self.writer_rank}


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
        """The document without its checksum (what the checksum covers)."""
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

    def dumps(self, compact: bool = False) -> str:
        """The document with its checksum; ``compact``: no indentation (json's C encoder, several
        times faster; memory snapshots written every step use it), same content."""
        d = self.to_json()
        if compact and self.format_version >= 2:
            return dumps_compact_with_checksum(d)
        if self.format_version >= 2:
            d["checksum"] = document_checksum(d)
        if compact:
            return json.dumps(d, separators=(",", ":"), sort_keys=False, allow_nan=False)
        return json.dumps(d, indent=1, sort_keys=False, allow_nan=False)

    @staticmethod
    def from_json(d: Any, where: str = "") -> "Manifest":
        """Validate ``d`` (parsed JSON) against the schema; raise ManifestError / FormatVersionError."""
        return _parse(d, where or "manifest")

    @staticmethod
    def loads(text: str, where: str = "") -> "Manifest":
        return _parse(_json(text, where or "manifest"), where or "manifest")

    @staticmethod
    def files_of(text: str, where: str = "") -> dict[str, "FileEntry"]:
        """Only the ``files`` of a manifest document, with the same checks as :meth:`loads` on what
        it reads (format, readable version, the document checksum, each file entry), without the
        tensors: a peer-copy receiver reads its own node's manifest of every copied snapshot for
        the file list alone, and the tensors were ~90 % of a full parse (2.1-2.7 ms for the
        example trainer's 84 tensors, growing with the model)."""
        where = where or "manifest"
        v = _V(where)
        d = v.obj(_json(text, where), "document")
        _check_document(v, d, where)
        return _files(v, d)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def document_checksum(d: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``d`` without its ``checksum`` field."""
    body = {k: v for k, v in d.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def dumps_compact_with_checksum(d: Mapping[str, Any]) -> str:
    """The compact document text with its checksum, serialised once: the canonical text (what the
    checksum covers) with the ``checksum`` member appended (readers parse JSON: order is free)."""
    body = json.dumps({k: v for k, v in d.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
    if not (body.startswith("{") and body.endswith("}")) or body == "{}":
        raise ManifestError("manifest document must be a non-empty JSON object")
    return body[:-1] + ',"checksum":"sha256:' + hashlib.sha256(body.encode()).hexdigest() + '"}'


# ------------------------------------------------------------------ schema
def is_plain_name(name: Any) -> bool:
    """A file name that stays in its directory: not empty, no separators, not '.' or '..', no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def is_relative_subpath(name: Any) -> bool:
    """'a/b/c' with every component a plain name (no absolute paths, no '..')."""
    return isinstance(name, str) and all(is_plain_name(p) for p in name.split("/"))


class _V:
    """Validation helpers bound to the manifest's location; every failure is one ManifestError line."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, what: str, value: Any) -> ManifestError:
        v = repr(value)
        if len(v) > 80:
            v = v[:77] + "..."
        return ManifestError(f"{self.where}: invalid manifest: {path}: expected {what}, got {v}")

    def obj(self, d: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(d, dict):
            raise self.fail(path, "a JSON object", d)
        return d

    def req(self, d: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in d:
            raise ManifestError(f"{self.where}: invalid manifest: {path}: missing required field {key!r}")
        return d[key]

    def int_(self, v: Any, path: str, lo: int = 0, hi: int = INT64_MAX) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.fail(path, f"an integer in {lo}..{hi:,}", v)
        return v

    def hex32(self, v: Any, path: str) -> int:
        if not isinstance(v, str) or len(v) != 8:
            raise self.fail(path, "8 hex digits", v)
        try:
            return int(v, 16)
        except ValueError:
            raise self.fail(path, "8 hex digits", v) from None

    def str_(self, v: Any, path: str) -> str:
        if not isinstance(v, str) or not v:
            raise self.fail(path, "a non-empty string", v)
        return v


def _json(text: str, where: str) -> Any:
    try:
        return strict_json(text)
    except (ValueError, RecursionError) as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{where}: not valid JSON ({e}); the manifest is corrupt") from None


def _check_document(v: "_V", d: Mapping[str, Any], where: str) -> int:
    """The document's format, a readable version and (version 2 on) its checksum; the version."""
    if d.get("format") != FORMAT_NAME:
        raise ManifestError(f"{where}: not an elastor manifest (format={d.get('format')!r})")
    ver = d.get("format_version")
    if isinstance(ver, bool) or ver not in READABLE_VERSIONS:
        raise FormatVersionError(f"{where}: checkpoint format version {ver!r} is not readable by this elastor_ds "
                                 f"(reads {list(READABLE_VERSIONS)}); upgrade elastor_ds")
    if ver >= 2:
        got = d.get("checksum")
        if not isinstance(got, str):
            raise ManifestError(f"{where}: format {ver} manifest has no checksum; the manifest is corrupt")
        want = document_checksum(d)
        if got != want:
            raise ManifestError(f"{where}: manifest checksum {got[:23]}... does not match its content "
                                f"({want[:23]}...); the manifest is corrupt")
    return ver


def _files(v: "_V", d: Mapping[str, Any]) -> dict[str, "FileEntry"]:
    files: dict[str, FileEntry] = {}
    for name, fe in v.obj(v.req(d, "files", "files"), "files").items():
        p = f"files[{name!r}]"
        if not is_relative_subpath(name) or has_control_chars(name):
            raise v.fail(p, "a file name inside the step directory, without control characters (or invisible formatting ones)", name)
        fe = v.obj(fe, p)
        files[name] = FileEntry(name, v.int_(v.req(fe, "size", p), p + ".size"),
                                v.hex32(v.req(fe, "crc32", p), p + ".crc32"),
                                v.int_(fe.get("writer_rank", -1), p + ".writer_rank", -1, MAX_RANKS - 1))
    return files


def _parse(d: Any, where: str) -> Manifest:
    v = _V(where)
    d = v.obj(d, "document")
    ver = _check_document(v, d, where)
    step = v.int_(v.req(d, "step", "step"), "step")
    world = v.int_(d.get("world_size", 1), "world_size", 1, MAX_RANKS)
    created = d.get("created_unix", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not -INT64_MAX <= created <= INT64_MAX \
            or not math.isfinite(created):
        raise v.fail("created_unix", "a finite number of seconds", created)
    for key in ("layout", "model"):
        if d.get(key) is not None:
            v.obj(d[key], key)
    extra = v.obj(d.get("extra", {}) if d.get("extra") is not None else {}, "extra")
    rsf_raw = v.obj(d.get("rank_state_files", {}), "rank_state_files")
    rank_state_files: dict[int, str] = {}
    for k, name in rsf_raw.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and int(k) < MAX_RANKS):
            raise v.fail("rank_state_files key", f"a rank number below {MAX_RANKS:,}", k)
        if not is_relative_subpath(name) or has_control_chars(name):
            raise v.fail(f"rank_state_files[{k}]", "a relative path inside the step directory", name)
        rank_state_files[int(k)] = name
    files = _files(v, d)
    for k, name in rank_state_files.items():
        if name not in files:
            raise v.fail(f"rank_state_files[{k}]", "a file listed in 'files'", name)
    tensors: dict[str, TensorEntry] = {}
    for name, t in v.obj(v.req(d, "tensors", "tensors"), "tensors").items():
        if not name or has_control_chars(name):
            raise v.fail("tensors", "tensor names that are non-empty and without control characters (or invisible formatting ones)", name)
        tensors[name] = _parse_tensor(v, name, t, files)
    return Manifest(step=step, tensors=tensors, files=files, layout=d.get("layout"), model=d.get("model"),
                    extra=extra, rank_state_files=rank_state_files, world_size=world,
                    created_unix=float(created), format_version=ver)


def _ints(s: Any) -> bool:
    """A list of non-negative ints (not bools) that fit in 64 bits."""
    return type(s) is list and all(type(x) is int and 0 <= x <= INT64_MAX for x in s)


def _hex32(v: Any) -> Optional[int]:
    """:meth:`_V.hex32` without the message: the value, or None when it is not 8 hex digits."""
    if not isinstance(v, str) or len(v) != 8:
        return None
    try:
        return int(v, 16)
    except ValueError:
        return None


def _chunk_fast(c: Any, shape: tuple[int, ...], itemsize: int, files: Mapping[str, FileEntry]) -> Optional[Chunk]:
    """A chunk entry that passes every check of :func:`_parse_tensor`'s loop, parsed without
    building the messages; None when any check fails (the caller then names the failure)."""
    if type(c) is not dict:
        return None
    fname = c.get("file")
    fe = files.get(fname) if type(fname) is str else None
    if fe is None or not is_plain_name(fname):
        return None
    key = c.get("key", "")
    reg = c.get("region")
    if type(key) is not str or type(reg) is not list or len(reg) != 2:
        return None
    offs, sizes = reg
    if not (_ints(offs) and _ints(sizes) and len(offs) == len(shape) == len(sizes)):
        return None
    if any(o + n > e for o, n, e in zip(offs, sizes, shape)):
        return None
    off, length = c.get("offset"), c.get("length")
    if type(off) is not int or type(length) is not int or off < 0 or length < 0:
        return None
    region = Region(tuple(offs), tuple(sizes))
    if length != region.numel * itemsize or off + length > fe.size:
        return None
    crc = None
    if c.get("crc32") is not None:
        crc = _hex32(c["crc32"])
        if crc is None:
            return None
    blocks = None
    b = c.get("blocks")
    if b is not None:
        if type(b) is not dict:
            return None
        bsize, table, index = b.get("size"), b.get("table"), b.get("index")
        if type(bsize) is not int or bsize < 1 or type(index) is not int or index < 0:
            return None
        tfe = files.get(table) if type(table) is str else None
        if tfe is None or not is_plain_name(table):
            return None
        blocks = BlockTable(bsize, table, index)
        if (index + blocks.count(length)) * CRC_ENTRY_BYTES > tfe.size:
            return None
    return Chunk(fname, key, region, off, length, crc, blocks)


def _shape(v: _V, s: Any, path: str) -> tuple[int, ...]:
    if not isinstance(s, list):
        raise v.fail(path, "a list of non-negative integers", s)
    return tuple(v.int_(x, f"{path}[{i}]") for i, x in enumerate(s))


def _parse_tensor(v: _V, name: str, t: Any, files: Mapping[str, FileEntry]) -> TensorEntry:
    p = f"tensors[{name!r}]"
    if not name:
        raise v.fail("tensors", "non-empty tensor names", name)
    t = v.obj(t, p)
    shape = _shape(v, v.req(t, "shape", p), p + ".shape")
    dtype = v.req(t, "dtype", p)
    if dtype not in DTYPE_SIZES:
        raise v.fail(p + ".dtype", f"one of {sorted(DTYPE_SIZES)}", dtype)
    raw = v.req(t, "chunks", p)
    if not isinstance(raw, list):
        raise v.fail(p + ".chunks", "a list", raw)
    full = Region.full(shape)
    itemsize = DTYPE_SIZES[dtype]
    chunks = []
    for i, c in enumerate(raw):
        ok = _chunk_fast(c, shape, itemsize, files)
        if ok is not None:
            chunks.append(ok)
            continue
        # something is off: the same checks again, naming the field and the value that fail
        cp = f"{p}.chunks[{i}]"
        c = v.obj(c, cp)
        fname = v.req(c, "file", cp)
        if not is_plain_name(fname):
            raise v.fail(cp + ".file", "a plain file name (no directories)", fname)
        if fname not in files:
            raise v.fail(cp + ".file", "a file listed in 'files'", fname)
        key = c.get("key", "")
        if not isinstance(key, str):
            raise v.fail(cp + ".key", "a string", key)
        reg = v.req(c, "region", cp)
        if not (isinstance(reg, list) and len(reg) == 2):
            raise v.fail(cp + ".region", "[[offsets], [sizes]]", reg)
        offs = _shape(v, reg[0], cp + ".region offsets")
        sizes = _shape(v, reg[1], cp + ".region sizes")
        if len(offs) != len(shape) or len(sizes) != len(shape):
            raise v.fail(cp + ".region", f"{len(shape)} offsets and sizes (the tensor's rank)", reg)
        region = Region(offs, sizes)
        if not full.contains(region):
            raise v.fail(cp + ".region", f"a box inside the tensor's shape {list(shape)}", reg)
        off = v.int_(v.req(c, "offset", cp), cp + ".offset")
        length = v.int_(v.req(c, "length", cp), cp + ".length")
        if length != region.numel * DTYPE_SIZES[dtype]:
            raise v.fail(cp + ".length", f"{region.numel * DTYPE_SIZES[dtype]} (region elements x {dtype} size)",
                         length)
        if off + length > files[fname].size:
            raise v.fail(cp + ".offset", f"a byte range inside {fname} ({files[fname].size} bytes)",
                         [off, off + length])
        crc = v.hex32(c["crc32"], cp + ".crc32") if c.get("crc32") is not None else None
        blocks = None
        if c.get("blocks") is not None:
            b = v.obj(c["blocks"], cp + ".blocks")
            bsize = v.int_(v.req(b, "size", cp + ".blocks"), cp + ".blocks.size", 1)
            table = v.req(b, "table", cp + ".blocks")
            if not is_plain_name(table) or table not in files:
                raise v.fail(cp + ".blocks.table", "a plain file name listed in 'files'", table)
            index = v.int_(v.req(b, "index", cp + ".blocks"), cp + ".blocks.index")
            blocks = BlockTable(bsize, table, index)
            if (index + blocks.count(length)) * CRC_ENTRY_BYTES > files[table].size:
                raise v.fail(cp + ".blocks.index", f"entries inside {table} ({files[table].size} bytes)", index)
        chunks.append(Chunk(fname, key, region, off, length, crc, blocks))
    # chunks never overlap (the save plan cuts overlapping holdings into a grid): an overlap can
    # hide a gap of the same size from every count of covered elements, and a load or export would
    # then leave those elements as they were (uninitialised memory in an export)
    hit = first_overlap([c.region for c in chunks])
    if hit is not None:
        i, j = hit
        raise v.fail(p + ".chunks", "chunks whose regions do not overlap",
                     f"chunks[{i}] {chunks[i].region} and chunks[{j}] {chunks[j].region}")
    return TensorEntry(name, shape, dtype, tuple(chunks))
