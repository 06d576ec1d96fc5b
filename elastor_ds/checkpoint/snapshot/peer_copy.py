"""Peer copies of memory snapshots: each rank's chunk files go to a rank on another node.

After a memory snapshot commits, :meth:`PeerCopier.submit` (called on every rank, for every
snapshot, in the same order) opens this rank's files of that step at once (so a later retention
that deletes them cannot pull them from under the copy) and hands them to a background thread,
which runs one exchange of the ring plan (:func:`~elastor_ds.checkpoint.snapshot.peer_plan.plan_peer_copies`)
over a :class:`~elastor_ds.comm.transport.Transport` of the whole world (a dedicated gloo group today):

1. every sender posts a JSON header (origin node id, step, files with sizes, CRC32 and a keyed
   digest under the job key, :class:`~elastor_ds.checkpoint.auth.FileMac`: GMAC, or HMAC-SHA256
   without the ``cryptography`` package) to its receiver; every
   receiver posts the receives of its senders' headers. Lengths first: a receiver tells each sender
   whether it takes a header of that length (1 byte to 1 MiB), and a sender posts its header only
   to the receivers that take it (a gloo send waits for its receive: a header sent to a receiver
   that refused its length waited for the transport's timeout); a refused one fails that copy at once;
2. a receiver trusts no size it is sent: every file must be listed in its own node's committed
   manifest of that step (read from a descriptor opened at :meth:`submit`: retention cannot pull
   it), with the manifest's size and CRC32 and written by that sender; the bytes it has to allocate
   must fit the node's free tmpfs, each name once. A lying sender's files are not received (its copy
   fails), nor those of a sender whose header is not one (that sender alone is refused); a copy
   that does not fit (at the budget check, or ENOSPC when its files are made) is received into a
   scratch buffer and dropped;
3. every receiver answers each sender: it receives the data or not; a sender sends only what will
   be received (a gloo send waits for its receive: a refused one hung until the transport's timeout
   and failed it for the rest of the launch); the answers are not waited for, so a sender that does
   not listen cannot hold a receiver;
4. receivers create each file (``.<name>.part``, sized, memory-mapped) and post a receive straight
   into it; senders post sends straight from their memory-mapped snapshot files; all operations are
   non-blocking, so the ring (A sends to B while B sends to A) cannot deadlock;
5. a receiver checks each file's CRC32 and keyed digest, renames it into
   ``$ELASTOR_SNAPSHOT_DIR/peer/<origin>/<step>/``, marks its sender done
   (``.from_<src>.<seq>``, holding the sender's file list) and, once every sender of that origin
   node has arrived, writes ``COMPLETE`` last (with the file list the snapshot server may serve)
   and drops the origin's older steps. A mismatch leaves no ``COMPLETE`` (logged): a restore falls
   back to the next source.

Peer copies need the job key (``elastor run --job-secret-file``): without it on any rank there are
none (decided collectively, logged).

The next :meth:`submit` waits for the previous exchange (back-pressure, reported as ``wait_s``);
:meth:`close` waits for it and for this rank's replies to its senders (bounded: a receiver that
left before a slow sender took its "no" left that sender's receive to fail on a closed connection).
:meth:`create` makes the transport: it is collective, every rank calls it at the same point
relative to its other group creations (see RUNTIME_FACTS.md: group creation order). A transfer that
fails or times out fails that copy (logged); a failed transport stays failed, so every later copy
fails at once until the next launch.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..auth import GMAC_AVAILABLE, FileMac, file_mac, job_key
from ..commit import recycle_data_files
from ..crc import crc32
from ..paths import safe_join
from .file_staging import FileStaging
from .peer_plan import PeerTransfer, node_of_rank, plan_peer_copies
from ...comm.groups import world_rank, world_size
from ...comm.transport import GlooTransport, Transport
from ...errors import CollectiveError
from ...threads import NamedThread

log = logging.getLogger(__name__)

__all__ = ["PeerCopier", "PeerCopyStats", "PeerFile", "COMPLETE", "origin_id", "node_origins"]

COMPLETE = "COMPLETE"
PEER_DIR = "peer"
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,200}")
_STEP_RE = re.compile(r"step_[0-9]{9,}")
_MAX_HEADER = 1 << 20
_MAC_RE = re.compile(r"(?:[0-9a-f]{64}|g1\.[0-9a-f]{24}\.[0-9a-f]{32})")   # HMAC-SHA256 | GMAC (auth.FileMac)
_CHECK_PIECE = 1 << 20      # the receiver's CRC and MAC run over each piece while it is in cache
_PIECE = 256 << 20          # one send/recv op moves at most this many bytes
_T_LEN, _T_HDR, _T_OK, _T_HDR_OK, _T_DATA = 1, 2, 3, 4, 16


@dataclass(frozen=True)
class PeerFile:
    relpath: str        # name relative to the step dir, as the manifest names it
    size: int
    crc: Optional[int] = None   # the file's CRC32 (the manifest's); computed when None


@dataclass
class PeerCopyStats:
    seq: int
    step_name: str
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0          # submit() waiting for the previous exchange (training stalls)
    copy_s: float = 0.0          # the exchange itself, in the background
    cpu_s: float = 0.0           # CPU time of the copy thread (MACs, CRC checks, moving into place)
    completed: list = field(default_factory=list)   # origins whose copy this rank completed
    error: Optional[str] = None


class _Open:
    """A file of this rank's snapshot, held open (mapped) from submit() until it is sent."""

    def __init__(self, dirs: Sequence[str], f: PeerFile, mapped: Optional[object] = None):
        """``dirs``: where the file may be, in order (a save's temp dir, then its committed dir: a
        directory rename between the two looks is atomic, so one of them has it). ``mapped``: the
        file's bytes as the writer mapped them (a uint8 tensor, kept mapped: no page is faulted in
        again to send it), used when its size is the file's."""
        import torch
        self.file = f
        self.tensor = None
        if mapped is not None and getattr(mapped, "numel", lambda: -1)() == f.size:
            self.tensor = mapped
            dirs = ()
        size = f.size
        for i, d in enumerate(dirs):
            path = safe_join(d, f.relpath, what="snapshot file", allow_subdirs=True)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if i == len(dirs) - 1:
                    raise
                continue
            try:   # the open fd pins the file: map it through /proc (no race with a rename or delete)
                size = os.fstat(fd).st_size
                if size != f.size:
                    raise CollectiveError(f"peer copy: {path} has {size} bytes, the manifest says {f.size}")
                if size:
                    self.tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=size, dtype=torch.uint8)
            finally:
                os.close(fd)
            break
        crc = f.crc
        if crc is None:
            crc = crc32(self.tensor.numpy()) if size else 0
        self.crc = crc


MANIFEST_WAIT_S = 5.0   # how long a receiving rank waits for its node's copy of the step to be committed


def _open_manifest(dirs) -> int:
    """A descriptor of the first ``manifest.json`` found in ``dirs`` (never through a link), or -1."""
    for d in dirs:
        try:
            return os.open(os.path.join(d, "manifest.json"),
                           os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
    return -1


def _allowed_files(fd: int, step_name: str) -> dict:
    """name -> (size, crc32, writer_rank) of this node's committed manifest of the step (from the
    descriptor :meth:`PeerCopier.submit` opened); empty when there is none (nothing is accepted)."""
    if fd < 0:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(256 << 20)
        from ..planning.manifest import Manifest
        files = Manifest.files_of(raw.decode("utf-8"), where=f"manifest of {step_name}")   # checked; no tensors
    except Exception as e:  # noqa: BLE001 - no trustworthy list: nothing is received
        log.warning("peer copy of %s: this node's manifest is unreadable (%s); not receiving copies", step_name, e)
        return {}
    return {n: (fe.size, fe.crc32, fe.writer_rank) for n, fe in files.items()}


def _check_budget(incoming: list, snapshot_dir: str) -> None:
    """Copies whose new bytes do not fit the node's free tmpfs are drained, not written (logged)."""
    try:
        st = os.statvfs(snapshot_dir)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return
    for inc in incoming:
        if inc.files is None:
            continue
        spare_dir = os.path.join(snapshot_dir, PEER_DIR, inc.origin, SPARE_DIR)
        need = 0
        for rel, size, *_ in inc.files:
            try:
                have = os.lstat(os.path.join(spare_dir, rel)).st_size if "/" not in rel else 0
            except OSError:
                have = 0
            need += max(0, size - have)
        if need > free:
            log.warning("peer copy of %s from %s (rank %d): %d new bytes do not fit this node's free memory (%d "
                        "bytes under %s); this copy is dropped", inc.step, inc.origin, inc.t.src, need, free,
                        snapshot_dir)
            inc.drain = True
        else:
            free -= need


def origin_id(snapshot_dir: str) -> str:
    """This node's name in other nodes' ``peer/``: host and snapshot directory name (users often
    give every node the same ``--snapshot-dir``)."""
    import socket
    raw = f"{socket.gethostname()}-{os.path.basename(os.path.normpath(snapshot_dir))}"
    return re.sub(r"[^A-Za-z0-9_.:\-]", "_", raw).lstrip(".-:")[:200] or "node"


def node_origins(procs_per_node: Sequence[int], ids: Sequence[str]) -> list[str]:
    """Every rank's origin id (pure; every rank computes the same): its node's first rank's
    :func:`origin_id`. Nodes that share one (the same host name and snapshot directory name, e.g.
    containers given one host name) get ``-n<node>`` appended, so two nodes' copies never share a
    directory and no node refuses its partner's copy as its own."""
    firsts, r = [], 0
    for n in procs_per_node:
        firsts.append(ids[r])
        r += n
    per_node = [f"{o[:190]}-n{i}" if firsts.count(o) > 1 else o for i, o in enumerate(firsts)]
    if len(set(per_node)) < len(per_node):   # a suffixed id met a node's own: number them all
        per_node = [f"{o[:190]}-n{i}" for i, o in enumerate(firsts)]
    return [per_node[node_of_rank(list(procs_per_node), k)] for k in range(sum(procs_per_node))]


def _pieces(n: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + _PIECE)) for a in range(0, n, _PIECE)] or []


class PeerCopier:
    """Runs the peer copies of one rank (see the module docstring)."""

    def __init__(self, transport: Transport, procs_per_node: Sequence[int], snapshot_dir: str, origin: str,
                 peer_copies: int = 1, key: Optional[bytes] = None, mac_scheme: str = "gmac",
                 origins: Optional[Sequence[str]] = None):
        """``transport``: over the whole world (its ranks are the plan's global ranks). ``mac_scheme``:
        the files' keyed digest (:class:`~elastor_ds.checkpoint.auth.FileMac`: "gmac", or "hmac" when
        a rank lacks GMAC; a receiver checks either). ``origins``: every rank's origin id
        (:func:`node_origins`; :meth:`create` gathers them): a sender's header must name its own
        node's, so no sender writes into another node's copies."""
        if not key:
            raise ValueError("peer copies need the job key (elastor run --job-secret-file)")
        if tuple(transport.ranks) != tuple(range(sum(procs_per_node))):
            raise CollectiveError(f"peer copy: the transport spans global ranks {list(transport.ranks)[:8]}, the plan "
                                  f"needs the whole world of {sum(procs_per_node)} processes {list(procs_per_node)}")
        self.key = key
        self.mac_scheme = mac_scheme
        # the sends of this rank's replies to its senders (header taken or not, files taken or not), not
        # waited for in the exchange; kept until the next one (a dropped gloo handle cancels its send) and
        # waited for by close()
        self._answers: list = []
        self.transport = transport
        self.rank = transport.rank
        self.procs_per_node = list(procs_per_node)
        self.snapshot_dir = snapshot_dir
        self.origin = origin
        self.origins = list(origins) if origins is not None else None
        if self.origins is not None and len(self.origins) != sum(procs_per_node):
            raise ValueError(f"peer copy: {len(self.origins)} origin ids for {sum(procs_per_node)} ranks")
        self.plan = plan_peer_copies(self.procs_per_node, peer_copies)
        self.node = node_of_rank(self.procs_per_node, self.rank)
        self.sends = [t for t in self.plan if t.src == self.rank]
        self.recvs = [t for t in self.plan if t.dst == self.rank]
        self.seq = 0
        self.stats: list[PeerCopyStats] = []
        self._thread: Optional[threading.Thread] = None
        self._announced = False
        # receives land in kept mappings of the data files they cycle through (held + arriving per
        # sender): a write through a fresh mapping of tmpfs pages faults on every page (~40 ms per
        # 17 MiB here, against ~4 ms into a kept one)
        self.recv_files = FileStaging(max_maps=2 * max(1, len(self.recvs)))
        if not _ID_RE.fullmatch(origin):
            raise ValueError(f"peer copy origin id {origin!r}: letters, digits, '_', '.', ':', '-' only")

    @staticmethod
    def create(procs_per_node: Sequence[int], snapshot_dir: str, peer_copies: int = 1, timeout_s: float = 600.0,
               make_transport: Optional[Callable[[float], Optional[Transport]]] = None) -> Optional["PeerCopier"]:
        """Collective on the default world: the transport exists on every rank (or on none: one node or
        ``peer_copies == 0`` returns None on every rank, logged once). ``make_transport(timeout_s)``:
        a transport over the whole world (collective; default :class:`GlooTransport`)."""
        plan = plan_peer_copies(procs_per_node, peer_copies)
        rank = world_rank()
        if not plan:
            if rank == 0:
                log.info("memory snapshots: no peer copy (%s)", "one node" if len(procs_per_node) < 2 else
                         "peer_copies 0")
            return None
        if sum(procs_per_node) != world_size():
            raise CollectiveError(f"peer copy: processes per node {list(procs_per_node)} do not add up to the world "
                                  f"size {world_size()}")
        transport = (make_transport or (lambda t: GlooTransport.create(None, t)))(timeout_s)
        if transport is None:
            raise CollectiveError("peer copy: the transport over the whole world left this rank out")
        try:
            key = job_key()
        except Exception as e:  # noqa: BLE001 - a bad secret file: this rank has no key (agreed below)
            log.warning("peer copy: the job secret file is unusable here: %s", e)
            key = None
        have = transport.all_gather_object((bool(key), GMAC_AVAILABLE, origin_id(snapshot_dir)))
        if not all(h[0] for h in have):
            if rank == 0:
                log.warning("memory snapshots: no peer copies: they need the job key on every node (elastor run "
                            "--job-secret-file FILE, the same file on every node); restores of a lost node read "
                            "storage")
            transport.close()
            return None
        origins = node_origins(procs_per_node, [h[2] for h in have])
        if rank == 0 and len(set(origins)) > len(set(h[2] for h in have)):
            log.warning("peer copies: nodes share an origin id (host name and snapshot directory name: %s); their "
                        "copies are told apart by node number (%s)", sorted({h[2] for h in have}),
                        sorted(set(origins)))
        scheme = "gmac" if all(h[1] for h in have) else "hmac"
        if rank == 0 and scheme == "hmac":
            log.warning("peer copies: a rank lacks the cryptography package; files carry HMAC-SHA256 digests (about "
                        "10x the CPU of GMAC per copied byte); pip install cryptography")
        return PeerCopier(transport, procs_per_node, snapshot_dir, origins[rank], peer_copies, key, scheme, origins)

    # ------------------------------------------------------------------ API
    def submit(self, step_dir: str, files: Sequence[PeerFile], search_dirs: Sequence[str] = (),
               mapped: Optional[dict] = None) -> PeerCopyStats:
        """Start the copy of snapshot ``step_dir`` (this rank's ``files``) in the background.
        Every rank calls it for every snapshot, in the same order. ``search_dirs``: where to look
        for the files before ``step_dir`` (the save's temp dir, not yet renamed on this node).
        ``mapped``: name -> the file's bytes as its writer keeps them mapped (sent from there; the
        writer reuses that file only after this copy is done: the next copy's submit waits for it)."""
        t0 = time.perf_counter()
        self.wait()
        wait_s = time.perf_counter() - t0
        step_name = os.path.basename(os.path.normpath(step_dir))
        dirs = [*search_dirs, step_dir]
        self.seq += 1
        st = PeerCopyStats(self.seq, step_name, wait_s=wait_s)
        self.stats.append(st)
        try:
            opened = [_Open(dirs, f, (mapped or {}).get(f.relpath)) for f in files] if self.sends else []
        except Exception as e:  # noqa: BLE001 - sent as an empty, failed copy so the receiver does not hang
            log.warning("peer copy of %s: cannot open this rank's files: %s", step_name, e)
            st.error = f"{type(e).__name__}: {e}"
            opened = None
        manifest_fd = _open_manifest((step_dir, *search_dirs)) if self.recvs else -1
        # what the senders may send: this node's committed manifest of the step, pinned now (retention
        # cannot take it); on a rank that is not its node's committer the node's copy of the step may be
        # a few milliseconds from committed yet: the copy thread then waits for it (MANIFEST_WAIT_S)
        wait_in = (step_dir, *search_dirs) if self.recvs and manifest_fd < 0 else None
        self._thread = NamedThread(target=self._run, args=(st, opened, manifest_fd, wait_in),
                                   name="elastor-peer-copy", daemon=True)
        self._thread.start()
        return st

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self, timeout_s: float = 60.0) -> bool:
        """At the end of training: let the last copy finish, and this rank's replies to its senders
        be taken (a sender this rank refused may listen for its "no" after this rank's exchange
        ended: leaving then broke its receive). Bounded by ``timeout_s`` in all (a partner that died
        leaves it to the gloo timeout). True when no copy is left running."""
        end = time.monotonic() + timeout_s
        t = self._thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                log.warning("peer copy %d still running after %.0f s at shutdown; leaving it", self.seq, timeout_s)
                return False
        self._thread = None
        answers, self._answers = self._answers, []
        for dst, w in answers:
            try:
                w.wait(timeout_s=max(0.001, end - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - the sender left or never listens: said, not raised
                log.warning("peer copy %d: rank %d did not take this rank's reply at shutdown: %s", self.seq, dst,
                            str(e)[:300])
                break   # a failed wait fails the transport: the other replies cannot be taken either
        self.recv_files.close()
        return True

    # ------------------------------------------------------------------ the exchange
    def _run(self, st: PeerCopyStats, opened: Optional[list[_Open]], manifest_fd: int = -1,
             wait_in: Optional[tuple] = None) -> None:
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        if wait_in is not None:
            end = time.monotonic() + MANIFEST_WAIT_S
            while manifest_fd < 0 and time.monotonic() < end:
                time.sleep(0.005)
                manifest_fd = _open_manifest(wait_in)
        try:
            self._exchange(st, opened, _allowed_files(manifest_fd, st.step_name))
        except Exception as e:  # noqa: BLE001 - a failed copy is logged; the restore falls back
            st.error = st.error or f"{type(e).__name__}: {e}"
            log.warning("peer copy %d of %s failed on rank %d: %s", st.seq, st.step_name, self.rank, st.error)
        st.copy_s = time.perf_counter() - t0
        st.cpu_s = time.thread_time() - cpu0
        if st.error is None:
            log.debug("peer copy %d of %s: sent %d B, received %d B in %.3f s", st.seq, st.step_name,
                      st.bytes_sent, st.bytes_received, st.copy_s)

    def _exchange(self, st: PeerCopyStats, opened: Optional[list[_Open]], allowed: Optional[dict] = None) -> None:
        import torch

        tr = self.transport
        # 1. headers
        header = {"origin": self.origin, "step": st.step_name, "seq": st.seq, "src": self.rank,
                  "files": [[o.file.relpath, o.file.size, o.crc, self._mac(st.step_name, o)] for o in opened]
                  if opened is not None else None}
        hbytes = json.dumps(header).encode()
        if len(hbytes) > _MAX_HEADER:   # more than a receiver takes: it would refuse it and this send would hang
            st.error = (f"this rank's header lists {len(opened or [])} files in {len(hbytes)} bytes, more than a "
                        f"receiver takes ({_MAX_HEADER}); not copied")
            log.warning("peer copy %d of %s: %s", st.seq, st.step_name, st.error)
            header["files"], opened = None, None
            hbytes = json.dumps(header).encode()
        htensor = torch.frombuffer(bytearray(hbytes), dtype=torch.uint8)
        lens_out = torch.tensor([len(hbytes)], dtype=torch.int64)
        works = [tr.isend(lens_out, t.dst, tag=_T_LEN) for t in self.sends]
        lens_in = [torch.zeros(1, dtype=torch.int64) for _ in self.recvs]
        works += [tr.irecv(b, t.src, tag=_T_LEN) for b, t in zip(lens_in, self.recvs)]
        for w in works:
            w.wait()
        # a sender announcing a header of no bytes or more than _MAX_HEADER is refused alone (its header
        # is not received: nothing of its size is allocated); the exchange goes on with the others
        sizes = [int(n) if 0 < int(n) <= _MAX_HEADER else -1 for n in lens_in]
        for n, k, t in zip(lens_in, sizes, self.recvs):
            if k < 0:
                log.warning("peer copy %d: refusing the copy rank %d announces: a header of %d bytes (1 to %d)",
                            st.seq, t.src, int(n), _MAX_HEADER)
        # each sender learns whether its header is taken before it sends it: a send of a header its
        # receiver does not take waited for a receive that never came until the transport's timeout
        # (the replies are not waited for here: a sender that does not listen cannot hold this rank)
        replies = [(t.src, tr.isend(torch.tensor([1 if k > 0 else 0], dtype=torch.int64), t.src, tag=_T_HDR_OK))
                   for k, t in zip(sizes, self.recvs)]
        self._answers = replies
        taken = [torch.zeros(1, dtype=torch.int64) for _ in self.sends]
        for w in [tr.irecv(v, t.dst, tag=_T_HDR_OK) for v, t in zip(taken, self.sends)]:
            w.wait()
        refused_hdr = [t.dst for v, t in zip(taken, self.sends) if int(v) != 1]
        if refused_hdr:
            st.error = (f"rank(s) {refused_hdr} refused this rank's header of {len(hbytes)} bytes (more than they "
                        f"take, or none: see their logs); not copied there")
            log.warning("peer copy %d of %s: %s", st.seq, st.step_name, st.error)
        works = [tr.isend(htensor, t.dst, tag=_T_HDR) for v, t in zip(taken, self.sends) if int(v) == 1]
        hdrs_in = [torch.empty(max(k, 0), dtype=torch.uint8) for k in sizes]
        works += [tr.irecv(b, t.src, tag=_T_HDR) for b, k, t in zip(hdrs_in, sizes, self.recvs) if k > 0]
        for w in works:
            w.wait()
        incoming = [_Incoming.parse(bytes(b.numpy()), t, self) if k > 0 else _Incoming.refused(t, self)
                    for b, k, t in zip(hdrs_in, sizes, self.recvs)]
        for inc in incoming:
            inc.staging = self.recv_files
        for inc in incoming:
            inc.check_against(allowed or {}, self.snapshot_dir)
        _check_budget(incoming, self.snapshot_dir)
        # 2. each receiver's answer to each sender: it receives the data (1) or not (0). A sender
        # never sends what will not be received (a gloo send waits for the matching receive: it would
        # hang until the transport's timeout, and fail the transport for the rest of the launch). The
        # answers are not waited for: a sender that does not listen must not hold this receiver
        # (the send handles are kept until the next exchange: a dropped gloo handle cancels its send)
        self._answers = replies + [(inc.t.src, tr.isend(torch.tensor([0 if inc.files is None else 1],
                                                                     dtype=torch.int64), inc.t.src, tag=_T_OK))
                                   for inc in incoming]
        answers = [torch.zeros(1, dtype=torch.int64) for _ in self.sends]
        for w in [tr.irecv(v, t.dst, tag=_T_OK) for v, t in zip(answers, self.sends)]:
            w.wait()
        accepted = [t for v, t in zip(answers, self.sends) if int(v) == 1]
        if opened is not None and len(accepted) < len(self.sends) and not st.error:
            st.error = (f"rank(s) {[t.dst for v, t in zip(answers, self.sends) if int(v) != 1]} did not accept this "
                        f"rank's files (see their logs)")
        # 3. data, straight from / into memory-mapped files
        works = []
        for t in accepted:
            for k, o in enumerate(opened or []):
                for a, b in _pieces(o.file.size):
                    works.append(tr.isend(o.tensor[a:b], t.dst, tag=_T_DATA + k))
        for inc in incoming:
            works += inc.post(tr)
        for w in works:
            w.wait()
        st.bytes_sent = sum(o.file.size for o in (opened or [])) * len(accepted)
        del opened
        # 4. check, move into place, COMPLETE
        for inc in incoming:
            st.bytes_received += inc.finish(self.key)
            if inc.ok:
                done = self._mark_done(inc)
                if done:
                    st.completed.append(inc.origin)
        if incoming and self.rank == min(t.dst for t in self.plan if t.dst_node == self.node):
            self._drop_stale_origins({inc.origin for inc in incoming}, st.step_name)

    def _mac(self, step_name: str, o: "_Open") -> str:
        data = o.tensor.numpy() if o.tensor is not None else b""
        return file_mac(self.key, self.origin, step_name, o.file.relpath, data, scheme=self.mac_scheme)

    def _drop_stale_origins(self, current: set, step: str) -> None:
        """Copies from nodes that no longer send here (they left, or the ring changed) are dropped
        once every current origin's copy of ``step`` is complete. Run by the node's lowest rank,
        which receives from every origin node."""
        root = os.path.join(self.snapshot_dir, PEER_DIR)
        if not all(os.path.exists(os.path.join(root, o, step, COMPLETE)) for o in current):
            return
        for name in os.listdir(root):
            if name not in current and not name.startswith("."):
                log.info("dropping the peer copy of %s (no longer in the ring)", name)
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _mark_done(self, inc: "_Incoming") -> bool:
        """Mark ``inc``'s sender done; write COMPLETE when every sender of its origin node is done."""
        d = inc.dir
        mtmp = os.path.join(d, f".from_{inc.t.src}.{inc.seq}.tmp")
        with open(mtmp, "w") as f:
            json.dump({rel: size for rel, size, *_ in inc.files or []}, f)
        os.replace(mtmp, os.path.join(d, f".from_{inc.t.src}.{inc.seq}"))
        senders = [t.src for t in self.plan if t.src_node == inc.t.src_node and
                   node_of_rank(self.procs_per_node, t.dst) == self.node]
        if not all(os.path.exists(os.path.join(d, f".from_{s}.{inc.seq}")) for s in senders):
            return False
        files: dict = {}
        for s in senders:
            with open(os.path.join(d, f".from_{s}.{inc.seq}")) as f:
                files.update(json.load(f))
        tmp = os.path.join(d, f".{COMPLETE}.{self.rank}")
        with open(tmp, "w") as f:   # the file list: what the snapshot server may serve of this copy
            json.dump({"origin": inc.origin, "seq": inc.seq, "senders": senders, "files": files}, f)
        os.replace(tmp, os.path.join(d, COMPLETE))
        if not self._announced:   # once; then every copy at debug level
            self._announced = True
            log.info("peer copies: %s of %s arrived complete in %s (%d B from rank %d on this rank; the previous "
                     "copy is dropped when the next one is complete)", inc.step, inc.origin, d,
                     sum(f[1] for f in inc.files or []), inc.t.src)
        else:
            log.debug("peer copy of %s from %s complete in %s", inc.step, inc.origin, d)
        # the newer copy is complete: drop this origin's older steps (their data files are kept in
        # .spare for the next copy to be received into) and the markers of older copies
        odir = os.path.dirname(d)
        for name in os.listdir(odir):
            if name != inc.step and _STEP_RE.fullmatch(name):
                recycle_data_files(os.path.join(odir, name), os.path.join(odir, SPARE_DIR),
                                   markers=(COMPLETE, "manifest.json"))
                shutil.rmtree(os.path.join(odir, name), ignore_errors=True)
        for name in os.listdir(d):
            if name.startswith(".from_") and not name.endswith(f".{inc.seq}"):
                try:
                    os.remove(os.path.join(d, name))
                except OSError:
                    pass
        return True


SPARE_DIR = ".spare"   # a dropped copy's data files: the next copy is received into their pages (first-touch
# allocation of tmpfs pages runs at ~0.3 GiB/s here)


def _spare_kind(rel: str) -> bool:
    """A file kept in ``.spare`` when its copy is dropped (a top-level data file)."""
    return "/" not in rel and rel.endswith(".safetensors")


def _take_spare(origin_dir: str, rel: str, part: str) -> bool:
    """Rename the spare of ``rel`` (same file name, a dropped copy's) to ``part``; False if none."""
    if not _spare_kind(rel):
        return False
    try:
        os.rename(os.path.join(origin_dir, SPARE_DIR, rel), part)
        return True
    except OSError:
        return False


class _Incoming:
    """One sender's files arriving at this rank."""

    def __init__(self, t: PeerTransfer, origin: str, step: str, seq: int, files: Optional[list], root: str):
        self.t, self.origin, self.step, self.seq, self.files = t, origin, step, seq, files
        self.dir = os.path.join(root, PEER_DIR, origin, step)
        self.bufs: list = []
        self.staged: dict = {}   # part path -> StagedFile (received into a kept mapping)
        self.staging: Optional[FileStaging] = None
        self.ok = files is not None
        self.drain = False   # received into a scratch buffer and dropped (does not fit this node)
        self.key = b""

    @staticmethod
    def parse(raw: bytes, t: PeerTransfer, cp: PeerCopier) -> "_Incoming":
        """The sender's header, checked before a byte of data is received. One that is not a header
        (not JSON, nested too deep, a bad field, another copy, a file listed twice) refuses that sender
        alone: it is answered "no" like a lying one, and the exchange goes on with the others (before,
        it failed this rank's whole exchange: no sender got its answer, and each waited for the
        transport's timeout, which failed the transport for the rest of the launch)."""
        try:
            return _Incoming._parse(raw, t, cp)
        except Exception as e:  # noqa: BLE001 - whatever the bytes: refused, never the whole exchange
            log.warning("peer copy %d: refusing the copy rank %d announces: %s", cp.seq, t.src,
                        str(e)[:300] if isinstance(e, CollectiveError) else f"not a header ({type(e).__name__})")
            return _Incoming.refused(t, cp)

    @staticmethod
    def refused(t: PeerTransfer, cp: PeerCopier) -> "_Incoming":
        """A sender whose header was refused: answered "no", nothing received, no origin touched."""
        return _Incoming(t, "", "", cp.seq, None, cp.snapshot_dir)

    @staticmethod
    def _parse(raw: bytes, t: PeerTransfer, cp: PeerCopier) -> "_Incoming":
        h = json.loads(raw)
        if not isinstance(h, dict):
            raise CollectiveError(f"peer copy: rank {t.src} sent a header that is not a JSON object")
        origin, step, seq, files = h.get("origin"), h.get("step"), h.get("seq"), h.get("files")
        if not isinstance(origin, str) or not _ID_RE.fullmatch(origin) or origin == cp.origin:
            raise CollectiveError(f"peer copy: bad origin {ascii(origin)[:80]} from rank {t.src}")
        if cp.origins is not None and origin != cp.origins[t.src]:
            raise CollectiveError(f"peer copy: rank {t.src} announces origin {ascii(origin)[:80]}, its node's is "
                                  f"{cp.origins[t.src]}")
        if not isinstance(step, str) or not _STEP_RE.fullmatch(step) or seq != cp.seq:
            raise CollectiveError(f"peer copy: rank {t.src} sent {ascii(step)[:80]} copy {ascii(seq)[:40]}, expected "
                                  f"copy {cp.seq}")
        if files is not None:
            for f in files:
                if not (isinstance(f, list) and len(f) == 4 and isinstance(f[0], str) and isinstance(f[1], int)
                        and f[1] >= 0 and isinstance(f[2], int) and isinstance(f[3], str) and _MAC_RE.fullmatch(f[3])):
                    raise CollectiveError(f"peer copy: bad file entry {ascii(f)[:200]} from rank {t.src}")
            names = [f[0] for f in files]
            if len(set(names)) != len(names):   # each name once: a repeat would be allocated, received, moved twice
                dup = next(n for n in names if names.count(n) > 1)
                raise CollectiveError(f"peer copy: rank {t.src} lists {ascii(dup[:80])} more than once")
        else:
            log.warning("peer copy of %s: rank %d could not send its files", step, t.src)
        return _Incoming(t, origin, step, seq, files, cp.snapshot_dir)

    def check_against(self, allowed: dict, snapshot_dir: str) -> None:
        """Every file this sender announces must be one of its files in this node's committed
        manifest of the step, with the manifest's size and CRC32; otherwise nothing is received."""
        if self.files is None:
            return
        for rel, size, crc, _mac in self.files:
            want = allowed.get(rel)
            if want is None or (size, crc) != want[:2] or want[2] not in (-1, self.t.src):
                log.warning("peer copy of %s from %s (rank %d): %s (%s bytes, CRC32 %08x) is not this sender's file "
                            "of size %s in this node's manifest of %s; not receiving this copy", self.step, self.origin,
                            self.t.src, ascii(rel[:80]), size, crc & 0xFFFFFFFF,
                            want[0] if want else "(absent)", self.step)
                self.files, self.ok = None, False
                return

    def post(self, tr: Transport) -> list:
        if self.files is None:
            return []
        if not self.drain:
            try:   # every file made before any receive is posted: a failure leaves none half-posted
                self._make_files()
            except OSError as e:
                # e.g. ENOSPC: the node's other receiving ranks filled the tmpfs the budget check saw
                # free. The sender's sends are matched all the same (drained into a scratch buffer),
                # or it would wait for the transport's timeout, and its next copy behind it
                log.warning("peer copy of %s from %s (rank %d) cannot be written here (%s); it is received and "
                            "dropped", self.step, self.origin, self.t.src, e)
                self._discard_files()
                self.drain = True
        if self.drain:   # sizes checked against the manifest: the scratch buffer is bounded by them
            import torch
            works = []
            for k, (rel, size, *_x) in enumerate(self.files):
                scratch = torch.empty(min(size, _PIECE), dtype=torch.uint8)
                for a, b in _pieces(size):
                    works.append(tr.irecv(scratch[:b - a], self.t.src, tag=_T_DATA + k))
            self.bufs = []
            return works
        works = []
        for k, ((_rel, size, _crc, _mac), (_part, _final, buf)) in enumerate(zip(self.files, self.bufs)):
            for a, b in _pieces(size):
                works.append(tr.irecv(buf[a:b], self.t.src, tag=_T_DATA + k))
        return works

    def _make_files(self) -> None:
        """Each announced file as a sized, allocated ``.part`` file, mapped (``self.bufs``)."""
        import torch

        assert self.files is not None
        os.makedirs(self.dir, exist_ok=True)
        try:   # a re-sent step: it is not complete until this copy is
            os.remove(os.path.join(self.dir, COMPLETE))
        except FileNotFoundError:
            pass
        for rel, size, _crc, _mac in self.files:
            final = safe_join(self.dir, rel, what="peer copy file", allow_subdirs=True)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            part = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.part")
            self.bufs.append((part, final, None))   # listed first: removed if what follows fails
            if self.staging is not None and size and _spare_kind(rel):
                # a retired copy's file (its pages exist, and usually its mapping is kept), renamed to
                # the part file; a new one is allocated before it is mapped (ENOSPC, not SIGBUS)
                staged = self.staging.take(os.path.dirname(part), os.path.basename(part),
                                           [os.path.join(os.path.dirname(self.dir), SPARE_DIR, rel)], b"", size)
                self.staged[part] = staged
                buf = staged.data
            else:
                _take_spare(os.path.dirname(self.dir), rel, part)   # a retired copy's file: its pages exist
                fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    os.ftruncate(fd, size)
                    if size:   # every page allocated now: a full tmpfs is ENOSPC here, not SIGBUS in the receive
                        os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
                buf = torch.from_file(part, shared=True, size=size, dtype=torch.uint8) if size else None
            self.bufs[-1] = (part, final, buf)

    def _discard_files(self) -> None:
        """The ``.part`` files :meth:`_make_files` made (or took) before it failed: gone, unmapped."""
        for part, _final, _buf in self.bufs:
            staged = self.staged.pop(part, None)
            if staged is not None and self.staging is not None:
                self.staging.release(staged)
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.debug("could not remove %s: %s", part, e)
        for part, staged in list(self.staged.items()):   # taken, then its mapping failed
            if self.staging is not None:
                self.staging.release(staged)
            self.staged.pop(part, None)
        self.bufs = []

    def finish(self, key: bytes) -> int:
        """Check every file's CRC and keyed digest (one pass: both run over each piece while it is
        in cache), move it into place; returns the bytes received."""
        n = 0
        if self.drain:
            self.ok = False
            return 0
        for (rel, size, crc, mac), (part, final, buf) in zip(self.files or [], self.bufs):
            data = memoryview(buf.numpy()) if size else memoryview(b"")
            check = FileMac(key, self.origin, self.step, rel, tag=mac)
            got = 0
            for a in range(0, size, _CHECK_PIECE):
                piece = data[a:a + _CHECK_PIECE]
                got = crc32(piece, got)
                check.update(piece)
            n += size
            why = (f"arrived with CRC32 {got:08x}, sent as {crc:08x}" if got != crc else
                   "failed its keyed digest (not sent by this job, or changed on the way)"
                   if not check.matches(mac) else "")
            if why:
                log.warning("peer copy of %s from %s (rank %d): %s %s; not completing this copy", self.step,
                            self.origin, self.t.src, rel, why)
                self.ok = False
                os.remove(part)
                if part in self.staged and self.staging is not None:
                    self.staging.release(self.staged.pop(part))   # gone: do not keep its pages mapped
                continue
            os.replace(part, final)
        self.bufs = []
        return n
