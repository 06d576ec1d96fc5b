"""The `elastor` CLI as a user runs it (a subprocess), and the checks the CLI tests share: a failure
is one line naming what is wrong, never a traceback; a destination's bytes before and after."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys


def elastor(*argv: str, timeout: float = 180, env_extra: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "elastor_ds.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def assert_one_line_failure(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """Exit ``code``, no traceback, one error line holding every one of ``words``; that line."""
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.startswith(("ERROR", "elastor", "error", "CORRUPT"))]
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def tree_hash(path: str) -> str:
    """Every file's path and bytes under ``path`` (sorted): equal hashes, an untouched tree."""
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            h.update(os.path.join(d, f).encode())
            with open(os.path.join(d, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()
