"""A restore's reads from another node's memory (issue 23): the load of a resharded layout whose data
file bytes all come from a peer's snapshot server, against the floor of a peer read on this machine.

The peer is a second process (another "node"): it serves a committed memory snapshot on /dev/shm
through the real :class:`~elastor_ds.checkpoint.snapshot.server.SnapshotServer` (signed range
requests, MACed answers), and beside it a raw TCP server that sends byte ranges of the same data
file with ``sendfile`` (only that file, only to a client that sends the job key first, as the
snapshot server's requests carry it). The reader keeps only the step's manifest and CRC table locally (a node
that lost its memory reads its data file from the peer), and loads a column half of every tensor
(a reshard: the needed bytes are the column tiles of that half), every byte CRC-checked, through
:class:`~elastor_ds.checkpoint.snapshot.peer_sources.RemoteSource` alone.

Floor (the physical floor of a peer read here): the same number of bytes, sent by the peer
process from its tmpfs file with ``sendfile`` over one loopback TCP connection, received into
preallocated memory (``recv_into``): no authentication, no MAC, no CRC, no copy into place. The
floor and the load alternate ``--reps`` times; ratios are of the medians, and of the best of each.

    .venv/bin/python bench/peer_read_bench.py --mib 256 --reps 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from elastor_ds.cli_types import positive_int  # noqa: E402

from _args import output_file  # noqa: E402
COLS = 4096


def serve(root: str, key_file: str, data_file: str) -> None:
    """The peer process: the snapshot server for ``root`` and the raw floor server for ``data_file``
    (a path fixed here, never taken from a request; ranges bounded by its size; a request without
    the key is closed unanswered); prints both addresses, serves until its stdin closes."""
    import hmac
    import threading
    from elastor_ds.checkpoint.snapshot.server import SnapshotServer
    with open(key_file, "rb") as f:
        key = f.read()
    size = os.path.getsize(data_file)
    srv = SnapshotServer(root, key).start()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)

    def floor_loop() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                req = b""
                try:
                    while not req.endswith(b"\n") and len(req) < 256:
                        got = conn.recv(256)
                        if not got:
                            break
                        req += got
                except OSError:
                    continue
                parts = req.decode(errors="replace").split()
                if len(parts) != 3 or not hmac.compare_digest(parts[0].encode(), key.hex().encode()):
                    continue
                try:
                    off, n = int(parts[1]), int(parts[2])
                except ValueError:
                    continue
                if not (0 <= off <= size and 0 <= n <= size - off):
                    continue
                conn.settimeout(None)
                fd = os.open(data_file, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    while n > 0:
                        k = os.sendfile(conn.fileno(), fd, off, n)
                        if k <= 0:
                            break
                        off += k
                        n -= k
                finally:
                    os.close(fd)
    threading.Thread(target=floor_loop, daemon=True).start()
    print(f"{srv.address} 127.0.0.1:{lsock.getsockname()[1]}", flush=True)
    sys.stdin.read()
    lsock.close()
    srv.close()


def _floor(addr: str, key: bytes, off: int, nbytes: int, into: memoryview) -> float:
    host, port = addr.rsplit(":", 1)
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"{key.hex()} {off} {nbytes}\n".encode())
        got = 0
        while got < nbytes:
            k = s.recv_into(into[got:nbytes])
            if k == 0:
                raise RuntimeError(f"floor: the peer closed after {got} of {nbytes} bytes")
            got += k
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=positive_int, default=256,
                    help=f"MiB in the snapshot (fp32, 4 tensors of {COLS} columns)")
    ap.add_argument("--reps", type=positive_int, default=4, help="alternations of the floor and the load")
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    ap.add_argument("--serve", nargs=3, metavar=("ROOT", "KEY_FILE", "DATA_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0

    import torch
    from elastor_ds.checkpoint import commit as commit_mod
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import TensorShard, full_shard
    from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
    from elastor_ds.checkpoint.storage import TmpfsStorage
    from elastor_ds.layout.region import Region

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    peer = tempfile.mkdtemp(prefix="elastor-peer-bench-", dir=shm)      # mkdtemp: mode 0700
    here = tempfile.mkdtemp(prefix="elastor-peer-bench-", dir=shm)
    keys = tempfile.mkdtemp(prefix="elastor-peer-bench-key-")           # outside the served root
    key_file = os.path.join(keys, "key")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    with open(key_file, "rb") as f:
        key = f.read()
    proc = None
    try:
        n = 4
        rows = args.mib * 2 ** 20 // 4 // COLS // n
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(rows, COLS, generator=g) for _ in range(n)]
        local = os.path.join(peer, "local")
        eng = CheckpointEngine(local, storage=TmpfsStorage(local), keep=1)
        eng.save(1, [full_shard(f"t{i}", t) for i, t in enumerate(full)])
        eng.finalize()
        step_dir = commit_mod.resolve(local)
        step = os.path.basename(step_dir)
        mine = os.path.join(here, "local", step)
        os.makedirs(mine)
        data = [f for f in os.listdir(step_dir) if f.endswith(".safetensors")]
        for f in os.listdir(step_dir):       # the manifest and CRC tables stay; the data files are the peer's
            if f not in data:
                shutil.copy(os.path.join(step_dir, f), os.path.join(mine, f))
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", peer, key_file,
                                 os.path.join(step_dir, data[0])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        server, floor_addr = proc.stdout.readline().split()
        half = COLS // 2
        dst = [torch.full((rows, half), float("nan")) for _ in range(n)]
        shards = [TensorShard(f"t{i}", (rows, COLS), Region((0, half), (rows, half)), d) for i, d in enumerate(dst)]
        need = sum(d.numel() * 4 for d in dst)
        sink = memoryview(bytearray(need))
        floors, loads, served = [], [], []
        for _ in range(args.reps):
            floors.append(_floor(floor_addr, key, 0, need, sink))
            for d in dst:
                d.fill_(float("nan"))
            src = RemoteSource(server, step, key)
            reader = CheckpointEngine(os.path.join(here, "local"))
            t0 = time.perf_counter()
            res = reader.load(mine, shards, sources=lambda sd, man, s=src: [s])
            loads.append(time.perf_counter() - t0)
            reader.finalize()
            src.close()
            served.append(dict(res.bytes_by_source))
            for i, d in enumerate(dst):
                if not torch.equal(d, full[i][:, half:]):
                    raise AssertionError(f"the load of t{i} is not the saved column half")
        fm, lm = statistics.median(floors), statistics.median(loads)
        out = {"mib": args.mib, "bytes_needed": need, "reps": args.reps, "floor_s": floors, "load_s": loads,
               "bytes_by_source": served[-1],
               "load_over_floor_median": lm / fm, "load_over_floor_best": min(loads) / min(floors),
               "floor_gb_s": need / fm / 1e9, "load_gb_s": need / lm / 1e9}
        print(json.dumps(out, indent=1))
        print(f"\npeer read: {need / 2**20:.0f} MiB needed (a column half of {args.mib} MiB), all from the peer's "
              f"snapshot server; {args.reps} alternations")
        print(f"  floor (sendfile -> loopback TCP -> recv_into): {out['floor_gb_s']:.2f} GB/s (median)")
        print(f"  load with reshard, every byte MACed and CRC-checked: {out['load_gb_s']:.2f} GB/s (median)")
        print(f"  load / floor: {out['load_over_floor_median']:.2f} (medians), {out['load_over_floor_best']:.2f} "
              f"(best of each); no goal in issue 23 beyond stating them")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    finally:
        if proc is not None:
            proc.stdin.close()
            proc.wait(timeout=30)
        for d in (peer, here, keys):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
