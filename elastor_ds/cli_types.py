"""argparse value types shared by the CLI subcommands: integers >= 1, finite numbers > 0 (or >= 0);
and :func:`has_control_chars`, the check of a name read from a user's file before it is printed.

A bad value becomes argparse's one-line usage error (exit 2) naming the flag and the value."""
from __future__ import annotations

import argparse
import math
import re
import unicodedata
from typing import Callable


_ASCII_INT = re.compile(r"[+-]?[0-9]+")


def ascii_int(text: str) -> int:
    """An integer written in ASCII digits (``int()`` alone also takes ``1_6`` and fullwidth digits)."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (ASCII digits, e.g. 16)")
    return int(text)


def _int_at_least(text: str, lo: int) -> int:
    v = ascii_int(text)
    if v < lo:
        raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (0 typically means "off")."""
    return _int_at_least(text, 0)


# a decimal number in ASCII (``float()`` alone also takes ``1_0`` and fullwidth or other scripts' digits)
_ASCII_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)", re.I)


def _finite_float(text: str, *, allow_zero: bool) -> float:
    if not _ASCII_FLOAT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (ASCII digits, e.g. 2.5)")
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {'>=' if allow_zero else '>'} 0")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    return _finite_float(text, allow_zero=False)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (0 typically means "off")."""
    return _finite_float(text, allow_zero=True)


def bounded_float(lo: float, hi: float) -> Callable[[str], float]:
    """A finite number in ``lo..hi`` (hardware figures: outside a sane range the cost model's
    arithmetic overflows or its answer is meaningless)."""
    def parse(text: str) -> float:
        v = positive_float(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: give {_num(lo)} to {_num(hi)}")
        return v
    parse.__name__ = "number"
    return parse


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1 and x == int(x) else f"{x:g}"


_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# controls (C0, C1), invisible formatting characters (bidirectional overrides and isolates, zero-width
# spaces and joiners, the byte order mark, ...), line and paragraph separators, lone surrogates
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# letters (category Lo) that print as nothing: the Hangul fillers
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0")


def has_control_chars(text: str) -> bool:
    """``text`` holds a control character (an escape sequence printed to the user's terminal would
    act on it) or an invisible formatting one (a right-to-left override or a zero-width space would
    make a printed name read as another). Refused in every tensor and file name a checkpoint
    manifest gives, and in the names and texts read from a user's file that the CLI prints (node
    names of a cluster file, a profile's sources)."""
    if text.isascii():   # the usual text: one C-speed scan
        return _ASCII_CONTROL.search(text) is not None
    return any(unicodedata.category(c) in _HIDDEN_CATEGORIES or c in _BLANK_LETTERS for c in text)
