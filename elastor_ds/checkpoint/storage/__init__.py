"""Storage backends: where a checkpoint engine's files go and how a step is committed.

:mod:`.base` is the interface (:class:`StorageWriter`, :class:`StorageReader`, :class:`Storage`,
:class:`Capabilities`); :mod:`.posix` is shared storage (fsync, directory fsync, rename commit);
:mod:`.tmpfs` is a node's memory (no fsync, node-local copies, in-place staging). A new backend is
a new module here; the engine takes it as ``CheckpointEngine(root, comm, storage=...)``.
"""
from .base import Capabilities, Storage, StorageReader, StorageWriter
from .posix import PosixStorage
from .tmpfs import TmpfsStorage

__all__ = ["Capabilities", "Storage", "StorageReader", "StorageWriter", "PosixStorage", "TmpfsStorage"]
