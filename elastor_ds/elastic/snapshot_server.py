"""The controller's read-only snapshot server: serves this node's memory snapshots to other nodes.

One :class:`SnapshotServer` per ``elastor run`` (stdlib ``http.server``, threaded, keep-alive). It
serves the node snapshot directory (``$ELASTOR_SNAPSHOT_DIR``: ``local/`` and ``peer/``) read-only:

- ``GET /f/<name>`` (``HEAD`` too): a file of the node directory; ``Range: bytes=A-B`` gives ``206``
  with exactly those bytes. Every name goes through :func:`~elastor_ds.checkpoint.paths.safe_join`
  (no ``..``, not absolute, no symlink out of the directory); names with a component starting with
  ``.`` (saves in progress) are refused; only regular files are served, opened with ``O_NOFOLLOW``
  and checked with ``fstat`` after opening (a symlink swapped in after the check is refused too).
- ``GET /index/<step dir name>``: JSON ``{"local": bool, "peer": [origin, ...]}``: whether
  ``local/<step>`` is committed (has its manifest) and which ``peer/<origin>/<step>`` copies are
  ``COMPLETE``.

Anything else is ``404`` (``405`` for other methods). Clients: :mod:`elastor_ds.checkpoint.peer_sources`.
No authentication: it serves checkpoint bytes to anyone who can reach the port; bind it to the
cluster's network (``--snapshot-server-host``).
"""
from __future__ import annotations

import http.server
import json
import logging
import os
import re
import socket
import stat
import threading
import urllib.parse
from typing import Optional

from ..checkpoint.paths import safe_join
from ..errors import UnsafeCheckpointError

log = logging.getLogger(__name__)

__all__ = ["SnapshotServer", "COMPLETE", "MANIFEST", "advertised_host"]

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_\d{9,}$")
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 20


class _Refused(Exception):
    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


def _open_regular(root: str, name: str) -> tuple[int, int]:
    """(fd, size) of the regular file ``root/name``; _Refused otherwise."""
    try:
        path = safe_join(root, name, what="requested file", allow_subdirs=True)
    except UnsafeCheckpointError as e:
        raise _Refused(403, str(e)) from None
    if any(p.startswith(".") for p in name.split("/")):
        raise _Refused(403, f"{name!r}: hidden names (saves in progress) are not served")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _Refused(404, f"{name!r}: no such file") from None
    except OSError as e:   # ELOOP: a symlink (swapped in after the check), EISDIR, EACCES, ...
        raise _Refused(403, f"{name!r}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _Refused(403, f"{name!r}: not a regular file")
    return fd, st.st_size


def step_index(root: str, step: str) -> dict:
    """What this node holds of step dir ``step``: committed local copy, COMPLETE peer copies."""
    if not _STEP_RE.match(step):
        raise _Refused(404, f"{step!r} is not a step directory name")
    out = {"local": os.path.isfile(os.path.join(root, "local", step, MANIFEST)), "peer": []}
    peer = os.path.join(root, "peer")
    try:
        origins = sorted(os.listdir(peer))
    except OSError:
        origins = []
    for o in origins:
        if not o.startswith(".") and os.path.isfile(os.path.join(peer, o, step, COMPLETE)):
            out["peer"].append(o)
    return out


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "elastor-snapshots/1"
    server: "_Server"

    def log_message(self, fmt: str, *args) -> None:  # noqa: D401 - http.server's hook
        log.debug("%s %s", self.address_string(), fmt % args)

    def _error(self, code: int, why: str) -> None:
        body = (why + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        if code == 403:
            log.warning("snapshot server: refused %s from %s: %s", self.path[:200], self.client_address[0], why)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _method_not_allowed(self) -> None:
        self._error(405, "read-only server: GET and HEAD only")

    do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed

    def _serve(self, head: bool) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.query or url.fragment:
            return self._error(404, "no queries")
        path = urllib.parse.unquote(url.path)
        root = self.server.root
        try:
            if path.startswith("/index/"):
                return self._json(step_index(root, path[len("/index/"):]), head)
            if not path.startswith("/f/"):
                raise _Refused(404, "unknown path (use /f/<name> or /index/<step>)")
            fd, size = _open_regular(root, path[len("/f/"):])
        except _Refused as e:
            return self._error(e.code, str(e))
        try:
            self._send_file(fd, size, head)
        finally:
            os.close(fd)

    def _json(self, obj: dict, head: bool) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_file(self, fd: int, size: int, head: bool) -> None:
        rng = self.headers.get("Range")
        lo, hi, code = 0, size - 1, 200
        if rng is not None:
            m = _RANGE_RE.match(rng.strip())
            if not m:
                return self._error(416, f"unsupported Range {rng[:80]!r} (one bytes=A-B range)")
            lo = int(m.group(1))
            hi = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if lo >= size or hi < lo:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            code = 206
        n = hi - lo + 1 if size else 0
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.send_header("X-File-Size", str(size))
        if code == 206:
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{size}")
        self.end_headers()
        if head or n == 0:
            return
        sent = 0
        sock = self.connection
        self.wfile.flush()
        while sent < n:
            k = os.sendfile(sock.fileno(), fd, lo + sent, min(n - sent, 16 * _CHUNK))
            if k == 0:   # the file shrank under us: the client sees a short body and falls back
                self.close_connection = True
                return
            sent += k
        self.server.bytes_served += sent


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, root: str):
        self.root = root
        self.bytes_served = 0
        super().__init__(addr, _Handler)


class SnapshotServer:
    """A read-only server for ``root`` on ``host`` (port 0: any free port), in a daemon thread."""

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0):
        self.root = os.path.abspath(root)
        self._srv = _Server((host, port), self.root)
        self.host = host
        self.port = self._srv.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bytes_served(self) -> int:
        return self._srv.bytes_served

    def start(self) -> "SnapshotServer":
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="elastor-snapshot-server", daemon=True)
        self._thread.start()
        log.info("snapshot server for %s at %s", self.root, self.address)
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
    """The controller's side of cross-node restore: runs the node's :class:`SnapshotServer` (when the
    node has a snapshot directory) and, at every rendezvous round, publishes its address in the
    round's store and collects every node's (node-rank order) for the workers' environment."""

    def __init__(self, snapshot_dir: Optional[str], rdzv_endpoint: str):
        self.server: Optional[SnapshotServer] = None
        self.peers: list[str] = []
        if snapshot_dir:
            host = os.environ.get("ELASTOR_SNAPSHOT_SERVER_HOST") or advertised_host(rdzv_endpoint)
            self.server = SnapshotServer(snapshot_dir, host=host).start()

    def publish(self, store, group_rank: int, group_world_size: int) -> list[str]:
        """Collective over the round's agents (each calls it once per round)."""
        mine = self.server.address if self.server is not None else ""
        store.set(_STORE_KEY.format(group_rank), mine.encode())
        raw = store.multi_get([_STORE_KEY.format(i) for i in range(group_world_size)])
        self.peers = [b.decode() for b in raw]
        return self.peers

    def env(self) -> dict:
        """``ELASTOR_SNAPSHOT_PEERS`` (every live node's server, node-rank order; nodes without one
        left out) and ``ELASTOR_SNAPSHOT_SELF`` (this node's)."""
        return {"ELASTOR_SNAPSHOT_PEERS": ",".join(p for p in self.peers if p),
                "ELASTOR_SNAPSHOT_SELF": self.server.address if self.server is not None else ""}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
