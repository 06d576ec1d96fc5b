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


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was expected."""


class IncompleteCheckpointError(CheckpointError):
    """A directory lacks its manifest or a data file: it was never committed."""


class CorruptCheckpointError(CheckpointError):
    """A data file's checksum or size does not match the manifest."""


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


class AsyncSaveError(CheckpointError):
    """A background save failed on some rank; raised on every rank."""


class CollectiveError(ElastorError, RuntimeError):
    """A collective failed on some rank; raised on every rank."""
