"""CRC32 (zlib's polynomial) for checkpoint data: the fastest implementation installed.

``crc32(data, value=0)`` and ``crc32_combine(crc1, crc2, len2)`` give exactly zlib's results. With
the ``zlib-ng`` package (a dependency of elastor_ds, so a plain ``pip install`` has it) both come from zlib-ng (SIMD
CRC folding: about 4x zlib's speed on the block-CRC pass of a save, and a combine in C instead of
Python); otherwise from the standard ``zlib`` module and a table-driven pure-Python combine.
Every writer and reader uses this module, so a checkpoint's CRCs never depend on which one ran.
"""
from __future__ import annotations

import zlib

try:  # pragma: no cover - depends on the environment
    from zlib_ng import zlib_ng as _ng
except ImportError:  # pragma: no cover
    _ng = None

__all__ = ["crc32", "crc32_combine", "crc32_combine_py", "IMPLEMENTATION"]

IMPLEMENTATION = "zlib-ng" if _ng is not None else "zlib"
crc32 = _ng.crc32 if _ng is not None else zlib.crc32


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _byte_tables(mat: list[int]) -> tuple[list[int], ...]:
    """The operator ``mat`` (column i: image of bit i) as four 256-entry tables, one per byte of
    the input, so applying it costs four lookups instead of one step per bit."""
    tables = []
    for j in range(4):
        cols = mat[8 * j:8 * j + 8]
        t = [0] * 256
        for b in range(1, 256):
            low = (b & -b).bit_length() - 1
            t[b] = t[b & (b - 1)] ^ cols[low]
        tables.append(t)
    return tuple(tables)


_OPS: list[list[int]] = []                    # _OPS[k]: CRC operator for 2**k zero bytes
_TABLES: list[tuple[list[int], ...]] = []     # the same operators as byte tables


def _tables(k: int) -> tuple[list[int], ...]:
    if not _OPS:
        op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):                                 # -> one zero byte
            op = _gf2_square(op)
        _OPS.append(op)
    while len(_OPS) <= k:
        _OPS.append(_gf2_square(_OPS[-1]))
    while len(_TABLES) <= k:
        _TABLES.append(_byte_tables(_OPS[len(_TABLES)]))
    return _TABLES[k]


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's method: shift
    ``crc1`` over ``len2`` zero bytes with cached power-of-two operators, then xor ``crc2``)."""
    if len2 > 0 and len(_TABLES) < len2.bit_length():
        _tables(len2.bit_length() - 1)
    k = 0
    while len2 > 0:
        if len2 & 1:
            t0, t1, t2, t3 = _TABLES[k]
            crc1 = t0[crc1 & 255] ^ t1[(crc1 >> 8) & 255] ^ t2[(crc1 >> 16) & 255] ^ t3[crc1 >> 24]
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    if _ng is not None and len2 >= 0:
        return _ng.crc32_combine(crc1, crc2, len2)
    return crc32_combine_py(crc1, crc2, len2)
