"""The restricted codec for values that cross processes in elastor_ds's object collectives.

Its one job: turn plain data into bytes and back, so that no byte received from another process is
ever unpickled (anyone who can join or impersonate a peer of a process group could otherwise run
code in every rank). :func:`encode` takes only ``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, ``list``, ``tuple`` and ``dict`` (``str`` or ``int`` keys), of exactly these types (no
subclasses: an ``IntEnum``, a ``NamedTuple`` or ``torch.Size`` is refused), nested at most
:data:`MAX_DEPTH` deep, :data:`MAX_BYTES` at most; anything else is a :class:`WireTypeError` (a
``TypeError``) naming the type and where it sits, raised at the sender: convert the value to plain
data at the call site. :func:`decode` gives back the same value (a tuple stays a tuple, a list a
list, dict order kept) and refuses anything malformed, truncated, oversize or too deep with a
:class:`WireFormatError`; it builds only the types above and calls no constructor named by the data.

Format (big-endian): the magic ``b"EW\\x01"``, then one value::

    N                      None            T / F            True / False
    i <8 bytes signed>     int in int64    I <u16 n> <n bytes signed, minimal>   any other int
    f <8 bytes IEEE 754>   float           s <u32 n> <n bytes UTF-8>             str
    b <u32 n> <n bytes>    bytes           l / t <u32 n> <n values>              list / tuple
    d <u32 n> <n (key, value) pairs>       dict (keys: s, i or I values, distinct)

Each value has one encoding (ints in int64 always use ``i``; ``I`` is minimal two's complement), so
equal values give equal bytes.
"""
from __future__ import annotations

import struct
from typing import Any, Callable

from ..errors import CollectiveError

__all__ = ["MAGIC", "MAX_BYTES", "MAX_DEPTH", "WireFormatError", "WireLimitError", "WireTypeError", "decode",
           "encode"]

MAGIC = b"EW\x01"
#: the largest payload one rank may send in one object collective (encoded bytes)
MAX_BYTES = 256 << 20
#: containers nested deeper than this are refused (the top-level value is depth 1)
MAX_DEPTH = 64
#: the largest int outside int64, in bytes of two's complement (Python's own str conversion
#: limit, 4300 digits, is about 1786 bytes)
MAX_INT_BYTES = 1024

_PLAIN = "None, bool, int, float, str, bytes, list, tuple and dict (str or int keys)"
_I64 = struct.Struct(">q")
_TAG_I64 = struct.Struct(">cq").pack
_TAG_F64 = struct.Struct(">cd").pack
_TAG_U32 = struct.Struct(">cI").pack
_F64 = struct.Struct(">d")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")


class WireTypeError(TypeError):
    """A value an object collective cannot carry (a programming error at the call site): its type
    is not plain data, or a dict key is neither str nor int."""


class WireLimitError(ValueError):
    """A value too large (more than ``max_bytes`` encoded) or too deeply nested to send."""


class WireFormatError(CollectiveError, ValueError):
    """Bytes received from another process are not a valid encoding (malformed, truncated, oversize
    or too deep): nothing of them was used."""


class _Refused(Exception):
    def __init__(self, what: str, kind: type = WireTypeError):
        super().__init__(what)
        self.what, self.kind, self.path = what, kind, []


def _where(path: list) -> str:
    return "".join(f"[{p!r}]" for p in reversed(path)) or "the value itself"


def _type_name(t: type) -> str:
    mod = getattr(t, "__module__", "")
    return t.__qualname__ if mod in ("builtins", "") else f"{mod}.{t.__qualname__}"


# ------------------------------------------------------------------ encoding
def _enc_none(v: Any, out: bytearray, depth: int) -> None:
    out += b"N"


def _enc_bool(v: bool, out: bytearray, depth: int) -> None:
    out += b"T" if v else b"F"


def _enc_int(v: int, out: bytearray, depth: int) -> None:
    if -(1 << 63) <= v < (1 << 63):
        out += _TAG_I64(b"i", v)
        return
    n = (v.bit_length() + 8) // 8   # room for the sign bit
    if n > MAX_INT_BYTES:
        raise _Refused(f"an int of {v.bit_length()} bits (at most {MAX_INT_BYTES * 8 - 1})", WireLimitError)
    out += b"I"
    out += _U16.pack(n)
    out += v.to_bytes(n, "big", signed=True)


def _enc_float(v: float, out: bytearray, depth: int) -> None:
    out += _TAG_F64(b"f", v)


def _enc_str(v: str, out: bytearray, depth: int) -> None:
    data = v.encode("utf-8", "surrogatepass")
    if len(data) > MAX_BYTES:
        raise _Refused(f"a str of {len(data)} bytes (at most {MAX_BYTES})", WireLimitError)
    out += _TAG_U32(b"s", len(data))
    out += data


def _enc_bytes(v: bytes, out: bytearray, depth: int) -> None:
    if len(v) > MAX_BYTES:
        raise _Refused(f"bytes of length {len(v)} (at most {MAX_BYTES})", WireLimitError)
    out += _TAG_U32(b"b", len(v))
    out += v


def _enc_items(tag: bytes) -> Callable[[Any, bytearray, int], None]:
    def enc(v: Any, out: bytearray, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _Refused(f"containers nested more than {MAX_DEPTH} deep", WireLimitError)
        out += _TAG_U32(tag, len(v))
        get = _ENCODERS.get
        i = 0
        try:
            for i, x in enumerate(v):
                f = get(type(x))
                if f is None:
                    raise _Refused(f"a value of type {_type_name(type(x))}")
                f(x, out, depth + 1)
        except _Refused as e:
            e.path.append(i)
            raise
    return enc


def _enc_dict(v: dict, out: bytearray, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _Refused(f"containers nested more than {MAX_DEPTH} deep", WireLimitError)
    out += _TAG_U32(b"d", len(v))
    for k, x in v.items():
        tk = type(k)
        if tk is str:
            _enc_str(k, out, depth)
        elif tk is int:
            _enc_int(k, out, depth)
        else:
            raise _Refused(f"a dict key {k!r} of type {_type_name(tk)} (keys must be str or int)")
        f = _ENCODERS.get(type(x))
        try:
            if f is None:
                raise _Refused(f"a value of type {_type_name(type(x))}")
            f(x, out, depth + 1)
        except _Refused as e:
            e.path.append(k)
            raise


_ENCODERS: dict[type, Callable[[Any, bytearray, int], None]] = {
    type(None): _enc_none, bool: _enc_bool, int: _enc_int, float: _enc_float, str: _enc_str, bytes: _enc_bytes,
    list: _enc_items(b"l"), tuple: _enc_items(b"t"), dict: _enc_dict,
}


def encode(value: Any, max_bytes: int = MAX_BYTES) -> bytes:
    """``value`` as bytes (see the module docstring). Raises :class:`WireTypeError` for a type that
    is not plain data (naming it and where it sits) and :class:`WireLimitError` for a value over
    ``max_bytes`` encoded or nested more than :data:`MAX_DEPTH` deep."""
    out = bytearray(MAGIC)
    f = _ENCODERS.get(type(value))
    try:
        if f is None:
            raise _Refused(f"a value of type {_type_name(type(value))}")
        f(value, out, 1)
    except _Refused as e:
        where = _where(e.path)
        if e.kind is WireTypeError:
            raise WireTypeError(f"cannot send {e.what} at {where} through an object collective: only {_PLAIN} "
                                f"cross processes (nothing is pickled); convert it to plain data where it is sent "
                                f"(e.g. a dataclass's fields as a tuple, an enum's .value, sorted(a_set), "
                                f"int(numpy_scalar), tuple(torch_size), an exception's str)") from None
        raise WireLimitError(f"cannot send {e.what} through an object collective: send less, or move it as a "
                             f"tensor") from None
    except RecursionError:   # a self-containing list: deeper than any limit
        raise WireLimitError(f"cannot send a value nested more than {MAX_DEPTH} deep through an object "
                             f"collective") from None
    if len(out) > max_bytes:
        raise WireLimitError(f"cannot send a value of {len(out)} bytes encoded through an object collective "
                             f"(at most {max_bytes}): send less, or move it as a tensor")
    return bytes(out)


# ------------------------------------------------------------------ decoding
_N, _T, _F, _SI, _BI, _FL, _S, _B, _L, _TU, _D = b"NTFiIfsbltd"
_I64_AT, _F64_AT, _U32_AT, _U16_AT = _I64.unpack_from, _F64.unpack_from, _U32.unpack_from, _U16.unpack_from


def _decoder(data: bytes) -> Callable[[int, int], tuple[Any, int]]:
    """``dec(pos, depth) -> (value, next pos)`` over ``data`` (one closure: the decoder runs at a few
    hundred ns a value, which matters for the engine's gathered shard metadata)."""
    end = len(data)

    def need(pos: int, n: int) -> None:
        if n > end - pos:
            raise WireFormatError(f"truncated: {n} bytes needed at offset {pos}, {max(end - pos, 0)} left")

    def text(pos: int) -> tuple[str, int]:
        need(pos, 4)
        n = _U32_AT(data, pos)[0]
        pos += 4
        need(pos, n)
        try:
            return str(data[pos:pos + n], "utf-8", "surrogatepass"), pos + n
        except UnicodeDecodeError as e:
            raise WireFormatError(f"a str that is not UTF-8 ({e.reason}) at offset {pos}") from None

    def big(pos: int) -> tuple[int, int]:
        need(pos, 2)
        n = _U16_AT(data, pos)[0]
        pos += 2
        if n > MAX_INT_BYTES:
            raise WireFormatError(f"an int of {n} bytes (at most {MAX_INT_BYTES})")
        need(pos, n)
        v = int.from_bytes(data[pos:pos + n], "big", signed=True)
        if -(1 << 63) <= v < (1 << 63) or (v.bit_length() + 8) // 8 != n:
            raise WireFormatError(f"a non-canonical int encoding at offset {pos - 3}")
        return v, pos + n

    def count(pos: int, what: str) -> int:
        need(pos, 4)
        n = _U32_AT(data, pos)[0]
        if n > end - pos - 4:   # every item takes a byte at least
            raise WireFormatError(f"a {what} of {n} items at offset {pos - 1} in {end - pos - 4} remaining bytes")
        return n

    def dec(pos: int, depth: int) -> tuple[Any, int]:
        if pos >= end:
            raise WireFormatError(f"truncated: a value needed at offset {pos}")
        tag = data[pos]
        pos += 1
        if tag == _SI:
            need(pos, 8)
            return _I64_AT(data, pos)[0], pos + 8
        if tag == _S:
            return text(pos)
        if tag == _TU or tag == _L:
            if depth > MAX_DEPTH:
                raise WireFormatError(f"containers nested more than {MAX_DEPTH} deep")
            n = count(pos, "list" if tag == _L else "tuple")
            pos += 4
            items = [None] * n
            for i in range(n):
                items[i], pos = dec(pos, depth + 1)
            return (tuple(items) if tag == _TU else items), pos
        if tag == _N:
            return None, pos
        if tag == _T:
            return True, pos
        if tag == _F:
            return False, pos
        if tag == _FL:
            need(pos, 8)
            return _F64_AT(data, pos)[0], pos + 8
        if tag == _B:
            need(pos, 4)
            n = _U32_AT(data, pos)[0]
            pos += 4
            need(pos, n)
            return data[pos:pos + n], pos + n
        if tag == _BI:
            return big(pos)
        if tag == _D:
            if depth > MAX_DEPTH:
                raise WireFormatError(f"containers nested more than {MAX_DEPTH} deep")
            n = count(pos, "dict")
            pos += 4
            d: dict = {}
            for _ in range(n):
                need(pos, 1)
                ktag = data[pos]
                if ktag == _S:
                    k, pos = text(pos + 1)
                elif ktag == _SI:
                    need(pos + 1, 8)
                    k, pos = _I64_AT(data, pos + 1)[0], pos + 9
                elif ktag == _BI:
                    k, pos = big(pos + 1)
                else:
                    raise WireFormatError(f"a dict key with tag {bytes([ktag])!r} at offset {pos} (keys are str or "
                                          f"int)")
                if k in d:
                    raise WireFormatError(f"the dict key {k!r} twice (before offset {pos})")
                d[k], pos = dec(pos, depth + 1)
            return d, pos
        raise WireFormatError(f"unknown tag {bytes([tag])!r} at offset {pos - 1}")

    return dec


def decode(data: Any, max_bytes: int = MAX_BYTES) -> Any:
    """The value :func:`encode` turned into ``data`` (bytes-like). Raises :class:`WireFormatError`
    for anything else: no magic, a truncated or trailing byte, an unknown tag, invalid UTF-8, a
    repeated or non-str/int dict key, more than ``max_bytes`` or nesting deeper than
    :data:`MAX_DEPTH`."""
    buf = bytes(data)
    if len(buf) > max_bytes:
        raise WireFormatError(f"a payload of {len(buf)} bytes (at most {max_bytes})")
    if buf[:len(MAGIC)] != MAGIC:
        raise WireFormatError(f"not an elastor wire payload (starts with {buf[:8]!r}, not {MAGIC!r}): "
                              f"refused, nothing decoded")
    try:
        value, pos = _decoder(buf)(len(MAGIC), 1)
    except RecursionError:   # pragma: no cover - MAX_DEPTH keeps far below the interpreter's limit
        raise WireFormatError("nested too deeply") from None
    if pos != len(buf):
        raise WireFormatError(f"{len(buf) - pos} trailing bytes after the value (at offset {pos})")
    return value
