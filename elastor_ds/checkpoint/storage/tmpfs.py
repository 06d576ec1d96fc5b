"""The node-local tmpfs backend: memory snapshots in each node's own directory, never fsynced.

What differs from :mod:`.posix`:

1. **No fsync.** tmpfs pages do not outlive the node, so no file, directory or commit is fsynced;
   the commit's renames keep it atomic (a reader never sees half a step).
2. **Node-local.** The root is a per-node directory (``/dev/shm/...``). :meth:`TmpfsStorage.set_up`
   (collective: one all-gather) finds the lowest rank of every node other than rank 0's: it commits
   its node's copy with rank 0's manifest text, so every node holds the step's manifest and
   ``latest``, and runs retention there.
3. **In-place staging** (``stage_in_place=True``, the default): the snapshot copies straight into
   this rank's mapped data file (:mod:`~elastor_ds.checkpoint.snapshot.file_staging`), so the write
   of the whole file disappears. Retention moves a retired step's data files to ``.recycle`` and
   the next save renames one back into its temp dir and writes over its pages (no allocation,
   zeroing and freeing of a snapshot's pages every step).
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
from typing import Optional

import torch

from ...comm.collectives import Comm, raise_failures
from ...errors import CheckpointError, RankFailure, SnapshotSpaceError
from .. import commit as commit_mod
from ..snapshot.file_staging import FileStaging, StagedFile
from ..writer import data_file_name
from .base import Capabilities, make_root
from .posix import PosixStorage

RECYCLE_DIR = ".recycle"


def mount_point(path: str) -> str:
    """The mount point of the file system holding ``path`` (for the fix a message suggests)."""
    p = os.path.realpath(path)
    try:
        dev = os.stat(p).st_dev
        while p != os.sep and os.stat(os.path.dirname(p)).st_dev == dev:
            p = os.path.dirname(p)
    except OSError:
        return "/dev/shm"
    return p


class TmpfsStorage(PosixStorage):
    """A node-local memory snapshot root (see the module docstring)."""

    def __init__(self, root: str, *, stage_in_place: bool = True, pin: Optional[bool] = None):
        """``pin`` (default: CUDA present): page-lock the mapped files, so device-to-host copies into
        them are DMA."""
        # written through the page cache: on tmpfs the page cache is the storage, and O_DIRECT would
        # only add the copy into a bounce buffer
        super().__init__(root, sync=False, direct_io=False)
        self.caps = Capabilities(durable=False, node_local=True, stages_in_place=bool(stage_in_place))
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self.recycle_dir = os.path.join(self.root, RECYCLE_DIR)
        self.files: Optional[FileStaging] = None
        self._committer = False     # this rank commits its node's copy (rank 0's node: rank 0)
        self._multi_node = False
        self._recycle_names: set[str] = set()   # data files a rank of this job will take (others are deleted)
        self._committed: list[str] = []         # step dirs committed while this storage was used, oldest first
        self._own_name: Optional[str] = None    # this rank's data file name (set_up)

    @property
    def commits_copy(self) -> bool:
        return self._committer

    @property
    def shares_manifest(self) -> bool:
        return self._multi_node

    def set_up(self, comm: Comm, keep: int) -> None:
        """Collective (one all-gather of (host, real path of the root))."""
        self.keep = keep
        # every node makes its own; one that cannot is every rank's error, raised at once after the
        # gather (a rank raising alone before it left the others waiting there for the timeout)
        failed = None
        try:
            self.created = make_root(self.root, "memory snapshot directory")
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            if comm.world_size <= 1:
                raise
            failed = e
        key = (socket.gethostname(), os.path.realpath(self.root))
        rows = comm.all_gather_object((key, None if failed is None else RankFailure.of(comm.rank, failed).to_wire()))
        raise_failures([RankFailure.from_wire(r[1]) for r in rows if r[1] is not None], comm.world_size, failed,
                       f"set-up of the memory snapshot directory {self.root}")
        keys = [r[0] for r in rows]
        self._own_name = data_file_name(comm.rank)
        self._committer = comm.rank != 0 and keys.index(key) == comm.rank and key != keys[0]
        self._multi_node = len(set(keys)) > 1
        # the data files this node's ranks take (a rank of another node never takes one from here: the
        # files of ranks that moved to another node after a re-launch are deleted, not kept for nobody)
        self._recycle_names = {data_file_name(r) for r, k in enumerate(keys) if k == key}
        if self.caps.stages_in_place and self.files is None:
            self.files = FileStaging(max_maps=keep + 3, pin=self.pin)

    def stage_data_file(self, tmp_dir: str, fname: str, header: bytes, size: int) -> StagedFile:
        if self.files is None:
            raise RuntimeError(f"{self!r}: stage_data_file before set_up, or with stage_in_place=False")
        # this rank's retired files: where retention put them, or still in a step dir that a newer
        # commit retired (newest first); never a step among the newest ``keep`` this process saw
        # committed, nor the one this node's ``latest`` names (it may differ: a re-save of an older
        # step, or another node whose copy of the newest step is not committed yet or failed)
        cands = [os.path.join(self.recycle_dir, fname)]
        old = self._committed[:-self.keep]
        # (the training thread's path: `latest` is read only when retention left no file to recycle)
        if old and not os.path.lexists(cands[0]):
            try:
                cur = os.path.basename(commit_mod.read_latest(self.root) or "")
            except (OSError, CheckpointError):
                cur = None   # unreadable: take nothing from a step dir
            if cur is not None:
                cands += [os.path.join(self.root, d, fname) for d in reversed(old) if d != cur]
        return self.files.take(tmp_dir, fname, cands, header, size)

    def explain_write_error(self, tmp_dir: str, step: int, error: BaseException) -> BaseException:
        """A full tmpfs (or a quota) is a :class:`SnapshotSpaceError` naming the folder and its free
        space: the memory tier drops that snapshot and training goes on."""
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                st = os.statvfs(self.root)
                free = f"{st.f_bavail * st.f_frsize / 2 ** 20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2 ** 20:.1f} MiB"
            except OSError:
                free = "free space unknown"
            return SnapshotSpaceError(
                f"memory snapshot of step {step} does not fit under {self.root} ({os.strerror(error.errno)}; "
                f"{free} on its file system): snapshot dropped, training goes on with the storage checkpoints. "
                f"Fix: free or enlarge that tmpfs (`mount -o remount,size=64G {mount_point(self.root)}`), lower "
                f"\"keep\", or "
                f"point \"memory_snapshot.dir\" (--snapshot-dir) at a tmpfs with room")
        return super().explain_write_error(tmp_dir, step, error)

    def release_staged(self, staged: StagedFile) -> None:
        if self.files is not None:
            self.files.release(staged)   # its temp dir is gone: do not keep its pages mapped

    def commit(self, tmp_dir: str, step: int, manifest_text: str) -> str:
        os.makedirs(tmp_dir, exist_ok=True)   # another node's committer whose ranks wrote no data file
        return commit_mod.commit_text(self.root, tmp_dir, step, manifest_text, sync=False)

    def committed(self, step_dir: str) -> None:
        name = os.path.basename(step_dir)   # a re-saved step moves to the end (it is the newest again)
        self._committed = [*[d for d in self._committed if d != name][-(self.keep + 2):], name]

    def retain(self, keep: int, protect: str, unusable: "frozenset[str]" = frozenset()) -> list[str]:
        return commit_mod.apply_retention(self.root, keep, protect=protect, recycle_dir=self.recycle_dir,
                                          recycle_names=self._recycle_names)

    def close(self, committer: bool) -> None:
        if self.files is not None:
            self.files.close()
        if committer:   # every rank's last save took its file before rank 0 could finish it
            shutil.rmtree(self.recycle_dir, ignore_errors=True)

    def drop_cache(self, committer: bool) -> None:
        """At exit without ``finalize``: the retired data files kept in ``.recycle`` for the next
        snapshot to write over are a snapshot's worth of this node's memory each, and no relaunch
        restores from them (it reads the committed step dirs; its first snapshots allocate anew).
        Removed: this rank's own file; a committer (the rank that moves retired files there) the
        whole folder, after its writer stopped. The committed steps, the mappings (gone with the
        process) and the files a save still holds are left alone; a rank of this node still
        running simply allocates a new file for its next snapshot."""
        if self._own_name is not None:
            try:
                os.unlink(os.path.join(self.recycle_dir, self._own_name))
            except FileNotFoundError:
                pass
        if committer:
            shutil.rmtree(self.recycle_dir, ignore_errors=True)
