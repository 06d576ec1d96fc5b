"""The data file format and its byte-level helpers: safetensors headers, streamed writes, CRCs, reads.

Where files go and how durable they are is the storage backend's business
(:mod:`elastor_ds.checkpoint.storage`); these helpers take a ``sync``/``fsync`` argument from it.

Files are standard safetensors (8-byte little-endian header length, JSON header padded with
spaces to a multiple of 8 -- of 4 KiB in checkpoint data files, which lets the ``O_DIRECT`` writer
send the page-aligned staging buffer to the disk without a copy -- then the raw tensor bytes), readable by the ``safetensors`` library.
We write the format ourselves instead of calling ``safetensors.torch.save_file`` because that
function first copies every tensor into a new bytes object: double host memory and an extra
memcpy. Here the header is computed from the save plan and the bytes stream straight from the
(reused) staging buffer to the file, CRC32 computed on the way, then ``fsync``.

Reads use ``os.preadv`` into caller-provided memory (no intermediate copy when possible).
"""
from __future__ import annotations

import array
import json
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..threads import NamedThread
from .paths import open_regular
from .crc import crc32, crc32_combine  # noqa: F401 - crc32_combine re-exported
from .planning.manifest import BLOCK_SIZE, CODE_DTYPES, DTYPE_CODES, strict_json
from .writer_sched import thread_target

WRITE_BLOCK = 32 * 1024 * 1024
DATA_ALIGN = 4096   # a checkpoint data file's data section starts at a multiple of this (a page)


@dataclass(frozen=True)
class EntrySpec:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(entries: Sequence[EntrySpec], metadata: dict[str, str] | None = None,
                 align: int = 8) -> tuple[bytes, list[int]]:
    """The padded header bytes and each entry's offset relative to the data section.

    The JSON is padded with spaces so that the data section starts at a multiple of ``align``
    bytes (8, as safetensors pads; :data:`DATA_ALIGN` for checkpoint data files, so that an
    ``O_DIRECT`` writer can send a page-aligned staging buffer straight to the disk)."""
    if align < 8 or align % 8:
        raise ValueError(f"header alignment {align} is not a positive multiple of 8")
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offs = []
    pos = 0
    for e in entries:
        hdr[e.key] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        offs.append(pos)
        pos += e.nbytes
    text = json.dumps(hdr, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % align)
    return struct.pack("<Q", len(text)) + text, offs


@dataclass(frozen=True)
class RowRuns:
    """``rows`` runs of ``width`` bytes, ``stride`` bytes apart, from byte ``offset`` of ``base``
    (1-D bytes): a column tile inside a row-major box of the staging buffer. The file holds the
    runs back to back (:func:`write_stream` writes them with ``writev``, no copy)."""

    base: memoryview
    offset: int
    rows: int
    width: int
    stride: int

    def __len__(self) -> int:
        return self.rows * self.width

    def row(self, r: int) -> memoryview:
        a = self.offset + r * self.stride
        return self.base[a:a + self.width]


IOV_MAX = 1024


def write_runs(fd: int, runs: RowRuns) -> None:
    """Write every row of ``runs`` in order: ``writev`` of up to IOV_MAX rows (and about
    WRITE_BLOCK bytes) per call; a short write continues where it stopped."""
    per = max(1, min(IOV_MAX, WRITE_BLOCK // max(1, runs.width)))
    for r0 in range(0, runs.rows, per):
        pieces = [runs.row(r) for r in range(r0, min(runs.rows, r0 + per))]
        want = runs.width * len(pieces)
        n = os.writev(fd, pieces)
        while n < want:   # a short write (a signal, a full pipe): finish the rest piece by piece
            done = 0
            for i, pc in enumerate(pieces):
                if done + len(pc) > n:
                    write_all(fd, pc[n - done:])
                    for rest in pieces[i + 1:]:
                        write_all(fd, rest)
                    break
                done += len(pc)
            n = want


def runs_cumulative_crcs(runs: RowRuns, block_size: int) -> "array.array[int]":
    """:func:`cumulative_crcs` of the bytes of ``runs`` taken in file order (rows back to back)."""
    out = array.array("I")
    c = 0
    filled = 0
    w = runs.width
    pause = max(1, GIL_PAUSE_BYTES // max(1, w)) if gil_pausing(min(block_size, w)) else 0
    for r in range(runs.rows):
        if pause and r and r % pause == 0:
            time.sleep(GIL_PAUSE_S)
        row = runs.row(r)
        if filled == 0 and w == block_size:   # the common case: a row is a block
            c = crc32(row, c)
            out.append(c)
            continue
        p = 0
        while p < w:
            take = min(w - p, block_size - filled)
            c = crc32(row[p:p + take], c)
            filled += take
            p += take
            if filled == block_size:
                out.append(c)
                filled = 0
    if filled or not out:
        out.append(c)
    return out


_SYNC_FILE_RANGE_WRITE = 2
_starter: list = []


def _writeback_starter():
    """``start(fd, offset, nbytes)``: make the kernel start writing those dirty pages to the disk
    now and return (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, through ctypes, which
    releases the GIL), so the disk works while the next pieces are copied into the page cache and
    the final ``fsync`` waits only for the tail. None where it is unavailable; never a durability
    guarantee by itself (the ``fsync`` is)."""
    if not _starter:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes
                libc = ctypes.CDLL(None, use_errno=True)
                raw = libc.sync_file_range
                raw.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
                raw.restype = ctypes.c_int

                def start(fd: int, offset: int, nbytes: int) -> None:
                    raw(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)   # a hint: a failure leaves it to fsync
                fn = start
            except (OSError, AttributeError):
                fn = None
        _starter.append(fn)
    return _starter[0]


def write_stream(path: str, header: bytes, buffers: Iterable["memoryview | RowRuns"], fsync: bool = True,
                 chunk_crcs: list[int] | None = None, block_crcs: list[list[int]] | None = None,
                 block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """Write ``header`` then each buffer; return (size, crc32 of the whole file).

    1. Write everything (into the page cache); with ``fsync``, every ~32 MiB written is handed to
       the disk at once (:func:`_writeback_starter`), so the flush overlaps the writes.
    2. ``fsync`` in a helper thread while this thread computes the CRC32 of every buffer from
       memory (both release the GIL), so checksumming hides behind the disk flush.
    3. One pass over each buffer gives its cumulative CRC32 at every ``block_size`` boundary
       (appended to ``block_crcs`` when given; the last one is the buffer's CRC, appended to
       ``chunk_crcs``); the file's CRC is combined from the buffers' CRCs (:func:`crc32_combine`).
    Raises OSError on failure."""
    mvs = [b if isinstance(b, RowRuns) else memoryview(b).cast("B") for b in buffers]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    start = _writeback_starter() if fsync else None
    try:
        write_all(fd, memoryview(header))
        size = len(header)
        kicked = 0   # bytes handed to the disk so far (start_writeback)

        def wrote(n: int) -> None:
            nonlocal size, kicked
            size += n
            if start is not None and size - kicked >= WRITE_BLOCK:
                start(fd, kicked, size - kicked)
                kicked = size
        for mv in mvs:
            if isinstance(mv, RowRuns):
                write_runs(fd, mv)
                wrote(len(mv))
            else:
                for i in range(0, len(mv), WRITE_BLOCK):
                    piece = mv[i:i + WRITE_BLOCK]
                    write_all(fd, piece)
                    wrote(len(piece))
        err: list[BaseException] = []

        def flush() -> None:
            try:
                os.fsync(fd)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                err.append(e)
        t = NamedThread(target=thread_target(flush), name="elastor-fsync", daemon=True) if fsync else None
        if t is not None:
            t.start()
        crc = stream_crcs(header, mvs, chunk_crcs, block_crcs, block_size)
        if t is not None:
            t.join()
            if err:
                raise err[0]
    finally:
        os.close(fd)
    return size, crc


def stream_crcs(header: bytes, mvs: Sequence["memoryview | RowRuns"], chunk_crcs: list[int] | None,
                block_crcs: list[list[int]] | None, block_size: int) -> int:
    """The CRCs of a data file written as ``header`` then ``mvs``: each buffer's cumulative block
    CRCs (appended to ``block_crcs``) and its CRC (appended to ``chunk_crcs``); returns the file's
    CRC, combined from the buffers' (:func:`crc32_combine`)."""
    crc = crc32(header)
    for mv in mvs:
        if block_crcs is not None:
            cum = runs_cumulative_crcs(mv, block_size) if isinstance(mv, RowRuns) else cumulative_crcs(mv, block_size)
            block_crcs.append(cum)
            c = cum[-1]
        elif isinstance(mv, RowRuns):
            c = 0
            for r in range(mv.rows):
                c = crc32(mv.row(r), c)
        else:
            c = 0
            for i in range(0, len(mv), WRITE_BLOCK):
                c = crc32(mv[i:i + WRITE_BLOCK], c)
        if chunk_crcs is not None:
            chunk_crcs.append(c)
        crc = crc32_combine(crc, c, len(mv))
    return crc


# The CRC of a small block (< 5 KiB) runs with the GIL held, so a loop of them in a background
# thread would keep training's Python from running for up to the interpreter's switch interval
# (5 ms) at every GIL hand-over. Such loops pause every GIL_PAUSE_BYTES for GIL_PAUSE_S: long
# enough for a waiting thread to wake and take the GIL (a zero sleep hands it straight back).
GIL_PAUSE_BYTES = 1 << 20
GIL_PAUSE_S = 1e-4
_GIL_FREE_CRC = 8 * 1024   # zlib(-ng) releases the GIL for calls on more than ~5 KiB


def gil_pausing(block_size: int) -> bool:
    """Whether a loop of CRCs over blocks of ``block_size`` bytes should pause now and then to
    hand over the GIL: the calls are too short to release it, and this is not the main thread."""
    return block_size < _GIL_FREE_CRC and threading.current_thread() is not threading.main_thread()


def cumulative_crcs(mv: memoryview, block_size: int) -> "array.array[int]":
    """CRC32 of ``mv[:end]`` for every block end (``block_size`` apart, the last at ``len(mv)``),
    as uint32 entries; at least one entry (0 for an empty buffer).

    An ``array`` (4 bytes an entry), not a list of Python ints (~36 bytes an entry): a table has
    an entry per 4 KiB, so 256 MiB of data made ~2.3 MiB of list and a 17 GiB shard ~160 MiB, all
    alive until the table file is written. Built in pieces of ``GIL_PAUSE_BYTES``, each a short
    list comprehension (the fastest loop of CRC calls) appended to the array."""
    c = 0
    out = array.array("I")
    pause = gil_pausing(block_size)
    step = max(block_size, GIL_PAUSE_BYTES // block_size * block_size)
    for s in range(0, len(mv), step):
        if pause and s:
            time.sleep(GIL_PAUSE_S)
        out.extend([c := crc32(mv[i:i + block_size], c) for i in range(s, min(len(mv), s + step), block_size)])
    if not out:
        out.append(0)
    return out


def extend_block_crcs(table: "array.array[int]", mv: memoryview, c: int, filled: int,
                      block_size: int) -> tuple[int, int]:
    """Continue a cumulative block-CRC table over the next bytes ``mv`` of its buffer: ``c`` is the
    CRC so far and ``filled`` the bytes already in the open block; every block that ``mv``
    completes appends its cumulative CRC to ``table``. Returns the new ``(c, filled)`` (the
    caller appends the last, short block's CRC at the buffer's end)."""
    bs, m, q = block_size, len(mv), 0
    if filled:
        q = min(bs - filled, m)
        c = crc32(mv[:q], c)
        filled += q
        if filled == bs:
            table.append(c)
            filled = 0
    end = q + (m - q) // bs * bs
    if end > q:
        table.extend([c := crc32(mv[a:a + bs], c) for a in range(q, end, bs)])
    if end < m:
        c = crc32(mv[end:], c)
        filled = m - end
    return c, filled


def crc_table_bytes(tables: Sequence[Sequence[int]]) -> tuple[bytes, list[int]]:
    """The block-CRC table file of a data file's chunks: their tables back to back (little-endian
    uint32), and the first entry index of each table."""
    arr = array.array("I")
    starts = []
    for t in tables:
        starts.append(len(arr))
        arr.extend(t)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes(), starts


def read_crc_entries(path: str, lo: int, hi: int) -> list[int]:
    """Entries ``lo .. hi`` (inclusive) of a block-CRC table file."""
    n = hi - lo + 1
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        f.seek(lo * 4)
        data = f.read(n * 4)
    if len(data) != n * 4:
        raise CorruptCheckpointError(f"{path}: block-CRC table is truncated (entries {lo}..{hi} wanted, "
                                     f"{len(data) // 4} there)")
    arr = array.array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def write_all(fd: int, mv: memoryview) -> None:
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


def read_header(path: str) -> tuple[dict, int]:
    """The safetensors header dict and the absolute offset of the data section."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:   # a planted FIFO never blocks
            raw = f.read(8)
            if len(raw) != 8:
                raise IncompleteCheckpointError(f"{path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise CorruptCheckpointError(f"{path}: header length {n} is implausible; the file is corrupt")
            text = f.read(n)
            if len(text) != n:
                raise IncompleteCheckpointError(f"{path}: truncated header ({len(text)} of {n} bytes)")
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: data file is missing") from None
    try:
        return strict_json(text), 8 + n
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON ({e})") from None


def header_dtype(code: str) -> str:
    return CODE_DTYPES[code]


def iter_file_blocks(path: str, block: int = 16 * 1024 * 1024) -> Iterator[memoryview]:
    """A whole regular file (never through a link), in order, as views of one reused buffer."""
    try:   # a small file gets a small buffer (allocating and zeroing 16 MiB costs milliseconds)
        block = max(1, min(block, os.path.getsize(path)))
    except OSError:
        pass
    mv = memoryview(bytearray(block))
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        while True:
            n = f.readinto(mv)
            if not n:
                return
            yield mv[:n]


def file_crc32(path: str, block: int = 16 * 1024 * 1024) -> tuple[int, int]:
    """(size, crc32) of a whole file."""
    crc = 0
    size = 0
    for piece in iter_file_blocks(path, block):
        crc = crc32(piece, crc)
        size += len(piece)
    return size, crc


def pread_into(fd: int, bufs: Sequence[memoryview], offset: int) -> None:
    """Fill ``bufs`` (in order) from ``offset``; raises on a short read."""
    want = sum(len(b) for b in bufs)
    got = 0
    bufs = [b for b in bufs if len(b)]
    i = 0   # bufs[:i] are full (an index, not pop(0): thousands of row views would make it quadratic)
    while i < len(bufs):
        n = os.preadv(fd, bufs[i:i + 1024], offset + got)
        if n == 0:
            raise CorruptCheckpointError(f"short read: file ended after {got} of {want} bytes at offset {offset}")
        got += n
        # skip fully-read buffers, trim a partial one
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str, sync: bool = True) -> None:
    """Write ``text`` to ``path`` via temp file + rename; with ``sync`` (durable storage) the file is
    fsynced before the rename and its directory after it."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:   # never through a link planted under the temp name; nothing left behind on a failure
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            if not os.path.islink(tmp):
                os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
