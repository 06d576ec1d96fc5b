"""One checkpoint session per training job, whatever the trainer: when to save, where the bytes go,
where a restart reads them from.

A :class:`CheckpointSession` owns, for one trainer (DeepSpeed's engine, Megatron-LM's own loop, ...):

- the save policy (:class:`~.settings.CheckpointConfig`: interval in steps and seconds, async,
  keep; ``maybe_save`` after every optimizer step; ``save`` for an explicit or preemption save);
- the storage engine (:class:`~.engine.CheckpointEngine` over ``cfg.dir``) and the memory tier
  (:class:`~.snapshot.tier.MemoryTier`: snapshots in the node's memory, their peer copies);
- the device fence (CUDA: a snapshot's device-to-host copies overlap the next forward/backward and
  finish before the next optimizer step);
- the restore chain: the newest committed step across memory and storage wins (memory on a tie);
  a memory restore reads this node's memory, then the registered sources (peer copies, other
  nodes' snapshot servers), then storage's identical files of the same step, every byte
  CRC-checked; a snapshot that fails on any rank falls back to storage. A ``restore`` record
  (tier, step, bytes per source, seconds) goes to the job's events file.

What the trainer gives is a :class:`TrainerState` (a small protocol): its step, its layout, its
shards and JSON state for a save, its shards for a given manifest, and how to take back its JSON
state after a load. The DeepSpeed adapter (:mod:`elastor_ds.integrations.deepspeed.runtime`) and the
Megatron-LM hooks (:mod:`elastor_ds.integrations.megatron.training_hooks`) are such states.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from ..comm import TorchComm
from ..errors import (CheckpointError, CheckpointNotFoundError, CollectiveError, ConfigError,
                      CorruptCheckpointError, IncompleteCheckpointError, RanksFailedError, UnsafeCheckpointError)
from ..layout import Layout
from . import commit as commit_mod
from .engine import DATA_ERRORS, CheckpointEngine, LoadResult, RankExtra, SaveStats, VerifyMode
from .storage.posix import PosixStorage
from .planning.manifest import Manifest
from .settings import CheckpointConfig, MemorySnapshotConfig, save_due

log = logging.getLogger(__name__)

__all__ = ["Collected", "TrainerState", "CheckpointSession", "check_roots_apart", "restore_candidates"]


def restore_candidates(steps_per_rank: list, storage_step: int) -> list[int]:
    """The memory snapshot steps a restore may try, newest first (pure): held by every rank's node
    and not older than storage's newest step (storage wins when it is newer)."""
    if not steps_per_rank or any(not s for s in steps_per_rank):
        return []
    common = set(steps_per_rank[0]).intersection(*map(set, steps_per_rank[1:]))
    return sorted((s for s in common if s >= storage_step), reverse=True)


@dataclass
class Collected:
    """What one save writes for this rank: its shards, the job's JSON state (identical on every
    rank), this rank's own JSON state (e.g. RNG), and a description of the model. ``rank_extra``: a
    part of the job's JSON that differs per rank, gathered and merged by the writer
    (:class:`~.engine.RankExtra`)."""
    shards: list
    extra: dict[str, Any]
    rank_state: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    rank_extra: Optional[RankExtra] = None


@runtime_checkable
class TrainerState(Protocol):
    """The trainer's side of a :class:`CheckpointSession`. Optional, beside these methods:
    ``for_storage(collected) -> Collected``, what a storage save writes of a collection (the trainer's
    own flags may leave state out of its checkpoints; memory snapshots, for recovery, keep all of it)."""

    def step(self) -> int:
        """The optimizer step just completed (the step a save now would carry)."""

    def layout(self) -> Layout:
        """The layout this process group runs (a heterogeneous plan's layout as is)."""

    def collect(self) -> Collected:
        """The shards and JSON state of a save (called on every rank, same point)."""

    def shards_for(self, manifest: Manifest) -> list:
        """This rank's shards to fill for the checkpoint about to be loaded (no collectives)."""

    def restore(self, result: LoadResult, same_layout: bool) -> None:
        """Take back the JSON state of a loaded checkpoint; ``same_layout``: RNG states may come back."""

    def snapshot_bytes(self, comm: Any) -> int:
        """Collective: bytes this rank writes per snapshot, estimated before the optimizer has state."""

    def fence_optimizer(self) -> Any:
        """The optimizer whose ``register_step_pre_hook`` runs the fence before each step (a
        snapshot's device copies, a live write's reads), or None (no such hook: snapshots then wait
        for their copies, and storage saves copy at save time)."""


def check_roots_apart(storage: str, snapshots: str) -> None:
    """Storage and the memory snapshots each own their root: retention and the commit protocol of
    one would delete or rename the other's steps when one root lies inside the other."""
    from .paths import overlap
    if overlap(storage, snapshots):
        raise ConfigError(f"the checkpoint directory {os.path.abspath(storage)} and the memory-snapshot directory "
                          f"{os.path.abspath(snapshots)} overlap (one holds the other); give them separate "
                          f"directories, e.g. --save on shared storage and --snapshot-dir on /dev/shm")


def check_root_placement(storage: str, memory: Optional[MemorySnapshotConfig], dir_setting: str = "checkpoint.dir"
                         ) -> None:
    """Neither root lies in a checkpoint's step directory (that run's retention would delete it
    with the step), and they do not overlap; checked before either is made."""
    from ..elastic.protocol import launch_context
    roots = [(f"checkpoint directory ({dir_setting})", storage)]
    snap = (memory.dir or launch_context().snapshot_dir) if memory is not None else None
    if snap:
        roots.append(("memory-snapshot directory", snap))
    for what, root in roots:
        step = commit_mod.step_dir_holding(root)
        if step is not None:
            raise ConfigError(f"the {what} {os.path.abspath(root)} lies in the checkpoint step directory {step}, which "
                              f"its run's commits and retention rename and delete; give a directory outside any "
                              f"checkpoint step (e.g. beside that checkpoint's root)")
    if snap:
        check_roots_apart(storage, snap)


def _first_problem(why: Optional[str], policy_comm: Any) -> Optional[tuple[int, str, str]]:
    """Collective: the first rank's problem of all ranks' ``why`` (None: none), as (rank, why, " (rank
    R)" or "" on one rank), the same on every rank; None when no rank has one."""
    bad = [(r, w) for r, w in enumerate(policy_comm.all_gather_object(why)) if w]
    if not bad:
        return None
    rank, first = bad[0]
    return rank, first, (f" (rank {rank})" if policy_comm.world_size > 1 else "")


def _check_writable(cfg: CheckpointConfig, policy_comm: Any, dir_setting: str = "checkpoint.dir") -> None:
    """Collective. ``cfg.dir`` must take this process's saves when any will come (periodic saves);
    a read-only folder used only to load is a warning. Judged where it exists (rank 0 made it; the
    others may not see it yet on shared storage), agreed so that every rank raises the same error."""
    root = os.path.abspath(cfg.dir)
    why = None
    if os.path.isdir(root) and not os.access(root, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only_fs(root) else "no write permission for this user"
    agreed = _first_problem(why, policy_comm)
    if agreed is None:
        return
    rank, why, on = agreed
    if cfg.periodic:
        raise ConfigError(f"{dir_setting} {_shown(cfg.dir)}: this process{on} cannot write there ({why}), so the "
                          f"first save would fail; give a directory you may write, or fix its permissions")
    if policy_comm.rank == rank:
        log.warning("%s %s: this process cannot write there (%s): checkpoints load from it, but an explicit or "
                    "end-of-run save would fail", dir_setting, _shown(cfg.dir), why)


def _say_started_over(cfg: CheckpointConfig, dir_setting: str) -> None:
    """``load`` "none" in a folder that holds committed steps: this run starts over beside them."""
    steps = [s for s, _ in commit_mod.list_committed(os.path.abspath(cfg.dir))]
    if steps:
        log.warning("%s %s holds committed steps of an earlier run (%s) and load is \"none\": this run starts "
                    "over; its saves move `latest` to its own steps, and a resume loads those. The earlier steps "
                    "above this run's newest are kept beside them (never counted by keep) until a save of the same "
                    "step number replaces one; give each run its own directory to keep them apart", dir_setting,
                    _shown(cfg.dir), ", ".join(map(str, steps[-3:])) if len(steps) <= 3
                    else f"{steps[0]} .. {steps[-1]}, {len(steps)} steps")


def _shown(path: str) -> str:
    """A directory setting's value as written, with its absolute path when that differs."""
    a = os.path.abspath(path)
    return path if a == path else f"{path} ({a})"


def _check_snapshot_dir_writable(memory: MemorySnapshotConfig, node: str, policy_comm: Any) -> None:
    """Collective. The node's memory-snapshot folder ``node`` (and its ``local/`` when there) must take
    this process's snapshots: refused at set-up naming the setting the user gave and its value (the
    snapshot storage's own error named ``<dir>/local``, a folder the user never named). Agreed so that
    every rank raises the same error."""
    from .snapshot.tier import LOCAL
    why = None
    for p in (node, os.path.join(node, LOCAL)):
        if os.path.isdir(p) and not os.access(p, os.W_OK | os.X_OK):
            why = "a read-only file system" if _read_only_fs(p) else "no write permission for this user"
            if p != node:
                why = f"its snapshot folder {p} allows no writes: {why}"
            break
    agreed = _first_problem(why, policy_comm)
    if agreed is None:
        return
    _, why, on = agreed
    if memory.dir:
        setting, value = "elastor.memory_snapshot.dir", memory.dir
    else:
        from ..elastic.protocol import ENV_SNAPSHOT_DIR
        setting, value = ENV_SNAPSHOT_DIR, os.environ.get(ENV_SNAPSHOT_DIR, node)
    raise ConfigError(f"{setting} {value}: this process{on} cannot write there ({why}), so no memory snapshot "
                      f"could be taken; give a directory you may write (one per node, in memory: /dev/shm/<job>), "
                      f"or fix its permissions")


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _world_initialised() -> bool:
    """Whether torch.distributed has a world: a one-process session on ``LocalComm`` (no
    ``init_process_group``) has no other node, so no peer copies and no other node's sources."""
    from ..comm.groups import world_size
    try:
        world_size()
    except CollectiveError:   # torch.distributed absent or not initialised
        return False
    return True


class CheckpointSession:
    """Collective constructor: every rank of the job, same point."""

    def __init__(self, state: TrainerState, cfg: CheckpointConfig, memory: Optional[MemorySnapshotConfig] = None,
                 *, comm: Any = None, policy_comm: Any = None, memory_comm: Any = None, cross_node: bool = True,
                 dir_setting: str = "checkpoint.dir"):
        """``dir_setting``: the name of the setting ``cfg.dir`` came from, as the user wrote it
        (``elastor.checkpoint.dir`` in a DeepSpeed config, ``--save`` for Megatron-LM): errors about
        the folder name it."""
        self.state = state
        self.cfg = cfg
        self.dir_setting = str(dir_setting)
        check_root_placement(cfg.dir, memory, self.dir_setting)   # before anything is made on disk
        if cfg.load not in ("latest", "none") and not os.path.lexists(cfg.load):
            raise CheckpointNotFoundError(f"elastor.checkpoint.load: {os.path.abspath(cfg.load)} does not exist; give "
                                          f"a checkpoint directory or step directory, \"latest\" (the newest under "
                                          f"{os.path.abspath(cfg.dir)}) or \"none\"")
        self.memory = None
        self.ckpt = None
        try:
            self._set_up(cfg, memory, comm, policy_comm, memory_comm, cross_node)
        except BaseException:
            self.discard_if_unused()   # a job rejected here leaves no empty folders of ours behind
            raise

    def _set_up(self, cfg: CheckpointConfig, memory: Optional[MemorySnapshotConfig], comm: Any, policy_comm: Any,
                memory_comm: Any, cross_node: bool) -> None:
        state = self.state
        self.comm = comm if comm is not None else self._new_comm(None)
        # main-thread agreement (policy, load) gets its own group: the background writer runs
        # collectives on ``self.comm`` and two threads must never interleave collectives on one group
        self.policy_comm = policy_comm if policy_comm is not None else self._new_comm(comm)
        self.ckpt = CheckpointEngine(cfg.dir, self.comm, keep=cfg.keep, async_save=cfg.async_save,
                                     storage=PosixStorage(cfg.dir, direct_io=cfg.direct_io, setting=self.dir_setting),
                                     writer_sched=cfg.writer_sched, writer_deadline_s=cfg.writer_deadline_s)
        # a read-only folder: refused now, not at the first save
        _check_writable(cfg, self.policy_comm, self.dir_setting)
        try:   # a folder of DeepSpeed's own checkpoints: refused now, not at the first commit
            commit_mod.check_latest_replaceable(cfg.dir)
        except UnsafeCheckpointError as e:
            raise ConfigError(f"{self.dir_setting}: {e}") from None
        if cfg.load == "none" and self.policy_comm.rank == 0:
            _say_started_over(cfg, self.dir_setting)
        self.last_save_step: Optional[int] = None
        self.last_save_time = time.monotonic()
        self.stats: list[SaveStats] = []
        self.loaded: Optional[LoadResult] = None
        self.last_collect_s = 0.0
        self.last_hook_s = 0.0   # wall time of the last save/snapshot on the training thread (collect .. stall)
        self.restore: Optional[dict[str, Any]] = None   # where the resumed bytes came from
        # sources consulted between this node's memory and storage on a memory restore (peer copies,
        # other nodes' servers): fn(step_dir, manifest) -> [ChunkSource, ...]
        self.extra_memory_sources: list[Callable[[str, Manifest], list]] = []
        if memory is not None:
            from .snapshot.tier import MemoryTier, node_dir
            snap_dir = node_dir(memory)
            check_roots_apart(cfg.dir, snap_dir)
            _check_snapshot_dir_writable(memory, snap_dir, self.policy_comm)   # before local/ is made in it
            self.memory = MemoryTier(memory, memory_comm if memory_comm is not None else self._new_comm(comm),
                                     storage_root=cfg.dir)
            self.memory.check_budget(state.snapshot_bytes(self.policy_comm), self.policy_comm, estimated=True)
            if cross_node and _world_initialised():
                from .snapshot.peer import attach   # cross-node half: peer copies and restore sources (collective)
                attach(self, cfg.timeout_s)
        live_mem = memory is not None and memory.live_write
        hazard_of = getattr(state, "live_write_hazard", None)
        hazard = hazard_of() if (cfg.live_write or live_mem) and hazard_of is not None else None
        if hazard is not None:
            for on, key in ((cfg.live_write, "checkpoint.live_write"), (live_mem, "memory_snapshot.live_write")):
                if on:
                    log.warning("%s is on, but %s: saves of this model copy the state at save time instead",
                                key, hazard)
            cfg = dataclasses.replace(cfg, live_write=False)
            live_mem = False
        self.device_fence = self._install_device_fence(cfg.live_write or live_mem)
        # a live write needs the fence before every optimizer step (nothing else changes saved tensors)
        self.ckpt.live_write = cfg.live_write and self.device_fence
        if live_mem and self.device_fence:
            assert self.memory is not None
            self.memory.use_live_writes()
        for on, key, what in ((cfg.live_write, "checkpoint.live_write", "storage saves"),
                              (live_mem, "memory_snapshot.live_write", "memory snapshots")):
            if on and not self.device_fence:
                log.warning("%s is on, but this trainer's optimizer has no step pre-hook for the fence (e.g. "
                            "Megatron-LM's optimizers): %s copy the state at save time instead", key, what)

    def _new_comm(self, given: Any) -> Any:
        """A group of the session's own: a new gloo group of the torch.distributed world; without
        one, a duplicate of the ``comm`` the caller gave (``LocalComm()`` for one process)."""
        if _world_initialised():
            return TorchComm.create(self.cfg.timeout_s)
        if given is not None:
            return given.duplicate()
        raise ConfigError("CheckpointSession: torch.distributed is not initialised; call "
                          "torch.distributed.init_process_group first (every rank), or pass comm=LocalComm() "
                          "(elastor_ds.comm.collectives) for a single process")

    @property
    def layout(self) -> Layout:
        return self.state.layout()

    def discard_if_unused(self) -> None:
        """Remove the checkpoint and snapshot folders this rank's set-up created while they are still
        empty (a job rejected at start-up, e.g. over a bad ``load``); never anything else."""
        engines = [self.ckpt, getattr(self.memory, "ckpt", None)]
        for eng in engines:
            if eng is not None:
                eng.storage.remove_if_unused()

    def _install_device_fence(self, live_write: bool) -> bool:
        """The fence in the optimizer's step pre-hook, where something needs it: CUDA (a snapshot's
        deferred device copies) or live writes. A CPU job without live writes gets no per-step hook."""
        import torch
        if not live_write and not torch.cuda.is_available():
            return False
        opt = self.state.fence_optimizer()
        if opt is None or not hasattr(opt, "register_step_pre_hook"):
            return False
        engines = [self.ckpt] + ([self.memory.ckpt] if self.memory is not None else [])

        def fence(*_args: Any) -> None:
            for e in engines:
                e.fence()
        opt.register_step_pre_hook(fence)
        for e in engines:
            e.defer_device_copies = True
        return True

    # ---------------------------------------------------------------- save
    def maybe_save(self) -> Optional[SaveStats]:
        """After an optimizer step: a storage save when the policy says so (identical decision on
        every rank), a memory snapshot when one is due."""
        cfg = self.cfg
        step = int(self.state.step())
        due = save_due(cfg, step, self.last_save_step, time.monotonic() - self.last_save_time, self.ckpt.local_idle())
        if cfg.min_interval_s > 0 and cfg.periodic and step != self.last_save_step:
            due = all(self.policy_comm.all_gather_object(due))  # clocks differ per rank: agree
        mem = self.memory
        mem_due = mem is not None and mem.due(step)
        if not due and not mem_due:
            return None
        t0 = time.perf_counter()
        got = self._collect()
        stats = self.save(collected=got) if due else None
        if mem_due:
            assert mem is not None
            ms = mem.save(step, got.shards, self.policy_comm, extra=got.extra, rank_state=got.rank_state,
                          model=got.model, layout=self.layout.to_json(), rank_extra=got.rank_extra)
            stats = stats or ms
        self.last_hook_s = time.perf_counter() - t0
        return stats

    def _collect(self) -> Collected:
        t0 = time.perf_counter()
        got = self.state.collect()
        self.last_collect_s = time.perf_counter() - t0
        return got

    def save(self, collected: Optional[Collected] = None) -> SaveStats:
        """Collective: save the current step to storage now (asynchronously when configured)."""
        got = collected or self._collect()
        trim = getattr(self.state, "for_storage", None)
        if trim is not None:   # what the trainer's own flags leave out of storage (memory snapshots keep all)
            got = trim(got)
        step = int(self.state.step())
        stats = self.ckpt.save(step, got.shards, extra=got.extra, rank_state=got.rank_state, model=got.model,
                               layout=self.layout.to_json(), rank_extra=got.rank_extra)
        self.last_save_step = step
        self.last_save_time = time.monotonic()
        self.stats.append(stats)
        if self.comm.rank == 0:
            log.info("elastor save of step %d: stall %.1f ms (%d bytes on rank 0)", step, stats.stall_s * 1e3,
                     stats.bytes_written)
        return stats

    def save_final(self) -> Optional[SaveStats]:
        """Collective: make the current step durable in storage (end of run, preemption), unless
        storage already holds it; waits for the write. A step restored from memory is not saved
        until storage holds it (see :meth:`resumed`)."""
        stats = None
        if self.last_save_step != int(self.state.step()):
            stats = self.save()
        self.wait()
        return stats

    def wait(self) -> Optional[SaveStats]:
        if self.memory is not None:
            self.memory.wait()   # a snapshot that did not fit is dropped there, not raised
        return self.ckpt.wait()

    def finalize(self) -> Optional[SaveStats]:
        if self.memory is not None:
            self.memory.wait()
            self.memory.ckpt.finalize()
            if self.memory.peer_copier is not None:   # the last snapshot's copy (snapshot.peer.attach)
                self.memory.peer_copier.close()
        return self.ckpt.finalize()

    # ---------------------------------------------------------------- load
    def resolve(self, load: str) -> Optional[str]:
        """The root or step dir to load for ``load`` (``latest``/a path), or None when there is nothing yet."""
        if load == "none":
            return None
        if load != "latest":
            return os.path.abspath(load)
        root = os.path.abspath(self.cfg.dir)
        if not os.path.isdir(root) or (commit_mod.read_latest(root) is None and not commit_mod.list_committed(root)):
            return None
        return root

    def load(self, path: Optional[str] = None) -> Optional[LoadResult]:
        """Collective: restore ``path`` (default ``cfg.load``); for ``latest`` with memory snapshots,
        the newest step across memory and storage. None when there is nothing to load."""
        want = path or self.cfg.load
        step_dir = self.resolve(want)
        if self.memory is not None and want == "latest":
            res = self.load_memory(step_dir)
            if res is not None:
                return res
        agreed = self.policy_comm.all_gather_object(step_dir is not None)
        if not any(agreed):
            log.info("no elastor checkpoint under %s: starting fresh", self.cfg.dir)
            return None
        if not all(agreed):
            raise IncompleteCheckpointError(f"some ranks see a checkpoint under {self.cfg.dir} and others do not: "
                                            f"the directory must be on storage shared by every rank")
        assert step_dir is not None
        return self.load_storage(step_dir)

    def load_storage(self, step_dir: str, *, fallback: Optional[bool] = None, strict: bool = True) -> LoadResult:
        """Collective: load ``step_dir`` (a root: its newest committed step) from storage."""
        res = self.ckpt.load(step_dir, self.state.shards_for,
                             verify_checksums=VerifyMode.CHUNKS if self.cfg.verify_on_load else VerifyMode.NONE,
                             fallback=self.cfg.fallback_to_previous if fallback is None else fallback, strict=strict)
        return self.resumed(res, "storage", durable_step=res.step)

    def resumed(self, res: LoadResult, tier: str, durable_step: Optional[int]) -> LoadResult:
        """Bookkeeping after a load. ``durable_step`` is the newest step storage holds (the loaded
        step for a storage load; for a memory restore storage's newest, which may be older): a step
        restored from memory is not saved until storage holds it, so the end-of-run and stop-point
        saves write it again (a relaunch that restored the final step from memory must not exit
        with storage one interval behind)."""
        layout = self.layout
        saved = res.manifest.layout
        same = saved is not None and Layout.from_json(saved).fingerprint() == layout.fingerprint()
        self.state.restore(res, same)
        if not same and self.comm.rank == 0:
            log.info("layout changed (%s -> %s): RNG states start fresh",
                     Layout.from_json(saved).describe() if saved else "?", layout.describe())
        self.loaded = res
        self.last_save_step = durable_step
        if self.memory is not None:
            self.memory.last_step = res.step
        rows = self.policy_comm.all_gather_object((res.bytes_by_source, res.seconds))
        total: dict[str, int] = {}
        for by, _ in rows:
            for k, v in by.items():
                total[k] = total.get(k, 0) + int(v)
        self.restore = {"step": res.step, "tier": tier, "step_dir": res.step_dir, "bytes": total,
                        "durable_step": durable_step,
                        "seconds": max(sec for _, sec in rows), "layout": layout.describe(),
                        "fell_back": bool(res.fell_back)}
        if self.comm.rank == 0:
            from .snapshot.tier import report_restore
            log.info("resumed from %s (step %d, %s) under %s in %.2f s; bytes per source: %s", res.step_dir, res.step,
                     tier, layout.describe(), self.restore["seconds"],
                     ", ".join(f"{k} {v}" for k, v in sorted(total.items())) or "none")
            report_restore(0, self.restore)
        return res

    def load_memory(self, storage_root: Optional[str]) -> Optional[LoadResult]:
        """Collective. Restore from the memory snapshots: the newest step that every rank's node
        holds, at least storage's newest; when its bytes cannot all be found (e.g. a lost node's
        files of a step that was not peer-copied), the next older such step. None (nothing loaded)
        when no step qualifies or every candidate fails its checks (logged; the caller then loads
        storage). When every candidate failed and storage holds no checkpoint, CorruptCheckpointError
        on every rank: the failed loads wrote into the tensors, which must not be trained as a fresh
        start."""
        mem = self.memory
        if mem is None:
            return None
        local = mem.committed_steps()
        sdir = None
        if storage_root is not None:
            try:
                sdir = commit_mod.resolve(storage_root)
            except CheckpointError:
                sdir = None
        sstep = commit_mod.step_of(os.path.basename(sdir)) if sdir else None
        rows = self.policy_comm.all_gather_object((sorted(local), sstep))
        best_storage = max((r[1] for r in rows if r[1] is not None), default=-1)
        cands = restore_candidates([r[0] for r in rows], best_storage)
        if not cands:
            if self.comm.rank == 0 and any(r[0] for r in rows):
                log.info("memory snapshots not used: steps per rank %s, storage step %s",
                         [r[0] for r in rows], best_storage)
            return None
        for i, step in enumerate(cands):
            res = self._load_memory_step(step, local[step], sdir, sstep, best_storage)
            if res is not None:
                return res
            if i + 1 < len(cands):
                if self.comm.rank == 0:
                    log.warning("trying the older memory snapshot of step %d", cands[i + 1])
            elif best_storage < 0:
                # the failed loads wrote into the tensors (bytes they could not verify zeroed), and
                # storage holds nothing to load over them: a "fresh start" would train from those
                raise CorruptCheckpointError(
                    f"no usable memory snapshot (step(s) {', '.join(map(str, cands))} failed their checks, logged "
                    f"above) and no storage checkpoint under {self.cfg.dir} to restore instead; the failed loads "
                    f"wrote into this process's model and optimizer tensors, so training cannot start fresh from "
                    f"them. Remove the unusable snapshots under {mem.root} to start fresh (or relaunch with a new "
                    f"snapshot folder)")
            elif self.comm.rank == 0:
                log.error("no usable memory snapshot; restoring from storage instead")
        return None

    def _load_memory_step(self, mstep: int, mdir: str, sdir: Optional[str], sstep: Optional[int],
                          best_storage: int) -> Optional[LoadResult]:
        from .sources import LOCAL_MEMORY, DirSource, registered_sources, storage_source_for
        mem = self.memory
        assert mem is not None

        def sources(step_dir: str, man: Manifest) -> list:
            out = [DirSource(step_dir, LOCAL_MEMORY)]
            for fn in self.extra_memory_sources:
                out.extend(fn(step_dir, man) or [])
            out.extend(registered_sources(step_dir, man))
            if sdir is not None and sstep == man.step:
                try:
                    smt = commit_mod.read_manifest(sdir)
                except CheckpointError as e:
                    log.warning("storage checkpoint %s cannot back the memory snapshot: %s", sdir, e)
                    smt = None
                st_src = storage_source_for(sdir, man, smt)
                if st_src is not None:
                    out.append(st_src)
            return out
        try:
            res = mem.ckpt.load(mdir, self.state.shards_for, verify_checksums=VerifyMode.CHUNKS, fallback=False,
                                sources=sources)
        except RanksFailedError as e:
            if not e.all_are(*DATA_ERRORS):
                raise
            if self.comm.rank == 0:
                log.error("memory snapshot of step %s is unusable (%s)", mstep, e)
            return None
        # storage's newest step on every rank (shared storage: the same); the restored step counts
        # as saved only when storage holds it too
        durable = best_storage if best_storage >= 0 else None
        return self.resumed(res, "memory", durable_step=durable)
