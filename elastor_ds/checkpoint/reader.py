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
import dataclasses
import logging
import sys
from typing import Optional, Sequence

import numpy as np
import torch

from .crc import crc32
from .direct_write import private_buffer
from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, TensorMismatchError
from .planning.load_plan import Check, LoadPlan, ReadOp, Request, plan_load
from .planning.manifest import DTYPE_SIZES, Manifest
from .shards import TensorShard, dtype_name, region_view
from .sources import STORAGE, ChunkSource, DirSource, close_all, describe_source, read_file

log = logging.getLogger(__name__)

# a staged read from a source in memory (``in_memory``: tmpfs, peer copies held here) into CPU
# destinations is read, checked and copied in pieces of about this size, each while it is in the
# core's cache. 1 MiB: two ranks loading 256 MiB each from tmpfs took 1.6-1.7x the cached-read
# floor with 1-2 MiB pieces, 1.8-2.1x with 512 KiB and 2.0-2.2x with 256 KiB (Python per piece),
# against 2.4-2.5x for whole 8 MiB reads (bench/results/2026-12-03-memory-loads.md)
MEMORY_PIECE = 1 << 20
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
    of ``step_dir``); a file that fails its checks from one source is read from the next.

    When it raises, each destination byte holds verified bytes of this checkpoint, its value
    before the call, or zero (a read into the destination that failed or failed its check is
    zeroed, logged): never bytes that failed their check. The destinations as a whole are then a
    mix, not a state to train from."""
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
        self.pstage: Optional[torch.Tensor] = None   # the piece buffer of reads from memory (_pieces)

    def _holders(self, fname: str) -> list[ChunkSource]:
        fe = self.man.files.get(fname)
        if fe is None:
            raise CorruptCheckpointError(f"{self.step_dir}: the manifest has no entry for file {fname!r}")
        return [s for s in self.sources if s.has(fname, fe.size)]

    def _not_held(self, fname: str, what: str) -> IncompleteCheckpointError:
        """No source holds the complete file: say what each has instead (missing, truncated, ...)."""
        size = self.man.files[fname].size
        why = "; ".join(f"{s.name}: {s.absence(fname, size)}" if hasattr(s, "absence") else s.name
                        for s in self.sources)
        return IncompleteCheckpointError(f"{self.step_dir}/{fname}: {what} is not complete in any source ({why})")

    def _load_table(self, table: str, lo: int, hi: int) -> None:
        """Entries ``lo..hi`` of a CRC table, from the first source whose *whole* table matches the
        manifest's CRC32 of that file (the last or only source too: a table is the link between
        the manifest and the data, so an entry recomputed over edited bytes is refused here)."""
        if not self._holders(table):
            raise self._not_held(table, "block-CRC table")
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
                raise self._not_held(fname, "data file")
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
                    raise self._not_held(fname, "data file")
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
        piecewise = bool(getattr(src, "in_memory", False))

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
                if direct is None and piecewise and all(self.targets[c.target].device.type == "cpu" for c in op.copies):
                    cuts = _piece_cuts(op, MEMORY_PIECE)
                    if cuts is not None:
                        # from memory: read, check and copy each cache-sized piece on this thread
                        if pending is not None:
                            p, pending = pending, None
                            p.result()
                        self._pieces(src, op, cuts)
                        continue
                job = None
                if direct is not None:
                    # into the destinations: not before the tables are known good (a load that
                    # fails on a forged table leaves no byte of that file in the destinations)
                    self._tables_loaded()
                    try:
                        src.read_into(op.file, op.offset, direct)
                    except BaseException:
                        _scrub(direct, op, src, "its read failed")   # part of a read is unverified bytes
                        raise
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
                    try:
                        pending.result()
                    except BaseException:
                        if job[2] is None:   # read straight into the destinations, never checked
                            _scrub(job[1], job[0], src, "an earlier read of its file failed")
                        raise
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

    def _pieces(self, src: ChunkSource, op: ReadOp, cuts: Sequence[int]) -> None:
        """A staged read from memory in pieces (``cuts``: :func:`_piece_cuts`): each piece is read
        into one small buffer, its blocks checked and its rows copied into the destinations while
        it is in this core's cache (one pass over memory for the read and one for the copy, where
        a whole read staged in a large buffer went to memory three times: read, check, copy)."""
        self._tables_loaded()
        size = max(b - a for a, b in zip(cuts, cuts[1:]))
        if self.pstage is None or self.pstage.numel() < size:
            self.pstage = torch.empty(size, dtype=torch.uint8)
        pbuf = self.pstage
        pnp = pbuf.numpy()
        pmv = memoryview(pnp)
        checks = [(chk.offset - op.offset, chk.offset - op.offset + chk.length, chk) for chk in op.checks] \
            if self.check else []
        # per copy: its byte range in the read, its row pitch there, and a copier of rows r0..r1 from
        # the piece buffer placed at byte ``a`` of the read
        copies = [(c.buf_offset, c.buf_offset + _span_bytes(c), c.src_strides[0] * c.itemsize if c.sizes else 0,
                   _row_copier(c, self.targets[c.target], pbuf, pnp)) for c in op.copies]
        checks.sort(key=lambda t: t[0])
        copies.sort(key=lambda t: t[0])
        name, base = op.file, op.offset
        ck = cp = 0   # the first check / copy not yet done with (both lists sorted by start)
        for a, b in zip(cuts, cuts[1:]):
            mv = pmv[:b - a]
            src.read_into(name, base + a, [mv])
            for j in range(ck, len(checks)):
                cs, ce, chk = checks[j]
                if cs >= b:
                    break
                if ce > a:
                    self._verify_part(op, chk, mv, a, max(cs, a), min(ce, b))
            while ck < len(checks) and checks[ck][1] <= b:
                ck += 1
            for j in range(cp, len(copies)):
                s0, e0, row, copy = copies[j]
                if s0 >= b:
                    break
                if e0 > a:
                    if s0 >= a and e0 <= b:
                        copy(a, 0, None)
                    else:   # a cut copy: its rows in this piece
                        copy(a, (max(s0, a) - s0) // row, -(-(min(e0, b) - s0) // row))
            while cp < len(copies) and copies[cp][1] <= b:
                cp += 1

    def _verify_part(self, op: ReadOp, chk: Check, mv: memoryview, a: int, lo: int, hi: int) -> None:
        """Check the blocks of ``chk`` in bytes ``lo..hi`` of the read (``mv`` holds its bytes from
        ``a``); ``lo`` and ``hi`` are the check's own ends or block ends in it (:func:`_piece_cuts`)."""
        cs = chk.offset - op.offset
        if lo != cs or hi != cs + chk.length:   # a part of the check: its blocks j0 .. j1 - 1
            if chk.table is None:
                raise AssertionError("a whole-chunk check cut into pieces")
            j0, j1 = (lo - cs) // chk.block_size, -(-(hi - cs) // chk.block_size)
            chk = dataclasses.replace(chk, offset=op.offset + lo, length=hi - lo, first=chk.first + j0,
                                      count=j1 - j0)
        if chk.table is None:
            seed, want = 0, chk.crc
        else:
            si, ei = chk.entries()
            seed, want = self._entry(chk.table, si), self._entry(chk.table, ei)
        got = crc32(mv[lo - a:hi - a], seed)
        if got != want:
            self._fail(chk, 0, op, [mv], lo - a, got, want)

    def _finish(self, op: ReadOp, views: Sequence[memoryview], buf: Optional[torch.Tensor]) -> None:
        """Check a read's bytes, then (staged reads) copy them into the destinations. A read that
        landed in the destinations (``buf`` None) and fails its check is zeroed there."""
        if buf is None:
            try:
                self._tables_loaded()
                self._verify(op, views, 0)
            except BaseException:
                _scrub(views, op, self.src, "they failed their check")
                raise
            return
        self._tables_loaded()
        self._verify(op, views, 0)
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
                try:
                    src.read_into(op.file, op.offset + k * op.stride, [dst])
                    self._verify(op, [dst], k)
                except BaseException:
                    _scrub([dst], op, src, "its read or check failed")
                    raise
            return
        buf = torch.empty(row, dtype=torch.uint8)
        bmv = memoryview(buf.numpy())
        piece = buf[c.buf_offset:c.buf_offset + need].view(_torch_dtype(c.dtype)).view(c.sizes[1:])
        for k in range(op.repeat):
            src.read_into(op.file, op.offset + k * op.stride, [bmv])
            self._verify(op, [bmv], k)
            v[k].copy_(piece)


# element size -> (torch, numpy) integer dtypes of that size: a byte-exact copy of any dtype, bf16 too
_SAME_SIZE_INT = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
                  8: (torch.int64, np.int64)}


def _row_copier(c, target: torch.Tensor, pbuf: torch.Tensor, pnp: "np.ndarray"):
    """``copy(a, r0, r1)``: rows ``r0..r1`` (outer index; ``r1`` None: all) of copy ``c`` from the
    piece buffer (``pbuf``, its numpy view ``pnp``) holding the read's bytes from byte ``a``, into
    their box of ``target``. A byte-exact numpy copy where the dtypes match on the CPU (1.3-1.6x
    faster than torch's ``copy_`` of these strided row blocks here), else torch's."""
    dst = region_view(target, c.dst)
    sizes = list(c.sizes)
    nrows = sizes[0] if sizes else 1
    same = _SAME_SIZE_INT.get(c.itemsize) if dtype_name(target.dtype) == c.dtype and target.device.type == "cpu" \
        else None
    if same is not None and sizes:
        dnp = dst.detach().view(same[0]).numpy()   # (a parameter that requires grad is filled in place too)
        sdt = np.dtype(same[1])
        bstrides = [st * c.itemsize for st in c.src_strides]
        row = bstrides[0]
        rest = sizes[1:]

        def copy(a: int, r0: int, r1: Optional[int]) -> None:
            r1 = nrows if r1 is None else min(nrows, r1)
            np.copyto(dnp[r0:r1], np.ndarray([r1 - r0, *rest], sdt, pnp, c.buf_offset + r0 * row - a, bstrides))
        return copy

    def copy_t(a: int, r0: int, r1: Optional[int]) -> None:
        r1 = nrows if r1 is None else min(nrows, r1)
        sz = [r1 - r0, *sizes[1:]] if sizes else []
        start = c.buf_offset + (r0 * c.src_strides[0] * c.itemsize if sizes else 0)
        n = (sum((k - 1) * st for k, st in zip(sz, c.src_strides)) + 1) * c.itemsize
        raw = pbuf[start - a:start - a + n]
        (dst.narrow(0, r0, r1 - r0) if sizes else dst).copy_(
            raw.view(_torch_dtype(c.dtype)).as_strided(sz, c.src_strides))
    return copy_t


def _piece_cuts(op: ReadOp, piece: int) -> Optional[list[int]]:
    """Where to cut a staged read into pieces of about ``piece`` bytes, as offsets in the read from
    0 to its length; None when it is short or no cut fits. A cut may fall inside a check only at
    one of its block ends (a whole-chunk check of format 1: never), and inside a copy only at the
    start of one of its rows (outer index), so each piece's blocks are checked and its rows copied
    on their own."""
    if op.repeat != 1 or op.length < 2 * piece:
        return None
    rules = []   # (start, end, step): a cut strictly inside [start, end) must be start + k * step
    for chk in op.checks:
        s0 = chk.offset - op.offset
        rules.append((s0, s0 + chk.length, chk.block_size if chk.table is not None else 0))
    for c in op.copies:
        step = c.src_strides[0] * c.itemsize if c.sizes and c.sizes[0] > 1 else 0
        rules.append((c.buf_offset, c.buf_offset + _span_bytes(c), step))
    rules.sort()

    def ok(p: int) -> bool:
        return all(p <= s0 or p >= e or (st and (p - s0) % st == 0) for s0, e, st in rules)

    def grid(q: int, down: bool) -> Optional[int]:
        """The nearest cut from ``q`` (included) downwards or upwards on the grid of the coarsest
        rule over ``q``, strictly between the last cut and the end; None when there is none near."""
        inside = [(s0, e, st) for s0, e, st in rules if s0 < q < e]
        whole = [(s0, e) for s0, e, st in inside if st == 0]
        if whole:   # inside a unit that cannot be cut: its start, or its end
            q = max(s0 for s0, _ in whole) if down else max(e for _, e in whole)
            return q if cuts[-1] < q < op.length and ok(q) else None
        s0, _, st = max(inside, key=lambda t: t[2]) if inside else (q, 0, 1)
        start = q
        q -= (q - s0) % st
        if not down and q < start:
            q += st
        for _ in range(_CUT_TRIES):
            if not cuts[-1] < q < op.length:
                return None
            if ok(q):
                return q
            q += -st if down else st
        return None

    cuts = [0]
    while op.length - cuts[-1] >= 2 * piece:
        target = cuts[-1] + piece
        below, above = grid(target, True), grid(target, False)
        p = below if below is not None and (below - cuts[-1] >= piece // 2 or above is None) else above
        if p is None:
            break
        cuts.append(p)
    if len(cuts) == 1:
        return None
    cuts.append(op.length)
    return cuts


_CUT_TRIES = 64   # grid points tried each way around a piece's target


class _TablesFailed(Exception):
    """A CRC table failed to load on the verify thread (``error``: why)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _entries(data: bytes) -> "array.array[int]":
    """Little-endian uint32 CRC-table entries, as an array (indexing it gives ints; a list of a
    256 KiB table's 65,536 entries cost 1.4 ms to build here, the array 5 us)."""
    arr = array.array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def _scrub(views: Sequence[memoryview], op: ReadOp, src: ChunkSource, why: str) -> None:
    """Zero destination bytes that a read put there unchecked when the read or its check failed
    (a corrupt copy; a peer whose bytes fail their MAC): after a failed load a destination byte is
    verified checkpoint bytes, its value before the load, or zero, never bytes that failed their
    check (they may be an attacker's). A fallback source reads the whole file again."""
    n = 0
    for v in views:
        np.frombuffer(v, dtype=np.uint8)[:] = 0
        n += len(v)
    log.warning("%s: %d bytes at offset %d read into the destination tensors were zeroed: %s",
                describe_source(src, op.file), n, op.offset, why)


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
        views.append(memoryview(v.detach().reshape(-1).view(torch.uint8).numpy()))
        pos += c.nbytes
    if pos != op.length:
        return None
    return views
