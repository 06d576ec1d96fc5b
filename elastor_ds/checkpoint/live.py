"""Live writes: a storage save that reads the training state itself, not a copy of it, until the
next optimizer step.

Why: with the copy first, a save's time to durable is the copy (the training stall) plus the write,
so persistence can be at most ``write / (copy + write)`` of the disk's speed: 0.79-0.86 on the
development VM (bench/results/2026-12-04-s27-writer-crcs.md). Model and optimizer state only change
at the optimizer step, and the checkpoint session already calls :meth:`~.engine.CheckpointEngine.fence`
right before it (the CUDA snapshot's deferred copies use the same hook). So the writer can read the
live CPU tensors from the start of the save, and only what it has not read when the fence comes is
copied into the staging buffer then; that copy is the stall, and it is empty when the write ends
before the next optimizer step.

How: a :class:`LiveGate` per save holds, for every chunk (span) of the rank's data file, two
views of the same shape: the live tensor's bytes and the staging buffer's. The ``O_DIRECT``
writer (:mod:`.direct_write`) copies a chunk into its bounce buffers piece by piece (1 MiB at most),
each piece under the gate's lock, from whichever view :meth:`LiveGate.source` gives. The fence
takes the lock (so it waits for at most one piece), copies every chunk from the one the writer is
in onwards into staging (the copy program's suffix, :meth:`~.staging._CopyProgram.run_from`), and
from then on the writer reads staging. When the writer has read every chunk it releases the gate
under the lock, and a later fence does nothing. Writers that do not go through bounce buffers
(the buffered fallback) copy everything into staging first (:meth:`LiveGate.stage_all`).

A memory snapshot staged in place (its data file on tmpfs, mapped, is the staging) works the same
way with the file as the staged side: :func:`fill_in_place` copies each chunk from the live
tensors into the file piece by piece under the lock and takes its block CRCs right after, and a
fence copies the rest into the file (``memory_snapshot.live_write``).

What guards the contract: each tensor's autograd version counter, which in-place torch operations
(the optimizer's ``add_``, ``mul_``, ``copy_``) increment. It is read at
``save`` and compared at the fence and when the writer releases the gate; a change means the bytes
the writer read may mix two states, so the save fails on every rank
(:class:`~elastor_ds.errors.LiveStateChangedError`) and nothing is committed. Writes that bypass the
counter are not seen: through ``.data``, numpy views or another process; batch norm's running
statistics on CPU; torch's fused optimizers (``fused=True``: Adam, AdamW, SGD, Adagrad; torch 2.13
on CPU), whose kernels write the parameters and moments without bumping it (behind the fence they
are safe, but a missing fence commits the state after their step); and :meth:`~.engine.CheckpointEngine.load`,
which fences every save of its process in flight first for that reason. Only turn live writes on
where the optimizer step (behind the fence) is the only thing that changes saved tensors. The DeepSpeed
integration's shards are ``detach()`` views (a ``.data`` alias would have a counter of its own),
and a session whose model has batch norm with running statistics keeps live writes off with a
warning. A fence interrupted part way (Ctrl-C in the step pre-hook) drops the save.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Optional, Sequence

import numpy as np
import torch

from ..errors import LiveStateChangedError
from .fileformat import RowRuns


class LiveChunks:
    """What a live write reads, per chunk of the rank's data file, for one copy program (built once
    per plan and reused): the live tensor's bytes and the staging buffer's as arrays of the same
    shape (1-D, or 2-D ``(rows, width)``), the writers' views of staging, where each chunk and the
    chunks after it start in staging, and ``stage_from(pos)`` that copies the live bytes at staging
    offsets >= ``pos`` into staging."""

    def __init__(self, live: Sequence[np.ndarray], views: Sequence["memoryview | RowRuns"], starts: Sequence[int],
                 stage_from: Callable[[int], int], tensors: Sequence[torch.Tensor], names: Sequence[str]):
        if not (len(live) == len(views) == len(starts)):
            raise ValueError(f"{len(live)} live, {len(views)} staged views for {len(starts)} chunks")
        self.live, self.views = list(live), list(views)
        self.staged = [_as_array(v, a.shape) for v, a in zip(views, live)]
        # the first staging byte of each chunk and of every chunk after it (a column tile's rows
        # interleave with its box's other tiles; every byte of chunk k and later is at or after this)
        self.suffix_start = list(starts)
        for k in range(len(starts) - 2, -1, -1):
            self.suffix_start[k] = min(self.suffix_start[k], self.suffix_start[k + 1])
        self.stage_from = stage_from
        self.tensors, self.names = list(tensors), list(names)


class LiveGate:
    """One save's switch between the live and the staged bytes of its :class:`LiveChunks` (see the
    module docstring); the tensors' version counters are read when it is made (at ``save``), or
    given (``versions``: a gate for the same tensors under a new plan, made after ``save``)."""

    def __init__(self, chunks: LiveChunks, step: int, versions: Optional[Sequence[int]] = None):
        self.chunks = chunks
        self.versions = list(versions) if versions is not None else [t._version for t in chunks.tensors]
        if len(self.versions) != len(chunks.tensors):
            raise ValueError(f"{len(self.versions)} version counters for {len(chunks.tensors)} tensors")
        self.step = step
        self.lock = threading.Lock()
        self.cursor = 0                     # the chunk the writer reads (or last read)
        self.staged_from: Optional[int] = None   # chunks >= this are read from staging
        self.released = False               # the writer has read every chunk
        self.error: Optional[BaseException] = None
        # a fence waits for the lock: the writer lets it in before its next piece (a lock is not
        # fair, and a writer that takes it again at once could keep a fence out until it is done)
        self.fence_waiting = False
        self._fence_over = threading.Event()

    def __len__(self) -> int:
        return len(self.chunks.live)

    def source(self, k: int) -> np.ndarray:
        """Chunk ``k``'s bytes to read now (call with :attr:`lock` held)."""
        if self.error is not None:
            raise self.error
        self.cursor = k
        c = self.chunks
        return c.staged[k] if self.staged_from is not None and k >= self.staged_from else c.live[k]

    def changed(self, when: str) -> Optional[LiveStateChangedError]:
        c = self.chunks
        moved = [n for n, t, v in zip(c.names, c.tensors, self.versions) if t._version != v]
        if not moved:
            return None
        shown = ", ".join(repr(n) for n in moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
        return LiveStateChangedError(
            f"checkpoint save of step {self.step}: {shown} changed in place {when}, while the writer was reading "
            f"the live tensors (live_write); the save is dropped. Call fence() on the engine before anything "
            f"changes a saved tensor (CheckpointSession does it before every optimizer step), or turn live_write off")

    def _stage(self, k: int) -> int:
        """Copy chunks ``k``.. into staging and read them from there from now on; the bytes copied."""
        starts = self.chunks.suffix_start
        if k >= len(starts):
            self.staged_from = k
            return 0
        try:
            n = self.chunks.stage_from(starts[k])
        except BaseException as e:
            # interrupted part way (Ctrl-C in the step pre-hook, a SIGTERM handler that exits): staging
            # holds some of these chunks, the live tensors may change from here on, so no byte of
            # this save can be trusted; the writer reports it and nothing is committed
            self.error = LiveStateChangedError(
                f"checkpoint save of step {self.step}: copying the state the writer had not read yet into "
                f"staging was interrupted ({type(e).__name__}); the save is dropped")
            raise
        self.staged_from = k   # only now: a writer reading staging from here on reads whole copies
        return n

    def fence(self, boost: Callable[[], ContextManager] = contextlib.nullcontext) -> int:
        """Training thread, before saved tensors change: copy what the writer has not read into
        staging (waiting for at most the piece it is copying, with the writer ``boost``-ed while
        waiting: a background writer holding the lock runs only on idle cycles); the bytes copied."""
        if not self.lock.acquire(blocking=False):
            self.fence_waiting = True
            try:
                with boost():
                    self.lock.acquire()
            except BaseException:
                self.fence_waiting = False
                self._fence_over.set()
                raise
        try:
            if self.released or self.staged_from is not None or self.error is not None:
                return 0
            self.error = self.changed("before the fence")
            if self.error is not None:
                return 0
            return self._stage(self.cursor)
        finally:
            self.fence_waiting = False
            self._fence_over.set()
            self.lock.release()

    def let_fence_in(self) -> None:
        """Writer thread, between two pieces: when a fence is waiting for the lock, wait until it
        has been through, so that it waits for one piece at most."""
        if self.fence_waiting:
            self._fence_over.wait()

    def stage_all(self) -> None:
        """Writer thread, for a writer that reads each chunk whole (the buffered fallback): copy
        every chunk not yet staged into staging now. Raises when a fence already moved some chunks
        to staging and the rest may have changed since (the save is then dropped, on every rank)."""
        with self.lock:
            if self.error is not None:
                raise self.error
            if self.released:
                # the O_DIRECT writer had read every chunk and let go of the tensors (a fence since
                # copied nothing, and the optimizer may have stepped) when the file system refused its
                # first write: re-reading the live tensors now could give another step's bytes
                self.error = LiveStateChangedError(
                    f"checkpoint save of step {self.step}: the file system refused O_DIRECT after the writer had "
                    f"read the live tensors, which may have changed since; the save is dropped (the next one "
                    f"writes through the page cache from the start)")
                raise self.error
            if self.staged_from is None:
                self.error = self.changed("before the writer staged them")
                if self.error is not None:
                    raise self.error
                self._stage(0)
            elif self.staged_from > 0:
                self.error = LiveStateChangedError(
                    f"checkpoint save of step {self.step}: the writer had to start over after the fence (the file "
                    f"system refused O_DIRECT), and chunks read before the fence may have changed; the save is "
                    f"dropped (the next one writes through the page cache from the start)")
                raise self.error
            self.released = True

    def release(self) -> None:
        """Writer thread: every chunk was read; check that no saved tensor changed meanwhile."""
        with self.lock:
            if self.error is None and self.staged_from is None:
                self.error = self.changed("before the writer finished")
            self.released = True
            if self.error is not None:
                raise self.error

    def staged_view(self, k: int) -> "memoryview | RowRuns":
        """Chunk ``k`` of the staging buffer as the writers take it (a flat view, or a tile's rows)."""
        return self.chunks.views[k]

    def close(self) -> None:
        """The save is over: a later fence has nothing to do."""
        with self.lock:
            self.released = True


def _as_array(view: "memoryview | RowRuns", shape: tuple) -> np.ndarray:
    """A writer's view of staging as a byte array of ``shape`` (a flat chunk whose live bytes are
    rows of a wider tensor is reshaped to those rows)."""
    if isinstance(view, RowRuns):
        return np.ndarray((view.rows, view.width), dtype=np.uint8, buffer=view.base, offset=view.offset,
                          strides=(view.stride, 1))
    return np.frombuffer(view, dtype=np.uint8).reshape(shape)


class LiveSpan:
    """Chunk ``k`` of a :class:`LiveGate`, as an item of the writer's buffer list."""

    __slots__ = ("gate", "k", "shape")

    def __init__(self, gate: LiveGate, k: int):
        self.gate, self.k = gate, k
        self.shape = gate.chunks.live[k].shape

    def __len__(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 0


# bytes a writer copies under the gate's lock at a time (a fence waits for one such piece at most)
PIECE_BYTES = 1 << 20


def fill_in_place(gate: LiveGate, data: memoryview, spans: Sequence[tuple[int, int]], block_size: int) -> list:
    """Writer thread, a live save whose staging is the data file itself (a memory snapshot's mapped
    file on tmpfs, :mod:`.snapshot.file_staging`; the gate's staged views are its chunks): copy
    each chunk from the live tensors into the file in file order, piece by piece (whole rows, or
    part of a row; :data:`PIECE_BYTES` at most) under the gate's lock, and take the block CRCs of
    each piece right after it lands, while it is in cache. A chunk a fence has staged is already in
    the file: only its CRCs are taken. Then the gate is released (which checks that no saved tensor
    changed meanwhile). ``spans``: each chunk's ``(offset, nbytes)`` in ``data``. Returns each
    chunk's cumulative block CRCs (:class:`~.staging.BlockCrcs`)."""
    from .staging import BlockCrcs
    crcs = BlockCrcs(spans, block_size, data)
    c = gate.chunks
    for k, (pos, n) in enumerate(spans):
        if not n:
            continue
        shape = c.live[k].shape
        rows, w = shape if len(shape) == 2 else (1, n)
        per = max(1, PIECE_BYTES // w)
        r = col = 0
        while r < rows:
            gate.let_fence_in()
            with gate.lock:
                src = gate.source(k)
                dst = c.staged[k]
                live = src is not dst
                if src.ndim == 1:
                    src, dst = src.reshape(1, w), dst.reshape(1, w)
                if col == 0 and w <= PIECE_BYTES:
                    m = min(per, rows - r)
                    if live:
                        np.copyto(dst[r:r + m], src[r:r + m])
                    r += m
                else:   # a row longer than a piece: part of it
                    m = min(PIECE_BYTES, w - col)
                    if live:
                        np.copyto(dst[r, col:col + m], src[r, col:col + m])
                    col += m
                    if col == w:
                        r, col = r + 1, 0
            crcs.feed(pos + r * w + col)   # the file's bytes, in file order: no lock needed
    gate.release()
    crcs.feed(spans[-1][0] + spans[-1][1] if spans else 0)
    return crcs.result()


def materialize(buffers: Sequence[Any]) -> list:
    """``buffers`` with every :class:`LiveSpan` replaced by its staged bytes (copied into staging
    first, :meth:`LiveGate.stage_all`): for writers that read a chunk more than once."""
    gates = []
    for b in buffers:
        if isinstance(b, LiveSpan) and b.gate not in gates:
            gates.append(b.gate)
    for g in gates:
        g.stage_all()
    return [b.gate.staged_view(b.k) if isinstance(b, LiveSpan) else b for b in buffers]
