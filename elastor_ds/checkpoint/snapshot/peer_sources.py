"""Chunk sources that cross nodes: peer copies held on this node, and other nodes' snapshot servers.

Both follow the ``ChunkSource`` protocol of :mod:`.sources` (``name``, ``bytes_read``,
``has(relpath, size)``, ``read_into(relpath, offset, views)``); ``relpath`` is a file name as the
manifest names it, relative to the step directory. They only move bytes: the reader checks every
byte against the manifest's CRCs whatever the source, and falls back to the next source on a
mismatch or on the :class:`~elastor_ds.errors.IncompleteCheckpointError` these raise for a missing,
short or unreachable file.

- :class:`PeerCopySource` (``peer-memory``): ``$ELASTOR_SNAPSHOT_DIR/peer/<origin>/<step>/``
  directories that carry a ``COMPLETE`` marker (written last by :mod:`elastor_ds.checkpoint.snapshot.peer_copy`).
- :class:`RemoteSource` (``remote:<host:port>``): another node's
  :class:`~elastor_ds.checkpoint.snapshot.server.SnapshotServer`: its committed ``local/<step>`` and
  its complete peer copies, read with signed HTTP range requests whose answers carry a MAC under the
  job key (:mod:`.auth`), checked piece by piece as the bytes arrive. The reader's ``prefetch`` hints
  send the next request ahead on a second keep-alive connection, so the server authenticates it and
  MACs its bytes while the current answer arrives (a reading thread keeps two connections to the
  server: the answer being read, the request ahead).
- :func:`node_sources`: the list for a restore, nearest first: peer copies here, then each other
  live node's server in ``ELASTOR_SNAPSHOT_PEERS`` order.

Stdlib only (no torch).
"""
from __future__ import annotations

import collections
import http.client
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
import urllib.parse
from typing import Optional, Sequence

from ...elastic.protocol import ENV_SNAPSHOT_DIR, ENV_SNAPSHOT_PEERS, ENV_SNAPSHOT_SELF, launch_context
from ...errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ..auth import job_key, request_mac, response_checker, response_mac_matches
from ..paths import open_regular, safe_join
from ..fileformat import pread_into
from ...threads import NamedThread

log = logging.getLogger(__name__)

__all__ = ["PeerCopySource", "RemoteSource", "node_sources", "ENV_SNAPSHOT_DIR", "ENV_SNAPSHOT_PEERS", "COMPLETE",
           "PEER_DIR", "LOCAL_DIR", "ENV_SNAPSHOT_SELF"]   # the names: re-exported from elastic.protocol

COMPLETE = "COMPLETE"
PEER_DIR = "peer"
LOCAL_DIR = "local"
MAX_RANGE = 16 << 20       # bytes per request to a snapshot server (the server refuses more: 416)
# requests sent ahead of the read that runs (the reader's ``prefetch`` hints), each on its own
# keep-alive connection: the server authenticates and MACs the next range while this one arrives
MAX_AHEAD = 1
MAX_HINTS = 64             # announced reads remembered per thread
_RECV_PIECE = 1 << 20      # the answer's MAC is checked piece by piece as the bytes arrive (in cache)
MIN_RATE = 1 << 20         # bytes/s an answer must keep up on average (beyond timeout_s) or it is abandoned
MAX_INDEX = 1 << 16        # bytes of an /index answer read before its MAC is checked (a few origins: peer_copies <= 1)
_UNAUTH_BODY = 1 << 16     # bytes of an answer that will not be used (busy, wrong status) read before hanging up


class _Watch:
    """One exchange watched by :data:`_WATCHDOG`: ``fired`` once its socket was shut at ``deadline``."""

    __slots__ = ("sock", "deadline", "within", "fired")

    def __init__(self, sock: socket.socket, deadline: float, within: float):
        self.sock, self.deadline, self.within, self.fired = sock, deadline, within, False

    def cancel(self) -> bool:
        """Stop watching; True when the deadline had already passed (the socket is shut: drop the connection)."""
        return _WATCHDOG.cancel(self)


class _Watchdog:
    """Shuts a connection's socket down when its exchange (the answer's head and body) runs past its
    deadline. http.client reads an answer's status line and headers with only the socket's per-recv
    timeout, and skips any number of ``100 Continue`` answers: a sender that trickled its head a byte
    at a time, or streamed interim answers, held a reader as long as it liked. A shut socket makes
    the blocked ``recv`` return at once (end of file), whatever http.client is waiting for."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._watches: set[_Watch] = set()
        self._thread: Optional[threading.Thread] = None

    def arm(self, sock: Optional[socket.socket], within: float) -> _Watch:
        if sock is None:
            raise ConnectionResetError("the connection is closed")
        w = _Watch(sock, time.monotonic() + within, within)
        with self._cv:
            self._watches.add(w)
            if self._thread is None:
                self._thread = NamedThread(target=self._run, name="elastor-remote-watchdog", daemon=True)
                self._thread.start()
            self._cv.notify()
        return w

    def cancel(self, w: _Watch) -> bool:
        with self._cv:
            self._watches.discard(w)
            return w.fired

    def _run(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                for w in [w for w in self._watches if w.deadline <= now]:
                    self._watches.discard(w)
                    w.fired = True
                    try:
                        w.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:   # closed already: nothing to wake
                        pass
                nxt = min((w.deadline for w in self._watches), default=None)
                self._cv.wait(None if nxt is None else max(0.0, nxt - now))


_WATCHDOG = _Watchdog()


def _recv_into(r: http.client.HTTPResponse, b: memoryview) -> int:
    """Bytes of ``r``'s body (a ``Content-Length`` answer) into ``b`` with at most one ``recv``, so
    that a deadline checked between calls bounds the wait (``readinto`` loops until ``b`` is full,
    each ``recv`` with its own timeout: a byte now and then kept it going). The response's count of
    bytes left is kept, and it is closed at its end, as ``readinto`` does (the connection stays
    usable for the next request)."""
    fp = r.fp
    if fp is None:
        return 0
    if r.length is not None:
        b = b[:r.length]
    if not len(b):
        return 0
    k = fp.readinto1(b)
    if r.length is not None:
        r.length -= k
        if r.length == 0:
            r.read()   # b"": marks the answer read whole
    return k


def _read_body(r: http.client.HTTPResponse, limit: int, deadline: float, name: str) -> bytes:
    """At most ``limit`` bytes of ``r``'s body, all by ``deadline`` (time.monotonic())."""
    out = bytearray()
    while len(out) < limit:
        if time.monotonic() > deadline:
            raise IncompleteCheckpointError(f"{name}: an answer was not received in time")
        got = r.read1(min(1 << 16, limit - len(out)))
        if not got:
            break
        out += got
    if r.length == 0:
        r.read()   # b"": marks the answer read whole (read1 leaves it open), so the connection is reused
    return bytes(out)


def _views_len(views: Sequence[memoryview]) -> int:
    return sum(v.nbytes for v in views)


class PeerCopySource:
    """Peer copies of other nodes' chunk files held in this node's snapshot directory."""

    name = "peer-memory"
    thread_safe = True
    in_memory = True   # files on this node's tmpfs: the reader takes them in cache-sized pieces

    def __init__(self, snapshot_dir: str, step_name: str):
        self.root = os.path.join(snapshot_dir, PEER_DIR)
        self.step_name = step_name
        self.bytes_read = 0
        self._dirs: Optional[list[str]] = None
        self._where: dict[str, str] = {}
        self._fds: dict[str, tuple[int, int]] = {}   # relpath -> (descriptor, size), opened once
        self._lock = threading.Lock()

    def _complete_dirs(self) -> list[str]:
        if self._dirs is None:
            out = []
            try:
                origins = sorted(os.listdir(self.root))
            except OSError:
                origins = []
            for o in origins:
                if o.startswith("."):
                    continue
                try:
                    d = safe_join(safe_join(self.root, o, what="peer origin"), self.step_name, what="step dir")
                except Exception:  # noqa: BLE001 - a crafted name is simply not a source
                    continue
                if os.path.isfile(os.path.join(d, COMPLETE)):
                    out.append(d)
            self._dirs = out
        return self._dirs

    def _path(self, relpath: str, size: int) -> Optional[str]:
        for d in self._complete_dirs():
            p = safe_join(d, relpath, what="chunk file", allow_subdirs=True)
            try:
                if os.path.getsize(p) == size and os.path.isfile(p):
                    return p
            except OSError:
                continue
        return None

    def where(self, relpath: str) -> str:
        p = self._where.get(relpath)
        return f"peer copy held in this node's memory {p}" if p else f"peer copies under {self.root} ({relpath})"

    def has(self, relpath: str, size: int) -> bool:
        p = self._path(relpath, size)
        if p is not None:
            with self._lock:
                self._where[relpath] = p
        return p is not None

    def _fd(self, relpath: str) -> tuple[int, int]:
        """The held copy's descriptor and size, opened once per load (a regular file only), not an
        open, a stat and a close for each of the reader's 1 MiB pieces."""
        got = self._fds.get(relpath)
        if got is not None:
            return got
        with self._lock:
            got = self._fds.get(relpath)
            if got is None:
                p = self._where.get(relpath)
                if p is None:
                    raise IncompleteCheckpointError(f"{self.name}: no complete peer copy of {relpath!r} of "
                                                    f"{self.step_name}")
                try:
                    fd = open_regular(p)
                except FileNotFoundError:
                    raise IncompleteCheckpointError(f"{p}: the peer copy is gone") from None
                got = self._fds[relpath] = (fd, os.fstat(fd).st_size)
        return got

    def read_into(self, relpath: str, offset: int, views: Sequence[memoryview]) -> None:
        fd, size = self._fd(relpath)
        n = _views_len(views)
        if size < offset + n:
            raise IncompleteCheckpointError(f"{self._where.get(relpath)}: shorter than {offset + n} bytes")
        pread_into(fd, views, offset)
        with self._lock:
            self.bytes_read += n

    def close(self) -> None:
        with self._lock:
            fds = [fd for fd, _ in self._fds.values()]
            self._fds.clear()
        for fd in fds:
            os.close(fd)


class RemoteSource:
    """Another node's snapshot server: its committed ``local/<step>`` or a complete peer copy it holds.

    Every request is signed with the job key and every answer's MAC is checked before its bytes are
    used (:mod:`.auth`); reads go in pieces of at most :data:`MAX_RANGE` bytes. A busy server
    (``503``) or a dropped connection is retried for up to ``busy_wait_s``. ``target``: the address
    the server published, which every request is signed for (default ``address``, the one dialled;
    another only where something between forwards the connection on purpose)."""

    thread_safe = True

    def __init__(self, address: str, step_name: str, key: bytes, timeout_s: float = 30.0, busy_wait_s: float = 30.0,
                 target: Optional[str] = None):
        host, _, port = address.rpartition(":")
        if not host or not re.fullmatch(r"[0-9]{1,5}", port):
            raise ValueError(f"snapshot server address {address!r}: expected HOST:PORT")
        if not isinstance(key, bytes) or not key:
            raise ValueError("a remote source needs the job key")
        self.address = address
        self.target = target or address
        self.host, self.port = host.strip("[]"), int(port)
        self.name = f"remote:{address}"
        self.step_name = step_name
        self.key = key
        self.timeout_s = timeout_s
        self.busy_wait_s = busy_wait_s
        self.bytes_read = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._index: Optional[dict] = None
        self._where: dict[str, str] = {}
        self._sizes: dict[str, int] = {}   # candidate path -> the file size its HEAD answer gave (the manifest's)
        self._down = False
        self._ahead_conns: list[http.client.HTTPConnection] = []   # every ahead connection (any thread): closed by close()

    # --------------------------------------------------------------- HTTP
    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None

    def _headers(self, method: str, path: str, rng: str) -> tuple[dict, str]:
        """A signed request's headers (a fresh nonce) and the nonce."""
        nonce = secrets.token_hex(16)
        when = str(int(time.time()))
        # the MAC names the server as published (what this source dials): a server at another address,
        # whoever put it among the peers, cannot relay the request to the real one
        headers = {"X-Elastor-Nonce": nonce, "X-Elastor-Time": when, "X-Elastor-Target": self.target,
                   "X-Elastor-Auth": request_mac(self.key, method, path, rng, nonce, when, self.target)}
        if rng:
            headers["Range"] = rng
        return headers, nonce

    def _request(self, method: str, path: str, rng: str = "",
                 within: Optional[float] = None) -> tuple[http.client.HTTPResponse, str, _Watch]:
        """(response, nonce, watch) of a signed request; retried on a dropped connection or a busy
        server. The watch shuts the connection ``within`` seconds (``timeout_s`` by default) after the
        request went out, whatever part of the answer is still to come: the caller reads the body,
        then ends the exchange with :meth:`_done`."""
        within = self.timeout_s if within is None else within
        deadline = time.monotonic() + self.busy_wait_s
        delay = 0.05
        reused = getattr(self._local, "conn", None) is not None
        while True:
            headers, nonce = self._headers(method, path, rng)
            c = self._conn()
            w: Optional[_Watch] = None
            try:
                c.request(method, path, headers=headers)
                w = _WATCHDOG.arm(c.sock, within)
                r = c.getresponse()
                if r.status != 503:
                    if w.fired:   # http.client took a head cut short by the watchdog for a whole one
                        self._done(w, self._drop)
                    return r, nonce, w
                r.read(_UNAUTH_BODY)   # an unauthenticated answer: never read whole (its size is the sender's say)
                w.cancel()
                self._drop()
                # the server is at its connection limit: free the slots this thread holds for requests
                # sent ahead, and send none from now on (they would compete with this one)
                self._stop_ahead()
            except (ConnectionRefusedError, TimeoutError):   # the node is down: no waiting
                self._drop()
                if w is not None:
                    self._done(w, self._drop)
                raise
            except (http.client.HTTPException, OSError):
                self._drop()
                if w is not None:
                    self._done(w, self._drop)   # the deadline passed: no retry
                if reused:       # a keep-alive connection the server closed: once more at once
                    reused = False
                    continue
                if time.monotonic() + delay > deadline:   # reset at once: a busy server's 503 lost on the way
                    raise
            if time.monotonic() + delay > deadline:
                raise IncompleteCheckpointError(f"{self.name}: busy for {self.busy_wait_s:.0f} s")
            time.sleep(delay)
            delay = min(1.0, delay * 2)

    def _done(self, w: _Watch, drop) -> None:
        """End a watched exchange. One whose deadline passed (its socket shut by the watchdog) is
        abandoned: ``drop`` closes its connection and IncompleteCheckpointError says so."""
        if w.cancel():
            drop()
            raise IncompleteCheckpointError(f"{self.name}: no whole answer within {w.within:.1f} s (a server that "
                                            f"sends its answer too slowly, or never ends it, is not read)")

    def _verified(self, r: http.client.HTTPResponse, nonce: str, body_pieces) -> None:
        got = r.getheader("X-Elastor-Auth") or ""
        if not response_mac_matches(self.key, nonce, r.status, r.getheader("Content-Range") or "",
                                    r.getheader("X-File-Size") or "", body_pieces, got):
            self._drop()
            raise CorruptCheckpointError(f"{self.name}: the answer failed its authentication (not from this job's "
                                         f"server, or changed on the way)")

    def _get_index(self) -> dict:
        """What the server holds of this step; a server that does not answer is marked down for the
        rest of the restore, after a second try when the first timed out or its connection dropped
        (one slow answer, a connection closed among a flood of others, does not lose the node's copies)."""
        if self._index is None:
            idx: dict = {"local": False, "peer": []}
            for attempt in (1, 2):
                if self._down:
                    break
                try:
                    idx = self._fetch_index()
                    break
                except (ConnectionRefusedError, CorruptCheckpointError, ValueError) as e:   # down, or not ours
                    self._down = True
                    log.warning("%s unreachable (%s); not reading from it", self.name, e)
                except (http.client.HTTPException, OSError, CheckpointError) as e:
                    if attempt == 2:
                        self._down = True
                        log.warning("%s unreachable (%s, twice); not reading from it", self.name, e)
                    else:
                        log.info("%s: its index did not come (%s); asking once more", self.name, e)
            self._index = idx
        return self._index

    def _fetch_index(self) -> dict:
        idx: dict = {"local": False, "peer": []}
        r, nonce, w = self._request("GET", f"/index/{self.step_name}", within=self.timeout_s + MAX_INDEX / MIN_RATE)
        try:
            body = _read_body(r, MAX_INDEX, w.deadline, self.name)
        except BaseException:
            self._done(w, self._drop)   # the deadline's error when the watchdog cut it
            raise
        self._done(w, self._drop)
        self._verified(r, nonce, [body])
        if r.status == 200:
            got = json.loads(body)
            if isinstance(got, dict):
                idx["local"] = got.get("local") is True
                idx["peer"] = [o for o in got.get("peer", []) if isinstance(o, str)]
        return idx

    def _candidates(self, relpath: str) -> list[str]:
        idx = self._get_index()
        base = []
        if idx["local"]:
            base.append(f"{LOCAL_DIR}/{self.step_name}")
        base += [f"{PEER_DIR}/{o}/{self.step_name}" for o in idx["peer"]]
        return [f"{b}/{relpath}" for b in base]

    def has(self, relpath: str, size: int) -> bool:
        safe_join("/", relpath, what="chunk file", allow_subdirs=True)   # a crafted name is refused here too
        for cand in self._candidates(relpath):
            try:
                r, nonce, w = self._request("HEAD", "/f/" + urllib.parse.quote(cand))
                try:
                    r.read()
                finally:
                    self._done(w, self._drop)
                self._verified(r, nonce, [])
            except (http.client.HTTPException, OSError, CheckpointError) as e:
                log.warning("%s: HEAD %s failed (%s)", self.name, cand, e)
                return False
            if r.status == 200 and r.getheader("X-File-Size") == str(size):
                with self._lock:
                    self._where[relpath] = cand
                    self._sizes[cand] = size
                return True
        return False

    def where(self, relpath: str) -> str:
        return f"peer {self.address} ({self._where.get(relpath, relpath)})"

    def read_into(self, relpath: str, offset: int, views: Sequence[memoryview]) -> None:
        cand = self._where.get(relpath)
        if cand is None:
            raise IncompleteCheckpointError(f"{self.name}: holds no copy of {relpath!r} of {self.step_name}")
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        n = sum(len(v) for v in flat)
        pieces = [(cand, offset + p, min(MAX_RANGE, n - p)) for p in range(0, n, MAX_RANGE)]
        if len(pieces) > 1 and not getattr(self._local, "no_ahead", False):   # its later pieces go first
            hints, mine = self._hints(), set(pieces)
            kept = [k for k in hints if k not in mine]
            hints.clear()
            hints.extend([k for k in pieces[1:] if k not in self._ahead()] + kept)
        for key in pieces:
            self._read_piece(key, _window(flat, key[1] - offset, key[2]))
        with self._lock:
            self.bytes_read += n

    # --------------------------------------------------------------- requests sent ahead
    def _ahead(self) -> dict:
        """This thread's requests sent ahead: (file, offset, length) -> (connection, nonce), in order."""
        got = getattr(self._local, "ahead", None)
        if got is None:
            got = self._local.ahead = {}
            self._local.idle = []
            self._local.hints = collections.deque()
        return got

    def _hints(self) -> "collections.deque":
        self._ahead()
        return self._local.hints

    def _discard(self, c: http.client.HTTPConnection) -> None:
        """Close a connection used for requests ahead and forget it (close() closes the rest)."""
        c.close()
        with self._lock:
            if c in self._ahead_conns:
                self._ahead_conns.remove(c)

    def _stop_ahead(self) -> None:
        """Close this thread's requests sent ahead and their connections; no more hints taken."""
        ahead = self._ahead()
        for c, _ in ahead.values():
            self._discard(c)
        for c in self._local.idle:
            self._discard(c)
        ahead.clear()
        self._local.idle.clear()
        self._local.hints.clear()
        self._local.no_ahead = True

    def prefetch(self, relpath: str, offset: int, length: int) -> None:
        """A hint (the reader announces its next reads, in order): their requests are sent early, at
        most :data:`MAX_AHEAD` at a time, each on another keep-alive connection, so the server
        authenticates the next request, MACs its bytes and starts sending while the read that runs
        now arrives. Hints beyond :data:`MAX_HINTS` are dropped (those reads then ask for themselves)."""
        cand = self._where.get(relpath)
        if cand is None or length <= 0 or self._down or getattr(self._local, "no_ahead", False):
            return
        hints = self._hints()
        for p in range(0, length, MAX_RANGE):
            if len(hints) >= MAX_HINTS:
                break
            hints.append((cand, offset + p, min(MAX_RANGE, length - p)))
        self._pump()

    def _pump(self) -> None:
        """Send announced requests until :data:`MAX_AHEAD` are out."""
        ahead, hints, idle = self._ahead(), self._local.hints, self._local.idle
        last = getattr(self._local, "last", None)   # the read that runs (or ran) last
        while hints and len(ahead) < MAX_AHEAD:
            key = hints.popleft()
            if key in ahead or (last is not None and key[0] == last[0] and key[1] <= last[1]):
                continue
            cand, offset, n = key
            c = idle.pop() if idle else getattr(self._local, "conn", None)
            if c is None:
                c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            elif c is getattr(self._local, "conn", None):
                # the direct requests' connection is idle between requests: it carries this one (the
                # thread keeps two connections to the server, not three; a direct request makes a new one)
                self._local.conn = None
            with self._lock:
                if c not in self._ahead_conns:
                    self._ahead_conns.append(c)
            path = "/f/" + urllib.parse.quote(cand)
            headers, nonce = self._headers("GET", path, f"bytes={offset}-{offset + n - 1}")
            try:
                c.request("GET", path, headers=headers)
            except (http.client.HTTPException, OSError):
                self._discard(c)
                return
            ahead[key] = (c, nonce)

    def _take_ahead(self, key: tuple) -> Optional[tuple]:
        """The request sent ahead for exactly this read (removed), or None; then the next announced
        ones go out. Requests and hints for another file, or for this file at or before this offset,
        are stale (their reads went elsewhere): closed and dropped."""
        ahead, hints = self._ahead(), self._local.hints

        def stale(k: tuple) -> bool:
            return k != key and (k[0] != key[0] or k[1] <= key[1])
        for k in [k for k in ahead if stale(k)]:
            self._discard(ahead.pop(k)[0])
        if any(stale(k) for k in hints):
            kept = [k for k in hints if not stale(k)]
            hints.clear()
            hints.extend(kept)
        got = ahead.pop(key, None)
        self._local.last = key
        self._pump()
        return got

    def _read_piece(self, key: tuple, views: list[memoryview]) -> None:
        cand, offset, n = key
        rng = f"bytes={offset}-{offset + n - 1}"
        # the whole answer, head and body, within this: a peer sending a byte now and then (of its head
        # or of its body) would otherwise hold the restore for as long as it likes
        within = self.timeout_s + n / MIN_RATE
        pre = self._take_ahead(key)
        r = None
        w: Optional[_Watch] = None
        conn: Optional[http.client.HTTPConnection] = None
        if pre is not None:
            conn, nonce = pre
            try:
                w = _WATCHDOG.arm(conn.sock, within)
                r = conn.getresponse()
                if w.fired:
                    raise ConnectionAbortedError("cut at the deadline")
                if r.status == 503:   # busy when it was sent: ask again (with _request's retries), no more ahead
                    r.read(_UNAUTH_BODY)
                    w.cancel()
                    self._discard(conn)
                    r = conn = w = None
                    self._stop_ahead()
            except (http.client.HTTPException, OSError):
                fired = w is not None and w.cancel()
                self._discard(conn)
                if fired:   # its head did not arrive in time: not asked again
                    raise IncompleteCheckpointError(f"{self.name}: {cand}: {n} bytes not received within "
                                                    f"{within:.0f} s") from None
                r = conn = w = None
        ahead_conn = conn
        drop = (lambda: self._discard(ahead_conn)) if ahead_conn is not None else self._drop
        try:
            if r is None:
                r, nonce, w = self._request("GET", "/f/" + urllib.parse.quote(cand), rng, within=within)
            if r.status != 206 or r.getheader("Content-Length") != str(n):
                r.read(_UNAUTH_BODY)
                self._done(w, drop)
                drop()
                raise IncompleteCheckpointError(f"{self.name}: {cand} bytes {offset}..{offset + n - 1}: HTTP {r.status}"
                                                f" with {r.getheader('Content-Length')} bytes")
            size = self._sizes.get(cand)
            want = f"bytes {offset}-{offset + n - 1}/{size}"
            if size is not None and (r.getheader("Content-Range") != want or r.getheader("X-File-Size") != str(size)):
                # (both are under the answer's MAC: only a server of this job can get here, answering
                # other bytes than asked or a file that changed size since its HEAD)
                r.close()
                self._done(w, drop)
                drop()
                raise CorruptCheckpointError(f"{self.name}: {cand}: asked for {want[6:]}, answered "
                                             f"{ascii(r.getheader('Content-Range'))[:80]} of a file of "
                                             f"{ascii(r.getheader('X-File-Size'))[:40]} bytes")
            tag = r.getheader("X-Elastor-Auth") or ""
            check = response_checker(self.key, nonce, r.status, r.getheader("Content-Range") or "",
                                     r.getheader("X-File-Size") or "", tag)
            got = 0
            for mv in views:
                at = 0
                while at < len(mv):
                    if time.monotonic() > w.deadline or w.fired:
                        w.cancel()
                        drop()
                        raise IncompleteCheckpointError(f"{self.name}: {cand}: {n} bytes not received within "
                                                        f"{within:.0f} s")
                    piece = mv[at:at + _RECV_PIECE]
                    k = _recv_into(r, piece)
                    if not k:
                        if w.fired:
                            continue   # the watchdog shut it at the deadline: said above
                        w.cancel()
                        drop()
                        raise IncompleteCheckpointError(f"{self.name}: {cand}: short read at byte {offset + got}")
                    check.update(piece[:k])
                    at += k
                    got += k
            self._done(w, drop)
            if not check.matches(tag):
                drop()
                raise CorruptCheckpointError(f"{self.name}: the answer failed its authentication (not from this "
                                             f"job's server, or changed on the way)")
        except (http.client.HTTPException, OSError) as e:
            drop()
            if w is not None and w.cancel():
                raise IncompleteCheckpointError(f"{self.name}: {cand}: {n} bytes not received within "
                                                f"{within:.0f} s") from e
            raise IncompleteCheckpointError(f"{self.name}: reading {cand} failed: {e}") from e
        if conn is not None:   # the answer was read whole: the connection can carry the next request ahead
            idle = self._local.idle
            if r.will_close or len(idle) >= MAX_AHEAD:
                self._discard(conn)
            else:
                idle.append(conn)

    def close(self) -> None:
        self._drop()
        for c, _ in self._ahead().values():
            c.close()
        self._ahead().clear()
        self._hints().clear()
        with self._lock:
            conns, self._ahead_conns = self._ahead_conns, []
        for c in conns:
            c.close()


def _window(views: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """Bytes ``start .. start+length`` of ``views`` taken back to back, as slices of them."""
    out, pos = [], 0
    for v in views:
        a, b = max(start, pos), min(start + length, pos + len(v))
        if a < b:
            out.append(v[a - pos:b - pos])
        pos += len(v)
        if pos >= start + length:
            break
    return out


def parse_peers(text: Optional[str]) -> list[str]:
    return [a.strip() for a in (text or "").split(",") if a.strip()]


def node_sources(step_name: str, snapshot_dir: Optional[str] = None, peers: Optional[Sequence[str]] = None,
                 self_address: Optional[str] = None, key: Optional[bytes] = None) -> list:
    """The cross-node sources of a restore of ``step_name``, nearest first: peer copies held on this
    node, then every other node's server (``ELASTOR_SNAPSHOT_PEERS`` minus ``ELASTOR_SNAPSHOT_SELF``;
    only with the job key, ``key`` or from ``ELASTOR_JOB_SECRET_FILE``). Arguments default to the
    environment ``elastor run`` sets; empty without it."""
    ctx = launch_context()
    snapshot_dir = snapshot_dir if snapshot_dir is not None else ctx.snapshot_dir
    peers = list(peers) if peers is not None else list(ctx.snapshot_peers)
    me = self_address if self_address is not None else ctx.snapshot_self
    out: list = []
    if snapshot_dir:
        out.append(PeerCopySource(snapshot_dir, step_name))
    remotes = [a for a in peers if a != me]
    key = key if key is not None else (job_key() if remotes else None)
    if remotes and key is None:
        log.warning("other nodes' snapshot servers %s are not read: no job key (elastor run --job-secret-file)",
                    remotes)
        return out
    out += [RemoteSource(a, step_name, key) for a in remotes]
    return out
