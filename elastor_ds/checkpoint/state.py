"""Extra training state that travels with a checkpoint: RNG states and JSON-safe encoding.

Per-rank RNG state (python ``random``, numpy, torch CPU and, when present, CUDA) is captured as a
JSON-safe dict and written to the rank's own state file; global state (iteration, consumed
samples, LR scheduler, user metadata) goes in the manifest.
"""
from __future__ import annotations

import array
import base64
import binascii
import logging
import math
import random
import sys
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _words_b64(words: Any) -> str:
    """Mersenne-Twister words (624 key words + position for python, 624 for numpy) as base64 of
    little-endian uint32: one JSON string in place of 600+ numbers, which took the writer ~4x
    longer to print on every snapshot (a snapshot every iteration pays it every step)."""
    if isinstance(words, np.ndarray):
        return base64.b64encode(words.astype("<u4", copy=False).tobytes()).decode()
    a = array.array("I", words)   # a tuple of python ints: array's conversion is ~3x numpy's
    if a.itemsize != 4 or sys.byteorder != "little":
        return base64.b64encode(np.asarray(words, dtype="<u4").tobytes()).decode()
    return base64.b64encode(a.tobytes()).decode()


def _words(v: Any) -> list[int]:
    """The words of :func:`_words_b64` (or a plain list of them, as earlier versions stored)."""
    if isinstance(v, str):
        return np.frombuffer(base64.b64decode(v, validate=True), dtype="<u4").tolist()
    return [int(x) for x in v]


def capture_rng_state() -> dict[str, Any]:
    py = random.getstate()
    npst = np.random.get_state()
    out: dict[str, Any] = {
        "python": [py[0], _words_b64(py[1]), py[2]],
        "numpy": [npst[0], _words_b64(npst[1]), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        v, internal, gauss = state["python"]
        random.setstate((v, tuple(_words(internal)), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(_words(keys), dtype=np.uint32), pos, has_gauss, cached))
    if "torch_cpu" in state:
        torch.set_rng_state(_unb64(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        states = [_unb64(s) for s in state["torch_cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:  # different GPU count per process: set the current device's from device 0's saved state
            torch.cuda.set_rng_state(states[0])


_SCALARS = frozenset((bool, int, float, str, type(None)))


class DeviceScalar:
    """The value of a one-element CUDA tensor (Adam's ``step``, a loss scale) as it is now, read
    later by the writer thread: ``.item()`` on the training thread would wait for every kernel
    queued before it, once per snapshot. The value is copied into pinned host memory behind those
    kernels (same stream, nothing waits) and an event marks its arrival; :meth:`value` waits for
    that event only."""

    __slots__ = ("_host", "_event")

    def __init__(self, t: torch.Tensor):
        self._host = torch.empty((), dtype=t.dtype, pin_memory=True)
        self._host.copy_(t.detach().reshape(()), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def value(self) -> Any:
        self._event.synchronize()
        return self._host.item()


def scalar(t: torch.Tensor) -> Any:
    """A one-element tensor's value for a checkpoint's JSON: a CPU tensor's now (a number), a CUDA
    tensor's later (:class:`DeviceScalar`, resolved by :func:`resolve_deferred` in the writer)."""
    return DeviceScalar(t) if t.is_cuda else t.item()


_KEEP = object()


def _rebuild(obj: Any, node: Any) -> Any:
    """``obj`` (JSON-like: dicts, lists, leaves) rebuilt with ``node(x)`` in place of every part
    ``x`` for which it returns something other than ``_KEEP``; lists of plain scalars (an RNG
    state's 600+ ints) are taken as they are, without a call per item."""
    out = node(obj)
    if out is not _KEEP:
        return out
    if isinstance(obj, dict):
        return {k: _rebuild(v, node) for k, v in obj.items()}
    if isinstance(obj, list) and not _SCALARS.issuperset(map(type, obj)):
        return [_rebuild(v, node) for v in obj]
    return obj


def resolve_deferred(obj: Any) -> Any:
    """``obj`` (what :func:`to_jsonable` returned) with every :class:`DeviceScalar` replaced by its
    value (waits for their copies)."""
    def node(x: Any) -> Any:
        if not isinstance(x, DeviceScalar):
            return _KEEP
        v = x.value()
        return _float(v) if isinstance(v, float) else v
    return _rebuild(obj, node)


#: the JSON form of a float JSON cannot hold: ``{NONFINITE: "inf" | "-inf" | "nan"}`` (``best_val_loss =
#: float("inf")`` in a DeepSpeed ``client_state`` is common; strict JSON has no such number)
NONFINITE = "__elastor_float__"


def _float(v: float) -> Any:
    return v if math.isfinite(v) else {NONFINITE: repr(v)}


def from_jsonable(obj: Any) -> Any:
    """``obj`` as read back from a checkpoint's JSON, with what :func:`to_jsonable`,
    :func:`tensors_to_json` and :func:`typed_to_json` tagged restored: non-finite floats, tensors,
    tuples, dicts with keys other than strings. A malformed tagged value is a
    :class:`~elastor_ds.errors.CorruptCheckpointError`."""
    def node(x: Any) -> Any:
        if not isinstance(x, dict) or len(x) != 1:
            return _KEEP
        if x.get(NONFINITE) in ("inf", "-inf", "nan"):
            return float(x[NONFINITE])
        if TUPLE in x and isinstance(x[TUPLE], list):
            return tuple(_rebuild(v, node) for v in x[TUPLE])
        if DICT in x and isinstance(x[DICT], list):
            return _dict_from_json(x[DICT], node)
        return _tensor_from_json(x[TENSOR]) if TENSOR in x else _KEEP
    return _rebuild(obj, node)


#: a tuple in JSON: ``{TUPLE: [items]}`` (JSON has lists only; ``(2, 3)`` came back ``[2, 3]``)
TUPLE = "__elastor_tuple__"
#: a dict with a key that is not a string: ``{DICT: [[key, value], ...]}`` (JSON keys are strings:
#: MultiStepLR's milestones ``{5: 1}`` came back ``{"5": 1}``, and the LR never decayed)
DICT = "__elastor_dict__"


def _dict_from_json(pairs: list, node: Any) -> dict:
    from ..errors import CorruptCheckpointError
    out = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise CorruptCheckpointError(f"a malformed dict in the checkpoint's JSON state: {str(pair)[:120]}")
        k = _rebuild(pair[0], node)
        try:
            out[k] = _rebuild(pair[1], node)
        except TypeError:
            raise CorruptCheckpointError(f"a dict key of type {type(k).__name__} in the checkpoint's JSON state "
                                         f"cannot be a key") from None
    return out


def typed_to_json(obj: Any) -> Any:
    """``obj`` with its tuples and its dicts with keys other than strings replaced by tagged forms
    (:data:`TUPLE`, :data:`DICT`), so that ``from_jsonable(json(to_jsonable(...)))`` gives them back
    as they were (DeepSpeed pickles an LR scheduler's state and a ``client_state``: ``{0: 4.1}`` and
    ``(2, 3)`` come back as such). Other values are left to :func:`to_jsonable`."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: typed_to_json(v) for k, v in obj.items()}
        return {DICT: [[typed_to_json(k), typed_to_json(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {TUPLE: [typed_to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [typed_to_json(v) for v in obj]
    return obj


def like(saved: Any, live: Any) -> Any:
    """``saved`` (read back from JSON) given the container types of ``live`` (what the object being
    restored holds now), for a checkpoint written before :func:`typed_to_json`: string keys that
    name ``live``'s keys become those keys (``"5"`` -> ``5``; any digit string where all of
    ``live``'s keys are integers), lists where ``live`` has tuples become
    tuples, a plain dict where ``live`` has a ``Counter``/``OrderedDict`` becomes one."""
    import collections
    if isinstance(saved, dict) and isinstance(live, dict):
        keys = {str(k): k for k in live if not isinstance(k, str)}
        # integer keys (milestones at other steps than the live object's): digit strings are integers
        ints = bool(live) and all(type(k) is int for k in live)
        out = {}
        for k, v in saved.items():
            lk = keys.get(k, k) if isinstance(k, str) else k
            if ints and isinstance(lk, str) and lk.isascii() and lk.lstrip("-").isdigit():
                lk = int(lk)
            out[lk] = like(v, live[lk]) if lk in live else v
        if type(live) in (collections.Counter, collections.OrderedDict) and type(out) is dict:
            out = type(live)(out)
        return out
    if isinstance(saved, list) and isinstance(live, (list, tuple)):
        items = [like(v, live[i]) if i < len(live) else v for i, v in enumerate(saved)]
        return tuple(items) if isinstance(live, tuple) else items
    return saved


#: a tensor kept as a tensor in JSON (a DeepSpeed ``client_state``): ``{TENSOR: {"dtype", "shape", "data"}}``
TENSOR = "__elastor_tensor__"
#: the largest tensor a JSON state holds this way (bigger ones belong in the checkpoint's shards)
MAX_JSON_TENSOR_BYTES = 1 << 20


def tensors_to_json(obj: Any, where: str, oversize_as_list: bool = False) -> Any:
    """``obj`` with every tensor replaced by its tagged form (dtype, shape, base64 of its bytes), so
    that :func:`from_jsonable` gives tensors back where :func:`to_jsonable` would give lists
    (DeepSpeed's ``load_checkpoint`` returns a ``client_state``'s tensors as tensors). Raises
    TypeError naming the key for a tensor over :data:`MAX_JSON_TENSOR_BYTES`; with
    ``oversize_as_list`` (an import of someone's checkpoint) such a tensor is left as it is (the
    JSON form makes it a list) and a warning names it."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        n = t.numel() * t.element_size()
        if n > MAX_JSON_TENSOR_BYTES:
            if oversize_as_list:
                log.warning("%s: a tensor of %d bytes is kept as a list of numbers (tensors up to %d bytes stay "
                            "tensors in the JSON state)", where, n, MAX_JSON_TENSOR_BYTES)
                return obj
            raise TypeError(f"{where}: a tensor of {n} bytes; the JSON state holds tensors up to "
                            f"{MAX_JSON_TENSOR_BYTES} bytes: save larger ones as checkpoint shards (TensorShard)")
        data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if n else b""
        return {TENSOR: {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                         "data": base64.b64encode(data).decode()}}
    if isinstance(obj, dict):
        return {k: tensors_to_json(v, f"{where}.{k}", oversize_as_list) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
        return [tensors_to_json(v, f"{where}[{i}]", oversize_as_list) for i, v in enumerate(obj)]
    return obj


def _tensor_from_json(spec: Any) -> torch.Tensor:
    from ..errors import CorruptCheckpointError
    try:
        dtype = getattr(torch, spec["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError
        shape = tuple(int(x) for x in spec["shape"])
        raw = base64.b64decode(spec["data"], validate=True)
    except (AttributeError, KeyError, TypeError, ValueError, binascii.Error):
        raise CorruptCheckpointError(f"a malformed tensor in the checkpoint's JSON state: {str(spec)[:120]}") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or len(raw) != math.prod(shape) * itemsize:
        raise CorruptCheckpointError(f"a tensor in the checkpoint's JSON state holds {len(raw)} bytes for shape "
                                     f"{shape} of {spec['dtype']}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def to_jsonable(obj: Any, where: str = "state", deferred: "list | None" = None) -> Any:
    """Recursively convert tensors/numpy/tuples to JSON types; raise TypeError naming the key
    otherwise. Dict keys become strings (``str(key)``); two keys that become the same string
    (``1`` and ``"1"``) are a :class:`~elastor_ds.errors.ConfigError` naming both. With ``deferred`` (a list), a one-element CUDA tensor becomes a
    :class:`DeviceScalar` (no device sync here), also appended to ``deferred``; the caller resolves
    them off the training thread (:func:`resolve_deferred`). Without it, they are read now."""
    if isinstance(obj, float):
        return _float(obj)
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if isinstance(obj, (bool, int, str)):   # an IntEnum, a str Enum, numpy's bool_ is not one: their plain value,
        return bool(obj) if isinstance(obj, bool) else (int(obj) if isinstance(obj, int) else str.__str__(obj))
    if isinstance(obj, DeviceScalar):
        if deferred is None:
            return obj.value()
        deferred.append(obj)
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 1 and obj.is_cuda and deferred is not None:
            d = DeviceScalar(obj)
            deferred.append(d)
            return d
        return to_jsonable(obj.item() if obj.numel() == 1 else obj.tolist(), where)
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item(), where)
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist(), where)
    if isinstance(obj, dict):
        out = {str(k): to_jsonable(v, f"{where}.{k}", deferred) for k, v in obj.items()}
        if len(out) != len(obj):
            raise _colliding_keys(obj, where)
        return out
    if isinstance(obj, (list, tuple)):
        types = set(map(type, obj))
        if _SCALARS.issuperset(types):   # e.g. an RNG state: 600+ ints, no per-item call
            return [_float(v) if type(v) is float else v for v in obj] if float in types else list(obj)
        return [to_jsonable(v, f"{where}[{i}]", deferred) for i, v in enumerate(obj)]
    raise TypeError(f"{where}: value of type {type(obj).__name__} cannot be stored in a checkpoint's JSON state; "
                    f"convert it to numbers/strings/lists/dicts (or save it as a tensor shard)")



def _colliding_keys(obj: dict, where: str) -> Exception:
    """The error for a dict two of whose keys are one JSON key (``1`` and ``"1"``): one value would be
    lost without a word."""
    from ..errors import ConfigError
    first: dict[str, Any] = {}
    for k in obj:
        first.setdefault(str(k), k)
    a, b = next((first[str(k)], k) for k in obj if first[str(k)] is not k)
    return ConfigError(f"{where}: keys {a!r} ({type(a).__name__}) and {b!r} ({type(b).__name__}) are both the JSON "
                       f"key {str(b)!r}, so one value would be lost; give the dict keys that differ as strings (or "
                       f"store it as a list of [key, value] pairs)")
