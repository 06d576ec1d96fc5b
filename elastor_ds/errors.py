"""Typed exceptions of elastor_ds. Every message names the offending values and says the fix."""
from __future__ import annotations


class ElastorError(Exception):
    """Base class of every error elastor_ds raises on purpose."""


class LayoutError(ElastorError, ValueError):
    """A parallel layout (or plan JSON) is invalid."""


class ShardingError(ElastorError, ValueError):
    """A tensor's sharding rule does not fit its shape or the TP degree."""


class ConfigError(ElastorError, ValueError):
    """A config section or CLI argument is invalid."""


class PlanningError(ElastorError, ValueError):
    """No feasible plan exists for the inputs."""


class CheckpointError(ElastorError):
    """Base class of checkpoint read/write errors."""


class LiveStateChangedError(CheckpointError):
    """A saved tensor changed in place while a live-writing save still read it (no fence before
    the change); the save is dropped on every rank."""


class ConcurrentWriterError(CheckpointError):
    """Another writer (a second job or engine) removed a save's files in the same checkpoint root."""


class StoppedEarly(BaseException):
    """SIGTERM or SIGINT while ``elastor run`` sets up (imports, checks, the wait for the store): no
    worker has started, so there is nothing to checkpoint (control flow, not an error)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class SnapshotSpaceError(CheckpointError):
    """A memory snapshot did not fit in its node's memory folder (tmpfs full, or over quota): the
    snapshot is dropped and training goes on (storage checkpoints are the durable tier)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was expected."""


class IncompleteCheckpointError(CheckpointError):
    """A directory lacks its manifest or a data file: it was never committed."""


class CorruptCheckpointError(CheckpointError):
    """A data file's checksum or size does not match the manifest."""


class UnreadableCheckpointError(CheckpointError, PermissionError):
    """This process may not read a checkpoint's directory or file (permissions): nothing is known
    to be wrong with the checkpoint itself."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint names a path outside its directory, or needs unpickling that was not trusted."""


class DestinationNotEmptyError(ConfigError):
    """A conversion's destination holds data; nothing is overwritten unless asked explicitly."""


class ManifestError(CorruptCheckpointError, ValueError):
    """A manifest is not valid JSON, fails its checksum, or breaks the schema (names the field)."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written by a format version this reader does not know."""


class TensorMismatchError(CheckpointError, ValueError):
    """A requested tensor is missing, or its shape/dtype differs from the checkpoint's."""


class CollectiveError(ElastorError, RuntimeError):
    """A collective failed on some rank; raised on every rank."""


class TransportError(CollectiveError):
    """A point-to-point transfer (:mod:`elastor_ds.comm.transport`) failed on this rank: the peer
    left, the connection broke, or the transport already failed earlier. Raised on this rank only."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A transfer did not complete within its timeout (the peer never sent, or never received)."""


# ------------------------------------------------------------------ errors gathered from every rank
class RankFailure:
    """What one rank raised: its exception's class name, message, and the names of its classes."""

    __slots__ = ("rank", "type_name", "message", "mro")

    def __init__(self, rank: int, type_name: str, message: str, mro: tuple[str, ...] = ()):
        self.rank, self.type_name, self.message, self.mro = rank, type_name, message, tuple(mro) or (type_name,)

    @staticmethod
    def of(rank: int, e: BaseException) -> "RankFailure":
        if isinstance(e, RanksFailedError):  # already gathered elsewhere: keep the original type
            e = e.original() or e
        return RankFailure(rank, type(e).__name__, str(e), tuple(c.__name__ for c in type(e).__mro__))

    def to_wire(self) -> tuple:
        """Plain strings only: safe to send through a pickling collective."""
        return (self.rank, self.type_name, self.message, self.mro)

    @staticmethod
    def from_wire(t: tuple) -> "RankFailure":
        return RankFailure(int(t[0]), str(t[1]), str(t[2]), tuple(str(x) for x in t[3]))

    def is_a(self, cls: type) -> bool:
        return cls.__name__ in self.mro

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"

    def __repr__(self) -> str:
        return f"RankFailure({self.rank}, {self.type_name!r}, {self.message[:60]!r})"


class RanksFailedError(CollectiveError):
    """An operation failed on some ranks; raised on every rank with each failing rank's exception
    class and message (``failures``). When every failing rank raised the same elastor error type,
    the raised object is also an instance of that type (see :func:`ranks_failed`)."""

    def __init__(self, message: str, failures: "list[RankFailure] | None" = None, what: str = ""):
        super().__init__(message)
        self.failures: list[RankFailure] = list(failures or [])
        self.what = what

    def all_are(self, *classes: type) -> bool:
        return bool(self.failures) and all(any(f.is_a(c) for c in classes) for f in self.failures)

    def original(self) -> "BaseException | None":
        return getattr(self, "_original", None)


class PeerFailedError(RanksFailedError):
    """A peer died or stopped answering during a checkpoint collective (detected within the
    configured timeout)."""


class AsyncSaveError(CheckpointError, RanksFailedError):
    """A background save failed on some rank; raised on every rank, listing each failing rank's
    exception class and message (``failures``)."""


_COMBINED: dict = {}


def _error_classes() -> dict[str, type]:
    return {n: c for n, c in globals().items() if isinstance(c, type) and issubclass(c, ElastorError)}


#: what a user must act on, never a bug: a flag, plan or folder to change, or a checkpoint whose
#: contents cannot be used (corrupt, incomplete, unreadable, unsafe, of an unknown format, or not
#: matching the model): one line, not a traceback. Not here: a save that failed in the background, a
#: live tensor changed mid-save, another writer in the same root, every other exception.
USER_ERRORS: "tuple[type[BaseException], ...]" = (ConfigError, CheckpointNotFoundError, CorruptCheckpointError,
                                                  IncompleteCheckpointError, UnreadableCheckpointError,
                                                  UnsafeCheckpointError, FormatVersionError, TensorMismatchError)


def ranks_failed(what: str, failures: "list[RankFailure]", world_size: int,
                 base: type = RanksFailedError) -> RanksFailedError:
    """One error for ``failures`` gathered from every rank: a ``base`` (RanksFailedError) that is
    also the most specific elastor error class common to every failure (so ``except
    CorruptCheckpointError`` still works), listing each rank's class and message."""
    failures = sorted(failures, key=lambda f: f.rank)
    shown = "; ".join(str(f) for f in failures[:8]) + (f"; ... {len(failures) - 8} more" if len(failures) > 8 else "")
    msg = f"{what} failed on {len(failures)} of {world_size} ranks: {shown}"
    known = _error_classes()
    common = None
    if failures:
        names = [n for n in failures[0].mro if n in known]
        for n in names:  # most specific first
            if all(n in f.mro for f in failures) and not issubclass(known[n], CollectiveError):
                common = known[n]
                break
    cls = base
    if common is not None and common is not ElastorError and not issubclass(base, common):
        key = (common, base)
        cls = _COMBINED.get(key)  # type: ignore[arg-type]
        if cls is None:
            cls = type(common.__name__, (common, base), {"__module__": __name__,
                                                         "__doc__": f"{common.__name__} gathered from ranks"})
            _COMBINED[key] = cls  # type: ignore[index]
    err = cls.__new__(cls)
    RanksFailedError.__init__(err, msg, failures, what)
    return err
