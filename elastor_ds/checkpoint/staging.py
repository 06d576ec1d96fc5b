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

import logging
from typing import Sequence

import numpy as np
import torch

from .planning.save_plan import WriteItem
from .shards import TensorShard, region_view

log = logging.getLogger(__name__)


def _byte_run(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``t``'s storage from ``t``'s first element, as a uint8 tensor."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, t.data_ptr() - st.data_ptr(), (nbytes,))


class _CopyProgram:
    """The CPU copies of one (items, shards, buffer): (destination array, source array) pairs."""

    def __init__(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor):
        self.items, self.shards, self.buf = items, shards, buf
        self.tensors = [sh.tensor for sh in shards]
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []
        self.strided: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.spans: list[tuple[int, int]] = []
        self.total = sum(i.nbytes for i in items)
        run: list = []   # [src tensor, src storage id, src start ptr, dst start, nbytes] of the open run

        def close() -> None:
            if run and run[4]:
                self.copies.append((buf[run[3]:run[3] + run[4]].numpy(), _byte_run(run[0], run[4]).numpy()))
            run.clear()
        pos = 0
        for it in items:
            sh = shards[it.shard]
            src = region_view(sh.tensor, it.region.relative_to(sh.region))
            n = it.nbytes
            self.spans.append((pos, n))
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
            elif n:
                close()   # any other strides: torch's strided copy (dtypes numpy lacks, e.g. bfloat16)
                self.strided.append((buf[pos:pos + n].view(src.dtype).view(it.region.sizes), src))
            pos += n
        close()

    def valid_for(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor) -> bool:
        return (items is self.items and shards is self.shards and buf is self.buf and len(shards) == len(self.tensors)
                and all(sh.tensor is t for sh, t in zip(shards, self.tensors)))


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

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            log.debug("allocating %d-byte staging buffer (pinned=%s)", nbytes, self.pin)
            self._programs = [p for p in self._programs if p.buf is not self.buf]
            self.buf = None
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
            buf.zero_()  # pre-fault every page now, not during the first save's stall
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

    def snapshot(self, items: Sequence[WriteItem], shards: Sequence[TensorShard], buf: torch.Tensor | None = None,
                 defer: bool = False) -> list[tuple[int, int]]:
        """Copy every item's bytes into the buffer in file order; return (offset, nbytes) per item."""
        prog = next((p for p in self._programs if p.valid_for(items, shards, buf)), None) if buf is not None else None
        total = prog.total if prog is not None else sum(i.nbytes for i in items)
        if buf is None:
            buf = self.ensure(total)
        elif buf.numel() < total:
            raise ValueError(f"staging destination holds {buf.numel()} bytes, the save needs {total}")
        self.wait_device()
        if not any(sh.tensor.is_cuda for sh in shards):
            if prog is None:
                prog = next((p for p in self._programs if p.valid_for(items, shards, buf)), None)
            if prog is None:
                prog = _CopyProgram(items, shards, buf)
                self._programs = [prog, *self._programs[:self.MAX_PROGRAMS - 1]]
            self._program = prog
            for dst, src in prog.copies:
                np.copyto(dst, src)
            for dst_t, src_t in prog.strided:
                dst_t.copy_(src_t)
            return list(prog.spans)
        spans = []
        pos = 0
        use_stream = False
        for it in items:
            sh = shards[it.shard]
            src = region_view(sh.tensor, it.region.relative_to(sh.region))
            n = it.nbytes
            raw = buf[pos:pos + n]
            if src.is_cuda:
                use_stream = True
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                    self._stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._stream):
                    raw.view(src.dtype).view(it.region.sizes).copy_(src, non_blocking=True)
            elif src.is_contiguous() and n:
                # a byte memcpy: numpy's copyto ran at ~11 GB/s here, torch's copy_ into a byte view at 5-7
                np.copyto(raw.numpy(), src.reshape(-1).view(torch.uint8).numpy())
            elif n and src.dim() == 2 and src.stride(1) == 1:
                # a column tile: one memcpy per row (numpy, byte views of the strided source)
                rows = src.shape[0]
                np.copyto(raw.numpy().reshape(rows, -1), src.view(torch.uint8).numpy())
            else:
                raw.view(src.dtype).view(it.region.sizes).copy_(src)
            spans.append((pos, n))
            pos += n
        if use_stream:
            stream, self._stream = self._stream, None
            ev = torch.cuda.Event()
            ev.record(stream)
            if defer:
                self.pending = ev
            else:
                ev.synchronize()
        return spans

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
