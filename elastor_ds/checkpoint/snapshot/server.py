"""The controller's read-only snapshot server: serves this node's memory snapshots to the job's
workers on other nodes, and to nobody else.

One :class:`SnapshotServer` per multi-node ``elastor run`` that holds memory snapshots and has a
job key (:class:`NodeSnapshots` decides; stdlib ``http.server``, threaded, keep-alive).

What it serves (``GET``, ``HEAD``; anything else ``405``):

- ``/f/local/<step>/<name>``: ``<name>`` listed in the ``files`` of ``local/<step>/manifest.json``
  (a committed memory snapshot of this node), of the listed size;
- ``/f/peer/<origin>/<step>/<name>``: ``<name>`` listed in the ``files`` of that directory's
  ``COMPLETE`` record (written last by :mod:`elastor_ds.checkpoint.snapshot.peer_copy`), of the listed size;
- ``/index/<step>``: JSON ``{"local": bool, "peer": [origin, ...]}``.

Any other name (the owner marker, a save in progress, a file under ``--snapshot-dir`` that no
committed manifest lists) is ``404``. Names still go through
:func:`~elastor_ds.checkpoint.paths.safe_join`; files are opened with ``O_NOFOLLOW`` and checked
with ``fstat`` (a regular file).

Authentication (:mod:`elastor_ds.checkpoint.auth`): every request carries ``X-Elastor-Nonce`` (32
hex), ``X-Elastor-Time`` (unix seconds, within :data:`CLOCK_SKEW_S`) and ``X-Elastor-Auth``
(HMAC-SHA256 under the job key over method, path, ``Range``, nonce, time and this server's address
as published, :attr:`SnapshotServer.address`: a request meant for another address, such as one a
fake peer in the unauthenticated store relays, is refused); a nonce is accepted once (beyond
:data:`MAX_NONCES` remembered, a request stamped no later than a forgotten one is refused).
Anything else is ``401`` and the connection is closed. Every answer to an authenticated request
carries ``X-Elastor-Auth`` over the nonce, status, ``Content-Range``, ``X-File-Size`` and the body
(GMAC under a key derived for responses, a random nonce each; HMAC-SHA256 without the
``cryptography`` package), so the client also knows the bytes came from this server unchanged.

Bounds: at most :data:`MAX_CONNECTIONS` connections (more get ``503`` and are closed at once); a
request head of at most :data:`MAX_HEAD` bytes (``431``) that must arrive within
:data:`HEAD_TIMEOUT_S` of the connection (or of the previous answer, :data:`IDLE_TIMEOUT_S`); a
``Range`` of at most :data:`~elastor_ds.checkpoint.snapshot.peer_sources.MAX_RANGE` bytes (``416``).
A request that announces a body (``Content-Length`` other than 0, ``Transfer-Encoding``) or an
``Expect`` is refused before its MAC is checked (``413``, ``417``; closed), and no ``100 Continue``
is ever sent: nobody is invited to send a body, none is read. Refusals are logged with a short,
escaped prefix of the name, and rate-limited (warnings; a job member's authenticated request of a
file this node does not hold is a debug line).
"""
from __future__ import annotations

import heapq
import hmac
import http.server
import io
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import urllib.parse
from collections import OrderedDict
from typing import Optional

from ..auth import load_key, request_mac, response_mac
from ..paths import safe_join
from .peer_sources import MAX_RANGE
from ...elastic.protocol import ENV_JOB_SECRET_FILE, ENV_SNAPSHOT_PEERS, ENV_SNAPSHOT_SELF, ENV_SNAPSHOT_SERVER_HOST
from ...errors import CheckpointError
from ...threads import NamedThread

log = logging.getLogger(__name__)

__all__ = ["SnapshotServer", "NodeSnapshots", "COMPLETE", "MANIFEST", "advertised_host", "MAX_CONNECTIONS",
           "MAX_HEAD", "HEAD_TIMEOUT_S", "IDLE_TIMEOUT_S", "CLOCK_SKEW_S", "MAX_NONCES"]

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
MAX_CONNECTIONS = 32
MAX_HEAD = 8192
HEAD_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 60.0
CLOCK_SKEW_S = 300.0
MAX_NONCES = 200_000               # nonces remembered (each for 2 * CLOCK_SKEW_S); see _Server.fresh_nonce
_MAX_RECORD = 256 << 20            # a manifest or COMPLETE record larger than this is not ours
_STEP_RE = re.compile(r"step_[0-9]{9,}")
_ORIGIN_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,200}")
_RANGE_RE = re.compile(r"bytes=([0-9]{1,18})-([0-9]{0,18})")
_TIME_RE = re.compile(r"[0-9]{1,12}")   # ASCII digits ("²³".isdigit() is True)
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class _Refused(Exception):
    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


def short(name: str, n: int = 60) -> str:
    """A refused name for the log: at most ``n`` characters, escaped (no control bytes, no newlines)."""
    return ascii(name[:n]) + ("..." if len(name) > n else "")


# ---------------------------------------------------------------------------------- what may be served
class _Listings:
    """The committed file lists of this node's snapshot directory, cached by the record's inode."""

    def __init__(self, root: str):
        self.root = root
        self._cache: dict[str, tuple[tuple, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def _record(self, path: str, parse) -> Optional[dict[str, int]]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD:
                return None
            key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            with self._lock:
                hit = self._cache.get(path)
            if hit is not None and hit[0] == key:
                return hit[1]
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(_MAX_RECORD + 1)
        finally:
            os.close(fd)
        try:
            files = parse(raw, path)
        except (CheckpointError, ValueError, TypeError, UnicodeDecodeError):
            return None
        with self._lock:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[path] = (key, files)
        return files

    def local(self, step: str) -> Optional[dict[str, int]]:
        """Files (name -> size) of the committed snapshot ``local/<step>``; None when not committed."""
        if not _STEP_RE.fullmatch(step):
            return None
        from ..planning.manifest import Manifest

        def parse(raw: bytes, where: str) -> dict[str, int]:
            return {n: fe.size for n, fe in Manifest.files_of(raw.decode("utf-8"), where=where).items()}
        return self._record(os.path.join(self.root, "local", step, MANIFEST), parse)

    def peer(self, origin: str, step: str) -> Optional[dict[str, int]]:
        """Files of the complete peer copy ``peer/<origin>/<step>``; None when not complete."""
        if not (_STEP_RE.fullmatch(step) and _ORIGIN_RE.fullmatch(origin)):
            return None

        def parse(raw: bytes, where: str) -> dict[str, int]:
            doc = json.loads(raw)
            files = doc.get("files") if isinstance(doc, dict) else None
            if not isinstance(files, dict):
                raise ValueError("no file list")
            return {str(n): int(s) for n, s in files.items() if isinstance(s, int) and not isinstance(s, bool)}
        return self._record(os.path.join(self.root, "peer", origin, step, COMPLETE), parse)

    def index(self, step: str) -> dict:
        if not _STEP_RE.fullmatch(step):
            raise _Refused(404, "not a step directory name")
        try:
            origins = sorted(os.listdir(os.path.join(self.root, "peer")))
        except OSError:
            origins = []
        return {"local": self.local(step) is not None,
                "peer": [o for o in origins if not o.startswith(".") and self.peer(o, step) is not None]}

    def open(self, name: str) -> tuple[int, int]:
        """(fd, size) of a committed snapshot file ``name``; _Refused otherwise."""
        parts = name.split("/")
        listed = None
        if len(parts) >= 3 and parts[0] == "local":
            listed, rel = self.local(parts[1]), "/".join(parts[2:])
        elif len(parts) >= 4 and parts[0] == "peer":
            listed, rel = self.peer(parts[1], parts[2]), "/".join(parts[3:])
        if listed is None or rel not in listed:
            raise _Refused(404, "not a file of a committed snapshot")
        try:
            path = safe_join(self.root, name, what="requested file", allow_subdirs=True)
        except CheckpointError:
            raise _Refused(404, "not a file of a committed snapshot") from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except OSError:
            raise _Refused(404, "not a file of a committed snapshot") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != listed[rel]:
            os.close(fd)
            raise _Refused(404, "not a file of a committed snapshot (changed)")
        return fd, st.st_size


# ---------------------------------------------------------------------------------- HTTP
class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "elastor-snapshots/2"
    server: "_Server"

    def version_string(self) -> str:
        """The ``Server`` header: the protocol only, never the Python version (answers go to anyone)."""
        return self.server_version

    def log_message(self, fmt: str, *args) -> None:  # noqa: D401 - http.server's hook
        log.debug("snapshot server: %s %s", self.client_address[0], short(fmt % args, 120))

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(SEND_TIMEOUT_S)
        try:   # an answer's last short segment must not wait for the client's delayed ACK (Nagle)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self._nonce = ""
        self._first = True
        self.command, self.path, self.requestline, self.request_version = "", "", "", "HTTP/1.1"

    # ------------------------------------------------------------------ request head, bounded
    def _read_head(self) -> Optional[list[bytes]]:
        srv = self.server
        srv.set_deadline(self.connection, time.monotonic() + (srv.head_timeout_s if self._first else
                                                              srv.idle_timeout_s))
        lines: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(srv.max_head - total + 1)
            if not line:
                return None
            total += len(line)
            if total > srv.max_head:
                self.close_connection = True
                self._plain(431, "request head too large")
                return None
            if not lines and line in (b"\r\n", b"\n"):
                continue
            lines.append(line)
            if line in (b"\r\n", b"\n"):
                srv.set_deadline(self.connection, time.monotonic() + SEND_TIMEOUT_S)
                return lines

    def handle_one_request(self) -> None:
        try:
            lines = self._read_head()
        except OSError:   # a timeout, a reset, a connection the reaper shut
            lines = None
        if lines is None:
            self.close_connection = True
            return
        self._first = False
        self.raw_requestline = lines[0]
        real, self.rfile = self.rfile, io.BytesIO(b"".join(lines[1:]))
        try:
            ok = self.parse_request()
        finally:
            self.rfile = real
        if not ok:
            self.close_connection = True
            return
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True
            return self._plain(405, "read-only server: GET and HEAD only")
        why = _body_refusal(self.headers)
        if why is not None:   # before authentication: no byte of a body is invited, buffered or parsed
            self.close_connection = True
            self.server.refused(self, why[0], why[1])
            return self._plain(*why)
        try:
            self._nonce = self._authenticate()
        except _Refused as e:
            self.close_connection = True
            self.server.refused(self, e.code, str(e))
            return self._plain(e.code, str(e))
        self.server.authenticated(self.connection)
        self._serve(head=self.command == "HEAD")
        self.wfile.flush()

    def handle_expect_100(self) -> bool:
        """Never ``100 Continue``: this server takes no request body (a request that announces one is
        refused before it is authenticated, :func:`_body_refusal`), so nobody is invited to send one."""
        return True

    def _authenticate(self) -> str:
        nonce = self.headers.get("X-Elastor-Nonce", "")
        when = self.headers.get("X-Elastor-Time", "")
        mac = self.headers.get("X-Elastor-Auth", "")
        if not (_HEX32.fullmatch(nonce) and _TIME_RE.fullmatch(when) and _HEX64.fullmatch(mac)):
            raise _Refused(401, "authentication required")
        want = request_mac(self.server.key, self.command, self.path, self.headers.get("Range", ""), nonce, when,
                           self.server.address)
        if not hmac.compare_digest(want, mac):
            target = self.headers.get("X-Elastor-Target", "")
            if target and target != self.server.address:   # a relayed request, or a client given another address
                raise _Refused(401, f"authentication failed: the request is addressed to {short(target)}, this "
                               f"server publishes {self.server.address}")
            raise _Refused(401, "authentication failed")
        if abs(time.time() - int(when)) > CLOCK_SKEW_S:
            raise _Refused(401, f"request time off by more than {CLOCK_SKEW_S:.0f} s")
        if not self.server.fresh_nonce(nonce, int(when)):
            raise _Refused(401, "replayed request")
        return nonce

    # ------------------------------------------------------------------ answers
    def _plain(self, code: int, why: str) -> None:
        """An answer without a MAC (to a request that is not authenticated)."""
        body = (why + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _signed(self, code: int, body: bytes, head: bool, ctype: str = "text/plain; charset=utf-8",
                rng: str = "", size: str = "") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if rng:
            self.send_header("Content-Range", rng)
        if size:
            self.send_header("X-File-Size", size)
        self.send_header("X-Elastor-Auth", response_mac(self.server.key, self._nonce, code, rng, size,
                                                        [] if head else [body]))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _serve(self, head: bool) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        try:
            if url.query or url.fragment:
                raise _Refused(404, "no queries")
            if path.startswith("/index/"):
                body = json.dumps(self.server.listings.index(path[len("/index/"):])).encode()
                return self._signed(200, body, head, "application/json")
            if not path.startswith("/f/"):
                raise _Refused(404, "unknown path (use /f/<name> or /index/<step>)")
            fd, size = self.server.listings.open(path[len("/f/"):])
        except _Refused as e:   # an authenticated job member asked for what this node does not hold
            self.server.refused(self, e.code, str(e), member=True)
            return self._signed(e.code, (str(e) + "\n").encode(), head)
        try:
            self._send_file(fd, size, head)
        finally:
            os.close(fd)

    def _send_file(self, fd: int, size: int, head: bool) -> None:
        rng = self.headers.get("Range")
        lo, hi, code = 0, size - 1, 200
        if rng is not None:
            m = _RANGE_RE.fullmatch(rng.strip())
            if not m:
                return self._signed(416, b"unsupported Range (one bytes=A-B range)\n", head)
            lo = int(m.group(1))
            hi = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if lo >= size or hi < lo:
                return self._signed(416, b"", head, rng=f"bytes */{size}")
            code = 206
        n = hi - lo + 1 if size else 0
        if n > MAX_RANGE and not head:
            return self._signed(416, f"at most {MAX_RANGE} bytes per request\n".encode(), head)
        crange = f"bytes {lo}-{hi}/{size}" if code == 206 else ""
        mac = response_mac(self.server.key, self._nonce, code, crange, str(size), [] if head else _pieces(fd, lo, n))
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.send_header("X-File-Size", str(size))
        if crange:
            self.send_header("Content-Range", crange)
        self.send_header("X-Elastor-Auth", mac)
        self.end_headers()
        if head or n == 0:
            return
        self.wfile.flush()
        # zero-copy (socket.sendfile waits for the socket within its timeout); bytes changed since the
        # MAC fail the client's check, a file that shrank gives a short body: either way it falls back
        with os.fdopen(os.dup(fd), "rb") as f:
            sent = self.connection.sendfile(f, lo, n)
        if sent < n:
            self.close_connection = True
        self.server.count_bytes(sent)


def _body_refusal(headers) -> Optional[tuple[int, str]]:
    """(status, why) for a request head that announces a body or an expectation (a ``Content-Length``
    other than 0, any ``Transfer-Encoding``, any ``Expect``); None for a plain GET/HEAD. Checked
    before the MAC: a body is never read, and one left on a keep-alive connection would be parsed
    as the next request."""
    if headers.get("Expect") is not None:
        return 417, "no expectation is supported (this server takes no request body)"
    lengths = headers.get_all("Content-Length") or []
    if headers.get("Transfer-Encoding") is not None or any(v.strip() != "0" for v in lengths):
        return 413, "this server takes no request body (GET and HEAD only)"
    return None


def _pieces(fd: int, lo: int, n: int):
    pos = 0
    while pos < n:
        b = os.pread(fd, min(_CHUNK, n - pos), lo + pos)
        if not b:
            return
        yield b
        pos += len(b)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, root: str, key: bytes, max_connections: int, head_timeout_s: float,
                 idle_timeout_s: float, max_head: int):
        self.root = root
        self.key = key
        self.address = ""   # HOST:PORT as published: set by SnapshotServer once the port is bound
        self.listings = _Listings(root)
        self.bytes_served = 0
        self.max_head = max_head
        self.head_timeout_s = head_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        # connections that have not yet sent an authenticated request, oldest first: at most half the
        # slots; a new connection then evicts the oldest (a client of the job authenticates within a
        # round trip of connecting, so idle connections from anyone cannot keep it out)
        self._pending: OrderedDict[socket.socket, float] = OrderedDict()
        self._max_pending = max(1, max_connections // 2)
        self._handed: set = set()   # evicted connections whose slot went to the newer one
        self.evicted = 0
        self._nonces: set[str] = set()
        self._nonce_heap: list[tuple[int, str]] = []   # (its request's time, nonce): earliest first
        self._nonce_floor = -1   # requests stamped at or before this are refused (their nonces may be forgotten)
        self._refusals = 0
        self.busy_refused = 0
        super().__init__(addr, _Handler)
        self._reaper = NamedThread(target=self._reap, name="elastor-snapshot-reaper", daemon=True)
        self._stop = threading.Event()
        self._reaper.start()

    # ------------------------------------------------------------------ bounded connections
    def process_request(self, request, client_address) -> None:
        evict = None
        with self._lock:
            if len(self._pending) >= self._max_pending:
                evict, _ = self._pending.popitem(last=False)
                self._deadlines[evict] = float("inf")
                self._handed.add(evict)   # its slot is the new connection's now: accept never waits for it
                self.evicted += 1
        if evict is not None:
            try:
                evict.shutdown(socket.SHUT_RDWR)   # its thread ends (and does not free the slot it handed on)
            except OSError:
                pass
        if evict is None and not self._slots.acquire(timeout=0.0):
            self.busy_refused += 1
            try:
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
                             b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            with self._lock:
                self._deadlines[request] = time.monotonic() + self.head_timeout_s
                self._pending[request] = time.monotonic()
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
            self._pending.pop(request, None)
            handed = request in self._handed
            self._handed.discard(request)
        if not handed:
            self._slots.release()

    def authenticated(self, sock) -> None:
        """``sock`` sent a request with the job's MAC: no longer among those a new connection evicts."""
        with self._lock:
            self._pending.pop(sock, None)

    def set_deadline(self, sock, t: float) -> None:
        with self._lock:
            if sock in self._deadlines:
                self._deadlines[sock] = t

    def _reap(self) -> None:
        """Shut connections past their deadline (a head that does not arrive, an idle keep-alive)."""
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self._lock:
                late = [s for s, t in self._deadlines.items() if now > t]
                for s in late:
                    self._deadlines[s] = float("inf")
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request, client_address) -> None:   # never a traceback on the controller's stderr
        import sys
        log.debug("snapshot server: connection from %s ended: %s", client_address[0], sys.exc_info()[1])

    def server_close(self) -> None:
        self._stop.set()
        super().server_close()

    # ------------------------------------------------------------------ bookkeeping
    def fresh_nonce(self, nonce: str, when: Optional[int] = None) -> bool:
        """Whether ``nonce`` (of a request stamped ``when``, unix seconds; now by default) was not seen
        yet (then it is remembered). A nonce is forgotten once its request's time is past the clock
        skew (the request is refused for its time from then on). When more than :data:`MAX_NONCES`
        are within it, those stamped earliest go first, and every request stamped no later than one
        of them is refused from then on: a forgotten nonce is never accepted again, and a member
        whose clock runs ahead cannot push the others' requests out."""
        now = time.time()
        when = int(now) if when is None else int(when)
        with self._lock:
            heap = self._nonce_heap
            while heap and (now - heap[0][0] > CLOCK_SKEW_S or len(heap) >= MAX_NONCES):
                stamped, old = heapq.heappop(heap)
                self._nonces.discard(old)
                if now - stamped <= CLOCK_SKEW_S:   # forgotten within its window: nothing that old from now on
                    self._nonce_floor = max(self._nonce_floor, stamped)
            if when <= self._nonce_floor or nonce in self._nonces:
                return False
            self._nonces.add(nonce)
            heapq.heappush(heap, (when, nonce))
            return True

    def count_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_served += n

    def refused(self, handler: _Handler, code: int, why: str, member: bool = False) -> None:
        """Log a refusal: a warning (rate-limited) for a request that was not authenticated; a debug
        line for a job member's request of a file this node does not hold (a restore probes the
        holders in turn: not an attack)."""
        if member:
            log.debug("snapshot server: %s %s from %s (a job member): %d %s", handler.command, short(handler.path),
                      handler.client_address[0], code, why)
            return
        with self._lock:
            self._refusals += 1
            k = self._refusals
        if k <= 20 or k % 1000 == 0:
            log.warning("snapshot server: refused %s %s from %s: %d %s%s", handler.command, short(handler.path),
                        handler.client_address[0], code, why, f" ({k} refusals so far)" if k > 20 else "")


class SnapshotServer:
    """A read-only, authenticated server for ``root`` on ``host`` (port 0: any free port), in a daemon thread."""

    def __init__(self, root: str, key: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_head: int = MAX_HEAD):
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("the snapshot server needs the job key (bytes, at least 16)")
        self.root = os.path.abspath(root)
        self._srv = _Server((host, port), self.root, key, max_connections, head_timeout_s, idle_timeout_s, max_head)
        self.host = host
        self.port = self._srv.server_address[1]
        self._srv.address = self.address   # what requests must be MAC'd for (NodeSnapshots publishes it)
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bytes_served(self) -> int:
        return self._srv.bytes_served

    @property
    def busy_refused(self) -> int:
        return self._srv.busy_refused

    @property
    def evicted(self) -> int:
        """Connections closed before they authenticated, to make room for a newer one."""
        return self._srv.evicted

    def start(self) -> "SnapshotServer":
        self._thread = NamedThread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="elastor-snapshot-server", daemon=True)
        self._thread.start()
        log.info("snapshot server for %s at %s (authenticated)", self.root, self.address)
        return self

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "SnapshotServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def advertised_host(rdzv_endpoint: str) -> str:
    """The address of this host that the rendezvous endpoint's host reaches us by: the local end of
    a (never sent) UDP socket towards it; ``127.0.0.1`` for a loopback endpoint."""
    host = rdzv_endpoint.rsplit(":", 1)[0].strip("[]") or "localhost"
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
        fam, _, _, _, sa = infos[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(sa)
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


_STORE_KEY = "elastor/snapshot_server/{}"


class NodeSnapshots:
    """The controller's side of cross-node restore. At every rendezvous round it publishes this
    node's server address in the round's store (an address is not a secret) and collects every
    node's for the workers' environment.

    The server starts lazily, at a round where all of these hold: the job may span nodes
    (``multi_node``), the node directory holds memory snapshots (``local/`` or ``peer/`` exists:
    the trainer has ``"memory_snapshot"`` on; ``elastor run`` cannot read the trainer's config, so
    it looks at what the trainer wrote) and a job key exists (``--job-secret-file``). A single-node
    job never starts it (its workers read this node's memory directly). Without a key the node's
    snapshots are not served (logged once): other nodes' restores read storage for those files."""

    def __init__(self, snapshot_dir: Optional[str], rdzv_endpoint: str, multi_node: bool = False,
                 secret_file: Optional[str] = None):
        self.server: Optional[SnapshotServer] = None
        self.peers: list[str] = []
        self.snapshot_dir = snapshot_dir
        self.rdzv_endpoint = rdzv_endpoint
        self.multi_node = multi_node
        self.secret_file = os.path.abspath(secret_file) if secret_file else None
        self.key = load_key(self.secret_file) if self.secret_file else None   # checked at start: exit 2 on a bad file
        self._warned = False

    def _holds_snapshots(self) -> bool:
        return bool(self.snapshot_dir) and any(os.path.isdir(os.path.join(self.snapshot_dir, s))
                                               for s in ("local", "peer"))

    def _maybe_start(self) -> None:
        if self.server is not None or not self.multi_node or not self._holds_snapshots():
            return
        if self.key is None:
            if not self._warned:
                self._warned = True
                log.warning("this node's memory snapshots are not served to the other nodes: no --job-secret-file "
                            "(the server authenticates every request with the job key); their restores read "
                            "storage for the files only this node held")
            return
        host = os.environ.get(ENV_SNAPSHOT_SERVER_HOST) or advertised_host(self.rdzv_endpoint)
        self.server = SnapshotServer(self.snapshot_dir, self.key, host=host).start()

    def publish(self, store, group_rank: int, group_world_size: int) -> list[str]:
        """Collective over the round's agents (each calls it once per round)."""
        self._maybe_start()
        mine = self.server.address if self.server is not None else ""
        store.set(_STORE_KEY.format(group_rank), mine.encode())
        raw = store.multi_get([_STORE_KEY.format(i) for i in range(group_world_size)])
        self.peers = [b.decode() for b in raw]
        return self.peers

    def env(self) -> dict:
        """``ELASTOR_SNAPSHOT_PEERS`` (every live node's server, node-rank order; nodes without one
        left out), ``ELASTOR_SNAPSHOT_SELF`` (this node's) and ``ELASTOR_JOB_SECRET_FILE`` (the
        secret file's path, not the secret: workers derive the job key from it themselves)."""
        out = {ENV_SNAPSHOT_PEERS: ",".join(p for p in self.peers if p),
               ENV_SNAPSHOT_SELF: self.server.address if self.server is not None else ""}
        if self.secret_file:
            out[ENV_JOB_SECRET_FILE] = self.secret_file
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
