"""Real faults at deterministic points, for tests and ``tests/faults/fault_campaign.py``.

:func:`kill_at_io` wraps the file-system calls a save makes (``os.open``, ``os.write``,
``os.fsync``, ``os.rename``, ``os.replace``, ``os.mkdir``, ``os.rmdir``, ``os.unlink``, the
checkpoint commit's directory exchange, ``shutil.rmtree``) so that the process SIGKILLs itself just
before its ``n``-th such call: the same ``n`` always stops the same save at the same point, and
``n`` = 1, 2, ... walks every phase of a save (data writes, fsyncs, manifest, renames, ``latest``,
retention). Use it in a forked child or a subprocess, never in the test process itself.

:func:`run_forked` runs a function in a forked child and returns its exit status (negative: the
signal that ended it), with a timeout that SIGKILLs a hung child.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Callable, Optional

_OS_CALLS = ("open", "write", "pwrite", "fsync", "rename", "replace", "mkdir", "rmdir", "unlink")


class IoCounter:
    """Counts wrapped calls; kills the process before call number ``kill_at`` (1-based; 0: never)."""

    def __init__(self, kill_at: int = 0):
        self.kill_at, self.count, self.last = kill_at, 0, ""
        self._lock = threading.Lock()

    def hit(self, what: str) -> None:
        with self._lock:
            self.count += 1
            self.last = what
            if self.kill_at and self.count >= self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # not reached


def kill_at_io(n: int, exchange_supported: Optional[bool] = None) -> IoCounter:
    """Install the wrappers in this process (see module docstring); ``n`` = 0 only counts.
    ``exchange_supported=False`` forces the commit's no-exchange fallback."""
    from ..checkpoint import commit as commit_mod

    counter = IoCounter(n)
    for name in _OS_CALLS:
        orig = getattr(os, name, None)
        if orig is None:
            continue

        def wrap(*a, __orig=orig, __name=name, **k):
            counter.hit(f"os.{__name}")
            return __orig(*a, **k)
        setattr(os, name, wrap)
    orig_rmtree = shutil.rmtree

    def rmtree(*a, **k):
        counter.hit("shutil.rmtree")
        return orig_rmtree(*a, **k)
    shutil.rmtree = rmtree  # type: ignore[assignment]
    orig_exchange = commit_mod._exchange

    def exchange(a: str, b: str) -> bool:
        counter.hit("commit.exchange")
        if exchange_supported is False:
            return False
        return orig_exchange(a, b)
    commit_mod._exchange = exchange  # type: ignore[assignment]
    return counter


def wait_or_kill(pid: int, timeout_s: float, poll_s: float = 0.002) -> Optional[int]:
    """Wait for child ``pid``; return its wait status, or None after SIGKILLing it at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(poll_s)


def run_forked(fn: Callable[[], None], timeout_s: float = 60.0) -> int:
    """Run ``fn`` in a forked child: 0 when it returned, 1 when it raised, -signal when killed
    (a child still running after ``timeout_s`` is SIGKILLed and reported as ``-SIGKILL - 1000``)."""
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    status = wait_or_kill(pid, timeout_s)
    if status is None:
        return -signal.SIGKILL - 1000
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)
