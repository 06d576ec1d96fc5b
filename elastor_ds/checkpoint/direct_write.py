"""Writing a data file with ``O_DIRECT``: the bytes go from aligned bounce buffers to the disk
without passing through the page cache.

Why: a buffered ``write`` copies every byte into the page cache, and the kernel pays for finding,
zeroing and later reclaiming those pages on the writing process's cores. On the development VM a
buffered write + ``fsync`` of 512 MiB took 0.19-3.3 s of CPU (the first write into fresh page
cache the most) and ran at 0.12-1.0 GB/s; the same bytes written with ``O_DIRECT`` took 0.03 s of
CPU at 1.3-1.4 GB/s (bench/results/2026-12-02-direct-io.md). A checkpoint is written once and
read back rarely, so caching its pages buys nothing.

How: a buffer whose bytes sit at the same offset modulo 4 KiB in memory as in the file (the
page-aligned staging buffer behind a header padded to a page, :data:`~.fileformat.DATA_ALIGN`)
is written straight from where it is, in :data:`DIRECT_CHUNK` pieces, apart from the few bytes
before its first aligned file offset and after its last. Everything else -- the header, a column
tile's :class:`~.fileformat.RowRuns`, a buffer that is not so aligned -- is copied into one of
:data:`NBUF` page-aligned bounce buffers of :data:`PIECE` bytes (numpy copies, which release the
GIL). A helper thread performs the writes in file order while the next bounce buffer fills; when
it finds several full ones waiting it writes them with one ``writev`` (the disk runs at its floor
only with requests of several MiB: one 2 MiB write per call was 1.10x slower than 32 MiB writes
here, ``writev`` of two 2 MiB buffers 1.01x). A tile's rows are not written straight from staging
with one iovec per row: with 4-16 KiB segments the disk's 254-segment requests stay small, and
two ranks wrote 1.15-1.45x slower than from contiguous memory
(bench/results/2026-12-04-s31-strided-writes-and-snapshot-cpu.md). The CRCs are taken in the copying thread, of the
bytes just copied into the bounce buffer while they are still in the cache (:class:`StreamCrcs`):
one strided pass over the source instead of two, and no second thread taking the GIL for every
4 KiB block (bench/results/2026-12-04-s27-writer-crcs.md). The last piece is padded with zeros
to the 4 KiB alignment ``O_DIRECT`` needs and the file is cut back to its size with
``ftruncate``; then ``fsync`` (with ``fsync=True``) makes size and data durable.

Fallback: a file system without ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE file systems) refuses
the open or the first write with ``EINVAL``; the file is then written by the buffered
:func:`~.fileformat.write_stream` from the start. Any other error is raised.
"""
from __future__ import annotations

import array
import errno
import logging
import mmap
import os
import queue
import time
from typing import Iterable, Sequence

import numpy as np

from ..threads import NamedThread
from .crc import crc32, crc32_combine
from .fileformat import GIL_PAUSE_BYTES, GIL_PAUSE_S, RowRuns, gil_pausing, extend_block_crcs, write_stream
from .live import LiveSpan, materialize
from .planning.manifest import BLOCK_SIZE
from .writer_sched import thread_target

log = logging.getLogger(__name__)

ALIGN = 4096            # O_DIRECT: buffer address, length and file offset in multiples of this
# bytes per bounce buffer (a multiple of ALIGN). 2 MiB, one huge page each (Linux aligns an anonymous
# mapping of a multiple of 2 MiB to a huge-page boundary): six runs of bench/ckpt_bench.py alternated
# with 4 MiB wrote as fast (write / floor 0.91-1.26, mean 1.12, against 1.00-1.22, mean 1.12) with
# 6 MiB less at the peak (peak / (state + staging) 1.019-1.023 against 1.031-1.032 at 256 MiB per
# rank); two 2 MiB buffers wrote slower (1.18-1.38), 1 MiB and 512 KiB buffers (4 KiB pages) too
# (1.35-1.64) (bench/results/2026-12-03-bounce-pieces-and-snapshot-cpu.md; 8 -> 4 MiB:
# bench/results/2026-12-02-bounce-buffers.md)
PIECE = 2 * 1024 * 1024
NBUF = 3                 # bounce buffers per file
_COPY = 1024 * 1024      # bytes per copy call
DIRECT_CHUNK = 32 * 1024 * 1024   # bytes per write straight from a caller's buffer
MIN_DIRECT = 256 * 1024  # a shorter aligned buffer is copied (one write saved is not worth the call)

_unsupported: set[int] = set()   # st_dev of file systems that refused O_DIRECT (not tried again)


class _Refused(Exception):
    """The file system refused O_DIRECT on the first write (EINVAL)."""


def write_stream_direct(path: str, header: bytes, buffers: Iterable["memoryview | RowRuns"], fsync: bool = True,
                        chunk_crcs: list[int] | None = None, block_crcs: list[list[int]] | None = None,
                        block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """:func:`~.fileformat.write_stream` (same file, same return value, same CRC lists) with
    ``O_DIRECT`` where the file system allows it (see the module docstring)."""
    mvs = [b if isinstance(b, (RowRuns, LiveSpan)) else memoryview(b).cast("B") for b in buffers]
    dev = _device_of(os.path.dirname(path) or ".")
    if dev in _unsupported or not hasattr(os, "O_DIRECT"):
        return write_stream(path, header, materialize(mvs), fsync=fsync, chunk_crcs=chunk_crcs, block_crcs=block_crcs,
                            block_size=block_size)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return _fall_back(dev, path, header, mvs, fsync, chunk_crcs, block_crcs, block_size)
    crcs = StreamCrcs(len(header), [len(m) for m in mvs], block_size, blocks=block_crcs is not None)
    try:
        try:
            size = _write_all_direct(fd, header, mvs, crcs)
        except _Refused:
            os.close(fd)
            fd = -1
            return _fall_back(dev, path, header, mvs, fsync, chunk_crcs, block_crcs, block_size)
        if fsync:
            os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    file_crc = crcs.finish()
    if chunk_crcs is not None:
        chunk_crcs.extend(crcs.chunk_crcs)
    if block_crcs is not None:
        block_crcs.extend(crcs.tables)
    return size, file_crc


class StreamCrcs:
    """The CRCs :func:`~.fileformat.stream_crcs` gives for a data file (the header's, each
    chunk's cumulative block CRCs and CRC, the file's), taken from the file's bytes as they are
    fed in file order, in pieces of any size: ``header_len`` bytes of header, then chunks of
    ``lengths`` bytes. ``blocks=False``: chunk and file CRCs only (one CRC call per piece)."""

    def __init__(self, header_len: int, lengths: Sequence[int], block_size: int, blocks: bool = True):
        self.segs = [header_len, *lengths]
        self.block = block_size
        self.want_blocks = blocks
        self.chunk_crcs: list[int] = []
        self.tables: list = []
        self.i = 0
        self.left = header_len
        self.c = 0
        self.filled = 0
        self.cur = array.array("I")
        self.file_crc = 0
        self._next_nonempty()

    def _close(self) -> None:
        if self.i == 0:
            self.file_crc = self.c
        else:
            if self.want_blocks:
                if self.filled or not self.cur:
                    self.cur.append(self.c)
                self.tables.append(self.cur)
            self.chunk_crcs.append(self.c)
            self.file_crc = crc32_combine(self.file_crc, self.c, self.segs[self.i])
        self.i += 1
        self.c = 0
        self.filled = 0
        self.cur = array.array("I")
        self.left = self.segs[self.i] if self.i < len(self.segs) else 0

    def _next_nonempty(self) -> None:
        while self.i < len(self.segs) and self.left == 0:
            self._close()

    def feed(self, mv: "memoryview | np.ndarray") -> None:
        """The next ``len(mv)`` bytes of the file."""
        if not isinstance(mv, memoryview):
            mv = memoryview(mv)
        p, n = 0, len(mv)
        while p < n:
            if self.i >= len(self.segs):
                raise ValueError(f"{n - p} bytes fed past the end of the file's chunks")
            take = min(self.left, n - p)
            if self.i == 0 or not self.want_blocks:
                self.c = crc32(mv[p:p + take], self.c)
            else:
                self.c, self.filled = extend_block_crcs(self.cur, mv[p:p + take], self.c, self.filled, self.block)
            p += take
            self.left -= take
            if self.left == 0:
                self._next_nonempty()

    def finish(self) -> int:
        """The file's CRC, once every byte was fed."""
        if self.i < len(self.segs):
            raise ValueError(f"the file's CRCs are missing {self.left + sum(self.segs[self.i + 1:])} bytes")
        return self.file_crc


def _device_of(folder: str) -> int:
    try:
        return os.stat(folder).st_dev
    except OSError:
        return -1


def _fall_back(dev: int, path: str, header: bytes, mvs: list, fsync: bool, chunk_crcs: list[int] | None,
               block_crcs: list[list[int]] | None, block_size: int) -> tuple[int, int]:
    if dev not in _unsupported:
        log.info("O_DIRECT is not supported under %s; checkpoint data files there are written through the "
                 "page cache", os.path.dirname(path))
        _unsupported.add(dev)
    return write_stream(path, header, materialize(mvs), fsync=fsync, chunk_crcs=chunk_crcs, block_crcs=block_crcs,
                        block_size=block_size)


def _write_all_direct(fd: int, header: bytes, mvs: list, crcs: "StreamCrcs") -> int:
    """Copy ``header`` and ``mvs`` through the bounce buffers to ``fd`` (opened O_DIRECT), feeding
    every byte to ``crcs`` in file order; cut the file to its size. Returns the size. Raises
    :class:`_Refused` when the first write gets EINVAL."""
    b = _Bounce(fd, crcs)
    try:
        b.put_flat(np.frombuffer(header, dtype=np.uint8))
        gates: list = []
        for mv in _coalesce(mvs):
            if isinstance(mv, LiveSpan):
                if mv.gate not in gates:
                    gates.append(mv.gate)
                b.put_live(mv)
            elif isinstance(mv, RowRuns):
                b.put_runs(mv)
            elif len(mv):
                b.put_flat(np.frombuffer(mv, dtype=np.uint8))
        for g in gates:   # every live byte is in a bounce buffer: a fence from now on has nothing to copy
            g.release()
        total = b.finish()
        if total % ALIGN:
            os.ftruncate(fd, total)
        return total
    finally:
        b.close()


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0] if len(mv) else 0


def _coalesce(mvs: list) -> list:
    """``mvs`` with each run of flat buffers that follow one another in the memory of one exporting
    object (the items of one staging buffer, in file order) merged into one buffer, so that a run
    is written in a few large writes rather than one or more per item."""
    out: list = []
    end = -1   # the address just past the last flat buffer in ``out``
    for mv in mvs:
        if isinstance(mv, (RowRuns, LiveSpan)) or not len(mv):
            out.append(mv)
            end = -1
            continue
        addr = _address(mv)
        prev = out[-1] if out else None
        if end == addr and isinstance(prev, memoryview) and prev.obj is mv.obj:
            try:
                whole = memoryview(mv.obj).cast("B")
            except TypeError:   # not a C-contiguous exporter: leave the two apart
                whole = None
            if whole is not None:
                base = _address(whole)
                a = _address(prev) - base
                if 0 <= a and addr + len(mv) - base <= len(whole):
                    out[-1] = whole[a:addr + len(mv) - base]
                    end = addr + len(mv)
                    continue
        out.append(mv)
        end = addr + len(mv)
    return out


def private_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned private anonymous memory, backed by huge pages where the kernel allows
    (``MADV_HUGEPAGE``; transparent huge pages in "madvise" mode). An ``O_DIRECT`` write from 4 KiB
    pages carries one segment per page; from 2 MiB pages far fewer, and it ran about 1.4x faster
    on the development VM (32 MiB writes: 0.12-0.14 s per 256 MiB against 0.16-0.21 s from
    Python's default shared anonymous mapping, bench/results/2026-12-02-huge-pages.md)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    advise = getattr(m, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            advise(mmap.MADV_HUGEPAGE)
        except OSError:   # a kernel without transparent huge pages: 4 KiB pages, still correct
            pass
    return m


class _Bounce:
    """NBUF page-aligned bounce buffers: the caller fills one while a helper thread writes the others;
    every byte, copied or written in place, is fed to ``crcs`` in file order."""

    def __init__(self, fd: int, crcs: StreamCrcs):
        self.fd = fd
        self.crcs = crcs
        self.bufs = [private_buffer(PIECE) for _ in range(NBUF)]
        self.arrs = [np.frombuffer(m, dtype=np.uint8) for m in self.bufs]
        self.free: "queue.Queue[int]" = queue.Queue()
        self.full: "queue.Queue[tuple[int, int] | None]" = queue.Queue()
        for i in range(len(self.bufs)):
            self.free.put(i)
        self.err: list[BaseException] = []
        self.written = 0
        self.total = 0
        self.cur = self.free.get()
        self.pos = 0
        self.thread = NamedThread(target=thread_target(self._writer), name="elastor-direct-write", daemon=True)
        self.thread.start()

    def _writer(self) -> None:
        """Write the full pieces in order: every piece waiting when the last write ended in one
        ``writev`` (up to DIRECT_CHUNK bytes), then hand the bounce buffers back."""
        stop = False
        while not stop:
            batch = [self.full.get()]
            size = self._len(batch[0])
            while batch[-1] is not None and size < DIRECT_CHUNK:
                try:
                    item = self.full.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
                size += self._len(item)
            if batch[-1] is None:
                stop = True
                batch.pop()
            if batch and not self.err:
                try:
                    self._write([memoryview(self.bufs[i])[:src] if i >= 0 else src for i, src in batch])
                except BaseException as e:  # noqa: BLE001 - reported to the producer
                    self.err.append(e)
            for i, _ in batch:
                if i >= 0:
                    self.free.put(i)

    @staticmethod
    def _len(item) -> int:
        if item is None:
            return 0
        i, src = item
        return src if i >= 0 else len(src)

    def _write(self, views: list) -> None:
        """``writev`` of ``views`` at the file's position, continuing after a short write."""
        while views:
            want = sum(len(v) for v in views)
            k = os.writev(self.fd, views)
            if k % ALIGN and k != want:
                raise OSError(errno.EIO, f"O_DIRECT short write of {k} bytes is not aligned")
            self.written += k
            while views and k >= len(views[0]):
                k -= len(views[0])
                views.pop(0)
            if views and k:
                views[0] = views[0][k:]

    def _raise(self) -> None:
        e = self.err[0]
        if isinstance(e, OSError) and e.errno == errno.EINVAL and self.written == 0:
            raise _Refused() from e
        raise e

    def room(self) -> int:
        """Free bytes in the current bounce buffer (handing a full one to the writer first)."""
        if self.pos == PIECE:
            self.full.put((self.cur, PIECE))
            self.cur = self.free.get()
            self.pos = 0
            if self.err:
                self._raise()
        return PIECE - self.pos

    def put_flat(self, src: np.ndarray) -> None:
        n = len(src)
        if n >= MIN_DIRECT and (src.__array_interface__["data"][0] - self.total) % ALIGN == 0:
            self._put_direct(src)
        else:
            self._copy(src)

    def _put_direct(self, src: np.ndarray) -> None:
        """``src`` whose address is congruent to its file offset modulo ALIGN: its bytes up to the
        next aligned file offset through the bounce buffer, then every whole ALIGN block written
        from ``src`` itself, the rest through the bounce buffer again."""
        k = (-self.total) % ALIGN
        self._copy(src[:k])
        m = (len(src) - k) // ALIGN * ALIGN
        if self.pos:   # the filled part of the bounce buffer (a multiple of ALIGN) goes first
            self.full.put((self.cur, self.pos))
            self.cur = self.free.get()
            self.pos = 0
            if self.err:
                self._raise()
        for a in range(k, k + m, DIRECT_CHUNK):
            self.full.put((-1, memoryview(src[a:min(a + DIRECT_CHUNK, k + m)])))
        self.total += m
        # the CRCs of the bytes written in place, from the source while the helper writes them;
        # a loop of small-block CRCs holds the GIL, so off the main thread it pauses between pieces
        pause = gil_pausing(self.crcs.block)
        for a in range(k, k + m, GIL_PAUSE_BYTES):
            if pause and a > k:
                time.sleep(GIL_PAUSE_S)
            self.crcs.feed(src[a:min(a + GIL_PAUSE_BYTES, k + m)])
        self._copy(src[k + m:])

    def _copy(self, src: np.ndarray) -> None:
        a, n = 0, len(src)
        while a < n:
            k = min(self.room(), n - a, _COPY)
            dst = self.arrs[self.cur][self.pos:self.pos + k]
            dst[...] = src[a:a + k]
            self.crcs.feed(dst)   # still in the cache
            self.pos += k
            self.total += k
            a += k

    def put_runs(self, runs: RowRuns) -> None:
        """A column tile's rows, back to back: whole rows as one 2-D copy where they fit, a row
        that straddles two bounce buffers through :meth:`put_flat`."""
        w = runs.width
        if runs.rows == 0 or w == 0:
            return
        src = np.ndarray((runs.rows, w), dtype=np.uint8, buffer=runs.base, offset=runs.offset,
                         strides=(runs.stride, 1))
        r = 0
        per = max(1, _COPY // w)
        while r < runs.rows:
            fit = self.room() // w
            if fit == 0:
                self._copy(src[r])
                r += 1
                continue
            k = min(fit, runs.rows - r, per)
            dst = self.arrs[self.cur][self.pos:self.pos + k * w]
            dst.reshape(k, w)[...] = src[r:r + k]
            self.crcs.feed(dst)
            self.pos += k * w
            self.total += k * w
            r += k

    def put_live(self, span: LiveSpan) -> None:
        """A chunk read from the live tensors until the fence, from staging after it
        (:mod:`.live`): each piece (whole rows, or part of a row; 1 MiB at most) is copied under
        the gate's lock from the view the gate names then; waiting for a free bounce buffer (the
        disk) happens outside the lock, so a fence waits for one piece at most."""
        gate, k = span.gate, span.k
        shape = span.shape if len(span.shape) == 2 else (1, len(span))
        rows, w = shape
        if rows == 0 or w == 0:
            return
        r = c = 0
        per = max(1, _COPY // w)
        while r < rows:
            room = self.room()
            gate.let_fence_in()
            with gate.lock:
                src = gate.source(k)
                if src.ndim == 1:
                    src = src.reshape(1, w)
                if c == 0 and room >= w:
                    m = min(room // w, rows - r, per)
                    dst = self.arrs[self.cur][self.pos:self.pos + m * w]
                    dst.reshape(m, w)[...] = src[r:r + m]
                    r += m
                else:
                    m = min(room, w - c, _COPY)
                    dst = self.arrs[self.cur][self.pos:self.pos + m]
                    dst[...] = src[r, c:c + m]
                    c += m
                    if c == w:
                        r, c = r + 1, 0
            self.crcs.feed(dst)   # the bounce buffer's bytes: no lock needed
            self.pos += len(dst)
            self.total += len(dst)

    def finish(self) -> int:
        """Hand the last piece (zero-padded to ALIGN) to the writer, wait for it; the file's size."""
        pad = (-self.pos) % ALIGN
        self.arrs[self.cur][self.pos:self.pos + pad] = 0
        if self.pos + pad:
            self.full.put((self.cur, self.pos + pad))
        self.full.put(None)
        self.thread.join()
        if self.err:
            self._raise()
        return self.total

    def close(self) -> None:
        if self.thread.is_alive():
            self.full.put(None)
            self.thread.join()
        self.arrs = []
        for m in self.bufs:
            try:
                m.close()
            except BufferError:   # a view still held (an exception's frame): freed with it
                pass
