"""The storage interface: what a checkpoint engine asks of the place it writes to and reads from.

After PyTorch DCP's ``StorageWriter``/``StorageReader``: the engine plans, snapshots, gathers and
decides; a :class:`Storage` puts the bytes somewhere and makes a step appear atomically. A backend
is one new module implementing these two halves; the engine does not change.

A save, as the engine drives it (``*`` on every rank, ``0`` on the coordinator, rank 0):

1. ``*`` :meth:`StorageWriter.set_up` once (collective where a backend needs it, e.g. node-local
   storage learns which rank commits each node's copy).
2. ``*`` :meth:`StorageWriter.temp_dir`: where this save's files go until the commit.
3. ``*`` :meth:`StorageWriter.write_data_file` (a data file streamed from buffers, with its CRCs)
   and :meth:`StorageWriter.write_file` (small files: the block-CRC table, the rank state); or,
   where :attr:`Capabilities.stages_in_place`, :meth:`StorageWriter.stage_data_file` before the
   snapshot copy and :meth:`StorageWriter.seal_file` after it.
4. ``0`` :meth:`StorageWriter.commit` (manifest last, atomically, then ``latest``) or
   :meth:`StorageWriter.abort`; other ranks with :attr:`StorageWriter.commits_copy` commit their
   node's copy with rank 0's manifest text.
5. ``*`` :meth:`StorageWriter.committed` on every rank; then the committers run
   :meth:`StorageWriter.retain`.

A load asks a :class:`StorageReader` to resolve a root or step dir to a committed step, list the
committed steps (for fallback), read the manifest and small files, check that the data files are
whole, and open a :class:`~elastor_ds.checkpoint.sources.ChunkSource` for byte-range reads.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from ...comm.collectives import Comm
from ..planning.manifest import Manifest
from ..sources import ChunkSource

if TYPE_CHECKING:
    from ..snapshot.file_staging import StagedFile
    from ..verify import Problem


@dataclass(frozen=True)
class Capabilities:
    """What a backend is, as typed fields (the engine branches on these, never on a backend's type)."""

    durable: bool           # a committed step survives a crash of the machine (files and dirs fsynced)
    node_local: bool        # each node has its own copy of every step under the root, not shared storage
    stages_in_place: bool   # the snapshot copy goes straight into the mapped data file (stage_data_file)
    # write_data_file takes live chunks (:class:`~elastor_ds.checkpoint.live.LiveSpan`) and reads
    # each piece under its gate's lock, so a save may read the live tensors until the fence
    writes_live: bool = False


class StorageWriter(abc.ABC):
    """The write half (see the module docstring for the order of the calls)."""

    root: str
    caps: Capabilities

    @property
    def commits_copy(self) -> bool:
        """This rank (not rank 0) commits its node's own copy of each step (node-local storage)."""
        return False

    @property
    def shares_manifest(self) -> bool:
        """Rank 0 sends the manifest text to the :attr:`commits_copy` ranks."""
        return False

    #: the top-most folder of ``root`` that :meth:`set_up` created on this rank (None: it was there)
    created: Optional[str] = None

    def remove_if_unused(self) -> None:
        """Remove the folders :meth:`set_up` created, bottom-up, each only while it is empty (a job
        rejected after set-up leaves nothing behind; never anything it did not create)."""
        if not self.created:
            return
        d = os.path.abspath(self.root)
        top = os.path.abspath(self.created)
        while True:
            try:
                os.rmdir(d)
            except OSError:
                return
            if d == top or not d.startswith(top + os.sep):
                self.created = None
                return
            d = os.path.dirname(d)

    @abc.abstractmethod
    def set_up(self, comm: Comm, keep: int) -> None:
        """Called once by the engine's constructor, on every rank (collective for some backends);
        ``keep``: committed steps retention keeps."""

    @abc.abstractmethod
    def temp_dir(self, step: int, nonce: str) -> str:
        """The directory this save's files go to before the commit (the same on every rank)."""

    @abc.abstractmethod
    def write_data_file(self, path: str, header: bytes, buffers: Sequence[memoryview], *, chunk_crcs: list[int],
                        block_crcs: list[list[int]], block_size: int) -> tuple[int, int]:
        """Write ``header`` then each buffer to ``path`` (making its directory); append each buffer's
        cumulative block CRCs and CRC; return (size, crc32 of the file). Raises OSError."""

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes) -> None:
        """Write a small file whole (making its directory). Raises OSError."""

    @abc.abstractmethod
    def seal_file(self, path: str) -> None:
        """A file written in place (through a mapping) is complete: make it as durable as the backend is."""

    def stage_data_file(self, tmp_dir: str, fname: str, header: bytes, size: int) -> "StagedFile":
        """Only with :attr:`Capabilities.stages_in_place`: ``tmp_dir/fname`` of ``size`` bytes,
        mapped, ``header`` written; the caller copies the data section into ``StagedFile.data``."""
        raise NotImplementedError(f"{type(self).__name__} does not stage in place (caps.stages_in_place is False)")

    def release_staged(self, staged: "StagedFile") -> None:
        """A staged file's save failed or was dropped (its temp dir is gone): drop its mapping."""

    @abc.abstractmethod
    def commit(self, tmp_dir: str, step: int, manifest_text: str) -> str:
        """Write the manifest into ``tmp_dir`` and make it step ``step`` atomically, then move
        ``latest``; return the committed step dir. Retention is separate (:meth:`retain`)."""

    def explain_write_error(self, tmp_dir: str, step: int, error: BaseException) -> BaseException:
        """The error a rank's write into ``tmp_dir`` raised, or a clearer one when the storage can
        tell what happened (shared storage: the temp dir removed by another writer)."""
        return error

    def check_written(self, tmp_dir: str, step: int, files: Iterable[str]) -> None:
        """Rank 0, just before :meth:`commit`: ``files`` (every file the ranks wrote, relative to
        ``tmp_dir``) are all there, else ``ConcurrentWriterError``. A no-op unless the storage can
        see every rank's files (shared storage)."""

    @abc.abstractmethod
    def abort(self, tmp_dir: str) -> None:
        """Remove a save's temp dir (a failed or dropped save); never raises."""

    def committed(self, step_dir: str) -> None:
        """Every rank, after a step committed (e.g. to know which retired files it may reuse)."""

    @abc.abstractmethod
    def retain(self, keep: int, protect: str, unusable: "frozenset[str]" = frozenset()) -> list[str]:
        """Delete committed steps beyond the newest ``keep`` and stale temp dirs, never ``protect``
        nor what ``latest`` names; return what was removed. ``unusable``: step dirs a load found
        corrupt, not counted among the newest ``keep``. Raises OSError."""

    def close(self, committer: bool) -> None:
        """The engine is finishing (no save in flight); ``committer``: rank 0 or :attr:`commits_copy`."""

    def drop_cache(self, committer: bool) -> None:
        """The program exits without the engine's ``finalize`` (e.g. an exception out of the training
        loop; the engine's exit handler calls this after its writer stopped): release what this
        backend holds only as a cache of this job (not collective; the other ranks may be gone or
        still running). Never a committed step: the relaunch restores from those."""


class StorageReader(abc.ABC):
    """The read half. Paths may lie outside the root (a load can name any root or step dir)."""

    @abc.abstractmethod
    def resolve(self, path: str) -> str:
        """The committed step dir that ``path`` (a step dir, or a root and its ``latest``) names;
        raises a :class:`~elastor_ds.errors.CheckpointError` saying why there is none."""

    @abc.abstractmethod
    def is_step(self, path: str) -> bool:
        """``path`` is a committed step dir."""

    @abc.abstractmethod
    def list_steps(self, root: str) -> list[tuple[int, str]]:
        """(step, step dir) of every committed step under ``root``, oldest first."""

    @abc.abstractmethod
    def read_manifest(self, step_dir: str) -> Manifest:
        """The manifest of a committed step (checked: every name it holds stays inside ``step_dir``)."""

    @abc.abstractmethod
    def read_text(self, step_dir: str, name: str) -> str:
        """A small file of the step (a rank state file)."""

    @abc.abstractmethod
    def check_files(self, step_dir: str, manifest: Manifest) -> None:
        """Every file the manifest lists is there with its size; else Incomplete/CorruptCheckpointError."""

    @abc.abstractmethod
    def verify_files(self, step_dir: str, names: Iterable[str], manifest: Manifest) -> "list[Problem]":
        """The whole-file CRC problems of ``names`` (empty: all good)."""

    @abc.abstractmethod
    def source(self, step_dir: str) -> ChunkSource:
        """A source of the step's files for byte-range reads (the reader closes it)."""


class Storage(StorageWriter, StorageReader):
    """Both halves: what :class:`~elastor_ds.checkpoint.engine.CheckpointEngine` takes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


def check_root(storage: Storage, root: str) -> Optional[str]:
    """A message when ``storage`` is not rooted at ``root`` (the engine refuses the pair), else None."""
    if os.path.abspath(storage.root) != os.path.abspath(root):
        return (f"storage {storage!r} is rooted at {storage.root}, the engine at {root}; construct the storage "
                f"with the engine's root")
    return None


def make_root_agreed(comm: Comm, root: str, what: str, create: bool, setting: Optional[str] = None,
                     given: Optional[str] = None) -> Optional[str]:
    """:func:`make_root` on every rank of ``comm`` (``create``: this rank makes it), its outcome
    agreed: when it failed on any rank, every rank raises the same typed error (a
    :class:`~elastor_ds.errors.ConfigError` naming the rank and the path) at once, instead of the
    ranks that succeeded waiting in the next collective for the one that raised alone. Collective
    (one tiny all-reduce; none on one rank). ``setting``/``given``: see :func:`make_root`."""
    def make() -> Optional[str]:
        return make_root(root, what, create=create, setting=setting, given=given)
    if comm.world_size <= 1:
        return make()
    from ...comm.collectives import agree
    return agree(comm, make, what=f"set-up of the {what} {root}")


def make_root(root: str, what: str = "checkpoint directory", create: bool = True, setting: Optional[str] = None,
              given: Optional[str] = None) -> Optional[str]:
    """``mkdir -p root`` (with ``create``; every rank checks, one creates), or
    :class:`~elastor_ds.errors.ConfigError` naming the path and the fix when it is a file, a link
    to nothing, lies under a file, or cannot be made (a user's path, not an internal error).
    ``setting``: the name of the setting the user wrote the path in (``elastor.checkpoint.dir``,
    ``--save``, ``checkpoint.dir``) and ``given`` its value as written; the error then starts with
    them and says what to set. Returns the top-most folder this call created, None when ``root``
    was there."""
    from ...errors import ConfigError
    root_abs = os.path.abspath(root)
    head = (f"{setting} {given if given is not None else root}: the {what} {root_abs}" if setting
            else f"{what} {root}")
    give = f"set {setting} to" if setting else "give"
    if os.path.islink(root) and not os.path.exists(root):   # a dangling link: mkdir would not follow it
        raise ConfigError(f"{head} is a symbolic link to {os.readlink(root)}, which does not exist; {give} an "
                          f"existing directory or a path to create (a link is not followed to make its target)")
    if os.path.lexists(root) and not os.path.isdir(root):
        raise ConfigError(f"{head} is a file, not a directory; {give} the path of a directory (it is created when "
                          f"absent)")
    if not create:
        return None
    missing = []   # the absent folders, top-most last
    d = root_abs
    while not os.path.lexists(d) and os.path.dirname(d) != d:
        missing.append(d)
        d = os.path.dirname(d)
    top = None   # the top-most folder this call's own mkdir made (one made meanwhile by another process is not)
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise NotADirectoryError(d) from None
                continue
            if top is None:
                top = d
        os.makedirs(root, exist_ok=True)   # raises if root exists as something else meanwhile
    except NotADirectoryError:
        comp = _file_in_path(root_abs)
        raise ConfigError(f"{head}: a component of the path is a file, not a directory"
                          + (f" ({comp})" if comp else "") + f"; {give} a directory path") from None
    except OSError as e:
        where = f" in {_nearest_dir(root_abs)}" if setting else ""
        raise ConfigError(f"{head}: cannot create it ({e.strerror or e}{where}); {give} a directory you may "
                          f"write") from None
    return top


def _nearest_dir(path: str) -> str:
    """The nearest folder of ``path`` (itself or an ancestor) that exists."""
    d = path
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    return d


def _file_in_path(path: str) -> Optional[str]:
    """The first component of ``path`` that exists and is not a directory, else None."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        d = os.sep.join(parts[:i])
        if os.path.lexists(d) and not os.path.isdir(d):
            return d
    return None
