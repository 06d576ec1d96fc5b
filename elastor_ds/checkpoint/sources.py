"""Where a checkpoint's files are read from: an ordered list of :class:`ChunkSource`.

A load names its files by the manifest (``data_00003.safetensors``, its block-CRC table, the rank
state files). The reader (:mod:`.reader`) resolves every file through an ordered list of sources,
nearest first: this node's memory snapshot, peer copies held on this node, other nodes' snapshot
servers, storage last. The first source that ``has`` the whole file (by size) serves it; every
byte it serves is checked against the manifest's block CRCs (the CRC tables themselves, read whole,
against the manifest's file CRC, from every source including the last); a mismatch, a short or missing
file or an I/O error falls back to the next source for that file (logged). When the last source
fails too, the load fails as a corrupt checkpoint.

A source is any object with ``name``, ``bytes_read``, ``has(relpath, size)`` and
``read_into(relpath, offset, views)``, optionally ``prefetch(relpath, offset, length)`` (a hint
that a read of those bytes comes next) and ``where(relpath)`` (where the file is, for
messages: ``local memory /dev/shm/...``, ``peer 10.0.0.2:4567 (local/step_.../data_00000...)``,
``storage /ckpt/...``; :func:`describe_source`) and ``thread_safe`` (True when two threads may read
through it at once: the reader then loads the CRC tables beside the first data reads; a source
without it is used from one thread at a time) and ``in_memory`` (True when its reads are copies
out of this node's memory, e.g. tmpfs: the reader then reads, checks and copies a staged read in
cache-sized pieces on one thread instead of staging it whole); ``relpath`` is the manifest's name, resolved inside the
source's directory with :func:`~.paths.safe_join` (never a name out of it). This module has the
directory sources (a step directory on tmpfs or on storage); ``elastor_ds.checkpoint`` users
build lists with :func:`dir_source` / :func:`storage_source_for`.

Rank-local, not collective; no torch.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from .paths import open_regular, safe_join
from .fileformat import pread_into

log = logging.getLogger(__name__)

LOCAL_MEMORY = "local-memory"
PEER_MEMORY = "peer-memory"
STORAGE = "storage"


@runtime_checkable
class ChunkSource(Protocol):
    """One place a checkpoint's files can be read from (see the module docstring)."""

    name: str
    bytes_read: int

    def has(self, relpath: str, size: int) -> bool:
        """The complete file ``relpath`` of ``size`` bytes is here."""

    def read_into(self, relpath: str, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` (back to back) from byte ``offset`` of ``relpath``; raise on a short read."""


class DirSource:
    """The files of one step directory on a local file system (tmpfs or storage).

    ``files``: when given, only these names are served (e.g. the storage files that are byte for
    byte the ones a memory snapshot's manifest describes). Thread-safe: descriptors are opened
    and the byte count kept under a lock."""

    thread_safe = True

    def __init__(self, step_dir: str, name: str = STORAGE, files: Optional[Iterable[str]] = None):
        self.step_dir = os.path.abspath(step_dir)
        self.name = name
        self.bytes_read = 0
        self.files = None if files is None else frozenset(files)
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int] = {}
        self._lock = threading.Lock()
        # O_DIRECT reads (read_direct) from storage only: the disk's DMA into the reader's aligned
        # buffers, no page cache (a memory snapshot on tmpfs is a copy either way)
        self.direct_ok = name == STORAGE and hasattr(os, "O_DIRECT")
        # reads are copies out of memory (a snapshot on tmpfs): the reader takes them in cache-sized pieces
        self.in_memory = name != STORAGE

    def __repr__(self) -> str:
        return f"DirSource({self.name!r}, {self.step_dir!r})"

    def path(self, relpath: str) -> str:
        return safe_join(self.step_dir, relpath, what=f"file name (source {self.name})", allow_subdirs=True)

    def where(self, relpath: str) -> str:
        label = {LOCAL_MEMORY: "local memory", STORAGE: "storage"}.get(self.name, self.name)
        return f"{label} {os.path.join(self.step_dir, relpath)}"

    def has(self, relpath: str, size: int) -> bool:
        if self.files is not None and relpath not in self.files:
            return False
        try:
            p = self.path(relpath)
            return os.path.isfile(p) and os.path.getsize(p) == size
        except (CheckpointError, OSError):
            return False

    def absence(self, relpath: str, size: int) -> str:
        """Why :meth:`has` is False for ``relpath`` (for an error message)."""
        if self.files is not None and relpath not in self.files:
            return "not among the files it serves"
        try:
            p = self.path(relpath)
            if not os.path.lexists(p):
                return "missing"
            if not os.path.isfile(p):
                return "not a regular file"
            got = os.path.getsize(p)
            return f"{got} bytes, the manifest says {size} (truncated or overwritten)" if got != size else "present"
        except CheckpointError as e:
            return str(e)
        except OSError as e:
            return f"unreadable ({e.strerror or e})"

    def _fd(self, relpath: str) -> int:
        fd = self._fds.get(relpath)
        if fd is None:
            with self._lock:
                fd = self._base_fd(relpath)
        return fd

    def _base_fd(self, relpath: str) -> int:
        """The file's descriptor, opened once (under the lock)."""
        fd = self._fds.get(relpath)
        if fd is None:
            try:
                fd = self._fds[relpath] = open_regular(self.path(relpath))   # a planted FIFO never blocks
            except FileNotFoundError:
                raise IncompleteCheckpointError(f"{self.step_dir}/{relpath}: data file is missing "
                                                f"(source {self.name})") from None
        return fd

    def prefetch(self, relpath: str, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``length`` bytes at ``offset`` into the page cache
        (``POSIX_FADV_WILLNEED``: it queues the reads and returns), so the disk works on the next
        read while this one is checked and copied. A hint: errors are ignored."""
        try:
            os.posix_fadvise(self._fd(relpath), offset, length, os.POSIX_FADV_WILLNEED)
        except (CheckpointError, OSError, AttributeError):
            pass

    def _direct_fd(self, relpath: str) -> Optional[int]:
        """A second, ``O_DIRECT`` descriptor of the file :meth:`_fd` opened and checked (reopened
        through ``/proc/self/fd``: the same inode, no second path lookup); None where the file
        system refuses ``O_DIRECT`` (then this source reads through the page cache only)."""
        fd = self._direct_fds.get(relpath)
        if fd is not None:
            return fd
        with self._lock:
            return self._open_direct(relpath)

    def _open_direct(self, relpath: str) -> Optional[int]:
        """:meth:`_direct_fd` under the lock."""
        fd = self._direct_fds.get(relpath)
        if fd is not None:
            return fd
        base = self._base_fd(relpath)
        try:
            fd = os.open(f"/proc/self/fd/{base}", os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.direct_ok = False
            return None
        a, b = os.fstat(fd), os.fstat(base)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):   # (cannot happen: the same open file)
            os.close(fd)
            self.direct_ok = False
            return None
        self._direct_fds[relpath] = fd
        return fd

    def read_direct(self, relpath: str, offset: int, view: memoryview) -> Optional[int]:
        """Read into ``view`` from ``offset`` with ``O_DIRECT`` (``offset``, ``len(view)`` and the
        view's address 4 KiB-aligned: the caller's job); returns the bytes read (fewer at the end of
        the file), or None when ``O_DIRECT`` is not available here (read with :meth:`read_into`)."""
        if not self.direct_ok:
            return None
        fd = self._direct_fd(relpath)
        if fd is None:
            return None
        got = 0
        try:
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            if e.errno != errno.EINVAL or got:
                raise
            self.direct_ok = False   # refused after all (e.g. an alignment the file system wants larger)
            return None
        with self._lock:
            self.bytes_read += got
        return got

    def read_into(self, relpath: str, offset: int, views: Sequence[memoryview]) -> None:
        fd = self._fd(relpath)
        try:
            pread_into(fd, views, offset)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{self.step_dir}/{relpath}: {e} (source {self.name})") from None
        n = sum(len(v) for v in views)
        with self._lock:
            self.bytes_read += n

    def close(self) -> None:
        with self._lock:
            fds = [*self._fds.values(), *self._direct_fds.values()]
            self._fds.clear()
            self._direct_fds.clear()
        for fd in fds:
            os.close(fd)


def describe_source(src: ChunkSource, relpath: str) -> str:
    """Where ``src`` holds ``relpath``, for messages: the source's own ``where`` when it has one
    (a local path, a peer's address), else its name and the file name."""
    where = getattr(src, "where", None)
    if where is not None:
        try:
            return str(where(relpath))
        except Exception:  # noqa: BLE001 - a message must not fail the load
            pass
    return f"{src.name} {relpath}"


def dir_source(step_dir: str, name: str = STORAGE) -> DirSource:
    """Every file of ``step_dir``."""
    return DirSource(step_dir, name)


def storage_source_for(storage_step_dir: str, manifest, storage_manifest) -> Optional[DirSource]:
    """A storage source for a snapshot described by ``manifest``: the files of ``storage_step_dir``
    whose entries in ``storage_manifest`` (size and CRC32) equal ``manifest``'s, so a memory
    snapshot of step N can borrow the same files from the storage checkpoint of step N. None when
    the steps differ or no file matches."""
    if storage_manifest is None or storage_manifest.step != manifest.step:
        return None
    same = [n for n, fe in manifest.files.items()
            if (other := storage_manifest.files.get(n)) is not None and (other.size, other.crc32) == (fe.size, fe.crc32)]
    return DirSource(storage_step_dir, STORAGE, files=same) if same else None


def bytes_by_source(sources: Sequence[ChunkSource]) -> dict[str, int]:
    """Bytes each source served (names that repeat are summed)."""
    out: dict[str, int] = {}
    for s in sources:
        out[s.name] = out.get(s.name, 0) + int(s.bytes_read)
    return out


def close_all(sources: Sequence[ChunkSource]) -> None:
    for s in sources:
        close = getattr(s, "close", None)
        if close is not None:
            try:
                close()
            except OSError as e:  # pragma: no cover - closing a read-only fd
                log.debug("closing source %s: %s", s.name, e)


def read_file(sources: Sequence[ChunkSource], relpath: str, size: int, crc32: int, what: str = "file") -> tuple[bytes, str]:
    """A whole small file (a rank state, a CRC table) from the first source whose copy matches the
    manifest's ``crc32``; other copies are skipped with a warning. Returns (bytes, source name)."""
    from .crc import crc32 as crc_of
    problems = []
    for src in sources:
        if not src.has(relpath, size):
            problems.append(f"{src.name}: absent")
            continue
        buf = bytearray(size)
        try:
            if size:
                src.read_into(relpath, 0, [memoryview(buf)])
        except (CheckpointError, OSError) as e:
            problems.append(f"{src.name}: {e}")
            log.warning("%s from %s is unreadable (%s); trying the next source", what, describe_source(src, relpath), e)
            continue
        got = crc_of(buf)
        if got != crc32:
            problems.append(f"{src.name}: CRC32 {got:08x} != manifest {crc32:08x}")
            log.warning("%s from %s fails its CRC32 check (%08x != %08x); trying the next source", what,
                        describe_source(src, relpath), got, crc32)
            continue
        return bytes(buf), src.name
    raise _no_source(relpath, problems)


def _no_source(relpath: str, problems: Sequence[str]) -> CheckpointError:
    text = "; ".join(problems) or "no sources"
    if problems and all(p.endswith(": absent") for p in problems):
        return IncompleteCheckpointError(f"{relpath}: no source holds this file ({text})")
    return CorruptCheckpointError(f"{relpath}: no source holds a good copy ({text})")


SourcesFor = Callable[[str, object], Sequence[ChunkSource]]
"""``(step_dir, manifest) -> sources``: the sources of the checkpoint a load actually reads (the
engine calls it after resolving ``latest`` and any fallback)."""


_FACTORIES: list[SourcesFor] = []


def register_source_factory(fn: SourcesFor) -> None:
    """Add ``fn(step_dir, manifest) -> [ChunkSource, ...]`` to the sources a memory restore consults
    between this node's memory and storage (e.g. peer copies, other nodes' servers). Idempotent."""
    if fn not in _FACTORIES:
        _FACTORIES.append(fn)


def registered_sources(step_dir: str, manifest) -> list[ChunkSource]:
    """The sources of every registered factory for this checkpoint, in registration order."""
    out: list[ChunkSource] = []
    for fn in list(_FACTORIES):
        out.extend(fn(step_dir, manifest) or [])
    return out


__all__ = ["register_source_factory", "registered_sources", "ChunkSource", "DirSource", "describe_source", "dir_source", "storage_source_for", "bytes_by_source", "close_all", "read_file",
           "SourcesFor", "LOCAL_MEMORY", "PEER_MEMORY", "STORAGE"]
