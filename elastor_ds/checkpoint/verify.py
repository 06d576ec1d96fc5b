"""Checkpoint verification: completeness, sizes, headers, chunk coverage and CRC32 checksums.

``verify(step_dir)`` returns a list of :class:`Problem` (empty when the checkpoint is good). It
reads every data file once (CRC32 of the whole file against the manifest). ``files`` restricts the
check to a subset, so ranks can split the work.
"""
from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from typing import Iterable, Optional

from tqdm import tqdm

from ..errors import CheckpointError, CorruptCheckpointError
from ..layout.region import Region, first_overlap
from .commit import read_manifest
from .planning.manifest import Manifest
from .crc import crc32
from .fileformat import CODE_DTYPES, iter_file_blocks, read_header
from .paths import open_regular
from .planning.manifest import CRC_ENTRY_BYTES, DTYPE_CODES, DTYPE_SIZES


@dataclass(frozen=True)
class Problem:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def check_header(header: object, data_len: int, path: str) -> None:
    """A safetensors header that the safetensors library itself would open: a JSON object whose
    entries (other than ``__metadata__``, a str -> str map) each give a known dtype, a shape of
    non-negative ints and ``data_offsets`` inside the data section. Raises CorruptCheckpointError."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: safetensors header {what}; the file is corrupt")
    if not isinstance(header, dict):
        raise bad("is not a JSON object")
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in entry.items()):
                raise bad("has a __metadata__ that is not a map of strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"entry {key[:80]!r} is not {{dtype, shape, data_offsets}}")
        shape, offs = entry["shape"], entry["data_offsets"]
        if entry["dtype"] not in CODE_DTYPES:
            raise bad(f"entry {key[:80]!r} has an unknown dtype {str(entry['dtype'])[:20]!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"entry {key[:80]!r} has a malformed shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise bad(f"entry {key[:80]!r} has data_offsets {str(offs)[:40]} outside the data section "
                      f"of {data_len} bytes")
        nbytes = math.prod(shape) * DTYPE_SIZES[CODE_DTYPES[entry["dtype"]]]
        if offs[1] - offs[0] != nbytes:   # safetensors: "invalid shape, data type, or offset for tensor"
            raise bad(f"entry {key[:80]!r}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, but a "
                      f"{entry['dtype']} tensor of shape {shape} has {nbytes}")
        spans.append((offs[0], offs[1], key))
    # safetensors also wants the entries to tile the data section: no gap, no overlap, nothing after
    pos = 0
    for a, b, key in sorted(spans):
        if a != pos:
            raise bad(f"entry {key[:80]!r} starts at byte {a} of the data section, where the entries before it "
                      f"end at {pos} (a gap or an overlap)")
        pos = b
    if pos != data_len:
        raise bad(f"entries end at byte {pos} of a data section of {data_len} bytes")


def header_problems(header: dict, data_start: int, expected: list, path: str) -> list[Problem]:
    """The header of the data file at ``path`` against the manifest: every chunk the manifest puts in the
    file (``expected``: (key, dtype code, shape, absolute offset, length)) is an entry with that key,
    dtype, shape and place, and the header has no other entry (a renamed or edited entry would be
    read by safetensors' own loader under the wrong name or type)."""
    got = {k: v for k, v in header.items() if k != "__metadata__"}
    by_place = {tuple(v["data_offsets"]): k for k, v in got.items()}   # (checked by check_header first)
    problems = []
    for key, code, shape, off, length in expected:
        want = {"dtype": code, "shape": list(shape), "data_offsets": [off - data_start, off - data_start + length]}
        if not key:   # a manifest may leave a chunk's key out: its entry is the one at its place
            key = by_place.get(tuple(want["data_offsets"]), "")
        entry = got.pop(key, None)
        if entry is None:
            problems.append(Problem(path, f"safetensors header has no entry {key[:80]!r}, which the manifest names"))
        elif entry != want:
            problems.append(Problem(path, f"safetensors header entry {key[:80]!r} is {str(entry)[:120]}, the manifest "
                                          f"says {str(want)[:120]}"))
    if got:
        problems.append(Problem(path, f"safetensors header has {len(got)} entr{'y' if len(got) == 1 else 'ies'} the "
                                      f"manifest does not name, e.g. {next(iter(got))[:80]!r}"))
    return problems


def _chunks_by_file(man: Manifest) -> dict:
    by: dict = {}
    for t in man.tensors.values():
        code = DTYPE_CODES.get(t.dtype, t.dtype)
        for ch in t.chunks:
            by.setdefault(ch.file, []).append((ch.key, code, ch.region.sizes, ch.offset, ch.length))
    return by


def verify(step_dir: str, checksums: bool = True, files: Optional[Iterable[str]] = None,
           progress: bool = False, manifest: Manifest | None = None) -> list[Problem]:
    try:
        man = manifest or read_manifest(step_dir)
    except CheckpointError as e:
        return [Problem(step_dir, str(e))]
    problems: list[Problem] = []
    names = sorted(man.files) if files is None else sorted(files)
    by_file = _chunks_by_file(man)
    chunks_by_file: dict[str, list] = {}
    if checksums:
        for t in man.tensors.values():
            for ch in t.chunks:
                chunks_by_file.setdefault(ch.file, []).append((ch.offset, t.name, ch))
        for lst in chunks_by_file.values():
            lst.sort(key=lambda x: (x[0], x[2].length))
    tables: dict[str, object] = {}
    for name in tqdm(names, desc="verify", unit="file", disable=None if progress else True):
        fe = man.files[name]
        path = os.path.join(step_dir, name)
        try:
            if not os.path.isfile(path):
                problems.append(Problem(path, "file is missing" if not os.path.lexists(path) else
                                        "is a FIFO" if stat.S_ISFIFO(os.lstat(path).st_mode) else
                                        "is not a regular file"))
                continue
            size = os.path.getsize(path)
            if size != fe.size:
                problems.append(Problem(path, f"size {size} bytes, manifest says {fe.size} (truncated or overwritten)"))
                continue
            if name.endswith(".safetensors"):
                try:
                    header, data_start = read_header(path)
                    check_header(header, size - data_start, path)
                except CheckpointError as e:
                    problems.append(Problem(path, str(e)))
                    continue
                found = header_problems(header, data_start, by_file.get(name, []), path)
                if found:
                    problems += found
                    continue
            if checksums:
                crc, bad = _scan_data(step_dir, path, chunks_by_file.get(name, []), man, tables)
                if crc != fe.crc32:
                    problems.append(Problem(path, f"CRC32 {crc:08x} != manifest {fe.crc32:08x} (corrupt data)"))
                problems += bad
        except OSError as e:   # a permission, an I/O error: this file's problem, the others are still checked
            problems.append(Problem(path, f"unreadable ({e.strerror or e})"))
    if files is None:
        problems += coverage_problems(man)
    return problems


class _ChunkScan:
    """The running check of one chunk's bytes against its block-CRC table (or its chunk CRC)."""
    __slots__ = ("tensor", "ch", "bsize", "done", "in_block", "crc", "j", "bad")

    def __init__(self, tensor: str, ch) -> None:
        self.tensor, self.ch = tensor, ch
        self.bsize = ch.blocks.size if ch.blocks is not None else max(1, ch.length)
        self.done = self.in_block = self.crc = self.j = 0
        self.bad = False


def _table(step_dir: str, man: Manifest, name: str, cache: dict):
    """The entries of block-CRC table ``name`` (little-endian uint32), or a Problem; read once."""
    if name not in cache:
        import array
        import sys
        path = os.path.join(step_dir, name)
        fe = man.files.get(name)
        try:
            if fe is None:
                raise CorruptCheckpointError(f"block-CRC table {name!r} is not a file the manifest lists")
            with os.fdopen(open_regular(path, nofollow=True), "rb") as f:
                raw = f.read(fe.size + 1)
            if len(raw) != fe.size or len(raw) % CRC_ENTRY_BYTES:
                raise CorruptCheckpointError(f"{len(raw)} bytes, the manifest says {fe.size} (truncated or "
                                             f"overwritten)")
            vals = array.array("I")
            vals.frombytes(raw)
            if sys.byteorder != "little":
                vals.byteswap()
            cache[name] = vals
        except (OSError, CheckpointError) as e:
            cache[name] = Problem(path, f"block-CRC table unreadable ({getattr(e, 'strerror', None) or e})")
    return cache[name]


def _scan_data(step_dir: str, path: str, chunks: list, man: Manifest, tables: dict
               ) -> tuple[int, list[Problem]]:
    """One pass over the data file ``path``: its whole-file CRC32, and every chunk's bytes against
    its block-CRC table (each block's cumulative CRC, as a reader checks them) or, without a table,
    its chunk CRC. A table can disagree with its data while the manifest's file CRCs of both agree
    (a writer bug, an edit): every read then fails, so verify must not say the checksums match.
    Returns (file CRC, problems: at most one per chunk, its first bad block)."""
    problems: list[Problem] = []
    scans = []
    for _, tensor, ch in chunks:
        if ch.blocks is not None:
            tab = _table(step_dir, man, ch.blocks.table, tables)
            if isinstance(tab, Problem):
                if tab not in problems:
                    problems.append(tab)
                continue
            if ch.blocks.index + ch.blocks.count(ch.length) > len(tab):
                problems.append(Problem(path, f"tensor {tensor!r}: its block CRCs run past the end of "
                                              f"{ch.blocks.table!r}"))
                continue
        scans.append(_ChunkScan(tensor, ch))

    def check_block(sc: _ChunkScan) -> None:
        ch = sc.ch
        if ch.blocks is not None:
            want = tables[ch.blocks.table][ch.blocks.index + sc.j]
            if sc.crc != want and not sc.bad:
                sc.bad = True
                problems.append(Problem(path, f"tensor {sc.tensor!r}: the {sc.bsize}-byte block at byte "
                                              f"{ch.offset + sc.j * sc.bsize} fails its CRC32 check (read "
                                              f"{sc.crc:08x}, the block table {ch.blocks.table} says {want:08x})"))
        sc.j += 1
        sc.in_block = 0

    def finish(sc: _ChunkScan) -> None:
        if sc.ch.length == 0:
            check_block(sc)   # one (empty) block: its entry is crc32(b"") == 0
        if sc.ch.crc32 is not None and sc.crc != sc.ch.crc32 and not sc.bad:
            sc.bad = True
            problems.append(Problem(path, f"tensor {sc.tensor!r}: chunk at byte {sc.ch.offset} has CRC32 "
                                          f"{sc.crc:08x}, the manifest says {sc.ch.crc32:08x}"))

    def feed(sc: _ChunkScan, mv: memoryview) -> None:
        n, i = len(mv), 0
        while i < n:
            take = min(sc.bsize - sc.in_block, n - i)
            sc.crc = crc32(mv[i:i + take], sc.crc)
            sc.in_block += take
            sc.done += take
            i += take
            if sc.in_block == sc.bsize or sc.done == sc.ch.length:
                check_block(sc)

    crc = 0
    pos = 0
    ci = 0   # scans[ci:] not finished (sorted by offset)
    for piece in iter_file_blocks(path):
        crc = crc32(piece, crc)
        a, b = pos, pos + len(piece)
        k = ci
        while k < len(scans) and scans[k].ch.offset < b:
            sc = scans[k]
            lo, hi = max(a, sc.ch.offset + sc.done), min(b, sc.ch.offset + sc.ch.length)
            if lo < hi:
                feed(sc, piece[lo - a:hi - a])
            k += 1
        while ci < len(scans) and scans[ci].ch.offset + scans[ci].ch.length <= b:
            finish(scans[ci])
            ci += 1
        pos = b
    for sc in scans[ci:]:   # (the file is the manifest's size: coverage_problems names a chunk past its end)
        if sc.ch.offset + sc.ch.length <= pos:
            finish(sc)
    return crc, problems


def coverage_problems(man: Manifest, names: Optional[Iterable[str]] = None) -> list[Problem]:
    """Manifest-only checks of tensors ``names`` (default all): every chunk names a listed file,
    lies inside it and inside its tensor's shape, and the chunks cover the tensor's elements."""
    problems: list[Problem] = []
    for name in (man.tensors if names is None else names):
        t = man.tensors[name]
        covered = 0
        for ch in t.chunks:
            if ch.file not in man.files:
                problems.append(Problem(t.name, f"chunk refers to unknown file {ch.file}"))
            elif ch.offset + ch.length > man.files[ch.file].size:
                problems.append(Problem(t.name, f"chunk {ch.region} lies beyond the end of {ch.file}"))
            if not Region.full(t.shape).contains(ch.region):
                problems.append(Problem(t.name, f"chunk {ch.region} outside shape {t.shape}"))
            covered += ch.region.numel
        hit = first_overlap([ch.region for ch in t.chunks])
        if hit is not None:   # a parsed manifest never has one (its parser refuses it); a built one may
            problems.append(Problem(t.name, f"chunks {t.chunks[hit[0]].region} and {t.chunks[hit[1]].region} "
                                            f"overlap"))
        numel = Region.full(t.shape).numel
        if covered != numel:
            problems.append(Problem(t.name, f"chunks cover {covered} of {numel} elements"))
    return problems


def require_coverage(man: Manifest, step_dir: str, names: Optional[Iterable[str]] = None) -> None:
    """:func:`coverage_problems` as an error (the first problem named): every exporter calls it
    before it allocates a tensor of the manifest's shapes (a crafted shape of 10^18 elements must
    not claim the node's memory)."""
    bad = coverage_problems(man, names)
    if bad:
        more = f" (and {len(bad) - 1} more problem(s))" if len(bad) > 1 else ""
        raise CorruptCheckpointError(f"{step_dir}: {bad[0]}{more}; nothing was written (`elastor verify` lists every "
                                     f"problem)")
