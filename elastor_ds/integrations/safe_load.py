"""Load other frameworks' pickled checkpoint files without running code stored in them.

DeepSpeed (``*_model_states.pt``, ``*_optim_states.pt``, universal ``zero/*/*.pt``) and Megatron
(``model_optim_rng.pt``, torch_dist ``common.pt`` and DCP's pickled ``.metadata``) store Python
objects with pickle, and a crafted file runs arbitrary code when fully unpickled. By default:

* ``.pt`` files load with ``torch.load(weights_only=True)`` plus :data:`ALLOWED_GLOBALS`, the
  few non-tensor types these formats hold (checked on files written by deepspeed 0.19.8 and
  megatron-core 0.16.1: DeepSpeed's ``fragment_address``, ``ZeroStageEnum``, ``LossScaler``;
  Megatron-LM's ``args`` namespace and its enums);
* DCP ``.metadata`` loads with a restricted unpickler that knows only DCP's metadata classes,
  and every storage file it names must lie inside the checkpoint directory.

Anything else raises :class:`~elastor_ds.errors.UnsafeCheckpointError` naming the type and the
fix: ``--trust-checkpoint`` (``trust=True``), which fully unpickles after a logged warning.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import logging
import os
import pickle
import re
from typing import Any

import torch

from ..checkpoint.paths import open_regular, safe_join
from ..errors import UnsafeCheckpointError

log = logging.getLogger(__name__)

TRUST_HINT = "rerun with --trust-checkpoint only if you trust where this checkpoint comes from"

# (module, qualified name) of the non-tensor types DeepSpeed / Megatron checkpoints need
_ALLOWED_NAMES = (
    ("argparse", "Namespace"),
    ("collections", "OrderedDict"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
)


def _resolve(module: str, name: str) -> Any:
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def allowed_globals() -> list[Any]:
    """The allow-list as objects (types of packages that are not installed are skipped)."""
    out: list[Any] = [argparse.Namespace, collections.OrderedDict]
    for module, name in _ALLOWED_NAMES:
        obj = _resolve(module, name)
        if callable(obj) and obj not in out:
            out.append(obj)
    try:  # numpy scalar dtypes (Megatron-LM's rng_state holds numpy arrays)
        import numpy as np
        out += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32", "bool")]
    except ImportError:
        pass
    return out


_UNSUPPORTED_RE = re.compile(r"(Unsupported global: GLOBAL [^\s]+|Unsupported operand [^\s]+|"
                             r"Trying to call reduce for [^\s]+|Can only build Tensor[^.]*)")


def load_pt(path: str, trust: bool = False, mmap: bool = False) -> Any:
    """``torch.load`` of an untrusted ``.pt`` file (see the module docstring). Opened first as a
    regular file, not through a link (a FIFO planted under the name would block ``torch.load`` for
    ever), and read through that descriptor."""
    fd = open_regular(path, nofollow=True)
    try:
        src: Any = f"/proc/self/fd/{fd}" if mmap and os.path.isdir("/proc/self/fd") else os.fdopen(os.dup(fd), "rb")
        try:
            if trust:
                log.warning("--trust-checkpoint: fully unpickling %s; this runs any code stored in the file", path)
                return torch.load(src, map_location="cpu", weights_only=False, mmap=mmap)
            return _load_weights_only(path, src, mmap)
        finally:
            if not isinstance(src, str):
                src.close()
    finally:
        os.close(fd)


def _load_weights_only(path: str, src: Any, mmap: bool) -> Any:
    # only what is not registered yet: torch's context manager removes on exit every global it was
    # given, also one the process had registered before (megatron-core registers argparse.Namespace at
    # import), after which the process's own loads of such files failed
    registered = torch.serialization.get_safe_globals()
    extra = [g for g in allowed_globals() if g not in registered]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = _UNSUPPORTED_RE.search(str(e))
        what = m.group(1) if m else str(e).splitlines()[0][:200]
        raise UnsafeCheckpointError(f"{path} needs a type outside the safe allow-list ({what}); refusing to "
                                    f"unpickle it: {TRUST_HINT}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise UnsafeCheckpointError(f"{path} is not a readable torch checkpoint ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


# ---------------------------------------------------------------------------------- DCP metadata
_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    (_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                         "TensorWriteData")
     } | {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),   # a checkpoint_id torch's own writer records
          ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"DCP metadata refers to {module}.{name}, which is not a DCP metadata type; "
                                    f"refusing to unpickle it: {TRUST_HINT}")


def load_dcp_metadata(path: str, trust: bool = False) -> Any:
    """A DCP ``.metadata`` file, unpickled with only DCP's metadata classes allowed (a regular file,
    not through a link: a FIFO would block for ever)."""
    with os.fdopen(open_regular(path, nofollow=True), "rb") as f:
        if trust:
            log.warning("--trust-checkpoint: fully unpickling %s; this runs any code stored in the file", path)
            return pickle.load(f)
        try:
            return _DcpMetadataUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed pickle is a corrupt checkpoint
            raise UnsafeCheckpointError(f"{path} is not a readable DCP metadata file ({type(e).__name__}: "
                                        f"{str(e)[:200]})") from None


def dcp_failure(e: BaseException) -> "BaseException | None":
    """The first error inside torch's ``CheckpointException`` (its ``failures`` map each rank to
    an ``(exception, traceback)`` pair), or None."""
    for v in (getattr(e, "failures", None) or {}).values():
        exc = v[0] if isinstance(v, tuple) and v else v
        if isinstance(exc, BaseException):
            return exc
    return None


def raise_dcp_failure(e: BaseException, what: str) -> None:
    """Re-raise what torch's ``CheckpointException`` ``e`` wraps: a stop (KeyboardInterrupt,
    SystemExit, a termination signal's exception) and elastor's own errors as themselves; anything
    else as :class:`CheckpointError` "``what`` failed (<inner error>)"."""
    from ..errors import CheckpointError, ElastorError
    inner = dcp_failure(e)
    if inner is not None and (not isinstance(inner, Exception) or isinstance(inner, ElastorError)):
        raise inner from None
    detail = (f"{type(inner).__name__}: {str(inner).splitlines()[0][:300] if str(inner) else 'no detail'}"
              if inner is not None else str(e).splitlines()[0][:300])
    raise CheckpointError(f"{what} failed ({detail})") from None


def safe_dcp_reader(directory: str, trust: bool = False):
    """A ``FileSystemReader`` for ``directory`` whose metadata loads through
    :func:`load_dcp_metadata` and whose storage files all lie inside ``directory`` and are opened
    as regular files, never through a link (a FIFO would block the read for ever)."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    class _RegularFiles(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str):
            if mode != "rb":   # a reader writes nothing
                raise UnsafeCheckpointError(f"{path}: the checkpoint reader does not open files for {mode!r}")
            with os.fdopen(open_regular(os.fspath(path), nofollow=True), "rb") as stream:
                yield stream

    class _Reader(FileSystemReader):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.fs = _RegularFiles()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = os.path.join(directory, ".metadata" if kwargs.get("rank") is None
                                else f"__{kwargs['rank']}.metadata")
            md = load_dcp_metadata(path, trust)
            if not isinstance(md, Metadata):
                raise UnsafeCheckpointError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
            if not trust:
                # the allowed classes may still carry any attributes a crafted pickle gives them (a
                # bytes entry dressed up with a tensor's size and dtype): each entry must be exactly
                # one of the two kinds, with its own fields only
                for key, v in (md.state_dict_metadata or {}).items():
                    kind = type(v)
                    if kind not in (TensorStorageMetadata, BytesStorageMetadata) or \
                            not set(vars(v)) <= {f.name for f in dataclasses.fields(kind)}:
                        raise UnsafeCheckpointError(f"{path}: entry {str(key)[:120]!r} is not a plain DCP tensor or "
                                                    f"bytes record; refusing it: {TRUST_HINT}")
            for info in (md.storage_data or {}).values():
                safe_join(directory, getattr(info, "relative_path", None), what="DCP storage file",
                          allow_subdirs=True)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            # a DCP "bytes" item is read back with torch.load(weights_only=False): pickled objects
            # run code. Only tensors are read from a checkpoint that is not trusted
            if not trust:
                from torch.distributed.checkpoint.planner import LoadItemType
                if any(getattr(r, "type", None) == LoadItemType.BYTE_IO for r in plan.items):
                    raise UnsafeCheckpointError(f"{directory}: the load would unpickle an object stored in the "
                                                f"checkpoint (a DCP bytes record); refusing: {TRUST_HINT}")
            return super().read_data(plan, planner)

    return _Reader(directory)
