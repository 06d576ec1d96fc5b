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
from .fileformat import CODE_DTYPES, file_crc32, read_header
from .planning.manifest import DTYPE_CODES, DTYPE_SIZES


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
                _, crc = file_crc32(path)
                if crc != fe.crc32:
                    problems.append(Problem(path, f"CRC32 {crc:08x} != manifest {fe.crc32:08x} (corrupt data)"))
        except OSError as e:   # a permission, an I/O error: this file's problem, the others are still checked
            problems.append(Problem(path, f"unreadable ({e.strerror or e})"))
    if files is None:
        problems += coverage_problems(man)
    return problems


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
