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
- requests to a snapshot server carry an HMAC-SHA256 over (method, path, range, nonce, time, the
  server's published address);
  responses a MAC over (the request's nonce, status, range, file size, body) and peer copies one
  MAC per file over (origin, step, name, bytes): GMAC (AES-256-GCM, a random nonce per message)
  under a key derived for each use, ~10x faster than HMAC-SHA256 on the bytes of every snapshot
  sent; HMAC-SHA256 where the ``cryptography`` package is missing (a receiver checks either).

Stdlib (no torch), plus ``cryptography`` for GMAC when it is installed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Any, Iterable, Optional

from ..elastic.protocol import ENV_JOB_SECRET_FILE, LaunchContext, launch_context
from ..errors import ConfigError

__all__ = ["ENV_JOB_SECRET_FILE", "load_key", "job_key", "request_mac", "response_mac", "response_mac_matches",
           "file_mac", "FileMac",
           "GMAC_AVAILABLE", "MIN_SECRET",
           "new_key_file_hint"]

MIN_SECRET = 32
_MAX_SECRET = 64 * 1024
_LABEL = b"elastor-ds job key v1"
_cache: dict[tuple, bytes] = {}


def new_key_file_hint(path: str, exists: bool = False) -> str:
    """How to make a secret file at ``path``; ``exists``: a file someone else owns is there, which
    ``>`` would write into (keeping its owner): name a new file instead."""
    if exists:
        return ("name a new file in a folder of your own and create it with: (umask 077; head -c 32 /dev/urandom "
                "> NEWFILE); give every node the same file")
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
                              f"{new_key_file_hint(path, exists=True)}")
        if st.st_mode & 0o077:
            raise ConfigError(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it; "
                              f"chmod 600 {path}")
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if key in _cache:
            return _cache[key]
        if st.st_size > _MAX_SECRET:   # the size itself, not the bounded read's length
            raise ConfigError(f"{what} {path}: {st.st_size} bytes; it needs {MIN_SECRET} to {_MAX_SECRET} random "
                              f"bytes; {new_key_file_hint(path)}")
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


def request_mac(key: bytes, method: str, path: str, rng: str, nonce: str, when: str, target: str) -> str:
    """A request's MAC. ``target``: the server's address as it published it (``HOST:PORT``, what the
    client dialled): a server refuses a request MAC'd for another address, so a signed request sent
    to whoever put its address among the peers cannot be relayed to the real server."""
    return hmac.new(key, b"req\n" + _fields(method, path, rng, nonce, when, target), hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------------------------- peer-copied files
# A peer copy moves a whole snapshot per step, so its MAC runs over every byte twice (sender and
# receiver). HMAC-SHA256 runs at ~0.4-1 GB/s here (18-45 ms per 17 MiB); GMAC (AES-256-GCM with the
# file as associated data and no plaintext; AES-NI and carry-less multiply) at ~8 GB/s (2 ms). GMAC
# needs a fresh nonce per message (a repeated nonce under one key leaks the hash key): 96 random
# bits per file, sent with the tag. Its key is derived from the job key for this use only. Without
# the ``cryptography`` package (a dependency; a missing one is tolerated) files carry HMAC-SHA256,
# and a receiver checks whichever of the two a tag is.
try:  # pragma: no cover - depends on the environment
    from cryptography.hazmat.primitives.ciphers import Cipher as _Cipher, algorithms as _algorithms, modes as _modes
except ImportError:  # pragma: no cover
    _Cipher = None

GMAC_AVAILABLE = _Cipher is not None
_GMAC_LABEL = b"elastor-ds peer-copy gmac v1"
_GMAC_PREFIX = "g1."
_MAC_PIECE = 1 << 20
_gmac_keys: dict[tuple[bytes, bytes], bytes] = {}


def _tag_nonce(tag: str) -> bytes:
    """The 12-byte nonce of a well-formed GMAC tag ``g1.<24 hex>.<32 hex>``; b"" for anything else
    (a tag from the wire: never an exception)."""
    parts = tag.split(".")
    if len(parts) != 3 or len(parts[1]) != 24 or len(parts[2]) != 32:
        return b""
    try:
        return bytes.fromhex(parts[1])
    except ValueError:
        return b""


class _KeyedMac:
    """Incremental keyed digest of one message (``head``, then the bytes given to ``update`` in
    order): :meth:`hexdigest` (the sender's tag) or :meth:`matches` (the receiver's check, constant
    time). ``tag``: the sender's tag (receiver; its scheme and nonce are taken from it); None: a new
    tag (sender; GMAC unless ``scheme`` is "hmac" or GMAC is unavailable). ``label``: what the GMAC
    key is derived for (one key per use)."""

    def __init__(self, key: bytes, label: bytes, head: bytes, tag: Optional[str] = None, scheme: str = "gmac"):
        self.nonce: Optional[bytes] = None
        if tag is not None:
            scheme = "gmac" if tag.startswith(_GMAC_PREFIX) else "hmac"
            if scheme == "gmac":
                self.nonce = _tag_nonce(tag)
        elif scheme == "gmac" and GMAC_AVAILABLE:
            self.nonce = os.urandom(12)
        else:
            scheme = "hmac"
        self.scheme = scheme
        self._h: Any = None
        self._enc: Any = None
        if scheme == "hmac":
            self._h = hmac.new(key, head, hashlib.sha256)
        elif GMAC_AVAILABLE and self.nonce and len(self.nonce) == 12:
            gk = _gmac_keys.get((key, label))
            if gk is None:
                gk = _gmac_keys[(key, label)] = hmac.new(key, label, hashlib.sha256).digest()
            self._enc = _Cipher(_algorithms.AES(gk), _modes.GCM(self.nonce)).encryptor()
            self._enc.authenticate_additional_data(head)
        # else: a GMAC tag this process cannot check (no cryptography, or a malformed nonce): never matches

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        for a in range(0, len(mv), _MAC_PIECE):
            piece = mv[a:a + _MAC_PIECE]
            if self._h is not None:
                self._h.update(piece)
            elif self._enc is not None:
                self._enc.authenticate_additional_data(piece)

    def hexdigest(self) -> str:
        if self._h is not None:
            return self._h.hexdigest()
        if self._enc is None:
            raise ValueError("no GMAC key: this tag cannot be computed here")
        self._enc.finalize()
        return f"{_GMAC_PREFIX}{self.nonce.hex()}.{self._enc.tag.hex()}"   # type: ignore[union-attr]

    def matches(self, tag: str) -> bool:
        if (self._h is None and self._enc is None) or not isinstance(tag, str) or not tag.isascii():
            return False   # compare_digest refuses non-ASCII text: a tag from the wire fails, never raises
        return hmac.compare_digest(self.hexdigest(), tag)


class FileMac(_KeyedMac):
    """The keyed digest of one peer-copied file, over (origin, step, name) and its bytes."""

    def __init__(self, key: bytes, origin: str, step: str, relpath: str, tag: Optional[str] = None,
                 scheme: str = "gmac"):
        super().__init__(key, _GMAC_LABEL, b"peer\n" + _fields(origin, step, relpath), tag, scheme)


def file_mac(key: bytes, origin: str, step: str, relpath: str, data, scheme: str = "gmac") -> str:
    """Keyed digest of one peer-copied file (``data``: a bytes-like object): GMAC with a fresh
    nonce (``g1.<nonce>.<tag>``) or, with ``scheme`` "hmac" or without GMAC, HMAC-SHA256 (hex)."""
    m = FileMac(key, origin, step, relpath, scheme=scheme)
    m.update(data)
    return m.hexdigest()


# ---------------------------------------------------------------------------------------------- server responses
# A snapshot server's answer to one request: (the request's nonce, status, Content-Range, file size,
# body). The body of a file range is up to MAX_RANGE bytes of a snapshot, MAC'd by the server and
# again by the client, so it takes GMAC like a peer copy, under its own derived key and with its
# own random nonce per response; a client checks a GMAC or an HMAC-SHA256 tag.
_RESP_GMAC_LABEL = b"elastor-ds snapshot-response gmac v1"


def _response(key: bytes, nonce: str, status: int, rng: str, size: str, tag: Optional[str], scheme: str) -> "_KeyedMac":
    return _KeyedMac(key, _RESP_GMAC_LABEL, b"resp\n" + _fields(nonce, status, rng, size), tag, scheme)


def response_mac(key: bytes, nonce: str, status: int, rng: str, size: str, body: Iterable,
                 scheme: str = "gmac") -> str:
    """Tag of a response to the request with ``nonce`` (server); ``body``: its bytes, in pieces.
    GMAC with a fresh nonce (``g1.<nonce>.<tag>``) or, with ``scheme`` "hmac" or without GMAC,
    HMAC-SHA256 (hex)."""
    m = _response(key, nonce, status, rng, size, None, scheme)
    for piece in body:
        m.update(piece)
    return m.hexdigest()


def response_mac_matches(key: bytes, nonce: str, status: int, rng: str, size: str, body: Iterable, tag: str) -> bool:
    """Whether ``tag`` (GMAC or HMAC-SHA256) authenticates this response (client; constant time)."""
    m = response_checker(key, nonce, status, rng, size, tag)
    for piece in body:
        m.update(piece)
    return m.matches(tag)


def response_checker(key: bytes, nonce: str, status: int, rng: str, size: str, tag: str) -> "_KeyedMac":
    """The client's incremental check of a response whose header carried ``tag``: ``update`` it with
    each piece of the body as it arrives (while the piece is in cache), then ``matches(tag)``."""
    return _response(key, nonce, status, rng, size, tag, "gmac")
