"""Checkpoint verification: completeness, sizes, headers, chunk coverage and CRC32 checksums.

``verify(step_dir)`` returns a list of :class:`Problem` (empty when the checkpoint is good). It
reads every data file once (CRC32 of the whole file against the manifest). ``files`` restricts the
check to a subset, so ranks can split the work.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Iterable, Optional

from tqdm import tqdm

from ..errors import CheckpointError
from ..layout.region import Region
from .commit import read_manifest
from .planning.manifest import Manifest
from .fileformat import file_crc32, read_header


@dataclass(frozen=True)
class Problem:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def verify(step_dir: str, checksums: bool = True, files: Optional[Iterable[str]] = None,
           progress: bool = False, manifest: Manifest | None = None) -> list[Problem]:
    try:
        man = manifest or read_manifest(step_dir)
    except CheckpointError as e:
        return [Problem(step_dir, str(e))]
    problems: list[Problem] = []
    names = sorted(man.files) if files is None else sorted(files)
    for name in tqdm(names, desc="verify", unit="file", disable=not progress):
        fe = man.files[name]
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            problems.append(Problem(path, "file is missing" if not os.path.lexists(path) else
                                    "is a FIFO" if stat.S_ISFIFO(os.lstat(path).st_mode) else "is not a regular file"))
            continue
        size = os.path.getsize(path)
        if size != fe.size:
            problems.append(Problem(path, f"size {size} bytes, manifest says {fe.size} (truncated or overwritten)"))
            continue
        if name.endswith(".safetensors"):
            try:
                read_header(path)
            except CheckpointError as e:
                problems.append(Problem(path, str(e)))
                continue
        if checksums:
            _, crc = file_crc32(path)
            if crc != fe.crc32:
                problems.append(Problem(path, f"CRC32 {crc:08x} != manifest {fe.crc32:08x} (corrupt data)"))
    if files is None:
        for t in man.tensors.values():
            covered = 0
            for ch in t.chunks:
                if ch.file not in man.files:
                    problems.append(Problem(t.name, f"chunk refers to unknown file {ch.file}"))
                elif ch.offset + ch.length > man.files[ch.file].size:
                    problems.append(Problem(t.name, f"chunk {ch.region} lies beyond the end of {ch.file}"))
                if not Region.full(t.shape).contains(ch.region):
                    problems.append(Problem(t.name, f"chunk {ch.region} outside shape {t.shape}"))
                covered += ch.region.numel
            numel = Region.full(t.shape).numel
            if covered != numel:
                problems.append(Problem(t.name, f"chunks cover {covered} of {numel} elements"))
    return problems
