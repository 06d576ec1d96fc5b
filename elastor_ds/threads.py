"""elastor's threads carry their names to the OS: ``top -H``, ``ps -L``, py-spy and
``/proc/<pid>/task/<tid>/comm`` then tell the checkpoint writer, its helpers and the heartbeats
apart from the training thread (Python threads are otherwise all named after the process).

:class:`NamedThread` is a :class:`threading.Thread` that, on Linux, sets its OS name
(``prctl(PR_SET_NAME)``, 15 bytes) from its Python name as it starts, ``elastor-`` shortened to
``el-``: ``elastor-direct-write`` shows as ``el-direct-write``. Elsewhere, or where the call
fails, the thread runs unnamed at the OS level, as before."""
from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15
_libc: "ctypes.CDLL | None | bool" = None   # None: not looked up yet; False: not available


def os_name(name: str) -> str:
    """The OS-level name for a thread named ``name`` (15 bytes at most)."""
    short = name.replace("elastor-", "el-", 1) if name.startswith("elastor-") else name
    return short.encode("utf-8", "replace")[:15].decode("utf-8", "ignore")


def set_os_name(name: str) -> bool:
    """Name the calling thread ``os_name(name)`` at the OS level; False where that is not possible."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    if not _libc:
        return False
    try:
        return _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(os_name(name).encode()), 0, 0, 0) == 0
    except (AttributeError, OSError):   # a libc without prctl
        return False


class NamedThread(threading.Thread):
    """A thread whose OS-level name follows its Python name (see the module docstring)."""

    def run(self) -> None:
        set_os_name(self.name)
        super().run()
