"""A small real tmpfs for the full-disk tests: mounted for the test (root), filled to the last byte."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(mnt, size: str):
    """Mount a ``size`` tmpfs (``"8m"``) on the new folder ``mnt`` for the ``with`` block; a test
    running as root that cannot mount fails, others skip. Unmounted after (lazily when a process
    still exiting holds it)."""
    os.mkdir(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        if os.geteuid() == 0:
            pytest.fail(f"cannot mount a tmpfs as root: {r.stderr.strip()}")
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path) -> None:
    """Write the new file ``path`` until its file system has no byte left (others may write beside
    it meanwhile: no size is computed in advance)."""
    block = b"\0" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    return
                raise
    finally:
        os.close(fd)
