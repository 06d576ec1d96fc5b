"""Conversions between an elastor checkpoint and a consolidated (unsharded) safetensors directory.

The format is layout-free, so converting between *layouts* needs no converter (load under the new
layout). This module handles *formats*, one tensor at a time (never the whole model in RAM):

* ``to_consolidated(src, dst)``: ``model.safetensors`` (every tensor whose name does not start with
  ``optimizer.``) and ``optimizer.safetensors`` (the rest, when present), full tensors under their
  saved names -- the canonical form, i.e. what megatron-core holds at TP=1 -- plus
  ``elastor_metadata.json`` (step, extra state, model and source layout).
* ``from_consolidated(src, dst_root)``: the reverse, written as a committed elastor checkpoint by
  :func:`write_single_writer_checkpoint`, which other importers (DeepSpeed, Megatron) reuse.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from tqdm import tqdm

from .settings import DEFAULT_KEEP
from .crc import crc32
from ..errors import CheckpointError, CheckpointNotFoundError
from ..layout.region import Region
from . import commit as commit_mod
from .reader import read_shards
from .paths import check_tensor_name, read_regular_text
from ..user_json import strict_json
from .planning.manifest import DTYPE_SIZES, INT64_MAX, Chunk, FileEntry, Manifest, TensorEntry
from .shards import dtype_name, full_shard
from .fileformat import EntrySpec, build_header, fsync_dir, write_stream

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
META_FILE = "elastor_metadata.json"
OPTIM_PREFIX = "optimizer."


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _stream_tensors(path: str, names: Sequence[str], shapes: Mapping[str, tuple], dtypes: Mapping[str, str],
                    get: Callable[[str], torch.Tensor], progress: bool, metadata: Optional[dict] = None):
    """Write a safetensors file tensor by tensor; return ({name: (offset, length, crc)}, size, crc)."""
    entries = [EntrySpec(n, dtypes[n], tuple(shapes[n]), _numel(shapes[n]) * DTYPE_SIZES[dtypes[n]]) for n in names]
    header, rel = build_header(entries, metadata)
    info: dict[str, tuple[int, int, int]] = {}
    bar = tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc=os.path.basename(path),
               disable=None if progress else True)   # None: a bar only on a terminal

    def gen():
        for e, off in zip(entries, rel):
            t = get(e.key).contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else memoryview(b"")
            info[e.key] = (len(header) + off, e.nbytes, crc32(raw))
            bar.update(e.nbytes)
            yield raw
    size, crc = write_stream(path, header, gen())
    bar.close()
    return info, size, crc


def to_consolidated(src: str, dst: str, progress: bool = True, names: Optional[Iterable[str]] = None) -> str:
    """Export (a :class:`~.commit.DirCommit`: ``dst`` must be absent or empty; a failure leaves nothing)."""
    step_dir = commit_mod.resolve(src)
    man = commit_mod.read_manifest(step_dir)
    wanted = sorted(man.tensors) if names is None else sorted(names)
    from .verify import require_coverage
    require_coverage(man, step_dir, [n for n in wanted if n in man.tensors])
    groups = {MODEL_FILE: [n for n in wanted if not n.startswith(OPTIM_PREFIX)],
              OPTIM_FILE: [n for n in wanted if n.startswith(OPTIM_PREFIX)]}

    def get(name: str) -> torch.Tensor:
        e = man.tensors[name]
        t = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        read_shards(step_dir, man, [full_shard(name, t)])
        return t
    try:
        _write_consolidated(dst, step_dir, man, groups, get, progress)
    except OSError as e:   # a full disk, a permission: name the destination, not only the errno
        raise OSError(e.errno, f"{e.strerror or e} (exporting {step_dir} to {dst})") from e
    log.info("wrote consolidated checkpoint of step %d to %s", man.step, dst)
    return dst


def _write_consolidated(dst: str, step_dir: str, man: Manifest, groups: Mapping[str, list], get: Callable,
                        progress: bool) -> None:
    with commit_mod.DirCommit.create(dst) as out:
        for fname, ns in groups.items():
            if ns:
                _stream_tensors(os.path.join(out.path, fname), ns, {n: man.tensors[n].shape for n in ns},
                                {n: man.tensors[n].dtype for n in ns}, get, progress,
                                {"format": "pt", "source": "elastor", "step": str(man.step)})
        meta = {"step": man.step, "extra": dict(man.extra), "model": man.model, "layout": man.layout,
                "source": step_dir, "format_version": man.format_version}
        with open(os.path.join(out.path, META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        out.finalize()


def check_import_step(step: int, where: str) -> int:
    """An imported step as an elastor checkpoint holds it: 0..2**63-1 (what every manifest reader
    accepts); else :class:`CheckpointError` naming ``where`` (the file or directory it came from)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT64_MAX:
        shown = str(step) if len(str(step)) <= 40 else str(step)[:40] + "..."
        raise CheckpointError(f"{where}: step {shown} is not an integer in 0..2**63-1 (an elastor checkpoint's "
                              f"steps are 64-bit); nothing was imported")
    return step


def write_single_writer_checkpoint(root: str, step: int, names: Sequence[str], shapes: Mapping[str, tuple],
                                   dtypes: Mapping[str, str], get: Callable[[str], torch.Tensor],
                                   extra: Optional[Mapping[str, Any]] = None, model: Any = None,
                                   layout: Any = None, keep: int = DEFAULT_KEEP, progress: bool = True,
                                   force: bool = False) -> str:
    """Commit a checkpoint written by one process, streaming tensor by tensor (importers use this).

    An import: ``root`` must be absent or empty unless ``force`` (then it must be an elastor root
    without ``step``); ``latest`` only moves forward and no retention runs (``keep`` is ignored)."""
    check_import_step(step, f"import into {root}")
    commit_mod.check_import_destination(root, step, force)
    for n in names:
        check_tensor_name(n)
    made_root = not os.path.lexists(root)
    try:
        return _write_single(root, step, names, shapes, dtypes, get, extra, model, layout, progress)
    except OSError as e:   # a full disk, a permission: name the destination, not only the errno
        raise OSError(e.errno, f"{e.strerror or e} (importing into {root})") from e
    finally:
        if made_root and not os.path.exists(os.path.join(root, commit_mod.LATEST)):
            try:
                os.rmdir(root)   # it was made for this import, which failed: only if empty (nothing else deleted)
            except OSError:
                pass


def _write_single(root: str, step: int, names: Sequence[str], shapes: Mapping[str, tuple],
                  dtypes: Mapping[str, str], get: Callable[[str], torch.Tensor], extra: Optional[Mapping[str, Any]],
                  model: Any, layout: Any, progress: bool) -> str:
    fname = "data_00000.safetensors"
    with commit_mod.StepCommit.create(root, step, commit_mod.import_nonce(), latest=commit_mod.LatestPolicy.FORWARD,
                                      check=True) as c:
        info, size, crc = _stream_tensors(os.path.join(c.path, fname), names, shapes, dtypes, get, progress)
        fsync_dir(c.path)
        tensors = {}
        for n in names:
            off, length, ccrc = info[n]
            tensors[n] = TensorEntry(n, tuple(shapes[n]), dtypes[n],
                                     (Chunk(fname, n, Region.full(shapes[n]), off, length, ccrc),))
        man = Manifest(step=step, tensors=tensors, files={fname: FileEntry(fname, size, crc, 0)}, layout=layout,
                       model=model, extra=dict(extra or {}), world_size=1, created_unix=time.time())
        return c.finalize(man, retention=False)


def from_consolidated(src: str, dst_root: str, progress: bool = True, force: bool = False) -> str:
    from safetensors import safe_open

    model_path = os.path.join(src, MODEL_FILE)
    if not os.path.isfile(model_path):
        raise CheckpointNotFoundError(f"{src} has no {MODEL_FILE}: a consolidated checkpoint is a directory with "
                                      f"{MODEL_FILE} (and optionally {OPTIM_FILE})")
    meta = _read_metadata(src)
    handles = {}
    owner: dict[str, str] = {}
    shapes, dtypes = {}, {}
    for fname in (MODEL_FILE, OPTIM_FILE):
        p = os.path.join(src, fname)
        if not os.path.lexists(p):
            continue
        if os.path.islink(p) or not os.path.isfile(p):   # a name is never followed out of the checkpoint
            raise CheckpointError(f"{p} is not a regular file (a link or a special file): a consolidated checkpoint "
                                  f"holds its {fname} itself")
        try:   # untrusted input: safetensors checks the header; say which file it refused
            h = safe_open(p, framework="pt")
            keys = list(h.keys())
            for k in keys:
                sl = h.get_slice(k)
                shapes[k] = tuple(sl.get_shape())
                dtypes[k] = dtype_name(_st_dtype(sl.get_dtype()))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError, a bad dtype, an unreadable file
            raise CheckpointError(f"{p} is not a readable safetensors file ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'})") from None
        handles[fname] = h
        for k in keys:
            if k in owner:
                raise CheckpointError(f"tensor {k} appears in both {owner[k]} and {fname}")
            owner[k] = fname
    names = sorted(owner)
    return write_single_writer_checkpoint(dst_root, meta["step"], names, shapes, dtypes,
                                          lambda n: handles[owner[n]].get_tensor(n), meta.get("extra"),
                                          meta.get("model"), meta.get("layout"), progress=progress,
                                          force=force)


MAX_META_BYTES = 64 << 20   # elastor_metadata.json: the step, the trainer's JSON state, the model and layout


def _read_metadata(src: str) -> dict:
    """``elastor_metadata.json`` of a consolidated directory, checked (untrusted input)."""
    p = os.path.join(src, META_FILE)
    if not os.path.lexists(p):
        return {"step": 0}
    try:   # a regular file, not through a link, bounded; strict JSON (no NaN), no deep nesting
        meta = strict_json(read_regular_text(p, MAX_META_BYTES, nofollow=True))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{p} is not readable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p} holds a {type(meta).__name__}, expected a JSON object")
    step = meta.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{p}: step {step!r} is not a non-negative integer")
    check_import_step(step, p)
    for k in ("extra", "model", "layout"):
        if meta.get(k) is not None and not isinstance(meta[k], dict):
            raise CheckpointError(f"{p}: {k!r} holds a {type(meta[k]).__name__}, expected a JSON object or null")
    return meta


def _st_dtype(code: str) -> torch.dtype:
    from .planning.manifest import CODE_DTYPES
    if code not in CODE_DTYPES:
        raise CheckpointError(f"safetensors dtype {code!r} is not one elastor checkpoints hold "
                              f"({', '.join(sorted(CODE_DTYPES))})")
    return getattr(torch, CODE_DTYPES[code])
