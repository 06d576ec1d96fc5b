"""The reader: executes a load plan on one rank, verifying every byte it reads.

:func:`read_shards` checks the requested shards against the manifest, plans the reads
(:func:`.planning.load_plan.plan_load`: every read widened to whole CRC blocks) and runs them:
straight into destination memory when the copies tile a read exactly, else through a staging
buffer (from storage, a staged read of 256 KiB or more goes with ``O_DIRECT`` into page-aligned
staging, widened to whole pages: the disk's DMA, no page cache); strided ops issue one pread per row. Every check of a read is verified (cumulative block
CRCs, or the whole chunk for format 1) before its bytes are used. Rank-local, not collective.
"""
from __future__ import annotations

import array
import logging
import os
import sys
from typing import Optional, Sequence

import torch

from .crc import crc32
from .direct_write import private_buffer
from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, TensorMismatchError
from .planning.load_plan import Check, LoadPlan, ReadOp, Request, plan_load
from .planning.manifest import DTYPE_SIZES, Manifest
from .shards import TensorShard, dtype_name, region_view
from .sources import STORAGE, ChunkSource, DirSource, close_all, describe_source, read_file

log = logging.getLogger(__name__)

PREFETCH_BYTES = 32 << 20   # reads announced to a source ahead of the one running (``prefetch``)
# a staged read at least this long from a source with ``read_direct`` (storage) uses O_DIRECT: the
# disk's DMA into an aligned buffer, no page cache; O_DIRECT read 1.1-4.9x faster than a buffered
# read of the same bytes here (bench/results/2026-12-02-huge-pages.md)
DIRECT_MIN = 256 << 10
ALIGN = 4096


def read_shards(step_dir: str, man: Manifest, shards: Sequence[TensorShard], allow_cast: bool = False,
                check_crc: bool = True, sources: Optional[Sequence[ChunkSource]] = None) -> LoadPlan:
    """Fill ``shards`` from the committed checkpoint ``step_dir`` (rank-local, not collective);
    ``check_crc``: verify every byte read against the block CRCs (whole chunks for format 1).
    ``sources``: where each file is read from, nearest first (:mod:`.sources`; default: the files
    of ``step_dir``); a file that fails its checks from one source is read from the next."""
    requests = []
    targets = []
    for s in shards:
        entry = man.tensors.get(s.name)
        if entry is None:
            raise TensorMismatchError(f"tensor {s.name!r} is not in checkpoint {step_dir} (it has "
                                      f"{len(man.tensors)} tensors; see `elastor inspect`)")
        if tuple(entry.shape) != tuple(s.shape):
            raise TensorMismatchError(f"tensor {s.name}: checkpoint global shape {tuple(entry.shape)} != model "
                                      f"{tuple(s.shape)}; the model config differs from the saved one")
        want = dtype_name(s.tensor.dtype)
        if want != entry.dtype and not allow_cast:
            raise TensorMismatchError(f"tensor {s.name}: checkpoint dtype {entry.dtype} != destination {want}; "
                                      f"pass allow_cast=True to convert")
        requests.append(Request(s.name, s.region, len(targets)))
        targets.append(s.tensor)
    lplan = plan_load(man.tensors, requests, verify=check_crc)
    own = sources is None
    srcs = [DirSource(step_dir, STORAGE)] if own else list(sources)
    try:
        _Reader(step_dir, lplan, targets, check_crc, srcs, man).run()
    finally:
        if own:
            close_all(srcs)
    return lplan


class _Reader:
    """Executes a load plan: reads straight into destination memory when possible, else via a
    staging buffer, and verifies every check of every read before the bytes are used. Each file
    comes from the first source that holds it whole; a file whose bytes fail a check (or cannot be
    read) is read again, whole plan part, from the next source that holds it."""

    def __init__(self, step_dir: str, lplan: LoadPlan, targets: Sequence[torch.Tensor], check: bool,
                 sources: Sequence[ChunkSource], man: Manifest):
        self.step_dir, self.lplan, self.targets, self.check = step_dir, lplan, targets, check
        self.sources, self.man = list(sources), man
        self.tables: dict[str, tuple[int, list[int]]] = {}
        self.table_bytes = 0
        self.src: ChunkSource = self.sources[-1]   # the source of the file being read
        # staging for reads that do not land in their destinations, kept for every file of the load
        # (two each: one read while the other's bytes are checked and copied)
        self.stages = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.astages: list = [None, None]   # page-aligned, for O_DIRECT reads: (tensor, memoryview)
        self._tables: list = []   # futures of the CRC tables loading on the verify thread

    def _holders(self, fname: str) -> list[ChunkSource]:
        fe = self.man.files.get(fname)
        if fe is None:
            raise CorruptCheckpointError(f"{self.step_dir}: the manifest has no entry for file {fname!r}")
        return [s for s in self.sources if s.has(fname, fe.size)]

    def _load_table(self, table: str, lo: int, hi: int) -> None:
        """Entries ``lo..hi`` of a CRC table, from the first source whose *whole* table matches the
        manifest's CRC32 of that file (the last or only source too: a table is the link between
        the manifest and the data, so an entry recomputed over edited bytes is refused here)."""
        if not self._holders(table):
            raise IncompleteCheckpointError(f"{self.step_dir}/{table}: block-CRC table is missing from every "
                                            f"source ({', '.join(s.name for s in self.sources)})")
        fe = self.man.files[table]
        data, _ = read_file(self.sources, table, fe.size, fe.crc32, what="block-CRC table")
        if (hi + 1) * 4 > len(data):
            raise CorruptCheckpointError(f"{self.step_dir}/{table}: {len(data)} bytes, the manifest's chunks use "
                                         f"entries up to {hi} ({(hi + 1) * 4} bytes)")
        self.tables[table] = (lo, _entries(data[lo * 4:(hi + 1) * 4]))
        self.table_bytes += fe.size

    def run(self) -> None:
        for fname in dict.fromkeys(op.file for op in self.lplan.reads):   # a missing file first: it is
            if not self._holders(fname):                                   # what needs fixing, not its table
                raise IncompleteCheckpointError(f"{self.step_dir}/{fname}: data file is missing from every source "
                                                f"({', '.join(s.name for s in self.sources)})")
        groups: list[list[ReadOp]] = []
        for op in self.lplan.reads:
            if groups and groups[-1][0].file == op.file:
                groups[-1].append(op)
            else:
                groups.append([op])
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix="elastor-verify")
        try:
            if self.check:
                tables = self.lplan.table_ranges().items()
                if all(getattr(s, "thread_safe", False) for s in self.sources):
                    # on the verify thread, beside the first data reads: it runs them before the
                    # first check that needs them (one worker, in order); the main thread's own
                    # checks (strided reads) wait for them
                    self._tables = [pool.submit(self._load_table, t, lo, hi) for t, (lo, hi) in tables]
                else:
                    for t, (lo, hi) in tables:
                        self._load_table(t, lo, hi)
            for ops in groups:
                fname = ops[0].file
                holders = self._holders(fname)
                if not holders:
                    raise IncompleteCheckpointError(f"{self.step_dir}/{fname}: data file is missing from every source "
                                                    f"({', '.join(s.name for s in self.sources)})")
                if len(self.sources) > 1 and holders[0] is self.sources[-1] and holders[0].name == STORAGE:
                    # a memory restore with storage as the last resort: no memory copy of this file
                    # (e.g. the node that held it was lost before its peer copy completed)
                    log.warning("%s: no memory copy holds it (%s); reading it from %s", fname,
                                ", ".join(s.name for s in self.sources[:-1]), describe_source(holders[0], fname))
                for i, src in enumerate(holders):
                    try:
                        self._run_file(pool, src, ops)
                        break
                    except (CheckpointError, OSError) as e:
                        if i == len(holders) - 1:
                            raise
                        log.warning("%s: the copy in %s failed (%s); reading it from %s instead", fname,
                                    describe_source(src, fname), e, describe_source(holders[i + 1], fname))
            self._tables_loaded()
        except _TablesFailed as e:   # a CRC table's own error, not the data file's that was being read
            raise e.error from None
        finally:
            pool.shutdown(wait=True)

    def _tables_loaded(self) -> None:
        """Wait for the CRC tables loading on the verify thread; raise their error (wrapped, so that
        the data file being read is not blamed and read again from another source)."""
        if self._tables:
            for f in self._tables:
                err = f.exception()
                if err is not None:
                    raise _TablesFailed(err)
            self._tables = []

    def _run_file(self, pool, src: ChunkSource, ops: Sequence[ReadOp]) -> None:
        """Every read of one file from ``src``. Pipelined: while one read's bytes are checked and
        copied in a helper thread, the next read runs here (reads, zlib.crc32 and torch copies
        release the GIL); two staging buffers."""
        self.src = src
        stages, astages = self.stages, self.astages   # the previous file's jobs are done (it waited)
        pending = None
        prefetch = getattr(src, "prefetch", None)
        read_direct = getattr(src, "read_direct", None) if getattr(src, "direct_ok", False) else None

        # each read's destination views when it lands straight in the destinations (None: staged),
        # found once (the prefetch below asks about later reads too)
        dviews = [_direct_views(op, self.targets) if op.repeat == 1 else None for op in ops]

        def goes_direct(k: int) -> bool:
            op = ops[k]
            return (read_direct is not None and op.repeat == 1 and op.length >= DIRECT_MIN
                    and dviews[k] is None)
        ahead = 0   # ops[:ahead] have been announced to the source
        try:
            for i, op in enumerate(ops):
                if prefetch is not None:
                    # keep about PREFETCH_BYTES of the following contiguous reads queued at the source
                    # (not those read with O_DIRECT: the page cache would read their bytes twice)
                    ahead = max(ahead, i + 1)
                    while ahead < len(ops) and sum(o.length for o in ops[i + 1:ahead]) < PREFETCH_BYTES:
                        if ops[ahead].repeat == 1 and not goes_direct(ahead):
                            prefetch(ops[ahead].file, ops[ahead].offset, ops[ahead].length)
                        ahead += 1
                if op.repeat > 1:
                    if pending is not None:
                        pending.result()
                        pending = None
                    self._strided(src, op)
                    continue
                direct = dviews[i]
                job = None
                if direct is not None:
                    # into the destinations: not before the tables are known good (a load that
                    # fails on a forged table leaves no byte of that file in the destinations)
                    self._tables_loaded()
                    src.read_into(op.file, op.offset, direct)
                    job = (op, direct, None)
                elif goes_direct(i):
                    job = self._read_direct(read_direct, op, astages, i % 2)
                if job is None and direct is None:
                    k = i % 2
                    if stages[k].numel() < op.length:
                        stages[k] = torch.empty(op.length, dtype=torch.uint8)
                    buf = stages[k][:op.length]
                    mv = memoryview(buf.numpy())
                    src.read_into(op.file, op.offset, [mv])  # buffer k's previous user (op i-2) is done
                    job = (op, [mv], buf)
                if pending is not None:
                    pending.result()
                pending = pool.submit(self._finish, *job)
            if pending is not None:
                p, pending = pending, None
                p.result()
        finally:
            if pending is not None:   # a read failed: let the helper finish before the buffers go
                try:
                    pending.result()
                except Exception:  # noqa: BLE001 - the read's error is the one reported
                    pass

    def _read_direct(self, read_direct, op: ReadOp, astages: list, k: int) -> Optional[tuple]:
        """Read ``op`` with ``O_DIRECT`` into page-aligned staging ``k``, widened to whole 4 KiB
        pages; the job for :meth:`_finish`, or None when the source cannot (read it buffered)."""
        a = op.offset - op.offset % ALIGN
        e = -(-(op.offset + op.length) // ALIGN) * ALIGN
        if astages[k] is None or astages[k][0].numel() < e - a:
            m = private_buffer(e - a)
            astages[k] = (torch.frombuffer(m, dtype=torch.uint8), memoryview(m))
        t, mv = astages[k]
        n = read_direct(op.file, a, mv[:e - a])
        if n is None:
            return None
        lo = op.offset - a
        if n < lo + op.length:
            raise CorruptCheckpointError(f"{describe_source(self.src, op.file)}: short read: file ended after "
                                         f"{a + n} bytes, {op.offset + op.length} needed")
        buf = t[lo:lo + op.length]
        return (op, [memoryview(buf.numpy())], buf)

    def _finish(self, op: ReadOp, views: Sequence[memoryview], buf: Optional[torch.Tensor]) -> None:
        """Check a read's bytes, then (staged reads) copy them into the destinations."""
        self._tables_loaded()
        self._verify(op, views, 0)
        if buf is None:
            return
        for c in op.copies:
            raw = buf[c.buf_offset:c.buf_offset + _span_bytes(c)]
            src = raw.view(_torch_dtype(c.dtype)).as_strided(c.sizes, c.src_strides)
            region_view(self.targets[c.target], c.dst).copy_(src)

    def _entry(self, table: str, idx: int) -> int:
        if idx < 0:
            return 0
        lo, vals = self.tables[table]
        return vals[idx - lo]

    def _verify(self, op: ReadOp, views: Sequence[memoryview], k: int) -> None:
        """Check run ``k`` of ``op`` (its bytes are ``views`` back to back, starting at the run's offset)."""
        if not self.check:
            return
        run_off = op.offset + k * op.stride
        for chk in op.checks:
            start = chk.offset + k * op.stride - run_off
            if chk.table is None:
                seed, want = 0, chk.crc
            else:
                si, ei = chk.entries(k, op.check_step)
                seed, want = self._entry(chk.table, si), self._entry(chk.table, ei)
            got = _crc_range(views, start, chk.length, seed)
            if got != want:
                self._fail(chk, k, op, views, start, got, want)

    def _fail(self, chk: Check, k: int, op: ReadOp, views, start: int, got: int, want) -> None:
        at = chk.offset + k * op.stride
        where = f"bytes {at}..{at + chk.length - 1}"
        if chk.table is not None:  # name the first bad block
            first = chk.first + k * op.check_step
            seed = self._entry(chk.table, chk.base + first - 1 if first > 0 else -1)
            for b in range(chk.count):
                n = min(chk.block_size, chk.length - b * chk.block_size)
                c = _crc_range(views, start + b * chk.block_size, n, seed)
                if c != self._entry(chk.table, chk.base + first + b):
                    where = f"the {chk.block_size}-byte block at byte {at + b * chk.block_size}"
                    break
                seed = c
        raise CorruptCheckpointError(
            f"{describe_source(self.src, chk.file)}: tensor {chk.tensor!r}: {where} fails its CRC32 check (read "
            f"{got:08x}, the manifest says {want:08x}); this copy is corrupt")

    def _strided(self, src: ChunkSource, op: ReadOp) -> None:
        """One pread per outer row, straight into the destination rows when they are contiguous and
        the run is exactly the needed bytes; every run verified."""
        self._tables_loaded()
        (c,) = op.copies
        t = self.targets[c.target]
        v = region_view(t, c.dst)
        row = op.length
        need = _numel(c.sizes[1:]) * c.itemsize
        if (c.buf_offset == 0 and need == row and t.is_contiguous() and t.device.type == "cpu"
                and dtype_name(t.dtype) == c.dtype and v.dim() >= 1 and v[0].is_contiguous()):
            mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            base = (v.storage_offset() - t.storage_offset()) * t.element_size()
            rs = v.stride(0) * t.element_size()
            for k in range(op.repeat):
                dst = mv[base + k * rs: base + k * rs + row]
                src.read_into(op.file, op.offset + k * op.stride, [dst])
                self._verify(op, [dst], k)
            return
        buf = torch.empty(row, dtype=torch.uint8)
        bmv = memoryview(buf.numpy())
        piece = buf[c.buf_offset:c.buf_offset + need].view(_torch_dtype(c.dtype)).view(c.sizes[1:])
        for k in range(op.repeat):
            src.read_into(op.file, op.offset + k * op.stride, [bmv])
            self._verify(op, [bmv], k)
            v[k].copy_(piece)


class _TablesFailed(Exception):
    """A CRC table failed to load on the verify thread (``error``: why)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _entries(data: bytes) -> list[int]:
    """Little-endian uint32 CRC-table entries."""
    arr = array.array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _crc_range(views: Sequence[memoryview], start: int, length: int, seed: int) -> int:
    """CRC32 (seeded) of ``length`` bytes from byte ``start`` of ``views`` taken back to back."""
    crc = seed
    pos = 0
    for mv in views:
        n = len(mv)
        if start < pos + n and length > 0:
            a = max(0, start - pos)
            b = min(n, start + length - pos)
            crc = crc32(mv[a:b], crc)
        pos += n
        if pos >= start + length:
            break
    return crc


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _span_bytes(c) -> int:
    if not c.sizes:
        return c.itemsize
    return (sum((n - 1) * s for n, s in zip(c.sizes, c.src_strides)) + 1) * c.itemsize


def _direct_views(op: ReadOp, targets: Sequence[torch.Tensor]) -> Optional[list[memoryview]]:
    """Destination memoryviews when the copies tile the read exactly and land contiguously."""
    copies = sorted(op.copies, key=lambda c: c.buf_offset)
    pos = 0
    views = []
    for c in copies:
        t = targets[c.target]
        if c.buf_offset != pos or not c.contiguous or DTYPE_SIZES.get(dtype_name(t.dtype)) != c.itemsize \
                or dtype_name(t.dtype) != c.dtype or t.device.type != "cpu":
            return None
        v = region_view(t, c.dst)
        if not v.is_contiguous():
            return None
        views.append(memoryview(v.reshape(-1).view(torch.uint8).numpy()))
        pos += c.nbytes
    if pos != op.length:
        return None
    return views
