"""The memory tier: snapshots in the node's memory (tmpfs) that outlive the worker process.

A memory snapshot is an ordinary elastor checkpoint (same safetensors chunk files, manifest, block
CRCs, commit protocol) written by a second :class:`CheckpointEngine` whose root is
``<node dir>/local`` (the node dir: ``$ELASTOR_SNAPSHOT_DIR``, created, exported and removed by
``elastor run``; or ``memory_snapshot.dir``). Files on tmpfs survive a SIGKILLed worker, so the
relaunched workers, under any layout, read them back. The engine writes to a
:class:`~elastor_ds.checkpoint.storage.TmpfsStorage` (node-local, never fsynced): each node's
directory holds its ranks' chunk files plus the whole manifest.

1. Start (:meth:`MemoryTier.check_budget`, collective): bytes per snapshot of every node, estimated
   from the model's shards through the save plan (deduplicated) when the optimizer has no state
   yet, times (``keep`` + 1 in flight), plus the peer copy the node holds of its ring predecessor's
   ranks (x 2: held + arriving; ``peer_plan.node_memory_need``), against the node's tmpfs space (free +
   what older snapshots there already use) and ``max_bytes``: too small -> :class:`MemoryBudgetError`
   (a ConfigError: exit 2) naming the numbers and the fixes, on every rank, before training. The
   first real snapshot checks the measured bytes again.
2. Save (:meth:`save`): every ``interval_steps`` optimizer steps, no fsync (tmpfs), no
   plan-agreement collective on the training thread (``optimistic_plan``). A snapshot that does
   not fit (the tmpfs is full: another process can fill a shared ``/dev/shm``) is dropped with a
   warning on every rank alike (:meth:`wait`); training and the storage checkpoints go on.
   With ``live_write`` (:meth:`use_live_writes`) the training thread copies nothing: the writer
   copies the live tensors into the mapped files on idle cycles until the fence before the next
   optimizer step, which copies the rest.
3. Restore: see ``runtime.ElastorCheckpointer.load`` (newest committed step across memory and
   storage wins; memory first, then registered sources, then storage's files of the same step).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Optional

from .. import commit as commit_mod
from .. import CheckpointEngine, SaveStats
from ..planning.manifest import SNAPSHOT_BLOCK_SIZE
from ..storage.tmpfs import TmpfsStorage, mount_point
from ..writer_sched import WriterSched
from ...elastic.protocol import ENV_SNAPSHOT_DIR, launch_context
from ...errors import AsyncSaveError, ConfigError, SnapshotSpaceError
from ..settings import MemorySnapshotConfig

log = logging.getLogger(__name__)

LOCAL = "local"
# in ``local/``: the storage root (checkpoint.dir, real path) of the session whose snapshots these are,
# written after its first snapshot commits; a session of another storage root restores none of them
STORAGE_MARK = ".storage-root"


class MemoryBudgetError(ConfigError):
    """The node's memory cannot hold the configured snapshots."""


def node_dir(mcfg: MemorySnapshotConfig) -> str:
    """The node's snapshot directory: the one the config names, else ``$ELASTOR_SNAPSHOT_DIR``
    (``elastor run`` makes it; a user may set it by hand), each checked as ``elastor run`` checks its
    own: a private real directory of this user (0700, made so when absent) under folders only this
    user or root can change."""
    from ..private_dir import ensure_private_dir
    if mcfg.dir:
        return ensure_private_dir(mcfg.dir, "elastor.memory_snapshot.dir")
    d = launch_context().snapshot_dir
    if not d:
        raise ConfigError("memory snapshots need a node directory (one per node, in memory): run under `elastor run` "
                          f"(it creates one on /dev/shm and exports {ENV_SNAPSHOT_DIR}), export "
                          f"{ENV_SNAPSHOT_DIR}=/dev/shm/<job>, or name one in the trainer's settings (Megatron-LM: "
                          "--elastor-memory-snapshot-dir /dev/shm/<job>; DeepSpeed config: \"elastor\": "
                          "{\"memory_snapshot\": {\"dir\": \"/dev/shm/<job>\"}})")
    return ensure_private_dir(d, ENV_SNAPSHOT_DIR)


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 27 else f"{n / 2 ** 20:.1f} MiB"


class MemoryTier:
    """One rank's handle on its node's memory snapshots. Collective constructor."""

    def __init__(self, mcfg: MemorySnapshotConfig, comm: Any, storage_root: Optional[str] = None):
        self.cfg = mcfg
        self.dir = node_dir(mcfg)
        self.root = os.path.join(self.dir, LOCAL)
        self.comm = comm
        # optimistic_plan: no plan-agreement collective on the training thread per snapshot (a rank
        # whose shards changed makes that one snapshot be dropped everywhere; the next one re-plans)
        # TmpfsStorage: node-local, no fsync, snapshots staged straight into each rank's mapped data file
        # writer_nice=0, sched "nice": a snapshot every step must finish within the step (its writer only checksums
        # 64 KiB blocks, which release the GIL); a lowered priority is not measured for it (issue 23)
        self.ckpt = CheckpointEngine(self.root, comm, TmpfsStorage(self.root), keep=mcfg.keep, async_save=True,
                                     optimistic_plan=True, block_size=SNAPSHOT_BLOCK_SIZE, writer_nice=0,
                                     writer_sched=WriterSched.NICE)
        self.last_step: Optional[int] = None
        self.stats: list[SaveStats] = []
        self.budget: Optional[dict[str, Any]] = None
        self._checked_measured = False
        self.peer_copier: Any = None   # set by .peer.attach on multi-node jobs with peer copies
        self.paused = False            # True: no snapshots until cleared (set identically on every rank)
        self.nodes = 1
        self.dropped_for_space = 0     # snapshots dropped because they did not fit (SnapshotSpaceError)
        self._space_ok_since_drop = True
        # the session's checkpoint.dir: snapshots left here by a session of another one (a new run that
        # kept the snapshot folder) are not this run's state and are never restored
        self.storage_root = os.path.realpath(storage_root) if storage_root else None
        self._storage_marked = False
        if self.storage_root is not None:
            self.ckpt.after_commit.append(self._mark_storage_root)

    def use_live_writes(self) -> None:
        """``memory_snapshot.live_write`` (the session installed the fence before every optimizer
        step): a snapshot copies nothing on the training thread; the writer copies the live CPU
        tensors into the mapped files on idle cycles (``SCHED_IDLE``) until the fence, which
        copies what is left, and then runs at normal priority, so the snapshot still ends within
        the step (:func:`~elastor_ds.checkpoint.live.fill_in_place`)."""
        self.ckpt.live_write = True
        self.ckpt.writer_priority.set_sched(WriterSched.IDLE)   # "nice" where SCHED_IDLE cannot be undone

    # ------------------------------------------------------------------ budget
    @property
    def copies(self) -> int:
        """Snapshot copies a node holds at once: ``keep`` committed + 1 being written + the peer
        copies it receives from another node (none on a one-node job)."""
        return self.cfg.keep + 1 + (self.cfg.peer_copies if self.nodes > 1 else 0)

    def check_budget(self, rank_bytes: int, policy_comm: Any, estimated: bool) -> dict[str, Any]:
        """Collective. ``rank_bytes``: bytes this rank writes per snapshot. Raises MemoryBudgetError
        on every rank when any node's file system (or ``max_bytes``) is too small for the snapshots.
        One that is large enough but filled by other files now is a warning: snapshots that do not
        fit are dropped (:meth:`wait`) until there is room, and training goes on."""
        import socket
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        usable = free + tree_bytes(self.root)   # older snapshots here are replaced, not added to
        limit = min(usable, self.cfg.max_bytes) if self.cfg.max_bytes else usable
        size = st.f_blocks * st.f_frsize        # the whole file system: what could ever be ours
        capacity = min(size, self.cfg.max_bytes) if self.cfg.max_bytes else size
        me = (socket.gethostname(), os.path.realpath(self.root))
        rows = policy_comm.all_gather_object((me, int(rank_bytes), int(limit), int(free), int(capacity)))
        nodes: dict = {}
        for key, b, lim, fr, cap_ in rows:
            n = nodes.setdefault(key, {"bytes": 0, "limit": lim, "free": fr, "capacity": cap_, "ranks": 0})
            n["bytes"] += b
            n["ranks"] += 1
        self.nodes = len(nodes)
        # peer copies: a node holds its ring predecessor's ranks' bytes (not its own), twice while
        # the next copy arrives (peer_plan.node_memory_need)
        from .peer_plan import node_memory_need
        order = list(dict.fromkeys(r[0] for r in rows))
        ppn = [sum(1 for r in rows if r[0] == k) for k in order]
        contiguous = [r[0] for r in rows] == [k for k, n in zip(order, ppn) for _ in range(n)]
        peers = min(self.cfg.peer_copies, self.nodes - 1)
        if contiguous:
            need_by = node_memory_need(ppn, {i: r[1] for i, r in enumerate(rows)}, self.cfg.keep, peers)
            for k, nb in zip(order, need_by):
                nodes[k]["peer"], nodes[k]["need"] = nb["peer"], nb["need"]
        else:   # ranks of a node are not numbered consecutively: assume a peer copy as large as its own
            for n in nodes.values():
                n["peer"] = n["bytes"] * peers
                n["need"] = n["bytes"] * (self.cfg.keep + 1) + 2 * n["peer"]
        mine = nodes[me]
        need = mine["need"]
        self.budget = {"node_bytes_per_snapshot": mine["bytes"], "rank_bytes_per_snapshot": int(rank_bytes),
                       "peer_bytes_per_snapshot": mine["peer"], "copies": self.copies, "need_bytes": need,
                       "limit_bytes": mine["limit"], "estimated": estimated}
        short = [(k, n) for k, n in nodes.items() if n["need"] > n["capacity"]]
        full_now = [(k, n) for k, n in nodes.items() if n["need"] > n["limit"]]
        if full_now and not short:
            # room enough, taken by other files now (any local user can fill a shared /dev/shm): a
            # job that starts then must not fail where the same fill an iteration later is a warning
            (host, root), n = full_now[0]
            self._space_ok_since_drop = False   # this warning opens the episode: the drops are not said again
            if self.comm.rank == 0:
                log.warning("memory snapshots do not fit on node %s now: they need %s, but %s has %s available "
                            "(free %s of the %s it can hold: other files fill it). Snapshots that do not fit are "
                            "dropped and training goes on with the storage checkpoints; they resume once there is "
                            "room. Fix: free that tmpfs (`df -h %s`), or point \"memory_snapshot.dir\" "
                            "(--snapshot-dir) at a tmpfs with room", host, _gib(n["need"]), root, _gib(n["limit"]),
                            _gib(n["free"]), _gib(n["capacity"]), mount_point(root))
        if short:
            (host, root), n = short[0]
            cap = f", max_bytes {self.cfg.max_bytes}" if self.cfg.max_bytes else ""
            held = (f" + the peer copy it holds of another node's ranks, {_gib(n['peer'])} x 2 (held + arriving)"
                    if n["peer"] else "")
            mount = mount_point(root)
            fixes = []
            if self.cfg.max_bytes and n["capacity"] >= self.cfg.max_bytes:   # the cap binds, not the tmpfs
                fixes.append("a larger \"max_bytes\"")
            else:
                fixes.append(f"a larger tmpfs at {mount} (e.g. `mount -o remount,size=64G {mount}`)")
            if self.cfg.keep > 1:
                fixes.append("keep 1 (\"keep\" / --elastor-memory-snapshot-keep)")
            if n["peer"]:
                fixes.append("no peer copies (\"peer_copies\": 0 / --elastor-memory-snapshot-peer-copies 0)")
            fixes.append("a snapshot folder on a larger tmpfs (\"dir\" / --snapshot-dir)")
            fixes.append("no memory snapshots")
            raise MemoryBudgetError(
                f"memory snapshots do not fit on node {host}: its {n['ranks']} rank(s) write "
                f"{_gib(n['bytes'])} per snapshot{' (estimated)' if estimated else ''} x {self.cfg.keep + 1} "
                f"(keep {self.cfg.keep} + 1 being written){held} = {_gib(n['need'])}, but {root} can hold "
                f"{_gib(n['capacity'])} (free {_gib(n['free'])}{cap}). Fix: {', '.join(fixes[:-1])}, or "
                f"{fixes[-1]}")
        if self.comm.rank == 0 and not full_now:
            log.info("memory snapshots: %s per snapshot on this node%s x %d + peer copies held %s x 2 = %s of %s "
                     "available under %s", _gib(mine["bytes"]), " (estimated)" if estimated else "", self.cfg.keep + 1,
                     _gib(mine["peer"]), _gib(need), _gib(mine["limit"]), self.root)
        return self.budget

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        if self.paused:
            return False
        return step != self.last_step and step % self.cfg.interval_steps == 0

    def wait(self) -> Optional[SaveStats]:
        """Wait for the snapshot in flight. One that did not fit (a full tmpfs: every rank raises the
        same :class:`SnapshotSpaceError`) is dropped with a warning and training goes on; any other
        failure is raised (on every rank)."""
        try:
            stats = self.ckpt.wait()
        except AsyncSaveError as e:
            if not e.all_are(SnapshotSpaceError):
                raise
            self.dropped_for_space += 1
            if self.comm.rank == 0:
                if self._space_ok_since_drop:   # the first drop of an episode
                    log.warning("%s", e.failures[0].message)
                else:
                    log.debug("memory snapshot dropped again (no space): %s", e.failures[0].message)
            self._space_ok_since_drop = False
            return None
        if stats is not None and stats.committed_dir and not self._space_ok_since_drop:
            self._space_ok_since_drop = True
            if self.comm.rank == 0 and self.dropped_for_space:
                log.warning("memory snapshots fit again from step %d (%d dropped for want of space so far)",
                            stats.step, self.dropped_for_space)
        return stats

    def save(self, step: int, shards, policy_comm: Any, **kw: Any) -> SaveStats:
        self.wait()
        stats = self.ckpt.save(step, shards, **kw)
        self.last_step = step
        self.stats.append(stats)
        if not self._checked_measured:   # the first real snapshot: check the measured bytes
            self._checked_measured = True
            if self.budget is None or self.budget.get("estimated"):
                self.check_budget(stats.bytes_written, policy_comm, estimated=False)
        return stats

    def committed_steps(self) -> dict[int, str]:
        """step -> step dir of every committed snapshot in this node's directory, up to the step its
        ``latest`` names: a newer one belongs to a trajectory the run went back from (it re-saved an
        older step, e.g. after reloading a storage checkpoint) and is never restored."""
        try:
            steps = dict(commit_mod.list_committed(self.root))
        except Exception as e:  # noqa: BLE001 - nothing usable here: restore elsewhere
            log.debug("no usable memory snapshot under %s: %s", self.root, e)
            return {}
        try:
            cur = commit_mod.read_latest(self.root)
        except Exception as e:  # noqa: BLE001 - nothing usable here: restore elsewhere
            if steps:   # snapshots are there, but which trajectory they belong to is unknown: said, not hidden
                log.warning("memory snapshots of step(s) %s under %s are not used: %s; restoring from another "
                            "node's copy or storage instead", ", ".join(map(str, sorted(steps))), self.root, e)
            else:
                log.debug("no usable memory snapshot under %s: %s", self.root, e)
            return {}
        top = commit_mod.step_of(os.path.basename(cur)) if cur else None
        steps = steps if top is None else {s: d for s, d in steps.items() if s <= top}
        other = self._other_storage_root() if steps else None
        if other is not None:
            log.warning("memory snapshots of step(s) %s under %s are not used: they belong to the run whose "
                        "checkpoint.dir is %s, not this run's %s; restoring from storage instead (give each run a "
                        "snapshot folder of its own, or \"load\": \"none\" to start fresh)",
                        ", ".join(map(str, sorted(steps))), self.root, other, self.storage_root)
            return {}
        return steps

    def _other_storage_root(self) -> Optional[str]:
        """The storage root the snapshots here were written for, when it is not this session's
        (None: this session's, or unknown: no mark, as before marks were written)."""
        if self.storage_root is None:
            return None
        try:
            with open(os.path.join(self.root, STORAGE_MARK), encoding="utf-8", errors="replace") as f:
                mark = f.read(4097).strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.debug("cannot read %s: %s", os.path.join(self.root, STORAGE_MARK), e)
            return None
        return None if mark == self.storage_root else (mark[:4096] or "(an empty mark)")

    def _mark_storage_root(self, _info: Any) -> None:
        """after_commit (writer thread, every rank): name this session's storage root beside the
        snapshots, once per process, atomically (its own temp name, then a rename)."""
        if self._storage_marked or self.storage_root is None:
            return
        path = os.path.join(self.root, STORAGE_MARK)
        tmp = f"{path}.{os.getpid()}.{self.comm.rank}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.storage_root + "\n")
        os.replace(tmp, path)
        self._storage_marked = True

    def newest_local_step(self) -> tuple[Optional[int], Optional[str]]:
        """(step, step dir) of the newest committed snapshot in this node's directory."""
        try:
            step_dir = commit_mod.resolve(self.root)
        except Exception as e:  # noqa: BLE001 - nothing usable here: restore elsewhere
            log.debug("no usable memory snapshot under %s: %s", self.root, e)
            return None, None
        return commit_mod.step_of(os.path.basename(step_dir)), step_dir


def report_restore(rank: int, record: dict[str, Any]) -> None:
    """Rank 0 appends a ``restore`` record to ``$ELASTOR_EVENTS_FILE`` (when set)."""
    path = launch_context().events_file
    if rank != 0 or not path:
        return
    from ...elastic.events import EventKind
    rec = {"event": EventKind.RESTORE.value, "time": time.time(), "node": "workers", **record}
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:  # a report, never a reason to stop training
        log.warning("could not append to the events file %s: %s", path, e)
