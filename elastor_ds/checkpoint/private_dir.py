"""A directory of model weights that must stay this user's: its path's folders, its owner, its mode.

Used for the node's memory-snapshot directory, whether ``elastor run --snapshot-dir`` prepares it
(:mod:`elastor_ds.elastic.snapshot_dir`) or a trainer's ``"memory_snapshot": {"dir": ...}`` names
it. ``setting`` (``--snapshot-dir``, ``elastor.memory_snapshot.dir``) starts every refusal, a
:class:`~elastor_ds.errors.ConfigError` (exit 2) naming the path and the fix.
"""
from __future__ import annotations

import os
from typing import Optional
import stat as stat_mod

from ..errors import ConfigError


def refuse(setting: str, p: str, why: str, fix: str = "name a new directory (on /dev/shm for memory speed)") -> ConfigError:
    return ConfigError(f"{setting} {p}: {why}; {fix}")


def _fix(fix: Optional[str]) -> tuple:
    """``refuse``'s fix argument: the caller's, else refuse's own default."""
    return (fix,) if fix else ()


def check_components(p: str, setting: str, fix: Optional[str] = None) -> None:
    """Every existing component of ``p`` (not ``p`` itself) is owned by root or this user; a symlink
    only when one of them owns it; no directory may be written by others without the sticky bit."""
    me = os.getuid()
    parts = os.path.abspath(p).split(os.sep)[1:-1]
    cur = os.sep
    for name in [""] + parts:
        cur = os.path.join(cur, name) if name else cur
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return   # the rest is created by us (0700)
        except OSError as e:
            raise refuse(setting, p, f"cannot inspect {cur} ({e.strerror})", *_fix(fix)) from None
        if st.st_uid not in (0, me):
            raise refuse(setting, p, f"{cur} belongs to uid {st.st_uid}, another user who could replace what we "
                         f"create there", fix or "name a directory under folders owned by you or root")
        if stat_mod.S_ISLNK(st.st_mode):
            continue   # a link of root's or ours: its target's folders are checked through realpath below
        if not stat_mod.S_ISDIR(st.st_mode):
            raise refuse(setting, p, f"{cur} is not a directory", *_fix(fix))
        if st.st_mode & (stat_mod.S_IWOTH | stat_mod.S_IWGRP) and not st.st_mode & stat_mod.S_ISVTX:
            raise refuse(setting, p, f"{cur} may be written by other users (mode {stat_mod.S_IMODE(st.st_mode):04o}, "
                         f"no sticky bit)", fix or "name a directory under folders only you (or root) can write")
    real = os.path.realpath(os.path.dirname(os.path.abspath(p)))
    if real != os.path.dirname(os.path.abspath(p)):
        check_components(os.path.join(real, os.path.basename(p)), setting, fix)


def check_private(p: str, setting: str, fix: Optional[str] = None,
                  contents: str = "the snapshots (model weights)") -> os.stat_result:
    """``p`` is a real directory (not a symlink) of this user that nobody else may enter."""
    st = os.lstat(p)
    if stat_mod.S_ISLNK(st.st_mode):
        raise refuse(setting, p, "is a symlink (never followed)", *_fix(fix))
    if not stat_mod.S_ISDIR(st.st_mode):
        raise refuse(setting, p, "exists and is not a directory", *_fix(fix))
    if st.st_uid != os.getuid():
        raise refuse(setting, p, f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): another user may have "
                     f"planted it", *_fix(fix))
    if st.st_mode & 0o077:
        raise refuse(setting, p, f"other users may enter it (mode {stat_mod.S_IMODE(st.st_mode):04o}) and read "
                     f"{contents}", f"run chmod 700 {p}, or " + (fix or "name a new directory"))
    return st


def mkdir_private(p: str, setting: str, fix: Optional[str] = None) -> bool:
    """``mkdir(p, 0700)``; False when ``p`` already exists."""
    try:
        os.mkdir(p, 0o700)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        raise refuse(setting, p, f"cannot create it ({e.strerror})", fix or "name a writable directory, e.g. under "
                     "/dev/shm") from None


def make_parents(p: str, setting: str, fix: Optional[str] = None) -> None:
    """Create ``p``'s missing folders one by one, each ``mkdir 0700`` then checked (a real directory
    of ours, set to 0700 whatever the umask), and check the components again after.
    ``os.makedirs(mode=0o700)`` gives the mode to the last folder only: under umask 0 the folders
    above it were made world-writable, and another user could swap what is inside them."""
    parent = os.path.dirname(os.path.abspath(p))
    missing = []
    cur = parent
    while not os.path.lexists(cur):
        missing.append(cur)
        cur = os.path.dirname(cur)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue   # made meanwhile: check_components below judges it
        except OSError as e:
            raise refuse(setting, p, f"cannot create its folder {d} ({e.strerror})",
                         fix or "name a writable directory") from None
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise refuse(setting, p, f"its folder {d} changed right after it was created ({e.strerror})",
                         *_fix(fix)) from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise refuse(setting, p, f"its folder {d} belongs to uid {st.st_uid} right after we created it",
                             *_fix(fix))
            if stat_mod.S_IMODE(st.st_mode) != 0o700:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    check_components(p, setting, fix)


def ensure_private_dir(p: str, setting: str, fix: Optional[str] = None,
                       contents: str = "the snapshots (model weights)") -> str:
    """Check ``p``'s folders, make it (0700, its missing folders 0700) when absent, and check it
    after: a private real directory of this user. Existing contents are kept (snapshots there are
    what a restart restores)."""
    p = os.path.abspath(p)
    if p == os.sep:
        raise refuse(setting, p, "is the root directory", *_fix(fix))
    check_components(p, setting, fix)
    make_parents(p, setting, fix)   # missing folders: ours, 0700 whatever the umask
    mkdir_private(p, setting, fix)
    check_private(p, setting, fix, contents)
    return p
