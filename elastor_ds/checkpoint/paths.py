"""Names read from a checkpoint are untrusted: resolve them inside their directory or refuse.

Every name that comes out of a checkpoint (a manifest's file names and chunk files, its
``rank_state_files``, the ``latest`` pointer, a DeepSpeed ``latest`` tag, a Megatron tracker, a
tensor name turned into a directory on export) goes through :func:`safe_join` before it touches
the file system. A name is refused when it is empty, absolute, contains ``..``, a NUL byte or a
backslash, or when the joined path, after following symlinks, lies outside the base directory.

Pure path logic plus ``os.path.realpath``; no torch.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat

from ..errors import CheckpointNotFoundError, UnsafeCheckpointError

_BAD_CHARS = ("\x00", "\\")


def _check_relative(name: object, what: str, allow_subdirs: bool) -> str:
    if not isinstance(name, str) or not name:
        raise UnsafeCheckpointError(f"{what} {name!r} is not a non-empty string")
    if any(c in name for c in _BAD_CHARS) or os.path.isabs(name) or name.startswith("~"):
        raise UnsafeCheckpointError(f"{what} {name!r} is not a relative name inside the checkpoint; refusing it "
                                    f"(the checkpoint is corrupt or crafted)")
    parts = name.split("/")
    if not allow_subdirs and len(parts) != 1:
        raise UnsafeCheckpointError(f"{what} {name!r} must be a plain file name without '/'; refusing it "
                                    f"(the checkpoint is corrupt or crafted)")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeCheckpointError(f"{what} {name!r} has an empty, '.' or '..' path component; refusing it "
                                    f"(the checkpoint is corrupt or crafted)")
    return name


def safe_join(base: str, name: object, what: str = "name", allow_subdirs: bool = False) -> str:
    """``base/name`` when ``name`` is a relative name that resolves (symlinks followed) inside
    ``base``; else :class:`~elastor_ds.errors.UnsafeCheckpointError`. ``allow_subdirs`` admits
    ``a/b`` (never ``..``)."""
    _check_relative(name, what, allow_subdirs)
    path = os.path.join(base, name)  # type: ignore[arg-type]
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if real != real_base and not real.startswith(real_base.rstrip(os.sep) + os.sep):
        raise UnsafeCheckpointError(f"{what} {name!r} in {printable(base)} resolves to {real!r}, outside the "
                                    f"checkpoint directory (a symlink out?); refusing it")
    return path


def printable(text: object) -> str:
    """``text`` safe to print on a terminal: every character that is not printable (an escape, a
    bell, a control or invisible formatting character, a newline) shown as its Python escape
    (``\\x1b``); printable text, spaces and non-ASCII letters unchanged. Names on disk (a link's
    target, a file name) are anyone's: printed raw, they could retitle or recolour the terminal."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


_TENSOR_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-:\[\]]+$")


def check_tensor_name(name: object, where: str = "") -> str:
    """A tensor name that may become a directory or file name on export: ASCII letters, digits and
    ``_ . - : [ ]``, no ``..`` component, not starting with ``.``. Raises UnsafeCheckpointError."""
    if not isinstance(name, str) or not _TENSOR_NAME_RE.match(name) or name.startswith(".") \
            or ".." in name.split("/") or ".." in name:
        raise UnsafeCheckpointError(f"{where}tensor name {name!r} is not a plain parameter name (letters, digits, "
                                    f"'_', '.', '-', ':', '[', ']'; no '..', no '/'); refusing it")
    return name


def inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies under it, after resolving symlinks (of the parts that exist)."""
    p, r = os.path.realpath(os.path.abspath(path)), os.path.realpath(os.path.abspath(root))
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def overlap(a: str, b: str) -> bool:
    """One of two directories holds the other (or they are the same)."""
    return inside(a, b) or inside(b, a)


def open_regular(path: str, nofollow: bool = False) -> int:
    """A read-only descriptor of ``path`` when it is a regular file. Opened non-blocking, so a FIFO,
    a device or a socket planted in a checkpoint never blocks the reader; refused with
    :class:`~elastor_ds.errors.UnsafeCheckpointError` (FileNotFoundError passes through).
    ``nofollow``: a symlink at ``path`` itself is refused too (the fixed names a checkpoint writes
    as regular files: ``manifest.json``, ``latest``)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if nofollow and e.errno == errno.ELOOP:
            raise UnsafeCheckpointError(f"{path} is a symbolic link; a checkpoint writes it as a regular file, so "
                                        f"it is corrupt or crafted (refusing it)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise UnsafeCheckpointError(f"{path} is {kind}; a checkpoint holds regular files only (refusing it)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_text(path: str, limit: int, nofollow: bool = False) -> str:
    """The text of regular file ``path`` (see :func:`open_regular`), at most ``limit`` bytes: a
    larger file is refused before any of it is read."""
    fd = open_regular(path, nofollow=nofollow)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise UnsafeCheckpointError(f"{path} is larger than {limit} bytes; refusing it (corrupt or crafted)")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeCheckpointError(f"{path} is larger than {limit} bytes; refusing it (corrupt or crafted)")
    return data.decode("utf-8")


def not_a_checkpoint(path: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{path} is not an elastor checkpoint (a checkpoint is a directory with "
                                   f"manifest.json, or a root with 'latest' and step_* directories)")
