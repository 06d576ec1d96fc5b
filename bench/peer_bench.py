"""Cross-node memory snapshots: peer-copy overhead per training step, and restore from another
node's memory (its snapshot server) vs from storage. Ratios within one run.

    python bench/peer_bench.py --mib 64 --steps 12 [--json out.json]

Part 1 (2 gloo processes acting as 2 nodes, one rank each, /dev/shm node directories): a
"training step" is a fixed matmul loop plus a gradient all-reduce on the default group (the
training traffic); each step is followed by a memory snapshot of ``--mib`` MiB whose peer copy
(:class:`elastor_ds.checkpoint.snapshot.peer_copy.PeerCopier`, the real transport) runs in the background while
the next steps compute. Reported: step time (including ``submit``, which waits for the previous
copy: back-pressure when copies are slower than steps) with copies / without; the copy's time / a
memcpy of the same bytes.

Part 2 (one process): read a ``--mib`` MiB chunk file through the real chunk sources: another
node's server on localhost (:class:`RemoteSource`, 8 MiB ranges, as the reader issues them), a
peer copy held on this node's tmpfs, and storage (a file under ``--storage-dir``) cold (evicted from
the page cache with posix_fadvise DONTNEED before each read) and warm; and the floor of the remote
read: the same bytes sent with ``sendfile`` over one loopback TCP connection (no HTTP, MAC or CRC).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from elastor_ds.cli_types import nonnegative_int, positive_int  # noqa: E402

from _args import output_file, writable_dir  # noqa: E402


def _step(x, dist, matmuls: int = 6):
    y = x
    for _ in range(matmuls):
        y = (y @ x).tanh_()
    g = y.sum(0)
    dist.all_reduce(g)
    return float(g[0])


def _part1(rank: int, world: int, port: int, mib: int, steps: int, base: str, out: str, matmuls: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from elastor_ds.checkpoint.snapshot.peer_copy import PeerCopier, PeerFile

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    nodedir = os.path.join(base, f"elastor-bench-node{rank}")
    os.makedirs(nodedir, exist_ok=True)
    secret = os.path.join(base, "job.secret")   # peer copies need the job key (same file for every rank)
    if rank == 0:
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
    dist.barrier()
    os.environ["ELASTOR_JOB_SECRET_FILE"] = secret
    cp = PeerCopier.create([1] * world, nodedir, 1, timeout_s=300)
    body = os.urandom(1 << 20) * mib
    crc = zlib.crc32(body)
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    every = [None] * world
    dist.all_gather_object(every, crc)   # the receiver checks what it is sent against the step's manifest
    files = {f"data_{r:05d}.safetensors": FileEntry(f"data_{r:05d}.safetensors", len(body), c, r)
             for r, c in enumerate(every)}
    x = torch.randn(384, 384) / 20
    for _ in range(3):
        _step(x, dist)

    def timed(with_copy: bool) -> tuple[list[float], list[float]]:
        ts, copies = [], []
        for s in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            _step(x, dist, matmuls)
            if with_copy:   # the snapshot committed: its files go to the next node in the background
                d = os.path.join(nodedir, "local", f"step_{s:09d}")
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"data_{rank:05d}.safetensors"), "wb") as f:
                    f.write(body)
                with open(os.path.join(d, "manifest.json"), "w") as f:
                    f.write(Manifest(step=s, tensors={}, files=files, world_size=world).dumps(compact=True))
                st = cp.submit(d, [PeerFile(f"data_{rank:05d}.safetensors", len(body), crc)])
                copies.append(st)   # submit() waits for the previous copy: that wait is a stall
            ts.append(time.perf_counter() - t0)
        cp.wait()
        return ts, [c.copy_s for c in copies if c.error is None]

    idle1, _ = timed(False)
    busy, copy_s = timed(True)
    idle2, _ = timed(False)
    buf = bytearray(len(body))
    mc = []
    for _ in range(5):
        t0 = time.perf_counter()
        buf[:] = body
        mc.append(time.perf_counter() - t0)
    res = {"rank": rank, "step_idle_s": statistics.median(idle1 + idle2), "step_with_copy_s": statistics.median(busy),
           "copy_s": statistics.median(copy_s), "memcpy_s": statistics.median(mc), "bytes": len(body),
           "copies_ok": len(copy_s), "steps": steps}
    with open(os.path.join(out, f"part1_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    cp.close()
    dist.destroy_process_group()


def part1(mib: int, steps: int, matmuls: int = 6) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    from dist_utils import free_port
    base = tempfile.mkdtemp(prefix="peer_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    out = tempfile.mkdtemp(prefix="peer_bench_out_")
    try:
        mp.start_processes(_part1, args=(2, free_port(), mib, steps, base, out, matmuls), nprocs=2, join=True,
                           start_method="spawn")
        rows = [json.load(open(os.path.join(out, f"part1_rank{r}.json"))) for r in range(2)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    worst = max(rows, key=lambda r: r["step_with_copy_s"] / r["step_idle_s"])
    return {"ranks": rows, "step_with_copy_over_idle": worst["step_with_copy_s"] / worst["step_idle_s"],
            "copy_over_memcpy": max(r["copy_s"] / r["memcpy_s"] for r in rows),
            "copy_over_step": max(r["copy_s"] / r["step_idle_s"] for r in rows)}


def _read_all(src, rel: str, size: int, piece: int = 8 << 20) -> float:
    """Read the file in ``piece`` reads as the checkpoint reader does: before each read, the
    following reads up to its ``PREFETCH_BYTES`` are announced to a source that takes hints
    (``prefetch``: storage's page-cache read-ahead, a snapshot server's requests sent ahead)."""
    from elastor_ds.checkpoint.reader import PREFETCH_BYTES
    buf = bytearray(size)
    mv = memoryview(buf)
    offs = list(range(0, size, piece))
    prefetch = getattr(src, "prefetch", None)
    t0 = time.perf_counter()
    assert src.has(rel, size)
    ahead = 0
    for i, a in enumerate(offs):
        if prefetch is not None:
            ahead = max(ahead, i + 1)
            while ahead < len(offs) and (ahead - i - 1) * piece < PREFETCH_BYTES:
                prefetch(rel, offs[ahead], min(piece, size - offs[ahead]))
                ahead += 1
        src.read_into(rel, a, [mv[a:min(size, a + piece)]])
    return time.perf_counter() - t0


def _loopback_floor(path: str, size: int) -> float:
    """The floor of a read from another node's memory here: the file's bytes sent from the page
    cache (``sendfile``) by another thread over one loopback TCP connection into a buffer; no HTTP,
    no MAC, no CRC. Seconds from connecting to the last byte received."""
    import socket
    import threading

    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn, open(path, "rb") as f:
            sent = 0
            while sent < size:
                sent += os.sendfile(conn.fileno(), f.fileno(), sent, size - sent)
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    buf = bytearray(size)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        got = 0
        while got < size:
            n = c.recv_into(mv[got:], size - got)
            if not n:
                raise RuntimeError(f"loopback floor: connection closed after {got} of {size} bytes")
            got += n
    dt = time.perf_counter() - t0
    th.join()
    lsock.close()
    return dt


def part2(mib: int, storage_dir: str, reps: int = 3) -> dict:
    from elastor_ds.checkpoint.snapshot.peer_sources import PeerCopySource, RemoteSource
    from elastor_ds.checkpoint.sources import DirSource
    from elastor_ds.checkpoint.snapshot.server import SnapshotServer

    step = "step_000000001"
    rel = "data_00000.safetensors"
    body = os.urandom(1 << 20) * mib
    shm = tempfile.mkdtemp(prefix="peer_bench_node_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    sto = tempfile.mkdtemp(prefix="peer_bench_storage_", dir=storage_dir)
    try:
        for d in (os.path.join(shm, "local", step), os.path.join(shm, "peer", "other", step), os.path.join(sto, step)):
            os.makedirs(d)
            with open(os.path.join(d, rel), "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
        from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
        with open(os.path.join(shm, "local", step, "manifest.json"), "w") as f:   # a committed snapshot
            f.write(Manifest(step=1, tensors={}, files={rel: FileEntry(rel, len(body), zlib.crc32(body), 0)}).dumps())
        with open(os.path.join(shm, "peer", "other", step, "COMPLETE"), "w") as f:
            json.dump({"files": {rel: len(body)}}, f)
        spath = os.path.join(sto, step, rel)
        times: dict[str, list[float]] = {"remote": [], "loopback_floor": [], "peer_local": [], "storage_cold": [],
                                         "storage_warm": []}
        key = os.urandom(32)   # the job key (authenticated requests and answers)
        with SnapshotServer(shm, key) as srv:
            for _ in range(reps):
                times["remote"].append(_read_all(RemoteSource(srv.address, step, key), rel, len(body)))
                times["loopback_floor"].append(_loopback_floor(os.path.join(shm, "local", step, rel), len(body)))
                times["peer_local"].append(_read_all(PeerCopySource(shm, step), rel, len(body)))
                fd = os.open(spath, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                times["storage_cold"].append(_read_all(DirSource(os.path.join(sto, step)), rel, len(body)))
                times["storage_warm"].append(_read_all(DirSource(os.path.join(sto, step)), rel, len(body)))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(sto, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds": med, "remote_over_storage_cold": med["remote"] / med["storage_cold"],
            "remote_over_storage_warm": med["remote"] / med["storage_warm"],
            "remote_over_peer_local": med["remote"] / med["peer_local"],
            "remote_over_loopback_floor": med["remote"] / med["loopback_floor"],
            "gb_per_s": {k: len(body) / 1e9 / v for k, v in med.items()}, "bytes": len(body)}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=positive_int, default=64, help="MiB per snapshot (part 1) and per file (part 2)")
    ap.add_argument("--steps", type=positive_int, default=12, help="part 1: training steps per measurement")
    ap.add_argument("--matmuls", type=nonnegative_int, default=6,
                    help="384x384 matmuls per step (the step's compute)")
    ap.add_argument("--storage-dir", type=writable_dir, default=os.getcwd(),
                    help="part 2: an existing writable directory on the storage disk (default: here)")
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument("--part", choices=["1", "2", "all"], default="all")
    a = ap.parse_args()
    res = {"uptime_load": os.getloadavg()}
    if a.part in ("1", "all"):
        res["peer_copy"] = part1(a.mib, a.steps, a.matmuls)
    if a.part in ("2", "all"):
        res["restore"] = part2(a.mib, a.storage_dir)
    print(json.dumps(res, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
