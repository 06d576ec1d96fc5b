"""CheckpointEngine: asynchronous, deduplicated, partition-agnostic save and resharding load.

Save (``save``), one in flight at a time:
1. Wait for the previous save; if it failed on any rank, raise its :class:`AsyncSaveError` here, on
   every rank, and start nothing (the message says this step was not saved: call ``save`` again).
2. Agree on the save plan: one ``all_equal`` (on a group with liveness checks, through the
   arrival marks in the store; else one tiny all-reduce) says whether every rank's shard metadata
   still matches the cached plan; if so reuse it, else all-gather the metadata and compute the plan
   (:func:`plan_save`: deduplicated, balanced, identical on every rank). When this rank's own
   metadata matches (CPU shards, a storage that does not stage in place), step 3's copy runs under
   the cached plan while the agreement runs in a helper thread, so the stall is the longer of the
   two, not their sum; if another rank's metadata changed, the copy is done again under the new
   plan (bench: the agreement, mostly the wait for the slowest rank, was 0.18 of the memcpy floor
   on top of the copy at 2 x 256 MiB). With ``optimistic_plan``
   (memory snapshots every step) there is no per-save collective: each rank checks its own
   metadata against the cached plan; a rank whose metadata changed writes nothing, the save is
   dropped on every rank at commit time (never half-committed; logged, counted in
   ``saves_dropped``) and the next save plans again.
3. Snapshot: copy the regions this rank writes into the reused staging buffer. This is the stall.
   With a storage that stages in place (:class:`~.storage.TmpfsStorage`: memory snapshots) the
   staging buffer is the rank's data file itself, mapped: a retired file is renamed into the temp
   dir, its header written, the regions copied into its pages; CPU shards are copied in pieces of
   256 KiB and each piece's block CRCs are taken while it is in cache (one pass over the bytes
   instead of the copy's plus the writer's).
   With ``live_write`` (CPU shards, a storage whose writer reads live chunks) there is no copy
   here: the writer reads the live tensors until :meth:`CheckpointEngine.fence`, which copies
   only what it has not read yet (:mod:`.live`). With nothing to hide step 2's agreement behind,
   it runs on the writer's group after ``save`` returns: the writer joins it before reading, the
   next fence after its copy; where it failed, the writers plan again on their group (waiting for
   nothing training does), and a fence waits for the new plan and copies under it.
4. Background writer thread (one per engine, fed one save at a time): stream the buffer to
   ``data_<rank>.safetensors`` in the temp step dir through the storage (a durable one fsyncs),
   write the rank's state file (staged in place: only the CRCs, the block-CRC table and the state
   file are left); all-gather every rank's outcome on the checkpoint group (staged in place: CRCs
   only, rank 0 renders the manifest from the plan's :class:`~.writer.ManifestTemplate`); rank 0
   has the storage commit (manifest last, atomically, ``latest``), broadcasts the result, and
   runs retention. Any rank's failure (disk full, permission denied, a dead peer) becomes every
   rank's error.

Where the bytes go and how a step is committed is the storage's (:mod:`.storage`: ``posix`` by
default, ``tmpfs`` for memory snapshots); the engine branches on its typed
:class:`~.storage.Capabilities`, never on a backend's type.

Why a thread and not a process: the writer's time goes to ``os.write``/``zlib.crc32`` calls that
release the GIL; a thread reads the staging buffer without copying it into shared memory, and a
process would double host memory or need shared-memory staging. So that training keeps its core,
the writer thread runs at a lower OS priority (``writer_nice``, Linux), by default only on cycles
training leaves idle until the training loop waits for it (:mod:`.writer_sched`), and its loops of
small-block CRCs (which hold the GIL) pause every MiB to hand the GIL over (:mod:`.fileformat`).
``bench/ckpt_bench.py`` measures the training slowdown while the thread writes.

Column tiles (:func:`~.planning.save_plan.column_tiles`) cost the stall nothing: the snapshot copies
each box whole, row-major (one memcpy when the shard holds whole rows), and the writer streams
each tile's rows from it with ``writev`` (:class:`~.fileformat.RowRuns`).

Load (``load``): resolve the step dir (``latest``, optional fallback to the previous committed
checkpoint when the newest fails verification on any rank), plan the byte ranges this rank needs
(:func:`plan_load`) and read each once into the destination tensors, checking every byte read
against its block's CRC32 (a helper thread checks and copies one read while the next is read).

Every collective runs on a dedicated gloo group (:class:`TorchComm`) with its own timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import enum
import hashlib
import hmac
import logging
import numbers
import operator
import os
import queue
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

from .settings import DEFAULT_KEEP, DEFAULT_WRITER_NICE
from .writer_sched import DEFAULT_WRITER_DEADLINE_S, DEFAULT_WRITER_SCHED, WriterPriority, WriterSched
from ..comm.collectives import Comm, LocalComm, agree
from ..errors import (AsyncSaveError, CheckpointError, ConfigError, CorruptCheckpointError, FormatVersionError,
                      IncompleteCheckpointError, RankFailure, RanksFailedError, TensorMismatchError,
                      ShardingError, SnapshotSpaceError, UnsafeCheckpointError, ranks_failed)
from ..threads import NamedThread
from . import commit as commit_mod
from .planning.manifest import Manifest
from .planning.save_plan import SavePlan, ShardMeta, metas_from_text, metas_to_text, plan_save
from .reader import read_shards
from .sources import SourcesFor
from .shards import TensorShard, aliased_destinations, conflicting_duplicate, dtype_name, read_only_destination
from .crc import crc32
from .fileformat import RowRuns
from .planning.manifest import BLOCK_SIZE, crc_table_name
from .live import LiveChunks, LiveGate, LiveSpan, fill_in_place
from .staging import StagingBuffer
from .state import from_jsonable, resolve_deferred, to_jsonable
from .storage import PosixStorage, Storage
from .storage.base import check_root
from .writer import ManifestTemplate, build_manifest, data_file_name, rank_header, write_rank_files, write_staged_rank_files

if TYPE_CHECKING:
    from .snapshot.file_staging import StagedFile

log = logging.getLogger(__name__)

# a checkpoint that fails with one of these on every failing rank is unusable: fall back to an older one
DATA_ERRORS = (CorruptCheckpointError, IncompleteCheckpointError, FormatVersionError)



@dataclass
class SaveStats:
    step: int
    bytes_written: int = 0
    plan_s: float = 0.0
    stall_s: float = 0.0      # snapshot copy (what training waits for)
    write_s: float = 0.0      # serialise + write + fsync in the background
    durable_s: float = 0.0    # from save() to committed (rank-local view)
    plan_cached: bool = False
    committed_dir: Optional[str] = None
    wait_s: float = 0.0       # save() blocked on the previous save before starting this one
    writer_cpu_s: float = 0.0  # CPU time of the background writer and its helper threads (copies, writes, CRCs, commit) for this save
    # why the writer left idle-only scheduling during this save ("wait", "deadline"), or None
    writer_escalated: Optional[str] = None
    # live_write: the fence's copy of what the writer had not yet read (training waits for it too)
    fence_s: float = 0.0
    fence_bytes: int = 0
    live: bool = False        # the writer read the live tensors until the fence (live_write)
    dropped: bool = False     # optimistic_plan: a rank's shard metadata changed; nothing was committed


@dataclass
class LoadResult:
    step: int
    step_dir: str
    extra: dict[str, Any]
    rank_state: Optional[dict[str, Any]]
    manifest: Manifest
    bytes_read: int = 0
    bytes_needed: int = 0
    seconds: float = 0.0
    fell_back: bool = False
    bytes_by_source: dict[str, int] = field(default_factory=dict)  # bytes each source served (this rank)


class VerifyMode(str, enum.Enum):
    """How a load checks what it reads."""

    CHUNKS = "chunks"   # every byte read, against the block CRCs of its chunk
    FULL = "full"       # also every file's CRC (ranks split the files)
    NONE = "none"       # no checks (trusted storage, fastest)


@dataclass(frozen=True)
class OpenCheckpoint:
    """A resolved checkpoint whose manifest was read once (by :meth:`CheckpointEngine.open`)."""

    step_dir: str
    manifest: Manifest
    older: tuple[str, ...] = ()   # committed fallbacks, newest first (empty without fallback)
    fallback: bool = False
    fell_back: bool = False       # the newest one's manifest was unusable
    error: Optional[BaseException] = None


ShardsFor = Callable[[Manifest], Sequence[TensorShard]]


@dataclass(frozen=True)
class CommitInfo:
    """What an ``after_commit`` hook gets, on every rank, in the writer thread, once a save committed."""

    step: int
    step_dir: str               # this root's committed step dir
    tmp_dir: str                # the save's temp dir (this rank's files are there until it is renamed)
    files: dict                 # this rank's files: name (relative to the step dir) -> (size, crc32)
    mapped: dict = field(default_factory=dict)   # name -> this rank's mapped bytes of that file (staged in place)


class _Agreement:
    """The plan agreement (``comm.all_equal``: this rank's shards match the cached plan) run in a
    helper thread while the training thread copies under that plan (or, with live writes, goes on
    training); :meth:`result` joins it and re-raises its error (a dead peer) in the caller."""

    def __init__(self, comm: Comm, value: int = 1):
        self._out: list = []

        def run() -> None:
            try:
                self._out.append(bool(comm.all_equal(value)))
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self._out.append(e)
        self._thread = NamedThread(target=run, name="elastor-plan-agree", daemon=True)
        self._thread.start()

    def result(self) -> bool:
        self._thread.join()
        out = self._out[0]
        if isinstance(out, BaseException):
            raise out
        return out


@dataclass(frozen=True)
class RankExtra:
    """A part of a save's ``extra`` that differs per rank (e.g. the param groups of each pipeline
    stage): the writer all-gathers every rank's ``value`` (one object collective on the writer's
    group, off the training thread) and rank 0 commits ``merge(extra, values)`` (``values`` in rank
    order, as JSON). Every rank of a save passes one, or none does."""
    value: Any
    merge: Callable[[dict, list], dict]


@dataclass
class _Job:
    step: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    stats: Optional[SaveStats] = None
    t0: float = 0.0
    stale: bool = False   # optimistic_plan: this rank's metadata no longer matches the cached plan
    staged: "Optional[StagedFile]" = None    # staged in place: the data file the snapshot went into
    header_crc: int = 0
    local_error: Optional[BaseException] = None   # the snapshot failed on this rank (reported by the writer)
    block_tables: Optional[list] = None   # staged in place: block CRCs taken during the copy (else the writer's)
    deferred: bool = False   # extra / rank_state hold DeviceScalars (resolved by the writer)
    gate: Optional[LiveGate] = None   # live_write: the writer reads the live tensors until the fence
    # live_write: the plan agreement, still running (on the writer's group) when save() returned; the
    # writer joins it before it reads anything and, when it failed, plans again
    # (:meth:`CheckpointEngine._replan_live`); the next fence joins it after its copy
    agreement: Optional[_Agreement] = None
    settled: bool = False             # the fence has joined it
    key: tuple = ()
    shards: Sequence[TensorShard] = ()
    nonce: int = 0                    # this save's number (its temp dir's name ends with it)
    lock: threading.Lock = field(default_factory=threading.Lock)   # a fence's copy vs. a new gate
    resolved: threading.Event = field(default_factory=threading.Event)   # the writer planned again


class CheckpointEngine:
    """Save/load model and optimizer state under any layout. Collective: every rank calls every method."""

    def __init__(self, root: str, comm: Optional[Comm] = None, storage: Optional[Storage] = None, keep: int = DEFAULT_KEEP,
                 async_save: bool = True, *, optimistic_plan: bool = False, block_size: int = BLOCK_SIZE,
                 writer_nice: int = DEFAULT_WRITER_NICE, writer_sched: "WriterSched | str" = DEFAULT_WRITER_SCHED,
                 writer_deadline_s: float = DEFAULT_WRITER_DEADLINE_S, live_write: bool = False):
        """``storage``: where the files go and how a step commits (:mod:`.storage`; default
        :class:`~.storage.PosixStorage` at ``root``: shared storage, fsynced). A node-local
        :class:`~.storage.TmpfsStorage` makes the constructor collective (one all-gather).
        ``optimistic_plan``: no plan-agreement collective per save (see the module docstring; a
        save-planning choice for snapshots every step, not a storage one).
        ``block_size``: bytes per block CRC of the data files (readers take it from the manifest).
        ``writer_nice``: added to the background writer thread's nice value (Linux; 0 leaves it as
        the training thread's), so its work yields the core to training.
        ``writer_sched``: ``"idle"`` (default) runs the writer under ``SCHED_IDLE`` until the
        training loop waits for it or ``writer_deadline_s`` seconds pass; ``"nice"`` keeps it at
        its nice value throughout (:mod:`.writer_sched`).
        ``live_write``: with CPU shards and a storage that can (``caps.writes_live``: posix with
        ``O_DIRECT``), a save copies nothing at first: the writer reads the live tensors, and
        :meth:`fence` copies what it has not read yet. The caller then must call :meth:`fence`
        before anything changes a saved tensor (:mod:`.live`; the session does, before every
        optimizer step)."""
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"CheckpointEngine(root={root!r}): give the checkpoint directory as a path")
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
            raise TypeError(f"keep={keep!r}: must be an integer >= 1 (committed checkpoints retention keeps)")
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1 (the last good checkpoint is never deleted)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1 byte")
        for key, val in (("async_save", async_save), ("live_write", live_write)):
            if not isinstance(val, bool):   # bool("no") is True: a string would turn the switch on
                raise ConfigError(f"CheckpointEngine({key}={val!r}): must be True or False")
        if isinstance(writer_nice, bool) or not isinstance(writer_nice, numbers.Integral):
            raise ConfigError(f"CheckpointEngine(writer_nice={writer_nice!r}): must be an integer 0..19 (added to the "
                              f"writer thread's nice value; 0 keeps the training thread's)")
        if not 0 <= writer_nice <= 19:
            raise ValueError(f"writer_nice={writer_nice}: must be 0..19 (added to the writer thread's nice value)")
        self.writer_nice = int(writer_nice)
        try:
            self.writer_priority = WriterPriority(writer_sched, self.writer_nice, writer_deadline_s)
        except ValueError as e:   # an unknown policy name or a deadline <= 0
            raise ValueError(f"writer_sched={writer_sched!r}, writer_deadline_s={writer_deadline_s!r}: {e} "
                             f"(policies: {', '.join(w.value for w in WriterSched)})") from None
        self.root = os.path.abspath(root)
        self.storage: Storage = storage if storage is not None else PosixStorage(self.root)
        mismatch = check_root(self.storage, self.root)
        if mismatch:
            raise ConfigError(mismatch)
        self.comm: Comm = comm or LocalComm()
        # the background writer's collectives run on their own group: two threads never share one
        self.writer_comm: Comm = self.comm.duplicate() if hasattr(self.comm, "duplicate") else self.comm
        self.keep = keep
        self.async_save = async_save
        self.staging = StagingBuffer()
        self.block_size = int(block_size)
        self._header: Optional[tuple] = None   # staged in place: (plan items, header, header CRC, file size)
        self._template: Optional[ManifestTemplate] = None   # rank 0, staged in place: the cached plan's manifest
        # CUDA: True once the caller calls fence() before every optimizer step; then the snapshot
        # does not wait for its device-to-host copies (they overlap the next forward/backward)
        self.defer_device_copies = False
        self._plan: Optional[SavePlan] = None
        self._local_key: tuple = ()
        self._session = ""
        self._session_key = ""   # the plan's secret: each save's temp dir name carries a MAC of its number
        self._job: Optional[_Job] = None
        self._saves = 0
        self._newest_step = -1   # the newest step this engine committed (a lower save moves `latest` back: warned)
        self._warned_backwards = False
        self._unusable: set[str] = set()   # step dirs of this root a load fell back past (not kept by retention)
        self.optimistic_plan = optimistic_plan
        self.live_write = live_write
        self.saves_dropped = 0
        self._queue: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None
        self.last_stats: Optional[SaveStats] = None
        # called with a CommitInfo on every rank after each committed save (writer thread; the next
        # save waits for them); an exception is logged, never fails the save (e.g. peer copies)
        self.after_commit: list[Callable[[CommitInfo], None]] = []
        self.storage.set_up(self.comm, keep)
        if self.in_place:   # its retired files are released at exit even without a writer thread (async_save=False)
            _stop_at_exit(self)

    @property
    def in_place(self) -> bool:
        """Snapshots go straight into mapped data files (the storage stages in place)."""
        return self.storage.caps.stages_in_place

    @property
    def committer(self) -> bool:
        """This rank commits a copy of each step (rank 0; with node-local storage, one rank per node)."""
        return self.comm.rank == 0 or self.storage.commits_copy

    # ------------------------------------------------------------------ save
    def save(self, step: int, shards: Sequence[TensorShard], extra: Optional[Mapping[str, Any]] = None,
             rank_state: Optional[Mapping[str, Any]] = None, model: Optional[Mapping[str, Any]] = None,
             layout: Optional[Mapping[str, Any]] = None, rank_extra: Optional[RankExtra] = None) -> SaveStats:
        """Start saving ``shards`` as checkpoint ``step``; returns after the snapshot (async) or the commit.
        ``rank_extra``: what each rank adds to ``extra`` (gathered by the writer, :class:`RankExtra`).

        The previous save is waited for first. When it failed (on any rank), this call raises its
        :class:`AsyncSaveError` on every rank and does **not** start: ``step`` is not saved (the
        message says so); call ``save(step, ...)`` again to save it. As with a
        ``torch.distributed.checkpoint.async_save`` future that is waited for before the next save,
        no error is dropped: :meth:`wait` after each save reports a failure before the next one."""
        step = _check_step(step)
        if not isinstance(shards, (list, tuple)) or not all(isinstance(s, TensorShard) for s in shards):
            bad = shards if not isinstance(shards, (list, tuple)) else next(s for s in shards if not isinstance(s, TensorShard))
            raise TypeError(f"save(step, shards): shards must be a list of TensorShard (got {type(bad).__name__}); "
                            f"wrap a whole tensor as full_shard(name, tensor), or build TensorShard(name, shape, "
                            f"region, tensor) for a piece of a global tensor")
        tw = time.perf_counter()
        try:
            self.wait()
        except AsyncSaveError as e:   # the same error on every rank: every rank refuses this save
            raise _not_started(e, step) from e.__cause__
        t0 = time.perf_counter()
        if step < self._newest_step and not self._warned_backwards and self.comm.rank == 0:
            self._warned_backwards = True   # once: a run that rewinds on purpose need not hear it every save
            log.warning("saving step %d after step %d: 'latest' under %s will name step %d, the one a resume "
                        "takes; the newer steps stay on disk (retention never removes a step newer than the "
                        "save it follows) until you delete them", step, self._newest_step, self.root, step)
        rank = self.comm.rank
        # this rank's shard metadata, compared exactly (tuples of strings and ints) with what the
        # cached plan was made from
        key = tuple((s.name, s.shape, dtype_name(s.tensor.dtype), s.region) for s in shards)
        # fast path: every rank's shard metadata is what the cached plan was made from: one tiny
        # all-reduce (all ranks reach the same answer); otherwise gather everything and plan again
        local_same = self._plan is not None and key == self._local_key
        stale = False
        agreement: Optional[_Agreement] = None
        pending: Optional[_Agreement] = None
        planned = False
        # the same on every rank (an engine setting and the storage's): which group agrees on the plan
        # (staged in place, a memory snapshot's writer copies the live tensors into the mapped file itself)
        live_any = self.live_write and (self.storage.caps.writes_live or self.in_place)
        live = live_any and not any(sh.tensor.is_cuda for sh in shards)
        if self.optimistic_plan and self._plan is not None:
            # every rank holds a plan (plans are made and dropped on all ranks together): no collective
            cached, stale = True, not local_same
        elif (live_any and not self.in_place and self._plan is not None and self.comm.world_size > 1
              and self.writer_comm is not self.comm):
            # live writes copy nothing here to hide the agreement behind: it runs on the writer's
            # group (idle now) while training goes on, and where it fails the ranks plan again on
            # that group too, in their writers (_replan_live), which wait for nothing training does;
            # a rank that cannot write live, or whose own shards changed, joins it here (and plans
            # again here, on the same group); a comm without a second group for the writer keeps the
            # agreement below (two threads never run collectives on one group)
            pending = _Agreement(self.writer_comm, int(local_same))
            cached = local_same and live
            if not cached:
                cached = pending.result() and local_same
                pending = None
                if not cached:
                    self._plan_again(key, shards, self.writer_comm)
                    planned = True
        elif local_same and self.comm.world_size > 1 and not self.in_place and not live and \
                not any(sh.tensor.is_cuda for sh in shards):
            # speculative: the copy below runs under the cached plan while the ranks agree on it in a
            # helper thread (the writer is idle: no other thread uses this group now); the agreement
            # (and the wait for the slowest rank) costs the stall max(copy, agreement), not their sum
            agreement = _Agreement(self.comm)
            cached = True
        else:
            cached = self.comm.all_equal(int(local_same)) and local_same
        if not cached and not planned:
            self._plan_again(key, shards)
        plan = self._plan
        assert plan is not None
        t1 = time.perf_counter()
        items = plan.items[rank] if not stale else []
        spans: list[tuple[int, int]] = []
        if agreement is not None:
            spans = self.staging.snapshot(items, shards, defer=self.defer_device_copies, whole_boxes=True)
            if not agreement.result():   # another rank's shards changed: plan again, copy again
                cached = False
                self._plan_again(key, shards)
                plan = self._plan
                items = plan.items[rank]
                spans = self.staging.snapshot(items, shards, defer=self.defer_device_copies, whole_boxes=True)
        tmp_dir = self.storage.temp_dir(step, self._temp_nonce(self._saves))
        job = _Job(step, t0=t0, stale=stale)
        if live and not stale and not self.in_place:
            job.gate = self._live_gate(items, shards, step)
        if pending is not None and job.gate is None:   # this save copies after all: agree before it
            if not pending.result():
                cached = False
                self._plan_again(key, shards, self.writer_comm)
                plan = self._plan
                items = plan.items[rank]
                tmp_dir = self.storage.temp_dir(step, self._temp_nonce(self._saves))   # the new plan's
            pending = None
        if pending is not None:
            job.agreement, job.key, job.shards, job.nonce = pending, key, list(shards), self._saves
        if job.gate is not None:   # nothing copied now: the writer reads the live tensors until fence()
            spans = list(self.staging.program(items, shards).spans)
        elif not stale and self.in_place:
            try:
                job.staged, job.header_crc = self._take_file(items, tmp_dir)
            except OSError as e:   # e.g. tmpfs full: reported by the writer, on every rank
                job.local_error = e
            if job.staged is not None and live:   # the writer copies into the file (live.fill_in_place)
                job.gate = self._live_gate(items, shards, step, buf=job.staged.data)
            if job.gate is not None:
                spans = list(self.staging.program(items, shards, buf=job.staged.data).spans)
            elif job.staged is not None:
                spans = self.staging.snapshot(items, shards, buf=job.staged.data, defer=self.defer_device_copies,
                                              block_crcs=self.block_size)
                job.block_tables = self.staging.block_tables
        elif not stale and agreement is None:
            # column tiles of a box are copied as the box (one memcpy) and tiled by the writer
            spans = self.staging.snapshot(items, shards, defer=self.defer_device_copies, whole_boxes=True)
        t2 = time.perf_counter()
        stats = job.stats = SaveStats(step, sum(sp[1] for sp in spans), plan_s=t1 - t0, stall_s=t2 - t1,
                                      plan_cached=cached, wait_s=t0 - tw, live=job.gate is not None)
        # one-element CUDA tensors (a step count, a loss scale) are read by the writer, not here: an
        # .item() would wait for every kernel queued so far, on every snapshot
        deferred: list = []
        extra_j = to_jsonable(dict(extra or {}), "extra", deferred)
        rank_j = to_jsonable(dict(rank_state or {}), "rank_state", deferred) if rank_state is not None else None
        mine = ((to_jsonable(rank_extra.value, "rank_extra", deferred), rank_extra.merge)
                if rank_extra is not None else None)
        job.deferred = bool(deferred)
        args = (job, plan, items, spans, tmp_dir, extra_j, rank_j, model, layout, mine)
        self._saves += 1
        self._job = job
        if self.async_save:
            self._submit(args)
        else:
            self._write_and_commit(*args)
            self.wait()
        return stats

    def _temp_nonce(self, save: int) -> str:
        """The nonce of save number ``save``'s temp dir (the same on every rank): the plan's session,
        the number, and a keyed hash of it that no one without the session's key can compute."""
        tag = hmac.new(self._session_key.encode(), str(save).encode(), hashlib.sha256).hexdigest()[:16]
        return f"{self._session}_{save}_{tag}"

    def _plan_again(self, key: tuple, shards: Sequence[TensorShard], comm: Optional[Comm] = None) -> None:
        """Collective (on ``comm``, default the engine's group): gather every rank's shard metadata
        and make the save plan (same on every rank). A rank's problem with its own shards travels
        in the gather, so every rank raises it."""
        # with a key for the temp dirs' names: another user of a shared root who can list it must not
        # be able to guess the next save's folder (and make it first)
        nonce = (f"{os.getpid()}_{int(time.time() * 1000)}", secrets.token_hex(16))
        metas = [ShardMeta(*k) for k in key]
        gathered = (comm or self.comm).all_gather_object((metas_to_text(metas), nonce, conflicting_duplicate(shards)))
        bad = [(r, g[2]) for r, g in enumerate(gathered) if g[2]]
        if bad:
            raise ShardingError(f"rank {bad[0][0]}: {bad[0][1]}")
        self._plan = plan_save([metas_from_text(g[0], r) for r, g in enumerate(gathered)])
        self._session, self._session_key = gathered[0][1]
        self._local_key = key

    def _take_file(self, items, tmp_dir: str) -> "tuple[StagedFile, int]":
        """Staged in place: this save's data file, mapped, header written (training thread)."""
        if self._header is None or self._header[0] is not items:
            header, _ = rank_header(self.comm.rank, items)
            self._header = (items, header, crc32(header), len(header) + sum(it.nbytes for it in items))
        _, header, hcrc, size = self._header
        staged = self.storage.stage_data_file(tmp_dir, data_file_name(self.comm.rank), header, size)
        return staged, hcrc

    def _live_gate(self, items, shards: Sequence[TensorShard], step: int,
                   versions: Optional[list] = None, buf: Any = None) -> Optional[LiveGate]:
        """live_write: the gate between the live tensors and the staging buffer for this save (no
        copy yet), or None when a chunk's strides need torch's strided copy (then the save copies).
        ``buf``: the staging is that memory (a mapped data file), chunk by chunk in file order."""
        prog = self.staging.program(items, shards, buf=buf)
        if prog.live is None:
            return None
        chunks = prog.live_chunks
        if chunks is False:
            return None
        if chunks is None:   # once per copy program: views and arrays of the same memory every save
            tensors, names, seen = [], [], set()
            for sh in shards:
                if id(sh.tensor) not in seen:
                    seen.add(id(sh.tensor))
                    tensors.append(sh.tensor)
                    names.append(sh.name)
            if any(t.is_inference() for t in tensors):
                # an inference-mode tensor has no version counter: the contract's guard could not
                # watch it, so these saves copy at save time
                prog.live_chunks = False
                return None
            chunks = prog.live_chunks = LiveChunks(prog.live, _staging_views(prog.buf, prog.spans),
                                                   [sp[0] for sp in prog.spans], prog.run_from, tensors, names)
        return LiveGate(chunks, step, versions)

    def _replan_live(self, job: _Job) -> tuple:
        """Writer thread, when a live save's plan agreement failed (another rank's shards changed):
        plan again on the writer's group (every rank's writer is here), then, under the job's lock
        (a fence may be copying under the old plan), a new gate over the same tensors (their
        versions as of ``save``), or the copy under the new plan where they cannot be read live; a
        fence waits for this (training changes nothing before it returns). Returns the new
        (plan, items, spans, tmp_dir)."""
        try:
            self._plan_again(job.key, job.shards, self.writer_comm)
            plan = self._plan
            assert plan is not None
            items = plan.items[self.comm.rank]
            with job.lock:
                old = job.gate
                assert old is not None
                old.close()
                if old.error is not None:
                    raise old.error
                gate = self._live_gate(items, job.shards, job.step, old.versions)
                if gate is None:
                    moved = old.changed("before the save was planned again")   # the copy below reads them now
                    if moved is not None:
                        raise moved
                    spans = self.staging.snapshot(items, job.shards, defer=self.defer_device_copies, whole_boxes=True)
                else:
                    spans = list(self.staging.program(items, job.shards).spans)
                job.gate = gate
            if job.stats is not None:
                job.stats.plan_cached = False
                job.stats.live = gate is not None
                job.stats.bytes_written = sum(sp[1] for sp in spans)
            # the temp dir's name carries the plan's session: the same on every rank again
            return plan, items, spans, self.storage.temp_dir(job.step, self._temp_nonce(job.nonce))
        finally:
            job.resolved.set()

    def fence(self) -> None:
        """Call before the optimizer step (anything that changes saved tensors). CUDA with
        ``defer_device_copies``: make the current stream wait for the last snapshot's
        device-to-host copies. ``live_write``: copy what the writer has not read of the live
        tensors into the staging buffer (the writer goes on from there); nothing once it has read
        everything."""
        self.staging.fence()
        job = self._job
        gate = job.gate if job is not None else None
        if gate is not None and not job.done.is_set():
            t0 = time.perf_counter()
            with self._job_lock(job):
                n = gate.fence(self.writer_priority.boosted)
            if job.agreement is not None and not job.settled:   # copied under the cached plan while the ranks agreed on it
                job.settled = True
                try:
                    ok = job.agreement.result()
                except BaseException:  # noqa: BLE001 - a dead peer: the writer reports it, on every rank
                    ok = True
                if not ok:   # the writer plans again: wait for its new gate, and copy under it
                    with self.writer_priority.boosted():
                        job.resolved.wait()
                    with self._job_lock(job):
                        if job.gate is not None and job.gate is not gate:
                            n = job.gate.fence(self.writer_priority.boosted)
            if self.in_place:   # a memory snapshot must end within the step: no more idle-only cycles
                self.writer_priority.urgent("fence")
            if job.stats is not None:
                job.stats.fence_s += time.perf_counter() - t0
                job.stats.fence_bytes += n

    @contextlib.contextmanager
    def _job_lock(self, job: _Job) -> Iterator[None]:
        """Training thread: the job's lock, which the writer holds while it plans a live save again
        (on idle cycles only, under ``SCHED_IDLE``): waited for with the writer boosted, as a fence
        waits for the gate's lock."""
        if not job.lock.acquire(blocking=False):
            with self.writer_priority.boosted():
                job.lock.acquire()
        try:
            yield
        finally:
            job.lock.release()

    def wait(self) -> Optional[SaveStats]:
        """Block until the in-flight save is committed; raise AsyncSaveError (on every rank) if it failed."""
        job = self._job
        if job is None:
            return None
        if not job.done.is_set():
            self.writer_priority.urgent("wait")   # the training loop waits: no more idle-only cycles
        job.done.wait()
        self._job = None
        self.last_stats = job.stats
        if job.error is not None:
            raise job.error
        return job.stats

    def local_idle(self) -> bool:
        """This rank's previous save has finished (not collective)."""
        return self._job is None or self._job.done.is_set()

    def is_idle(self) -> bool:
        """Collective: True on every rank when every rank's previous save has finished."""
        return all(self.comm.all_gather_object(self.local_idle()))

    def finalize(self) -> Optional[SaveStats]:
        """Wait for the in-flight save (raises if it failed) and stop the writer thread. Call before
        exiting (a later save starts a new writer thread)."""
        try:
            return self.wait()
        finally:
            self._stop_writer()
            if self.in_place:
                self.staging.forget_all()   # their views would keep the mappings alive
            self.storage.close(self.committer)
            depart = getattr(self.comm, "depart", None)
            if depart is not None:   # rank 0 (the store's usual host) leaves last: QA round 6, Q6-1
                depart()

    def _submit(self, args: tuple) -> None:
        """Hand a save to the writer thread (started on first use): no thread start per save, which
        costs the training thread a GIL hand-over each time."""
        if _EXITING:
            # the writers were stopped at exit (a save from an atexit handler that runs after ours):
            # no thread would be waited for (nor should one start now), so this save is written here,
            # at normal priority, before save() returns
            self._write_and_commit(*args)
            return
        if self._thread is None or not self._thread.is_alive():
            self._queue = queue.SimpleQueue()
            self._thread = NamedThread(target=self._writer_loop, args=(self._queue,), name="elastor-writer",
                                            daemon=True)
            self._thread.start()
            _stop_at_exit(self)
        assert self._queue is not None
        self.writer_priority.begin()
        self._queue.put(args)

    def _writer_loop(self, q: "queue.SimpleQueue") -> None:
        self.writer_priority.enter(nice=True)
        try:
            while True:
                args = q.get()
                if args is None:
                    return
                self._write_and_commit(*args)
        finally:
            self.writer_priority.leave()

    def _stop_writer(self, join_s: Optional[float] = None) -> None:
        """Stop the writer thread after the save it is writing, if any (``join_s``: wait at most
        that long for it)."""
        t, q = self._thread, self._queue
        self._thread = self._queue = None
        self.writer_priority.close(join_s=1.0 if join_s is not None else 0.0)
        if t is not None and q is not None and t.is_alive():
            q.put(None)
            if t is not threading.current_thread():
                t.join(join_s)

    def _report_at_exit(self) -> None:
        """At exit (the program never called :meth:`wait` or :meth:`finalize` after its last
        save): say on this rank, at ERROR, when that save failed or did not end, since no exception
        will. The exit status is the program's own."""
        job = self._job
        if job is None or (job.done.is_set() and job.error is None):
            return
        try:
            resume = f"'latest' under {self.root} names {os.path.basename(self.storage.resolve(self.root))}"
        except Exception:  # noqa: BLE001 - only for the message
            resume = f"no step is committed under {self.root}"
        if not job.done.is_set():
            log.error("checkpoint save of step %d FAILED: the program exited before it was written (it waited "
                      "%.0f s at most), and nothing was committed for it; %s. Call finalize() before exiting",
                      job.step, EXIT_SAVE_WAIT_S, resume)
            return
        log.error("checkpoint save of step %d FAILED and nothing was committed for it: %s; %s. The program exited "
                  "without wait() or finalize(), which raise this error", job.step, job.error, resume)

    def _drop_cache_at_exit(self) -> None:
        """At exit without :meth:`finalize`: what the storage keeps only as a cache for the next
        save (memory snapshots: the retired data file in ``.recycle``, a snapshot's worth of this
        node's memory that outlived the process until the next start) is released; committed
        steps stay for the relaunch. Not while this rank's last save is still being written (the
        exit gave up waiting for it: its writer may still commit, and retire a file there)."""
        job = self._job
        if job is not None and not job.done.is_set():
            return
        self.storage.drop_cache(self.committer)

    def _write_and_commit(self, job: _Job, plan: SavePlan, items, spans, tmp_dir: str, extra, rank_state,
                          model, layout, rank_extra: Optional[tuple] = None) -> None:
        rank = self.comm.rank
        stats = job.stats
        assert stats is not None
        what = f"checkpoint save of step {job.step}"
        cpu0 = time.thread_time()
        helpers0 = self.writer_priority.helper_cpu_s
        # CRCs and sizes as int rows (one all-gather, one broadcast) and rank 0's manifest from
        # the plan's template, where the comm has int collectives: on storage saves the object
        # collectives and the manifest built and printed anew took 8-10 ms between the last write
        # and durable (bench/results/2026-12-03-load-fixed-costs.md)
        lean = self.in_place or getattr(self.writer_comm, "all_gather_ints", None) is not None
        outcome: Any
        try:
            tw = time.perf_counter()
            if job.agreement is not None and not job.agreement.result():
                plan, items, spans, tmp_dir = self._replan_live(job)
            if job.deferred:   # the values of device scalars: wait for their copies here, off the training thread
                extra, rank_state = resolve_deferred(extra), resolve_deferred(rank_state)
                if rank_extra is not None:
                    rank_extra = (resolve_deferred(rank_extra[0]), rank_extra[1])
            if job.local_error is not None:
                raise job.local_error
            if job.stale:
                outcome = ("stale", rank)
            elif job.staged is not None:
                self.staging.wait_device()
                data = job.staged.data.numpy()
                if job.gate is not None:   # live: copy the live tensors into the file here, CRCs on the way
                    try:
                        job.block_tables = fill_in_place(job.gate, memoryview(data), spans, self.block_size)
                    finally:
                        job.gate.close()
                outcome = ("ok", write_staged_rank_files(rank, items, data, spans, job.staged.path,
                                                         job.staged.header_len, job.header_crc, rank_state,
                                                         self.storage, block_size=self.block_size, lean=True,
                                                         block_tables=job.block_tables))
            else:
                self.staging.wait_device()
                views: list = ([LiveSpan(job.gate, k) for k in range(len(job.gate))] if job.gate is not None
                               else _staging_views(self.staging.buf, spans))
                try:
                    outcome = ("ok", write_rank_files(rank, items, views, tmp_dir, rank_state, self.storage,
                                                      block_size=self.block_size, lean=lean))
                finally:
                    if job.gate is not None:
                        job.gate.close()
            stats.write_s = time.perf_counter() - tw
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            e = self.storage.explain_write_error(tmp_dir, job.step, e)
            # a snapshot that did not fit is dropped, and said once, by the memory tier
            log.log(logging.DEBUG if isinstance(e, SnapshotSpaceError) else logging.ERROR,
                    "rank %d: checkpoint write for step %d failed: %s", rank, job.step, e)
            outcome = ("error", RankFailure.of(rank, e).to_wire())
        try:
            # every rank's part of extra (RankExtra), before the outcomes: every rank gets here
            values = self.writer_comm.all_gather_object(rank_extra[0]) if rank_extra is not None else None
            outcomes = self._gather_lean(outcome, plan, job.step) if lean else self._gather_objects(outcome, job.step)
            failures = [o[1] for o in outcomes if o[0] == "error"]
            stale = [o[1] for o in outcomes if o[0] == "stale"]
            result: Any = None
            if rank == 0:
                if failures or stale:
                    result = ("error", failures) if failures else ("stale", stale)
                    self.storage.abort(tmp_dir)
                else:
                    try:
                        if rank_extra is not None:
                            extra = rank_extra[1](extra, values)
                        if lean:   # lean results: the plan's template, CRCs filled in
                            if self._template is None or self._template.plan is not plan:
                                self._template = ManifestTemplate(plan, self.block_size)
                            text = self._template.render(job.step, [o[1] for o in outcomes], extra, model, layout)
                        else:
                            man = build_manifest(job.step, plan, [o[1] for o in outcomes], extra, model, layout)
                            text = man.dumps(compact=self.storage.caps.node_local)   # serialised once
                        self.storage.check_written(tmp_dir, job.step, [n for o in outcomes for n in o[1]["files"]])
                        final = self.storage.commit(tmp_dir, job.step, text)
                        result = ("ok", final, text if self.storage.shares_manifest else None)
                    except BaseException as e:  # noqa: BLE001
                        e = self.storage.explain_write_error(tmp_dir, job.step, e)   # e.g. a full tmpfs
                        # the failed save's folder goes now (as after a rank's failure): retention
                        # removes only temp dirs older than the newest step, so a run of failed
                        # commits kept every one (a tmpfs that was full stayed full)
                        self.storage.abort(tmp_dir)
                        result = ("error", [RankFailure.of(0, e).to_wire()])
            result = (self._broadcast_lean(result, job.step) if lean else
                      self.writer_comm.broadcast_object(result, src=0))
            if result[0] != "ok" and rank != 0 and self.storage.commits_copy:
                self.storage.abort(tmp_dir)   # this node's copy of the failed save (node-local storage)
            if result[0] == "stale":
                # every rank gets here for this save: all drop the plan, the next save plans again
                self._plan = None
                self.saves_dropped += 1
                stats.dropped = True
                if rank == 0:
                    log.warning("save of step %d dropped: the shard metadata of rank(s) %s changed since the cached "
                                "save plan (nothing committed; the next save plans again)", job.step, result[1])
            elif result[0] != "ok":
                job.error = ranks_failed(what, [RankFailure.from_wire(f) for f in result[1]], self.comm.world_size,
                                         base=AsyncSaveError)
            else:
                stats.committed_dir = result[1]
                self._newest_step = max(self._newest_step, job.step)
                self.storage.committed(result[1])
                if rank != 0 and self.storage.commits_copy:
                    self._commit_node_copy(job.step, tmp_dir, result[2])
                stats.durable_s = time.perf_counter() - job.t0
                if self.committer:  # committed and announced: now delete what retention drops
                    try:
                        if self._unusable:   # (a storage written before the argument still works without one)
                            self.storage.retain(self.keep, protect=result[1], unusable=frozenset(self._unusable))
                        else:
                            self.storage.retain(self.keep, protect=result[1])
                    except OSError as e:  # never fails a committed save
                        log.warning("retention under %s failed: %s", self.root, e)
                if self.after_commit and outcome[0] == "ok":
                    staged = job.staged
                    mapped = ({os.path.basename(staged.path): staged.whole}
                              if staged is not None and staged.whole is not None else {})
                    info = CommitInfo(job.step, os.path.join(self.root, os.path.basename(result[1])), tmp_dir,
                                      dict(outcome[1]["files"]), mapped)
                    for fn in self.after_commit:
                        try:
                            fn(info)
                        except Exception as e:  # noqa: BLE001 - a hook never fails a committed save
                            log.warning("after-commit hook %s for step %d failed: %s", getattr(fn, "__name__", fn),
                                        job.step, e)
        except BaseException as e:  # noqa: BLE001 - a dead or stopped peer on the checkpoint group
            failures = e.failures if isinstance(e, RanksFailedError) else [RankFailure.of(rank, e)]
            err = ranks_failed(what, failures, self.comm.world_size, base=AsyncSaveError)
            err.__cause__ = e
            job.error = err
        finally:
            if job.staged is not None and (job.error is not None or stats.dropped):
                self.staging.forget(job.staged.data)
                self.storage.release_staged(job.staged)   # its temp dir is gone: do not keep its pages mapped
            stats.writer_cpu_s = time.thread_time() - cpu0 + self.writer_priority.helper_cpu_s - helpers0
            stats.writer_escalated = self.writer_priority.end() if self.async_save else None
            job.done.set()

    # file staging: outcomes and the commit result as fixed-size int rows (one all-gather, one
    # broadcast, no pickling); errors, rare, then go through the object collectives
    _OK, _STALE, _ERROR = 1, 2, 3

    def _gather_objects(self, outcome: tuple, step: int) -> list:
        """Every rank's outcome through the object collective, checked for one step."""
        got = self.writer_comm.all_gather_object((step, outcome))
        return _one_step([s for s, _ in got], [o for _, o in got])

    def _gather_lean(self, outcome: tuple, plan: SavePlan, step: int) -> list:
        """Every rank's outcome (``("ok", lean result) | ("stale", rank) | ("error", wire)``) from
        int rows: status and step, then for "ok" the chunk count and CRCs, the data file's, the
        table's and the state file's sizes and CRCs (file names follow from the rank)."""
        width = 10 + max((len(its) for its in plan.items), default=0)
        if outcome[0] == "ok":
            res = outcome[1]
            fname = data_file_name(res["rank"])
            files = res["files"]
            st = files.get(res["state"], (0, 0)) if res["state"] else (0, 0)
            row = [self._OK, step, len(res["crcs"]), *res["crcs"], *files[fname], *files[crc_table_name(fname)],
                   int(bool(res["state"])), *st]
        else:
            row = [self._STALE if outcome[0] == "stale" else self._ERROR, step]
        rows = self.writer_comm.all_gather_ints(row, width)
        if any(r[0] == self._ERROR for r in rows):   # every rank sees it: all take the object route
            return self._gather_objects(outcome, step)
        out: list = []
        for r, row in enumerate(rows):
            if row[0] == self._STALE:
                out.append(("stale", r))
                continue
            n = row[2]
            crcs, rest = row[3:3 + n], row[3 + n:]
            fname = data_file_name(r)
            files = {fname: (rest[0], rest[1]), crc_table_name(fname): (rest[2], rest[3])}
            state = None
            if rest[4]:
                state = f"rank_state/rank_{r:05d}.json"
                files[state] = (rest[5], rest[6])
            out.append(("ok", {"rank": r, "crcs": crcs, "files": files, "state": state}))
        return _one_step([row[1] for row in rows], out)

    def _broadcast_lean(self, result: Any, step: int) -> Any:
        """Rank 0's commit result (``("ok", step dir, manifest text or None) | ("stale", ranks) |
        ("error", wires)``) on every rank: one int, plus the text when other nodes commit copies."""
        code = {"ok": self._OK, "stale": self._STALE}.get(result[0], self._ERROR) if self.comm.rank == 0 else 0
        code = self.writer_comm.broadcast_ints([code], src=0)[0]
        if code == self._ERROR:
            return self.writer_comm.broadcast_object(result, src=0)
        if code == self._STALE:
            return ("stale", result[1] if self.comm.rank == 0 else [])
        text = self.writer_comm.broadcast_object(result[2] if self.comm.rank == 0 else None, src=0) \
            if self.storage.shares_manifest else None
        return ("ok", os.path.join(self.root, commit_mod.step_dirname(step)), text)

    def _commit_node_copy(self, step: int, tmp_dir: str, manifest_text: str) -> None:
        """Node-local storage, on another node's committer: commit this node's directory with rank 0's
        manifest. A failure here leaves this node without the step (logged; its restore then
        reads elsewhere), it never fails the save."""
        try:
            self.storage.commit(tmp_dir, step, manifest_text)
        except (OSError, CheckpointError) as e:
            log.error("rank %d: could not commit this node's copy of snapshot %d under %s: %s", self.comm.rank, step,
                      self.root, e)

    # ------------------------------------------------------------------ load
    def open(self, path: Optional[str] = None, *, fallback: bool = False) -> "OpenCheckpoint":
        """Collective: resolve ``path`` (root or step dir; default: this root) and read its manifest,
        once. With ``fallback``, a newest checkpoint whose manifest is unreadable on any rank gives way
        to the next older committed one. Pass the result to :meth:`load`."""
        root_or_dir = os.path.abspath(path or self.root)
        candidates = self._load_candidates(root_or_dir, fallback)
        last_err: Optional[BaseException] = None
        for i, step_dir in enumerate(candidates):
            try:
                man = agree(self.comm, lambda: self.storage.read_manifest(step_dir), what=f"manifest of {step_dir}")
                return OpenCheckpoint(step_dir, man, tuple(candidates[i + 1:]), fallback, i > 0, last_err)
            except RanksFailedError as e:
                last_err = e
                if e.all_are(*DATA_ERRORS):
                    self._mark_unusable(step_dir)
                if not fallback or not e.all_are(*DATA_ERRORS):
                    raise
                log.error("checkpoint %s is unusable (%s); falling back to the previous one", step_dir, e)
        raise CorruptCheckpointError(f"no usable checkpoint under {root_or_dir}: {last_err}")

    def load(self, path: "Optional[str] | OpenCheckpoint", shards: "Sequence[TensorShard] | ShardsFor", *,
             strict: bool = True, allow_cast: bool = False, verify_checksums: "VerifyMode | str" = "chunks",
             fallback: bool = False, sources: "Optional[SourcesFor]" = None) -> LoadResult:
        """Collective: fill shards in place from a checkpoint.

        ``path``: a root or step dir (default: this root), or what :meth:`open` returned (then its
        manifest is not read again and its ``fallback`` applies). ``shards``: the destination shards,
        or a function ``shards_for(manifest)`` building them from the manifest actually loaded (so an
        adapter never reads a manifest itself, and a fallback gets shards for the older one).
        ``strict``: every shard's tensor must be in the checkpoint. ``verify_checksums``: "chunks"
        (every byte read is checked against its block CRCs), "full" (also the CRC of every file,
        split across ranks) or "none". ``fallback``: when the newest checkpoint fails on any rank
        with a data error (corrupt, incomplete, unknown format), try older committed ones.
        ``sources``: ``(step_dir, manifest) -> [ChunkSource, ...]`` (:mod:`.sources`), called for the
        checkpoint actually read: each file comes from the first source holding it whole and falls
        back to the next one when its bytes fail their checks (default: the step dir's own files).
        With sources, "full" checks only the files this rank reads (whole-file CRC per source).

        A save of this process still in flight that reads the live tensors (``live_write``) or
        waits for device copies out of them is fenced first (:meth:`fence`): the load writes into
        memory without bumping version counters, so its step keeps the state at ``save()``.

        When it raises, the destinations are not a state to use: each byte holds verified bytes of
        the checkpoint tried last (or of an older one tried before it), its value before the call,
        or zero (a read that failed or failed its check is zeroed where it landed, never left
        unverified: :func:`~.reader.read_shards`). A caller that goes on after the raise must load
        another checkpoint into every destination, or initialise them again, before it trains."""
        try:
            mode = VerifyMode(verify_checksums)
        except ValueError:
            raise ValueError(f"load(verify_checksums={verify_checksums!r}): use one of "
                             f"{', '.join(repr(m.value) for m in VerifyMode)}") from None
        if not callable(shards) and (not isinstance(shards, (list, tuple)) or
                                     not all(isinstance(s, TensorShard) for s in shards)):
            bad = shards if not isinstance(shards, (list, tuple)) else next(s for s in shards if not isinstance(s, TensorShard))
            raise TypeError(f"load(path, shards): shards must be a list of TensorShard or a function of the manifest "
                            f"returning one (got {type(bad).__name__}); wrap a whole tensor as full_shard(name, tensor)")
        self._fence_saves_in_flight()
        todo: list[tuple[str, Optional[Manifest]]]
        if isinstance(path, OpenCheckpoint):
            fallback, fell_back, last_err = path.fallback, path.fell_back, path.error
            todo = [(path.step_dir, path.manifest), *[(c, None) for c in path.older]]
        else:
            # one agreement per checkpoint tried, with the manifest read inside it (open()'s own
            # agreement on the manifest first was one more collective on every load)
            fell_back, last_err = False, None
            todo = [(c, None) for c in self._load_candidates(os.path.abspath(path or self.root), fallback)]
        for i, (step_dir, man) in enumerate(todo):
            try:
                res = agree(self.comm, lambda: self._load_from(step_dir, man, shards, strict, allow_cast, mode, sources),
                            what=f"load of {step_dir}")
                res.fell_back = fell_back or i > 0
                if res.fell_back:
                    log.warning("loaded the older checkpoint %s after the newer one failed: %s", step_dir, last_err)
                return res
            except RanksFailedError as e:
                last_err = e
                if e.all_are(*DATA_ERRORS):
                    self._mark_unusable(step_dir)
                if not fallback or not e.all_are(*DATA_ERRORS) or i == len(todo) - 1:
                    raise
                log.error("checkpoint %s is unusable (%s); falling back to the previous one", step_dir, e)
        raise CorruptCheckpointError(f"no usable checkpoint: {last_err}")  # pragma: no cover

    def _fence_saves_in_flight(self) -> None:
        """Before a load writes into tensors: fence this engine's save in flight and every other
        engine's of this process (a session's memory snapshots read the same tensors). A load
        fills memory through ``pread`` and numpy, which no version counter sees: into the live
        tensors of an unfenced live save, the save committed the loaded bytes. Only the training
        thread's fence is taken (nothing waits for a write to end)."""
        for eng in [self, *(e for e in list(_AT_EXIT) if e is not self)]:
            eng.fence()

    def _mark_unusable(self, step_dir: str) -> None:
        """A committed step of this root that failed its load with a data error: retention does not
        count it among the steps it keeps (a good older one would go in its favour)."""
        if os.path.dirname(os.path.abspath(step_dir)) == os.path.abspath(self.root):
            self._unusable.add(os.path.abspath(step_dir))

    def _load_candidates(self, path: str, fallback: bool) -> list[str]:
        try:
            first = self.storage.resolve(path)
        except (IncompleteCheckpointError, UnsafeCheckpointError) as e:
            # a `latest` that is garbage or points outside the root is never followed; with fallback
            # the committed step dirs of this root itself are still usable
            if not fallback:
                raise
            log.error("%s; falling back to the newest committed step dir under %s", e, path)
            first = None
        cands = [first] if first else []
        if fallback:
            # the committed steps older than the one named, newest first: a step numbered above it
            # is not this run's past (a run that started over with load "none" beside an earlier
            # run's higher steps: its corrupt newest step must not fall back to that run's)
            root = path if not self.storage.is_step(path) else os.path.dirname(path)
            steps = self.storage.list_steps(root)
            below = next((s for s, p in steps if p == first), None) if first else None
            older = [p for s, p in reversed(steps) if p != first and (below is None or s < below)]
            cands.extend(older)
        if not cands:
            raise IncompleteCheckpointError(f"{path}: no committed checkpoint to load")
        return cands

    def _load_from(self, step_dir: str, man: Optional[Manifest], shards_arg: "Sequence[TensorShard] | ShardsFor",
                   strict: bool, allow_cast: bool, mode: "VerifyMode", sources: "Optional[SourcesFor]" = None
                   ) -> LoadResult:
        t0 = time.perf_counter()
        if man is None:
            man = self.storage.read_manifest(step_dir)
        shards = _returned_shards(shards_arg, man) if callable(shards_arg) else list(shards_arg)
        if sources is None:
            if mode is VerifyMode.FULL:
                mine = [f for i, f in enumerate(sorted(man.files)) if i % self.comm.world_size == self.comm.rank]
                problems = self.storage.verify_files(step_dir, mine, man)
                if problems:
                    raise CorruptCheckpointError("; ".join(str(p) for p in problems))
            self.storage.check_files(step_dir, man)
        shards_found = [s for s in shards if s.name in man.tensors]
        alias = aliased_destinations(shards_found)
        if alias is not None:   # a caller's error, not a corrupt checkpoint (and no reason to fall back)
            raise ShardingError(alias)
        ro = read_only_destination(shards_found)
        if ro is not None:   # the reads would fail with EFAULT, or a copy into it kill the process
            raise ShardingError(ro)
        if strict and len(shards_found) != len(shards):
            missing = next(s.name for s in shards if s.name not in man.tensors)
            raise TensorMismatchError(f"tensor {missing!r} is not in checkpoint {step_dir} (it has "
                                      f"{len(man.tensors)} tensors; see `elastor inspect`): was it saved from "
                                      f"another model? (CheckpointEngine.load(..., strict=False) skips missing "
                                      f"tensors)")
        from .sources import DirSource, bytes_by_source, close_all, read_file
        srcs = [self.storage.source(step_dir)] if sources is None else list(sources(step_dir, man))
        if not srcs:
            raise IncompleteCheckpointError(f"{step_dir}: no source to read the checkpoint from")
        try:
            sf = man.rank_state_files.get(self.comm.rank)
            fe = man.files[sf] if sf else None   # the manifest's schema: every rank state file is in files
            if fe is not None and sources is None and isinstance(srcs[0], DirSource):
                # a hint: the kernel reads the small state file while the data reads run (it was
                # one more cold read after them)
                srcs[0].prefetch(sf, 0, fe.size)
            lplan = read_shards(step_dir, man, shards_found, allow_cast, check_crc=mode is not VerifyMode.NONE,
                                sources=srcs)
            rank_state = None
            if fe is not None:   # checked against the manifest's CRC32, from a regular file, whatever the source
                data, _ = read_file(srcs, sf, fe.size, fe.crc32, what="rank state")
                rank_state = _rank_state(data, step_dir, sf)
        finally:
            close_all(srcs)
        by_source = bytes_by_source(srcs)
        read = sum(by_source.values())   # measured: the reads plus the whole CRC tables they were checked with
        return LoadResult(man.step, step_dir, from_jsonable(dict(man.extra)), from_jsonable(rank_state), man, read,
                          lplan.bytes_needed,
                          time.perf_counter() - t0, bytes_by_source=by_source)


def _returned_shards(fn: Callable, man: Manifest) -> list:
    """What a ``shards_for(manifest)`` function of :meth:`CheckpointEngine.load` returned, checked:
    a list of :class:`TensorShard`."""
    got = fn(man)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        if isinstance(got, (str, bytes, Mapping)):
            raise TypeError
        shards = list(got)
    except TypeError:
        raise ConfigError(f"load(path, shards_for): {name}(manifest) returned {type(got).__name__}; a shards_for "
                          f"function must return a list of TensorShard to fill for that checkpoint (an empty list "
                          f"loads no tensor)") from None
    bad = next((s for s in shards if not isinstance(s, TensorShard)), None)
    if bad is not None:
        raise ConfigError(f"load(path, shards_for): {name}(manifest) returned a list holding a "
                          f"{type(bad).__name__}; a shards_for function must return a list of TensorShard "
                          f"(full_shard(name, tensor) for a whole tensor)")
    return shards


def _not_started(e: AsyncSaveError, step: int) -> AsyncSaveError:
    """The previous save's failure ``e``, as ``save(step)`` raises it: of the same class (so ``except
    LiveStateChangedError`` still matches), saying that this save was not started."""
    err = copy.copy(e)
    err.args = (f"{e} -- so save({step}) did not start: step {step} was not saved; call save({step}, ...) again "
                f"to save it (wait() after each save reports a failure before the next one)",)
    return err


def _one_step(steps: Sequence[int], outcomes: list) -> list:
    """``outcomes``, with rank 0's made an error when the ranks saved different steps in one save
    (a caller's bug: committing it would publish a step that lacks the other ranks' files)."""
    if len(set(steps)) <= 1:
        return outcomes
    said = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps[:8])) + (", ..." if len(steps) > 8 else "")
    err = ValueError(f"the ranks saved different steps in one save ({said}); nothing was committed. Every rank "
                     f"must call save() with the same step")
    return [("error", RankFailure.of(0, err).to_wire())] + list(outcomes[1:])


MAX_STEP = 2 ** 63 - 1


# engines whose writer thread may still run when the interpreter exits (a program that never
# called finalize()): stopped at exit, after the save they are writing, so that no thread of
# ours is alive while the interpreter finalizes. A daemon thread that finalization catches on its
# way back from a C call is ended with a forced unwind, which can abort the whole process
# ("terminate called without an active exception", exit -6: seen once in CI, after a script
# that never called finalize(); the liveness heartbeats had the same fix, comm.collectives).
_AT_EXIT: "weakref.WeakSet[CheckpointEngine]" = weakref.WeakSet()
EXIT_SAVE_WAIT_S = 300.0   # at exit, how long the saves in flight (all engines together) may still take to commit


_EXITING = False   # set when the exit handler has stopped the writers: later saves are written in place


def _stop_at_exit(engine: "CheckpointEngine") -> None:
    if not _AT_EXIT:
        atexit.unregister(_stop_writers)   # (registered once: a no-op when it is not)
        atexit.register(_stop_writers)
    _AT_EXIT.add(engine)


def _stop_writers() -> None:
    global _EXITING
    _EXITING = True
    deadline = time.monotonic() + EXIT_SAVE_WAIT_S
    for engine in list(_AT_EXIT):
        try:
            if engine._thread is not None and engine._thread.is_alive() and not engine.local_idle():
                job = engine._job
                log.warning("the program exits while checkpoint step %s is being written: waiting up to %.0f s for "
                            "its commit (interrupt again to abandon it; call finalize() before exiting)",
                            job.step if job is not None else "?", max(0.0, deadline - time.monotonic()))
                engine.writer_priority.urgent("exit")
            engine._stop_writer(join_s=max(0.1, deadline - time.monotonic()))
            engine._report_at_exit()
            engine._drop_cache_at_exit()
        except KeyboardInterrupt:   # the second interrupt: abandon the waits, still tell every writer to stop
            log.warning("checkpoint saves still being written at exit were abandoned")
            deadline = time.monotonic()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.debug("stopping a checkpoint writer at exit: %s", e)


def _staging_views(buf, spans) -> list:
    """Each span of the staging buffer as the writer takes it: a flat view, or a column tile's
    rows (:class:`~.fileformat.RowRuns`)."""
    if buf is None:
        return []
    base = memoryview(buf.numpy())
    return [base[sp[0]:sp[0] + sp[1]] if len(sp) == 2 else RowRuns(base, sp[0], sp[2], sp[1] // sp[2], sp[3])
            for sp in spans]


def _check_step(step: Any) -> int:
    """A checkpoint step: an integer >= 0 (numpy and torch integers too), as the manifest's schema says."""
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)   # python, numpy and one-element torch integers
    except TypeError:
        raise TypeError(f"step={step!r}: must be an integer >= 0 (the optimizer step or iteration)") from None
    if step < 0:
        raise ValueError(f"step={step}: must be >= 0 (the optimizer step or iteration)")
    if step > MAX_STEP:   # the outcome rows carry it as an int64
        raise ValueError(f"step={step}: must be at most 2**63 - 1 (the optimizer step or iteration)")
    return int(step)


def _rank_state(data: bytes, step_dir: str, name: str) -> Any:
    """A rank state file's JSON; bytes that are not JSON are a corrupt checkpoint."""
    import json
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{step_dir}/{name}: rank state is not JSON ({e}); the checkpoint is "
                                     f"corrupt") from None
