"""Staging straight into a node-local data file: the snapshot copy lands in the file's own pages.

A memory snapshot's data file lives on tmpfs. Writing it from a host staging buffer copies every
byte twice (model -> buffer on the training thread, buffer -> tmpfs pages in ``os.write`` on the
writer thread). Here the data file *is* the staging buffer: a rank keeps a shared mapping of each
of its data files and the snapshot copy writes into it; the writer thread only checksums it.

Protocol (one rank, in the engine's ``save``, after the previous save of this engine finished):

1. **Take a file.** This rank's retired data file (retention moved it to ``.recycle``, or it still
   sits in a step dir that a newer commit retired) is *renamed* into the save's temp dir before a
   byte of it changes. A step dir with a manifest therefore only ever holds an intact file or none
   (then loaders call it incomplete): a file is never written while a manifest can name it. None
   found: a new file, ``posix_fallocate``\\ d so that its tmpfs pages exist before the copy (a write
   through a mapping into a full tmpfs would be SIGBUS, not an error).
2. **Size and map it.** A file of another size is cut or extended (and allocated) first. The
   mapping of an inode is kept across saves (no page-table faults in the copy: a copy into freshly
   mapped pages runs ~20x slower than into warm ones); a new mapping is ``MAP_POPULATE``\\ d. With
   ``pin`` (CUDA present) a new mapping is page-locked (``cudaHostRegister``), so device-to-host
   copies into it are DMA on a side stream.
3. **Header.** The safetensors header is written at offset 0; the caller copies the data section
   (``StagedFile.data``).

Mappings of inodes that stop turning up are dropped (at most ``max_maps`` are kept: ``keep`` + 1
files cycle per rank). Everything here raises ``OSError`` for the engine to report on every rank.
"""
from __future__ import annotations

import logging
import mmap
import os
import stat
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass
class _Mapping:
    key: tuple[int, int]       # (st_dev, st_ino) of the file
    size: int
    mm: mmap.mmap
    array: np.ndarray          # uint8 over the whole file
    tensor: torch.Tensor       # the same bytes as a torch uint8 tensor
    pinned: bool = False
    used: int = 0              # save counter of the last use (least recently used goes first)
    data: Optional[torch.Tensor] = None   # cached view of the data section (stable across saves)
    data_off: int = -1


@dataclass(frozen=True)
class StagedFile:
    """A data file of a save in progress, mapped: ``data`` is its data section (after the header)."""

    path: str
    header_len: int
    data: torch.Tensor         # uint8, the data section's bytes, in the file's pages
    key: tuple[int, int]       # (st_dev, st_ino)
    whole: Optional[torch.Tensor] = None   # uint8, the whole file (header included), in the same mapping


class FileStaging:
    """One rank's mapped data files (see the module docstring)."""

    def __init__(self, max_maps: int = 4, pin: bool = False):
        self.max_maps = max(2, max_maps)
        self.pin = pin
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._uses = 0
        self.new_files = 0        # files created (first saves, or a retired file that was not found)
        self.new_mappings = 0

    def take(self, tmp_dir: str, fname: str, candidates: Sequence[str], header: bytes, size: int) -> StagedFile:
        """Steps 1-3 for ``tmp_dir/fname`` of ``size`` bytes (header included)."""
        if size < len(header):
            raise ValueError(f"file size {size} < header {len(header)}")
        os.makedirs(tmp_dir, exist_ok=True)
        path = os.path.join(tmp_dir, fname)
        reused = False
        for src in (*candidates, *candidates):   # twice: a committer may move one between two tries
            try:
                if not stat.S_ISREG(os.lstat(src).st_mode):   # a link or anything else: never written through
                    continue
                os.rename(src, path)
                reused = True
                break
            except FileNotFoundError:
                continue
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | (0 if reused else os.O_CREAT | os.O_TRUNC),
                     0o644)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            m = self._maps.get(key)
            if m is not None and m.size != size:
                self._drop(key)
                m = None
            if st.st_size != size:
                os.ftruncate(fd, size)
            if m is None:
                # every page allocated before it is mapped: a write through a mapping into a full
                # tmpfs is SIGBUS, an allocation here is ENOSPC (reported like any write error)
                if size:
                    os.posix_fallocate(fd, 0, size)
                m = self._map(fd, key, size)
        finally:
            os.close(fd)
        if not reused:
            self.new_files += 1
        self._uses += 1
        m.used = self._uses
        m.array[:len(header)] = np.frombuffer(header, dtype=np.uint8)
        if m.data is None or m.data_off != len(header):
            m.data, m.data_off = m.tensor[len(header):size], len(header)
        self._evict(keep=key)
        return StagedFile(path, len(header), m.data, key, m.tensor[:size])

    def release(self, staged: StagedFile) -> None:
        """Drop the mapping of a file that is gone (its save failed or was dropped and its temp dir
        removed): an unlinked file's pages stay allocated for as long as they are mapped."""
        self._drop(staged.key)

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)

    # ------------------------------------------------------------------ internals
    def _map(self, fd: int, key: tuple[int, int], size: int) -> _Mapping:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        arr = np.frombuffer(mm, dtype=np.uint8)
        t = torch.from_numpy(arr)
        pinned = False
        if self.pin and size:
            pinned = _host_register(t)
        m = _Mapping(key, size, mm, arr, t, pinned)
        self._maps[key] = m
        self.new_mappings += 1
        return m

    def _drop(self, key: tuple[int, int]) -> None:
        m = self._maps.pop(key, None)
        if m is None:
            return
        if m.pinned:
            _host_unregister(m.tensor)
        mm = m.mm
        m.data = m.tensor = m.array = None  # type: ignore[assignment]
        del m
        try:
            mm.close()
        except BufferError:   # a view is still alive somewhere: unmapped when the last one goes
            log.debug("mapping of inode %s still has views; left to the garbage collector", key)

    def _evict(self, keep: tuple[int, int]) -> None:
        while len(self._maps) > self.max_maps:
            key = min((k for k in self._maps if k != keep), key=lambda k: self._maps[k].used)
            self._drop(key)


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for DMA (CUDA only); False when that is not possible."""
    try:
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        ok = int(getattr(err, "value", err)) == 0
    except Exception as e:  # noqa: BLE001 - pinning is an acceleration, never a reason to fail a save
        log.warning("could not page-lock a %d-byte snapshot mapping (%s): device-to-host copies into it are "
                    "synchronous", t.numel(), e)
        return False
    if not ok:
        log.warning("cudaHostRegister of a %d-byte snapshot mapping failed (error %s): device-to-host copies into it "
                    "are synchronous", t.numel(), err)
    return ok


def _host_unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception as e:  # noqa: BLE001
        log.debug("cudaHostUnregister failed: %s", e)
