"""JSON that comes from someone else: strict parsing and the bounded, no-symlink read of a file a
user names on the command line or in a config (a profile, a previous plan).

Shared by the planner, the checkpoint's manifest parser and the integrations, so that each reads
untrusted JSON the same way."""
from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from .errors import ConfigError


def no_constant(name: str) -> Any:
    """``json.loads(parse_constant=...)``: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON."""
    raise ValueError(f"{name} is not a JSON number")


def finite(text: str) -> float:
    """``json.loads(parse_float=...)``: a number beyond a float's range (``1e999``) is refused."""
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:40]} is out of a float's range")
    return x


def strict_json(text: "str | bytes") -> Any:
    """``json.loads`` of strict JSON: ``NaN``, ``Infinity`` and numbers beyond a float's range are
    refused with a ValueError, not let through to fail later where nobody expects a float."""
    return json.loads(text, parse_constant=no_constant, parse_float=finite)


def read_user_file(path: str, flag: str, max_bytes: int, what: str, fix: str) -> bytes:
    """The bytes of a file the user names (``flag``: the option that named it): a regular file, not
    followed through a symlink, at most ``max_bytes``; a FIFO or a device is never opened for
    reading (it could block for ever). Every problem a ConfigError naming the file and ``fix``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot open ({e.strerror}; a symlink is not followed); {fix}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):   # /dev/zero, a FIFO, a directory: never read
        os.close(fd)
        raise ConfigError(f"{flag} {path}: not a regular file; {fix}")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > max_bytes:
            raise ConfigError(f"{flag} {path}: {st.st_size:,} bytes; {what} is at most {max_bytes:,}")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot read ({e.strerror}); {fix}") from None
    if len(data) > max_bytes:   # grew since the stat
        raise ConfigError(f"{flag} {path}: more than {max_bytes:,} bytes; {what} is at most {max_bytes:,}")
    return data


def read_json_file(path: str, flag: str, max_bytes: int, what: str, fix: str, strict: bool = True) -> Any:
    """A JSON document the user names (``flag``: the option or config key that named it): a regular
    file, not followed through a symlink, at most ``max_bytes``, with ``strict`` no NaN/Infinity
    and no number beyond a float's range (without, the caller's field checks name them), nested
    too deeply refused: every problem a usage error (ConfigError naming the file and ``fix``),
    never a traceback."""
    data = read_user_file(path, flag, max_bytes, what, fix)
    try:
        return json.loads(data, parse_constant=no_constant, parse_float=finite) if strict else json.loads(data)
    except RecursionError:
        raise ConfigError(f"{flag} {path}: nested too deeply to be {what}; {fix}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: not {what} ({type(e).__name__}: {e}); {fix}") from None
