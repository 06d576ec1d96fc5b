"""Run a test's attacker (or a user without rights) as another local user: a forked child that
drops to that uid and gid first. Needs root (CI runs as root)."""
from __future__ import annotations

import os
import pwd
from typing import Callable

import pytest


def nobody_ids() -> tuple[int, int]:
    """(uid, gid) of user nobody; skips the test when this process cannot become another user."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user (CI runs as root)")
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def as_other_user(uid_gid: tuple[int, int], fn: Callable[[], None]) -> None:
    """``fn()`` in a forked child that first becomes ``uid_gid`` (no supplementary groups); fails the
    test unless the child exits 0 (its traceback is printed)."""
    uid, gid = uid_gid
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            assert os.getuid() == uid and os.geteuid() == uid
            fn()
            code = 0
        except BaseException:  # noqa: BLE001 - shown in the test's output
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child as uid {uid} failed (its traceback is above)"
