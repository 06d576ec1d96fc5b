"""``torch.save`` for the exporters (DeepSpeed universal, Megatron), with a full disk named as one.

torch's zip writer reports a failed write as a ``RuntimeError`` ("basic_ios::clear: iostream
error", "[enforce fail at inline_container.cc:672] . unexpected pos ...") and drops the ``OSError``
behind it, so a full disk read as an internal error. :func:`save_pt` checks the file system right
after such a failure (before any clean-up frees space) and raises ``OSError(ENOSPC)`` naming the
file when the file system is full, an ``OSError(EIO)`` naming it otherwise.
"""
from __future__ import annotations

import errno
import os
from typing import Any

import torch

__all__ = ["save_pt"]

FULL_BELOW = 1 << 20   # free bytes under which a failed write is taken as a full file system


def save_pt(obj: Any, path: str) -> None:
    try:
        torch.save(obj, path)
    except RuntimeError as e:
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(path)))
            full = st.f_bavail * st.f_frsize < FULL_BELOW
        except OSError:
            full = False
        if full:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} writing {path}") from e
        raise OSError(errno.EIO, f"torch.save could not write {path} ({e})") from e
