"""TensorShard: a view of local memory that holds one region of a global tensor.

This is the engine's whole interface to model state: save takes shards to read from, load takes
shards to fill in place. Helpers build shards from a local tensor and its TP pieces, and from a
ZeRO flat partition (see :mod:`elastor_ds.layout.zero`).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import operator
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import ShardingError
from ..layout.region import Piece, Region
from ..layout.zero import flat_partition_pieces


@dataclass
class TensorShard:
    name: str
    shape: tuple[int, ...]   # global shape
    region: Region           # the part of the global tensor this shard holds
    tensor: torch.Tensor     # view with shape == region.sizes (may be non-contiguous)

    def __post_init__(self) -> None:
        if not isinstance(self.region, Region):
            raise TypeError(f"shard {self.name}: region must be a Region (got {type(self.region).__name__}); "
                            f"Region.full(shape) for a whole tensor")
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"shard {self.name}: tensor must be a torch.Tensor (got {type(self.tensor).__name__})")
        self.shape = _global_shape(self.name, self.shape)
        if len(self.shape) != self.region.ndim:
            raise ShardingError(f"shard {self.name}: region {self.region} has {self.region.ndim} dimension(s), the "
                                f"global shape {self.shape} has {len(self.shape)}; give the region one offset and one "
                                f"size per dimension of the shape (Region.full(shape) for a whole tensor)")
        if tuple(self.tensor.shape) != tuple(self.region.sizes):
            raise ValueError(f"shard {self.name}: tensor shape {tuple(self.tensor.shape)} != region sizes "
                             f"{self.region.sizes}")


def _global_shape(name: str, shape: object) -> tuple[int, ...]:
    """A shard's global shape as ints: each dimension an integer >= 0 (numpy and torch integers
    too); a float (4.7) is refused, not truncated."""
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        out = tuple(map(_dim, shape))   # type: ignore[call-overload]
    except TypeError:
        raise ShardingError(f"shard {name}: global shape {shape!r} must be a sequence of integers >= 0 (e.g. "
                            f"tuple(tensor.shape))") from None
    if any(d < 0 for d in out):
        raise ShardingError(f"shard {name}: global shape {shape!r} has a negative size")
    return out


def _dim(d: object) -> int:
    if isinstance(d, bool):
        raise TypeError
    return operator.index(d)   # type: ignore[arg-type]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def region_view(t: torch.Tensor, box: Region) -> torch.Tensor:
    """``t[box]`` as a view."""
    if box.ndim == 0:
        return t
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]


def shards_from_pieces(name: str, shape: Sequence[int], local: torch.Tensor,
                       pieces: Sequence[Piece]) -> list[TensorShard]:
    """One shard per TP piece of ``local`` (the rank's local tensor)."""
    return [TensorShard(name, tuple(shape), p.global_, region_view(local, p.local)) for p in pieces]


def shards_from_flat(names: Sequence[str], shapes: Sequence[Sequence[int]],
                     local_shapes: Sequence[Sequence[int]], pieces: Sequence[Sequence[Piece]],
                     flat: torch.Tensor, start: int, end: int) -> list[TensorShard]:
    """Shards for a ZeRO partition: ``flat`` holds elements ``[start, end)`` of the concatenation
    of the flattened local params (``local_shapes``) named ``names``."""
    if flat.numel() != end - start:
        raise ValueError(f"flat partition has {flat.numel()} elements, expected {end - start}")
    out = []
    for fp in flat_partition_pieces(local_shapes, pieces, start, end):
        view = flat[fp.flat_offset: fp.flat_offset + fp.global_.numel].view(fp.global_.sizes)
        out.append(TensorShard(names[fp.param_index], tuple(shapes[fp.param_index]), fp.global_, view))
    return out


def full_shard(name: str, t: torch.Tensor) -> TensorShard:
    """The whole tensor (a replicated or unsharded tensor)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"full_shard({name!r}, ...): expected a torch.Tensor, got {type(t).__name__}")
    return TensorShard(name, tuple(t.shape), Region.full(t.shape), t)


def conflicting_duplicate(shards: Sequence[TensorShard]) -> "str | None":
    """A message when two shards of one rank claim the same region of one tensor from different
    memory (the save would keep one of them and drop the other silently); None otherwise. The same
    view given twice (a tied weight passed under one name twice) is fine."""
    seen: dict[tuple, TensorShard] = {}
    for s in shards:
        first = seen.setdefault((s.name, s.region), s)
        if first is s:
            continue
        if not _same_view(first.tensor, s.tensor):
            return (f"tensor {s.name}: this rank gives region {s.region} twice, from two different tensors; only one "
                    f"could be saved. Give each tensor a name of its own, or pass the shard once")
    return None


_ALIAS_WORK = 1 << 20   # numpy's overlap solver: enough for any pair of strided views seen in practice
_TooHard = getattr(getattr(np, "exceptions", np), "TooHardError")


def aliased_destinations(shards: Sequence[TensorShard]) -> "str | None":
    """A message when two destination shards of a load share memory (a load writes one, then
    checks the bytes it wrote while the other overwrites them: it would read as a corrupt
    checkpoint); None otherwise. Column slices of one tensor interleave without sharing an element
    and are fine; so is one view given twice under the same name and region (both writes are the
    same bytes). Views are compared by their byte extents, exactly when both are contiguous; two
    strided views whose extents meet go to numpy's exact overlap solver."""
    spans: dict[tuple, list] = {}
    for s in shards:
        t = s.tensor
        if t.numel() == 0:
            continue
        if t.device.type == "meta":
            return f"destination shard {s.name} {s.region} is a meta tensor: it holds no memory to load into"
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            return (f"destination shard {s.name} {s.region} is an expanded view (a stride of 0): its elements share "
                    f"memory; load into a tensor of its own (.clone() it)")
        lo = t.data_ptr()
        hi = lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((lo, hi, s))
    for items in spans.values():
        items.sort(key=lambda x: x[0])
        active: list = []
        for lo, hi, s in items:
            active = [a for a in active if a[1] > lo]
            for _, _, other in active:
                if (other.name, other.region) == (s.name, s.region) and _same_view(other.tensor, s.tensor):
                    continue   # one tensor given twice under its name (a master that is the weight): same bytes
                if _share_elements(other.tensor, s.tensor):
                    return (f"destination shards {other.name} {other.region} and {s.name} {s.region} share memory; a "
                            f"load fills each destination once: give each shard its own tensor (or views that do not "
                            f"overlap)")
            active.append((lo, hi, s))
    return None


def read_only_destination(shards: Sequence[TensorShard]) -> "str | None":
    """A message when a destination shard of a load lies in memory this process may not write (a
    read-only mapping: ``torch.frombuffer`` over ``mmap(prot=PROT_READ)``); None otherwise. A read
    into it fails with EFAULT, and a copy into it (a strided or cast shard) kills the process with
    SIGSEGV. Memory torch allocated (a resizable storage) is writable; of the rest (``frombuffer``,
    ``from_numpy``, mapped files) the first byte of each CPU shard (each page once) goes through a
    pipe back onto itself, unchanged, which the kernel refuses with EFAULT where the page is
    read-only."""
    pages: set[int] = set()
    r = w = -1
    try:
        for s in shards:
            t = s.tensor
            if t.device.type != "cpu" or t.numel() == 0 or t.untyped_storage().resizable():
                continue
            ptr = t.data_ptr()
            if ptr // mmap.PAGESIZE in pages:
                continue
            pages.add(ptr // mmap.PAGESIZE)
            if r < 0:
                r, w = os.pipe()
            os.write(w, ctypes.string_at(ptr, 1))
            try:
                os.readv(r, [(ctypes.c_char * 1).from_address(ptr)])
            except OSError as e:
                if e.errno != errno.EFAULT:
                    raise
                return (f"destination shard {s.name} {s.region} lies in read-only memory (e.g. torch.frombuffer over "
                        f"a read-only mmap): a load cannot fill it; load into a writable tensor (.clone() it)")
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    return None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements of the same memory, read the same way."""
    return (a.device, a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.device, b.data_ptr(), b.shape, b.stride(), b.dtype)


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views whose byte extents meet share a byte. Contiguous views: yes. Strided
    ones: numpy's exact overlap solver on their shapes and strides (no element is read, any
    device); a case it cannot settle within :data:`_ALIAS_WORK` is left to the load (a write over
    another shard then fails its check)."""
    if a.is_contiguous() and b.is_contiguous():
        return True   # contiguous byte ranges that meet
    try:
        return bool(np.shares_memory(_layout_only(a), _layout_only(b), max_work=_ALIAS_WORK))
    except _TooHard:
        return False


class _Layout:
    """An object numpy reads a tensor's address, shape and byte strides from (the array interface)."""

    def __init__(self, t: torch.Tensor):
        es = t.element_size()
        self.__array_interface__ = {"shape": tuple(t.shape), "typestr": f"|V{es}", "data": (t.data_ptr(), False),
                                    "strides": tuple(st * es for st in t.stride()), "version": 3}


def _layout_only(t: torch.Tensor) -> np.ndarray:
    """A numpy array over ``t``'s memory, built from its layout alone and never read."""
    return np.asarray(_Layout(t))
