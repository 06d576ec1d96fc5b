"""The per-job secret and the keyed digests of everything that crosses nodes.

CRC32 detects accidents, not tampering. Bytes that come from another node (the snapshot server's
responses, peer copies received over gloo) are authenticated with HMAC-SHA256 under a per-job key
that only the job's processes know:

- the key is derived from a secret file the user gives every node (``elastor run --job-secret-file
  FILE``: a regular file of at least 32 bytes, owned by the user, mode 0600 or stricter, opened
  without following a symlink); the derivation binds it to this protocol's label, so the file
  itself never goes on the wire;
- the controller hands the workers the file's *path* (``ELASTOR_JOB_SECRET_FILE``), never the
  secret: not in the environment, not in the rendezvous store, not in a path; each worker reads
  and checks the file itself;
- requests to a snapshot server carry a MAC over (method, path, range, nonce, time); responses a
  MAC over (the request's nonce, status, range, file size, body); peer copies one MAC per file
  over (origin, step, name, bytes).

Stdlib only (no torch).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Iterable, Optional

from ..elastic.protocol import ENV_JOB_SECRET_FILE, LaunchContext, launch_context
from ..errors import ConfigError

__all__ = ["ENV_JOB_SECRET_FILE", "load_key", "job_key", "request_mac", "response_mac", "file_mac", "MIN_SECRET",
           "new_key_file_hint"]

MIN_SECRET = 32
_MAX_SECRET = 64 * 1024
_LABEL = b"elastor-ds job key v1"
_cache: dict[tuple, bytes] = {}


def new_key_file_hint(path: str) -> str:
    return f"create it with: (umask 077; head -c 32 /dev/urandom > {path}) and give every node the same file"


def load_key(path: str, what: str = "--job-secret-file") -> bytes:
    """The job key derived from secret file ``path``; ConfigError naming the problem otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot open it ({e.strerror}; a symlink is not followed); "
                          f"{new_key_file_hint(path)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path}: not a regular file; {new_key_file_hint(path)}")
        if st.st_uid != os.getuid():
            raise ConfigError(f"{what} {path}: owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
                              f"{new_key_file_hint(path)}")
        if st.st_mode & 0o077:
            raise ConfigError(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it; "
                              f"chmod 600 {path}")
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if key in _cache:
            return _cache[key]
        data = os.read(fd, _MAX_SECRET + 1)
    finally:
        os.close(fd)
    if not MIN_SECRET <= len(data) <= _MAX_SECRET:
        raise ConfigError(f"{what} {path}: {len(data)} bytes; it needs {MIN_SECRET} to {_MAX_SECRET} random bytes; "
                          f"{new_key_file_hint(path)}")
    derived = hmac.new(data, _LABEL, hashlib.sha256).digest()
    _cache[key] = derived
    return derived


def job_key(env: Optional[dict] = None) -> Optional[bytes]:
    """The job key of a worker launched by ``elastor run --job-secret-file`` (None without one)."""
    path = (launch_context() if env is None else LaunchContext.from_env(env)).job_secret_file
    return load_key(path, ENV_JOB_SECRET_FILE) if path else None


def _fields(*parts: object) -> bytes:
    return b"\n".join(str(p).encode("utf-8", "surrogateescape") for p in parts) + b"\n"


def request_mac(key: bytes, method: str, path: str, rng: str, nonce: str, when: str) -> str:
    return hmac.new(key, b"req\n" + _fields(method, path, rng, nonce, when), hashlib.sha256).hexdigest()


def response_mac(key: bytes, nonce: str, status: int, rng: str, size: str, body: Iterable) -> str:
    """MAC of a response to the request with ``nonce``; ``body``: its bytes, in pieces."""
    h = hmac.new(key, b"resp\n" + _fields(nonce, status, rng, size), hashlib.sha256)
    for piece in body:
        h.update(piece)
    return h.hexdigest()


def file_mac(key: bytes, origin: str, step: str, relpath: str, data) -> str:
    """Keyed digest of one peer-copied file (``data``: a bytes-like object)."""
    h = hmac.new(key, b"peer\n" + _fields(origin, step, relpath), hashlib.sha256)
    h.update(data)
    return h.hexdigest()
