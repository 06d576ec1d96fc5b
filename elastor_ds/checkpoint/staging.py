"""Host staging: one pre-allocated, reused byte buffer per rank, and the snapshot copy into it.

The training stall of a save is this copy and nothing else. The buffer is sized to the bytes this
rank writes (after deduplication), allocated once (pinned when CUDA is present, so device-to-host
copies are DMA) and pre-faulted, because first-touch page faults on fresh host memory are slower
than the disk. It is reused across saves and only grows when a plan needs more.

On the CPU the copy runs a cached *copy program*: built once per (plan items, shard list, buffer),
it merges items whose source bytes are adjacent in memory and adjacent in the buffer (a ZeRO flat
partition's per-parameter pieces, parameters of one flat buffer) into single memcpys, so a save of
hundreds of small regions costs a handful of ``numpy.copyto`` calls (each releases the GIL) instead
of a Python loop of views per item. The program is rebuilt whenever the items, the shard list, any
shard's tensor or the buffer is not the one it was built for. The destination may also be the
caller's (a memory snapshot's mapped data file, :mod:`.file_staging`); programs are cached per
destination.
"""
from __future__ import annotations

import array
import ctypes
import logging
import mmap
from typing import Sequence

import numpy as np
import torch

from ..layout.region import Region
from .fileformat import extend_block_crcs
from .planning.save_plan import WriteItem
from .shards import TensorShard, region_view

log = logging.getLogger(__name__)

PAGE = 4096   # the staging buffer's alignment
HUGE_PAGE = 2 << 20


def advise_huge_pages(addr: int, nbytes: int) -> bool:
    """Ask for transparent huge pages behind ``[addr, addr + nbytes)`` (``madvise(MADV_HUGEPAGE)``
    on the whole pages inside it), before its pages are first touched. Fewer, larger pages make
    the snapshot copy's TLB misses and an ``O_DIRECT`` write's segments fewer. False where the
    platform or kernel has no such advice (nothing changes then)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return False
    return _madvise(addr, nbytes, advice)


def drop_pages(addr: int, nbytes: int) -> bool:
    """Give the whole pages inside ``[addr, addr + nbytes)`` back to the kernel
    (``madvise(MADV_DONTNEED)``: private memory reads as zeros afterwards and takes no memory until
    it is written again), for a buffer whose old bytes are not needed: an allocator may hand out
    memory another allocation already made resident. False where the platform has no such advice."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    return advice is not None and _madvise(addr, nbytes, advice)


def _madvise(addr: int, nbytes: int, advice: int) -> bool:
    start = addr + (-addr) % PAGE
    end = (addr + nbytes) // PAGE * PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), int(advice)) == 0
    except (OSError, AttributeError):
        return False


def _byte_run(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``t``'s storage from ``t``'s first element, as a uint8 tensor (on ``t``'s device)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, t.data_ptr() - st.data_ptr(), (nbytes,))


def _tile_run_end(items: Sequence[WriteItem], i: int) -> int:
    """The end of the run of column tiles of one 2-D box that starts at ``items[i]``: the items
    after it of the same tensor and shard, with the same rows, each starting at the column where
    the one before ends (:func:`~.planning.save_plan.column_tiles` cuts a box so)."""
    first = items[i]
    if first.region.ndim != 2:
        return i + 1
    j = i + 1
    while j < len(items):
        it, prev = items[j], items[j - 1]
        if (it.name != first.name or it.shard != first.shard or it.dtype != first.dtype
                or it.region.offsets[0] != first.region.offsets[0] or it.region.sizes[0] != first.region.sizes[0]
                or it.region.offsets[1] != prev.region.ends[1]):
            break
        j += 1
    return j


class _CopyProgram:
    """The CPU copies of one (items, shards, buffer): (destination array, source array) pairs."""

    device = False

    def __init__(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor,
                 whole_boxes: bool = False):
        self.items, self.shards, self.buf, self.whole_boxes = items, shards, buf, whole_boxes
        self.tensors = [sh.tensor for sh in shards]
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []
        self.copy_pos: list[int] = []   # each copy's first byte in the buffer (copies run in buffer order)
        self.strided: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.spans: list[tuple[int, ...]] = []
        # each span's bytes in the live tensor (1-D, or 2-D rows of a wider tensor), for writes that
        # read the live state until the fence (:mod:`.live`); None when some span has other strides
        self.live: list[np.ndarray] | None = []
        self.live_chunks = None   # the engine's LiveChunks of this program (built on its first live save)
        self.total = sum(i.nbytes for i in items)
        run: list = []   # [src tensor, src storage id, src start ptr, dst start, nbytes] of the open run

        def close() -> None:
            if run and run[4]:
                self.copies.append((buf[run[3]:run[3] + run[4]].numpy(), _byte_run(run[0], run[4]).numpy()))
                self.copy_pos.append(run[3])
            run.clear()

        def copy(src: torch.Tensor, pos: int, n: int, sizes: Sequence[int]) -> None:
            if n and src.is_contiguous():
                sid = src.untyped_storage().data_ptr()
                if run and run[1] == sid and run[2] + run[4] == src.data_ptr() and run[3] + run[4] == pos:
                    run[4] += n   # adjacent in the source storage and in the buffer: one memcpy
                else:
                    close()
                    run.extend([src, sid, src.data_ptr(), pos, n])
            elif n and src.dim() == 2 and src.stride(1) == 1:
                close()   # a column tile: one memcpy per row (numpy, byte views of the strided source)
                self.copies.append((buf[pos:pos + n].numpy().reshape(src.shape[0], -1), src.view(torch.uint8).numpy()))
                self.copy_pos.append(pos)
            elif n:
                close()   # any other strides: torch's strided copy (dtypes numpy lacks, e.g. bfloat16)
                self.strided.append((buf[pos:pos + n].view(src.dtype).view(tuple(sizes)), src))
        pos = 0
        i = 0
        while i < len(items):
            it = items[i]
            sh = shards[it.shard]
            j = _tile_run_end(items, i) if whole_boxes else i + 1
            if j - i > 1:
                # the column tiles of one box: the box is copied whole, row-major (one memcpy when
                # the shard holds whole rows), and each tile is a strided span of it that the
                # writer streams row by row (the tiling costs the training thread nothing)
                box = Region(it.region.offsets, (it.region.sizes[0], items[j - 1].region.ends[1] - it.region.offsets[1]))
                n = sum(items[k].nbytes for k in range(i, j))
                src = region_view(sh.tensor, box.relative_to(sh.region))
                copy(src, pos, n, box.sizes)
                rows = box.sizes[0]
                row_bytes = n // rows
                rows_live = _rows_of(src, rows)
                col = 0
                for k in range(i, j):
                    width = items[k].nbytes // rows
                    self.spans.append((pos + col, items[k].nbytes, rows, row_bytes))
                    self._add_live(None if rows_live is None else rows_live[:, col:col + width])
                    col += width
                pos += n
                i = j
                continue
            n = it.nbytes
            self.spans.append((pos, n))
            src = region_view(sh.tensor, it.region.relative_to(sh.region))
            copy(src, pos, n, it.region.sizes)
            if not n or src.is_contiguous():
                self._add_live(_byte_run(src, n).numpy())
            else:
                self._add_live(_rows_of(src, src.shape[0]) if src.dim() == 2 else None)
            pos += n
            i += 1
        close()

    def _add_live(self, arr: "np.ndarray | None") -> None:
        if self.live is not None:
            if arr is None:
                self.live = None
            else:
                self.live.append(arr)

    def run_from(self, start: int) -> int:
        """Run the copies of the buffer's bytes at offsets >= ``start`` (a 2-D copy that reaches
        past ``start`` is run whole); the bytes copied. Only for programs without torch strided copies."""
        if self.strided:
            raise ValueError("a copy program with strided copies cannot run a suffix")
        done = 0
        for (dst, src), pos in zip(self.copies, self.copy_pos):
            if pos + dst.size <= start:
                continue
            if dst.ndim == 1 and pos < start:
                d = start - pos
                np.copyto(dst[d:], src[d:])
                done += dst.size - d
            else:
                np.copyto(dst, src)
                done += dst.size
        return done

    def valid_for(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor,
                  whole_boxes: bool = False) -> bool:
        return (items is self.items and shards is self.shards and buf is self.buf and whole_boxes == self.whole_boxes
                and len(shards) == len(self.tensors)
                and all(sh.tensor is t for sh, t in zip(shards, self.tensors)))


def _rows_of(src: torch.Tensor, rows: int) -> "np.ndarray | None":
    """A 2-D tensor whose rows are contiguous (stride 1 along them) as a ``(rows, row bytes)``
    uint8 array over its memory; None for any other strides."""
    if src.dim() != 2 or src.shape[0] != rows or src.stride(1) != 1:
        return None
    try:
        return src.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):   # a dtype torch cannot view as bytes: the save copies instead
        return None


class _DeviceCopyProgram(_CopyProgram):
    """The device-to-host copies of one (items, device shards, pinned buffer), as torch tensor
    pairs: items adjacent in one device storage and in the buffer (a ZeRO flat partition's
    pieces, a DDP bucket's parameters) merged into one ``copy_`` each, any other item copied alone
    (strided ones through torch's own staging). Built once per plan and reused: without it every
    snapshot looped over every item in Python, a view and a copy launch each, on the training
    thread."""

    device = True

    def __init__(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor):
        self.items, self.shards, self.buf, self.whole_boxes = items, shards, buf, False
        self.tensors = [sh.tensor for sh in shards]
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []   # (buffer view, source view)
        self.spans: list[tuple[int, ...]] = []
        self.total = sum(i.nbytes for i in items)
        run: list = []   # [src tensor, src storage ptr, src start ptr, dst start, nbytes] of the open run

        def close() -> None:
            if run and run[4]:
                self.pairs.append((buf[run[3]:run[3] + run[4]], _byte_run(run[0], run[4])))
            run.clear()

        pos = 0
        for it in items:
            sh = shards[it.shard]
            src = region_view(sh.tensor, it.region.relative_to(sh.region))
            n = it.nbytes
            self.spans.append((pos, n))
            if n and src.is_contiguous():
                sid = src.untyped_storage().data_ptr()
                if (run and run[1] == sid and run[2] + run[4] == src.data_ptr() and run[3] + run[4] == pos
                        and run[0].device == src.device):
                    run[4] += n
                else:
                    close()
                    run.extend([src, sid, src.data_ptr(), pos, n])
            elif n:
                close()
                self.pairs.append((buf[pos:pos + n].view(src.dtype).view(tuple(it.region.sizes)), src))
            pos += n
        close()


class BlockCrcs:
    """The cumulative block CRCs of a buffer's spans, fed with its bytes in buffer order (right
    after they are copied, while they are in cache). ``spans``: contiguous ``(offset, nbytes)`` in
    buffer order; :meth:`result` gives :func:`~.fileformat.cumulative_crcs` of each span (the CRC
    of the span's bytes up to every block end, the last at the span's end; ``[0]`` when empty)."""

    def __init__(self, spans: Sequence[tuple[int, ...]], block_size: int, data: memoryview):
        self.spans = [(int(sp[0]), int(sp[1])) for sp in spans]
        self.bs = int(block_size)
        self.mv = data
        self.tables: list = [array.array("I") for _ in self.spans]   # uint32 entries (see cumulative_crcs)
        self.k = 0
        self.pos = self.spans[0][0] if self.spans else 0
        self.c = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self.k < len(self.spans) and self.spans[self.k][1] == 0:
            self.tables[self.k] = array.array("I", [0])
            self.k += 1

    def feed(self, end: int) -> None:
        """The bytes up to buffer offset ``end`` are final."""
        spans, bs, mv = self.spans, self.bs, self.mv
        pos, c = self.pos, self.c
        while pos < end and self.k < len(spans):
            start, n = spans[self.k]
            span_end = start + n
            stop = min(end, span_end)
            table = self.tables[self.k]
            c, _ = extend_block_crcs(table, mv[pos:stop], c, (pos - start) % bs, bs)
            pos = stop
            if pos == span_end:
                if not table or (pos - start) % bs:                # the span's last, short block
                    table.append(c)
                self.k += 1
                c = 0
                self._skip_empty()
        self.pos, self.c = pos, c

    def result(self) -> list:
        if self.k != len(self.spans):
            raise AssertionError(f"block CRCs: {self.k} of {len(self.spans)} spans fed")
        return self.tables


class StagingBuffer:
    """The rank's staging memory and the snapshot copy into it.

    ``snapshot(items, shards)`` copies into this object's own reused buffer; ``snapshot(..., buf=t)``
    into caller-provided memory (a mapped data file, :mod:`.file_staging`). Copy programs are
    cached per destination buffer (a node-local engine alternates between its ``keep`` + 1 files).

    CUDA shards are copied on a side stream that first waits for the work queued on the current
    stream. By default the snapshot waits for those copies. With ``defer=True`` it returns at once
    and leaves a CUDA event in :attr:`pending`: whoever reads the bytes waits for it
    (:meth:`wait_device`), and the training loop must call :meth:`fence` before it next changes a
    saved tensor (the optimizer step), so the copy overlaps the next forward and backward.
    """

    MAX_PROGRAMS = 6

    def __init__(self, pin_memory: bool | None = None):
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.buf: torch.Tensor | None = None
        self._stream = None
        self._program: _CopyProgram | None = None   # the last one used
        self._programs: list[_CopyProgram] = []
        self.pending = None   # CUDA event of copies not yet known to be complete (defer=True)
        self.block_tables: list[list[int]] | None = None   # the last snapshot's block CRCs (block_crcs=)

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def ensure(self, nbytes: int, prefault: bool = True) -> torch.Tensor:
        """The buffer, at least ``nbytes`` long (allocated anew when shorter). ``prefault``: touch
        every page now, not during the first save's copy; False for a live write's buffer, which
        only a fence copies into (a save whose write ends before the next optimizer step leaves it
        untouched, and it then takes no memory)."""
        if self.buf is None or self.buf.numel() < nbytes:
            log.debug("allocating %d-byte staging buffer (pinned=%s)", nbytes, self.pin)
            self._programs = [p for p in self._programs if p.buf is not self.buf]
            self.buf = None
            # page-aligned (the data section of a file starts at a page too, fileformat.DATA_ALIGN):
            # the O_DIRECT writer then sends the buffer to the disk as it is, with no bounce copy
            raw = torch.empty(max(nbytes, 1) + PAGE - 1, dtype=torch.uint8, pin_memory=self.pin)
            off = (-raw.data_ptr()) % PAGE
            buf = raw[off:off + max(nbytes, 1)]
            if not self.pin:   # (pinned memory is the CUDA allocator's)
                advise_huge_pages(buf.data_ptr(), buf.numel())
            if prefault:
                buf.zero_()  # pre-fault every page now, not during the first save's stall
            elif not self.pin:
                drop_pages(buf.data_ptr(), buf.numel())   # memory freed before may come back resident
            self.buf = buf
        return self.buf

    def forget_all(self) -> None:
        """Drop every cached copy program (before the memory they copy into is unmapped)."""
        self._programs = []
        self._program = None

    def forget(self, buf: torch.Tensor) -> None:
        """Drop the copy programs into ``buf`` (their views would keep its memory alive)."""
        self._programs = [p for p in self._programs if p.buf is not buf]
        if self._program is not None and self._program.buf is buf:
            self._program = None

    # the copy runs in pieces of this many bytes when block CRCs are taken on the way (each piece is
    # checksummed while it is in cache: one pass over memory instead of the copy's plus the writer's)
    CRC_PIECE = 256 * 1024

    def snapshot(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor | None = None,
                 defer: bool = False, whole_boxes: bool = False,
                 block_crcs: int | None = None) -> list[tuple[int, ...]]:
        """Copy every item's bytes into the buffer in file order; return (offset, nbytes) per item.

        ``whole_boxes`` (CPU shards): the column tiles of one box are copied as the box, row-major,
        and each tile's span is ``(offset, nbytes, rows, row stride)``: its rows of ``nbytes //
        rows`` bytes, ``row stride`` apart (the writer streams them in file order, row by row);
        for a destination that is the file itself (staged in place) leave it False.

        ``block_crcs`` (a block size; CPU shards, ``whole_boxes`` False): also take each span's
        cumulative block CRCs of the bytes just copied into the buffer, piece by piece while they
        are in cache; they are left in :attr:`block_tables` (None when this copy could not take
        them, e.g. device shards or copies out of buffer order: the writer then reads the buffer)."""
        self.block_tables: list[list[int]] | None = None
        prog = (next((p for p in self._programs if not p.device and p.valid_for(items, shards, buf, whole_boxes)),
                     None) if buf is not None else None)
        total = prog.total if prog is not None else sum(i.nbytes for i in items)
        if buf is None:
            buf = self.ensure(total)
        elif buf.numel() < total:
            raise ValueError(f"staging destination holds {buf.numel()} bytes, the save needs {total}")
        self.wait_device()
        if not any(sh.tensor.is_cuda for sh in shards):
            if prog is None:
                prog = next((p for p in self._programs if not p.device and p.valid_for(items, shards, buf, whole_boxes)),
                            None)
            if prog is None:
                prog = _CopyProgram(items, shards, buf, whole_boxes)
                self._programs = [prog, *self._programs[:self.MAX_PROGRAMS - 1]]
            self._program = prog
            if block_crcs and not whole_boxes and not prog.strided:
                self.block_tables = self._copy_with_crcs(prog, buf, block_crcs)
                return list(prog.spans)
            for dst, src in prog.copies:
                np.copyto(dst, src)
            for dst_t, src_t in prog.strided:
                dst_t.copy_(src_t)
            return list(prog.spans)
        dprog = next((p for p in self._programs if p.device and p.valid_for(items, shards, buf)), None)
        if dprog is None:
            dprog = _DeviceCopyProgram(items, shards, buf)
            self._programs = [dprog, *self._programs[:self.MAX_PROGRAMS - 1]]
        self._program = dprog
        use_stream = any(src.is_cuda for _, src in dprog.pairs)
        if use_stream:
            # a side stream that starts after the work already queued (the values being saved)
            self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for dst, src in dprog.pairs:
                    dst.copy_(src, non_blocking=src.is_cuda)   # a CPU shard beside device ones: copied now
        else:
            for dst, src in dprog.pairs:
                dst.copy_(src)
        spans = list(dprog.spans)
        if use_stream:
            stream, self._stream = self._stream, None
            ev = torch.cuda.Event()
            ev.record(stream)
            if defer:
                self.pending = ev
            else:
                ev.synchronize()
        return spans

    def program(self, items: Sequence[WriteItem], shards: Sequence[TensorShard],
                buf: torch.Tensor | None = None) -> _CopyProgram:
        """The CPU copy program of a whole-box snapshot into this object's buffer (built or cached),
        without running it: a live write (:mod:`.live`) runs a suffix of it at the fence (a buffer
        allocated here is not pre-faulted: its pages take memory once a fence copies into them).
        ``buf``: into that memory instead (a memory snapshot's mapped data file, item by item in
        file order, as :meth:`snapshot` copies into it)."""
        whole = buf is None
        if buf is None:
            buf = self.ensure(sum(i.nbytes for i in items), prefault=False)
        elif buf.numel() < sum(i.nbytes for i in items):
            raise ValueError(f"staging destination holds {buf.numel()} bytes, the save needs "
                             f"{sum(i.nbytes for i in items)}")
        prog = next((p for p in self._programs if not p.device and p.valid_for(items, shards, buf, whole)), None)
        if prog is None:
            prog = _CopyProgram(items, shards, buf, whole)
            self._programs = [prog, *self._programs[:self.MAX_PROGRAMS - 1]]
        self._program = prog
        return prog

    def _copy_with_crcs(self, prog: _CopyProgram, buf: torch.Tensor, block_size: int) -> list[list[int]]:
        """Run ``prog`` in buffer order, in pieces, feeding each piece's bytes to the block CRCs."""
        crcs = BlockCrcs(prog.spans, block_size, memoryview(buf.numpy()))
        piece = self.CRC_PIECE
        for (dst, src), pos in zip(prog.copies, prog.copy_pos):
            if dst.ndim != 1:   # a column tile's rows: one strided copy, then its bytes
                np.copyto(dst, src)
                crcs.feed(pos + dst.size)
                continue
            n = dst.shape[0]
            for a in range(0, n, piece):
                b = min(n, a + piece)
                np.copyto(dst[a:b], src[a:b])
                crcs.feed(pos + b)
        crcs.feed(prog.total)
        return crcs.result()

    def wait_device(self) -> None:
        """Block until the deferred device-to-host copies have landed (before reading the bytes)."""
        ev = self.pending
        if ev is not None:
            ev.synchronize()   # cleared only after it completed: a concurrent fence() still waits
            if self.pending is ev:
                self.pending = None

    def fence(self) -> None:
        """Make the current CUDA stream wait (on the device, the CPU does not block) for the deferred
        copies: call before anything changes a tensor that a snapshot is still reading."""
        ev = self.pending
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
