"""The posix backend: a checkpoint root on a shared (or local) file system, committed durably.

Every data file, CRC table and rank state file is fsynced before the writer reports it; the commit
(:class:`~elastor_ds.checkpoint.commit.StepCommit`) writes the manifest to a temp name, fsyncs it,
renames it into the temp step dir, renames that to ``step_<N>`` and fsyncs the root, then moves
``latest`` the same way. ``sync=False`` keeps the renames (atomic) and drops the fsyncs (a benchmark
of the write path, or storage that is thrown away); :attr:`Capabilities.durable` then says False.
Data files are written with ``O_DIRECT`` (:mod:`~elastor_ds.checkpoint.direct_write`: no page-cache
copy, a fraction of the CPU) where the file system allows it; ``direct_io=False`` writes them
through the page cache.

The read half (also the tmpfs backend's) reads the step directory through
:class:`~elastor_ds.checkpoint.sources.DirSource`.
"""
from __future__ import annotations

import os
import secrets
import shutil
import stat
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from ...comm.collectives import Comm
from ...errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError
from .. import commit as commit_mod
from ..direct_write import write_stream_direct
from ..fileformat import write_all, write_stream
from ..live import materialize
from ..planning.manifest import Manifest
from ..sources import STORAGE, ChunkSource, DirSource
from .base import Capabilities, Storage, make_root_agreed

if TYPE_CHECKING:
    from ..verify import Problem


class PosixStorage(Storage):
    """A checkpoint root on a posix file system (see the module docstring)."""

    def __init__(self, root: str, *, sync: bool = True, direct_io: bool = True, setting: Optional[str] = None):
        """``setting``: the name of the setting ``root`` came from (``elastor.checkpoint.dir``,
        ``--save``, ``checkpoint.dir``): set-up errors name it and ``root`` as written."""
        self.given = root
        self.setting = setting
        self.root = os.path.abspath(root)
        self.sync = bool(sync)
        self.direct_io = bool(direct_io)
        self.caps = Capabilities(durable=self.sync, node_local=False, stages_in_place=False,
                                 writes_live=self.direct_io)
        self.keep = 1

    # ------------------------------------------------------------------ write
    def set_up(self, comm: Comm, keep: int) -> None:
        self.keep = keep
        # rank 0 makes it; its failure (a path it may not create) is every rank's error, at once
        self.created = make_root_agreed(comm, self.root, "checkpoint directory", create=comm.rank == 0,
                                        setting=self.setting, given=self.given)
        if comm.world_size > 1:
            try:
                self._check_shared(comm)
            except BaseException:
                self.remove_if_unused()   # the engine was not made: nobody else removes what set-up made
                raise

    def _check_shared(self, comm: Comm) -> None:
        """Collective: every rank sees the folder rank 0 made, with its content, else every rank
        raises a ConfigError naming it. A path on node-local storage (``/tmp/ckpt`` on each node) is
        a different, empty folder on each node: each node's ranks would write their files into their
        own, and the first save fail as another writer's interference (rank 0 missing their files).
        Rank 0 writes a file of a random name and content into the root, every rank reads it back,
        rank 0 removes it: one broadcast of five ints and one tiny agreement. A folder rank 0 cannot
        write (one only loaded from) is not probed."""
        from ...comm.collectives import agree
        token = secrets.token_hex(16) if comm.rank == 0 else ""
        probe = os.path.join(self.root, f"{PROBE_PREFIX}{token}")
        written = 0
        if comm.rank == 0:
            try:
                _write_probe(probe, token)
                written = 1
            except OSError:   # a folder only loaded from (read-only): the session's own check says so
                pass
        got = comm.broadcast_ints([written] + [int(token[i:i + 8], 16) for i in range(0, 32, 8)] if token
                                  else [0] * 5)
        if not got[0]:
            return
        token = "".join("%08x" % v for v in got[1:])
        probe = os.path.join(self.root, f"{PROBE_PREFIX}{token}")
        try:
            agree(comm, lambda: self._read_probe(probe, token),
                  what=f"set-up of the checkpoint directory {self.root}")
        finally:
            if comm.rank == 0:
                try:
                    os.unlink(probe)
                except OSError:
                    pass

    def _read_probe(self, probe: str, token: str) -> None:
        from ...errors import ConfigError
        if _probe_says(probe) == token:
            return
        # a network file system may still hold this node's earlier look-up of the (then absent)
        # folder: a mkdir goes to the server, fails there (the folder exists) and drops that entry
        if _mkdirs_made(self.root):   # it did not exist here: this node's own storage
            seen = "does not exist on this rank's node"
        elif _probe_says(probe) == token:
            return
        else:
            seen = "exists on this rank's node, but without the file rank 0 just wrote into it"
        setting = self.setting or "the checkpoint directory"
        raise ConfigError(f"{setting} {self.given}: the folder {self.root} {seen}: it is not the "
                          f"same folder on every node (node-local storage, such as /tmp or a local disk, at the "
                          f"same path on each node?); a checkpoint is one folder every rank writes into: give a "
                          f"directory on storage every node shares (a parallel or network file system)")

    def temp_dir(self, step: int, nonce: str) -> str:
        return os.path.join(self.root, commit_mod.tmp_dirname(step, nonce))

    def write_data_file(self, path: str, header: bytes, buffers: Sequence[memoryview], *, chunk_crcs: list[int],
                        block_crcs: list[list[int]], block_size: int) -> tuple[int, int]:
        own_dir(os.path.dirname(path))
        if self.direct_io:
            return write_stream_direct(path, header, buffers, fsync=self.sync, chunk_crcs=chunk_crcs,
                                       block_crcs=block_crcs, block_size=block_size)
        return write_stream(path, header, materialize(buffers), fsync=self.sync, chunk_crcs=chunk_crcs,
                            block_crcs=block_crcs, block_size=block_size)

    def write_file(self, path: str, data: bytes) -> None:
        own_dir(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, memoryview(data))
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def seal_file(self, path: str) -> None:
        if not self.sync:
            return
        fd = os.open(path, os.O_RDONLY)   # pages written through a mapping are flushed by an fsync of the file
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def explain_write_error(self, tmp_dir: str, step: int, error: BaseException) -> BaseException:
        if isinstance(error, (FileNotFoundError, FileExistsError)) and not self.caps.node_local \
                and not os.path.isdir(tmp_dir):   # makedirs racing a removal raises FileExistsError too
            return commit_mod.vanished(self.root, tmp_dir, step, "its temporary folder")
        return error

    def check_written(self, tmp_dir: str, step: int, files: Iterable[str]) -> None:
        if self.caps.node_local:   # tmpfs: this node's folder holds only its own ranks' files
            return
        commit_mod.check_written(self.root, tmp_dir, step, files)

    def commit(self, tmp_dir: str, step: int, manifest_text: str) -> str:
        return commit_mod.commit_text(self.root, tmp_dir, step, manifest_text, sync=self.sync)

    def abort(self, tmp_dir: str) -> None:
        try:
            st = os.lstat(tmp_dir)
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():   # not another user's (own_dir refused it)
            shutil.rmtree(tmp_dir, ignore_errors=True)

    def retain(self, keep: int, protect: str, unusable: "frozenset[str]" = frozenset()) -> list[str]:
        return commit_mod.apply_retention(self.root, keep, protect=protect, unusable=unusable)

    # ------------------------------------------------------------------ read
    def resolve(self, path: str) -> str:
        return commit_mod.resolve(path)

    def is_step(self, path: str) -> bool:
        return commit_mod.is_committed(path)

    def list_steps(self, root: str) -> list[tuple[int, str]]:
        return commit_mod.list_committed(root)

    def read_manifest(self, step_dir: str) -> Manifest:
        return commit_mod.read_manifest(step_dir)

    def read_text(self, step_dir: str, name: str) -> str:
        with open(os.path.join(step_dir, name), encoding="utf-8") as f:
            return f.read()

    def check_files(self, step_dir: str, manifest: Manifest) -> None:
        for fname, fe in manifest.files.items():
            p = os.path.join(step_dir, fname)
            if not os.path.isfile(p):
                raise IncompleteCheckpointError(f"{p}: data file is missing")
            if os.path.getsize(p) != fe.size:
                raise CorruptCheckpointError(f"{p}: size {os.path.getsize(p)} != manifest {fe.size} (truncated?)")

    def verify_files(self, step_dir: str, names: Iterable[str], manifest: Manifest) -> "list[Problem]":
        from ..verify import verify
        return verify(step_dir, files=list(names), manifest=manifest)

    def source(self, step_dir: str) -> ChunkSource:
        return DirSource(step_dir, STORAGE)


#: the file :meth:`PosixStorage.set_up` writes into the root for a moment (a probe of shared storage)
PROBE_PREFIX = ".elastor-probe-"


def _write_probe(path: str, token: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, memoryview(token.encode()))
    finally:
        os.close(fd)


def _probe_says(path: str) -> Optional[str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 64).decode("ascii", "replace")
    finally:
        os.close(fd)


def _mkdirs_made(root: str) -> bool:
    """``mkdir`` each folder of ``root``, top-down; True when one of them was made here (then
    removed again, bottom-up): the path did not exist in this node's view."""
    parts = os.path.abspath(root).split(os.sep)
    made = []
    for i in range(2, len(parts) + 1):
        d = os.sep.join(parts[:i])
        try:
            os.mkdir(d, 0o700)
        except OSError:
            continue
        made.append(d)
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass
    return bool(made)


def own_dir(path: str) -> None:
    """Make the folder a save writes into (and its missing parents) and check that it is a real
    folder of this user. The checkpoint root may be shared (a team folder, sticky and writable by
    all): another user who made a folder under this save's name first, with links in it to files of
    the job's user, would have had the save write through them (and the step it commits be theirs).
    Raises :class:`UnsafeCheckpointError` for such a folder."""
    os.makedirs(path, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "is not a folder" if not stat.S_ISDIR(st.st_mode) else f"belongs to uid {st.st_uid}"
        raise UnsafeCheckpointError(f"{path} {what}: another user made this save's folder before it (a shared "
                                    f"checkpoint folder?); nothing is written through it. Give a checkpoint folder "
                                    f"only this user can write to")
