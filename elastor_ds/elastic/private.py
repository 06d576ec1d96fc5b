"""Private directories and files of ``elastor run`` in folders other local users may write to.

The log directory (``--log-dir``) may be a shared, world-writable folder. Everything the controller
creates there that a process later trusts (the standby pool's folder, the heartbeat folders) is a
directory that only this user can enter, made and then checked the same way every time:

1. the parent and every folder above it: refused when others may write to it without the sticky
   bit (``/tmp``-like folders have it: there nobody but the folder's owner can rename or remove
   another user's entries), or when another user (root aside) owns it, sticky or not: its owner
   may rename or replace our entries whatever its mode says, and swap our directory for theirs
   after every check;
2. ``mkdir(path, 0o700)``; an existing entry is accepted only when ``lstat`` shows a real directory
   (not a symlink) owned by this user; ours but readable by others (made before this rule) is
   narrowed to 0700 through an ``O_NOFOLLOW`` descriptor of it;
3. checked after creation: ``lstat`` again, ``st_uid == getuid()``, ``mode & 0o077 == 0``.

Files in them are opened with ``O_NOFOLLOW`` and checked with ``fstat`` (a regular file of ours).
Every refusal is a :class:`~elastor_ds.errors.ConfigError` naming the path and the fix (exit 2).
"""
from __future__ import annotations

import os
import stat

from ..errors import ConfigError

__all__ = ["check_parent", "private_dir", "open_private", "is_private_dir"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def check_parent(path: str, what: str) -> None:
    """``path`` (an existing directory) may hold our private entries: not writable by others
    without the sticky bit, not owned by another user (root aside) even with it, and no folder
    above it either (:func:`~elastor_ds.checkpoint.private_dir.check_components`)."""
    from ..checkpoint.private_dir import check_components
    st = os.stat(path)
    sticky = st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky:
        raise ConfigError(f"{what} {path}: any user may write to it (mode {stat.S_IMODE(st.st_mode):04o}, no sticky "
                          f"bit), so another user could replace what elastor run creates there; give a directory "
                          f"of your own (or one with the sticky bit, like /tmp)")
    if st.st_uid not in (os.getuid(), 0):
        # its owner may rename or replace our entries whatever its mode or sticky bit says
        raise ConfigError(f"{what} {path}: owned by uid {st.st_uid}, not by you (uid {os.getuid()}) or root, so its "
                          f"owner could replace what elastor run creates there (a sticky bit does not stop the "
                          f"folder's owner); give a directory of your own")
    check_components(os.path.join(path, "x"), what, "give a --log-dir under folders owned by you or root")


def is_private_dir(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def private_dir(path: str, what: str = "private directory") -> str:
    """Create (or accept our own) ``path`` as a 0700 directory of this user; see the module docstring."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    check_parent(parent, f"the folder of the {what}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot create it ({e.strerror}); give a writable --log-dir") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path}: exists and is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}"
                          f" (planted by another user?); remove it or give another --log-dir")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{what} {path}: exists and belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                          f"another user may have planted it; remove it or give a --log-dir of your own")
    if st.st_mode & 0o077:   # ours, made before directories were private: narrow it without following links
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
        try:
            fst = os.fstat(fd)
            if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        st = os.lstat(path)
    if not is_private_dir(st) or stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{what} {path}: not a private directory of yours after creation (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}); give another --log-dir")
    return path


def open_private(path: str, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink and accepts only a regular file of ours."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as e:
        raise ConfigError(f"{path}: cannot open it safely ({e.strerror}; a symlink is never followed); remove it or "
                          f"give another --log-dir") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise ConfigError(f"{path}: not a regular file of yours (uid {st.st_uid}); remove it or give another --log-dir")
    return fd
