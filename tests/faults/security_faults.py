"""The fault campaign's attacker classes (issue 19): another local user or a forger against the job.

Used by ``tests/faults/fault_campaign.py`` (``--classes standby-handoff,snapshot-server,forged-table,
peer-sender``); same row semantics: **detected** = the attack was refused as it should be;
**data lost** = the attacker got something (a file of ours written through its symlink, its code
run as us, a secret byte served, a forged value returned as good); **hangs**; **tracebacks**.

* ``standby-handoff``: ``nobody`` plants a ``standby`` folder with a ``standby.log`` symlink in a
  shared log dir (sticky and not) and swaps every assignment file it sees; a real ``elastor run``
  must refuse (exit 2) without running the attacker's script or writing through the link.
* ``snapshot-server``: requests without a token, with a wrong one, replayed, with the path edited,
  for files under ``--snapshot-dir`` that no committed manifest lists, 500 idle connections, a
  5000-digit and an oversized ``Range``, a 10 KB escaped name, a 70 KB head: each refused (4xx /
  503 / closed), no secret byte out, no traceback, and a legitimate read served afterwards.
* ``forged-table``: a data byte edited and its chunk's block-CRC entries recomputed (zlib), under
  every read pattern: the load fails as corrupt and never returns the forged value.
* ``peer-sender``: a sender announcing 16 GiB for its file, an unlisted file, another rank's
  file: the receiver writes and completes nothing of it, the honest copies complete.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import pwd
import random
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import fault_campaign as fc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------- standby handoff
_ATTACKER = r'''
import json, os, sys, time
shared, evil, victim, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sb = os.path.join(shared, "standby")
os.mkdir(sb)
os.chmod(sb, 0o777)
os.symlink(victim, os.path.join(sb, "standby.log"))
open(os.path.join(shared, "attacker_ready"), "w").close()
job = json.dumps({"argv": [evil], "env": {"PATH": "/usr/bin:/bin"}, "stdout": None, "stderr": None, "cwd": "/"})
end = time.time() + seconds
while time.time() < end:
    for root, dirs, files in os.walk(shared):
        for f in files:
            if f.startswith("assign_"):
                try:
                    with open(os.path.join(root, ".e"), "w") as fh:
                        fh.write(job)
                    os.replace(os.path.join(root, ".e"), os.path.join(root, f))
                except OSError:
                    pass
    time.sleep(0.002)
'''


def _reachable(path: str) -> None:
    p = os.path.dirname(os.path.abspath(path))
    while p not in ("/", ""):
        os.chmod(p, os.stat(p).st_mode | 0o001)
        p = os.path.dirname(p)


def run_standby_handoff(work: str, rng: random.Random, reps: int) -> fc.Row:
    row = fc.Row()
    if os.getuid() != 0:
        row.add("needs root to run the attacker as another user", False)
        return row
    pw = pwd.getpwnam("nobody")
    python = next((x for x in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(x, os.X_OK)), sys.executable)
    for i in range(max(1, reps)):
        for mode in (0o1777, 0o777):
            base = os.path.join(work, f"h{i}_{mode:o}")
            shared = os.path.join(base, "shared")
            os.makedirs(shared)
            os.chmod(shared, mode)
            _reachable(shared)
            victim = os.path.join(base, "victim.txt")
            fc.write(victim, "precious\n")
            marker = os.path.join(shared, "evil_ran")
            evil = fc.write(os.path.join(shared, "evil.py"), f"open({marker!r}, 'w').write('pwned')\n")
            os.chmod(evil, 0o644)
            good = fc.write(os.path.join(base, "good.py"), "pass\n")

            def drop(uid=pw.pw_uid, gid=pw.pw_gid):
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
            att = subprocess.Popen([python, "-c", _ATTACKER, shared, evil, victim, "120"], preexec_fn=drop,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
            t0 = time.time()
            while not os.path.exists(os.path.join(shared, "attacker_ready")) and time.time() - t0 < 30:
                time.sleep(0.05)
            env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
            hang = False
            try:
                r = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--standalone", "--nproc-per-node",
                                    "1", "--log-dir", shared, "--standby-preload", "torch", "--snapshot-dir",
                                    os.path.join(base, "snap"), good], capture_output=True, text=True, timeout=180,
                                   env=env, cwd=base)
                rc, out = r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired:
                rc, out, hang = fc.HANG, "", True
            finally:
                att.kill()
                att.wait()
            pwned = os.path.exists(marker)
            written = open(victim).read() != "precious\n"
            row.add(f"shared log dir mode {mode:o}: planted standby/ + standby.log symlink + swapped assignments "
                    f"(rc {rc}; attacker ran {pwned}; victim written {written}: {out.strip()[-160:]})",
                    rc == 2 and not pwned and not written, pwned or written, hang, fc.TRACEBACK in out)
    return row


# ---------------------------------------------------------------------------------- snapshot server
_STEP = "step_000000007"
_DATA = f"/f/local/{_STEP}/data_00000.safetensors"


def _node(root: str) -> bytes:
    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    data = bytes((i * 7 + 3) % 256 for i in range(300_000))
    d = os.path.join(root, "local", _STEP)
    os.makedirs(d)
    with open(os.path.join(d, "data_00000.safetensors"), "wb") as f:
        f.write(data)
    with open(os.path.join(d, "big.bin"), "wb") as f:
        f.truncate(20 << 20)
    files = {"data_00000.safetensors": FileEntry("data_00000.safetensors", len(data), zlib.crc32(data), 0),
             "big.bin": FileEntry("big.bin", 20 << 20, zlib.crc32(bytes(20 << 20)), 0)}
    fc.write(os.path.join(d, "manifest.json"), Manifest(step=7, tensors={}, files=files).dumps())
    fc.write(os.path.join(d, "unlisted.bin"), "SECRET-inside")
    fc.write(os.path.join(root, "weights.pt"), "SECRET-weights")
    fc.write(os.path.join(root, ".elastor-owner"), "SECRET-owner")
    return data


def _sign(key: bytes, method: str, path: str, rng: str = "", when: str = "", target: str = "") -> str:
    """A signed request's headers, by hand (the MAC's fields as docs/security.md gives them): for
    ``target``, the address the server published (a request signed for another is refused)."""
    nonce, when = secrets.token_hex(16), when or str(int(time.time()))
    mac = hmac.new(key, b"req\n" + "\n".join([method, path, rng, nonce, when, target]).encode() + b"\n",
                   hashlib.sha256).hexdigest()
    return (f"X-Elastor-Nonce: {nonce}\r\nX-Elastor-Time: {when}\r\nX-Elastor-Target: {target}\r\n"
            f"X-Elastor-Auth: {mac}\r\n")


def _raw(port: int, req: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        buf = b""
        while True:
            try:
                k = s.recv(65536)
            except ConnectionResetError:
                break
            if not k:
                break
            buf += k
    try:
        return int(buf.split(b" ", 2)[1]), buf
    except (IndexError, ValueError):
        return 0, buf


def _attacks(key: bytes, port: int, target: str = "") -> dict:
    """name -> callable returning (refused, leaked) for one attack."""
    wrong = bytes(32)

    def get(path: str, k, extra: str = "") -> bytes:
        auth = _sign(k, "GET", path, target=target) if k else ""
        return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}{auth}Connection: close\r\n\r\n".encode()

    def simple(req: bytes, codes=(401, 403, 404, 416, 431, 400)):
        def run():
            st, buf = _raw(port, req)
            return st in codes, b"SECRET" in buf or bytes((3, 10, 17, 24)) in buf
        return run

    def replay():
        path, rng = _DATA, "bytes=0-99"
        req = (f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: {rng}\r\n{_sign(key, 'GET', path, rng, target=target)}"
               f"Connection: close\r\n\r\n").encode()
        first, _ = _raw(port, req)
        again, buf = _raw(port, req)
        return first == 206 and again == 401, False

    def edited():
        rng = "bytes=0-99"
        req = (f"GET {_DATA} HTTP/1.1\r\nHost: x\r\nRange: {rng}\r\n{_sign(key, 'GET', _DATA, rng, target=target)}"
               f"Connection: close\r\n\r\n").encode()
        st, buf = _raw(port, req.replace(_DATA.encode(), b"/f/weights.pt"))
        return st == 401, b"SECRET" in buf

    def idle500():
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(500)]
        try:
            time.sleep(0.3)
            return _legit(key, port, within_s=12), False
        finally:
            for s in socks:
                s.close()

    def range_req(rng: str, path: str = f"/f/local/{_STEP}/big.bin"):
        return simple(f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: {rng}\r\n{_sign(key, 'GET', path, rng, target=target)}"
                      f"Connection: close\r\n\r\n".encode(), (416,))

    return {
        "no token": simple(get(_DATA, None), (401,)),
        "wrong token": simple(get(_DATA, wrong), (401,)),
        "replayed request": replay,
        "edited path, kept MAC": edited,
        "signed, outside snapshots: weights.pt": simple(get("/f/weights.pt", key), (404,)),
        "signed, outside snapshots: owner marker": simple(get("/f/.elastor-owner", key), (404,)),
        "signed, unlisted file of a committed step": simple(get(f"/f/local/{_STEP}/unlisted.bin", key), (404,)),
        "signed, ../ out": simple(get("/f/local/../weights.pt", key), (404,)),
        "stale time": simple(f"GET {_DATA} HTTP/1.1\r\nHost: x\r\n"
                             f"{_sign(key, 'GET', _DATA, when='1000', target=target)}"
                             f"Connection: close\r\n\r\n".encode(),
                             (401,)),
        "500 idle connections": idle500,
        "5000-digit Range": range_req("bytes=" + "9" * 5000 + "-"),
        "17 MiB Range": range_req(f"bytes=0-{(17 << 20) - 1}"),
        "10 KB escaped name": simple(f"GET /f/{'A' * 10_000}\x1b[2J HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                                     (400, 401, 414, 431)),
        "70 KB head": simple(b"GET /f/x HTTP/1.1\r\nX-Pad: " + b"p" * 70_000 + b"\r\n\r\n", (400, 431)),
    }


def _legit(key: bytes, port: int, within_s: float = 10) -> bool:
    from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
    t0 = time.monotonic()
    src = RemoteSource(f"127.0.0.1:{port}", _STEP, key, busy_wait_s=within_s)
    try:
        buf = bytearray(4096)
        ok = src.has("data_00000.safetensors", 300_000)
        src.read_into("data_00000.safetensors", 5000, [memoryview(buf)])
        want = bytes((i * 7 + 3) % 256 for i in range(5000, 9096))
        return ok and bytes(buf) == want and time.monotonic() - t0 < within_s
    finally:
        src.close()


def run_snapshot_server(work: str, rng: random.Random, reps: int) -> fc.Row:
    import logging
    row = fc.Row()
    for i in range(max(1, reps)):
        for name in list(_attacks(b"x" * 32, 0)):
            root = tempfile.mkdtemp(prefix="srv_", dir=work)

            def trial(root=root, name=name) -> int:
                logging.basicConfig(level=logging.WARNING)
                from elastor_ds.checkpoint.snapshot.server import SnapshotServer
                _node(root)
                key = os.urandom(32)
                with SnapshotServer(root, key, head_timeout_s=2.0) as srv:
                    refused, leaked = _attacks(key, srv.port, srv.address)[name]()
                    served = _legit(key, srv.port, within_s=12)
                print(f"refused={refused} leaked={leaked} served_after={served}")
                return 3 if leaked else (0 if refused and served else 1)
            o = fc.forked(trial, 90)
            row.add(f"{name} (rc {o.rc}: {o.out.strip()[-120:]}{o.err.strip()[-200:]})", o.rc == 0, o.rc == 3, o.hang,
                    o.traceback)
    return row


# ---------------------------------------------------------------------------------- forged table
_FSHAPE = (64, 1024)   # 128 KiB row halves: 32 CRC blocks per chunk (chunks of one block carry their own CRC)
_FPATTERNS = {
    "full": [((0, 0), (64, 1024))],
    "row": [((32, 0), (32, 1024))],
    "column": [((0, 512), (64, 512))],
    "strided": [((0, 256), (64, 256)), ((0, 768), (64, 256))],
    "reshard": [((r, c), (16, 512)) for r in range(0, 64, 16) for c in (0, 512)],
}


def _fsave(root: str):
    import torch

    from elastor_ds.checkpoint import CheckpointEngine, TensorShard
    from elastor_ds.layout.region import Region
    w = torch.randn(*_FSHAPE, generator=torch.Generator().manual_seed(11))
    CheckpointEngine(root, async_save=False).save(3, [TensorShard("w", _FSHAPE, Region((0, 0), (32, 1024)), w[:32]),
                                                      TensorShard("w", _FSHAPE, Region((32, 0), (32, 1024)), w[32:])])
    return w


def _forge(step_dir: str, rng: random.Random) -> tuple[int, int]:
    """One float of the second row half set to 1e6, inside every pattern's first region; the
    chunk's cumulative block CRCs recomputed with zlib and written into the table."""
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    chunk = next(c for c in man["tensors"]["w"]["chunks"] if c["region"][0][0] == 32)
    row, col = 48 + rng.randrange(16), 768 + rng.randrange(256)   # read by every pattern
    with open(os.path.join(step_dir, chunk["file"]), "r+b") as f:
        f.seek(chunk["offset"] + ((row - 32) * 1024 + col) * 4)
        f.write(struct.pack("<f", 1e6))
        f.seek(chunk["offset"])
        body = f.read(chunk["length"])
    blk, crc, entries = chunk["blocks"], 0, []
    for a in range(0, len(body), blk["size"]):
        crc = zlib.crc32(body[a:a + blk["size"]], crc)
        entries.append(crc)
    with open(os.path.join(step_dir, blk["table"]), "r+b") as f:
        f.seek(blk["index"] * 4)
        f.write(struct.pack(f"<{len(entries)}I", *entries))
    return row, col


def run_forged_table(work: str, rng: random.Random, reps: int) -> fc.Row:
    from elastor_ds.checkpoint import commit as commit_mod
    row = fc.Row()
    for i in range(max(1, reps) * 2):
        for pattern, boxes in _FPATTERNS.items():
            root = os.path.join(work, f"f{i}_{pattern}")
            _fsave(root)
            at = _forge(commit_mod.resolve(root), rng)

            def trial(root=root, boxes=boxes) -> int:
                import torch

                from elastor_ds.checkpoint import CheckpointEngine, TensorShard
                from elastor_ds.errors import CorruptCheckpointError
                from elastor_ds.layout.region import Region
                w = torch.randn(*_FSHAPE, generator=torch.Generator().manual_seed(11))
                shards = [TensorShard("w", _FSHAPE, Region(o, z), torch.empty(z)) for o, z in boxes]
                try:
                    CheckpointEngine(root).load(None, shards)
                except CorruptCheckpointError as e:
                    print(f"CorruptCheckpointError: {e}", file=sys.stderr)
                    return 1
                good = all(torch.equal(s.tensor, w[s.region.offsets[0]:s.region.offsets[0] + s.region.sizes[0],
                                                   s.region.offsets[1]:s.region.offsets[1] + s.region.sizes[1]])
                           for s in shards)
                return 0 if good else 3   # 3: the forged value returned as good
            o = fc.forked(trial, 60)
            row.add(f"{pattern}: w{list(at)} forged, table entries recomputed (rc {o.rc}: {o.err.strip()[-160:]})",
                    o.rc == 1 and "CRC32" in o.err, o.rc in (0, 3), o.hang, o.traceback)
    return row


# ---------------------------------------------------------------------------------- lying peer-copy sender
def _peer_world(base: str, lie: str, timeout_s: float = 60.0) -> list[int]:
    """3 forked gloo ranks (node 0 = ranks 0, 1; node 1 = rank 2); rank 1 announces ``lie``."""
    store = tempfile.mktemp(prefix="elastor_store_", dir=base)
    secret = os.path.join(base, "job.secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    pids = []
    for rank in range(3):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
                code = _peer_rank(rank, base, store, secret, lie, timeout_s)
            finally:
                os._exit(code)
        pids.append(pid)
    out = []
    for pid in pids:
        st = fc.wait_or_kill(pid, timeout_s + 30)
        out.append(fc.HANG if st is None else (os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)))
    return out


def _files(rank: int) -> dict:
    body = bytes(((rank + 1) * 31 + i) % 251 for i in range(40_000 + 1000 * rank))
    return {f"data_{rank:05d}.safetensors": body}


def _peer_rank(rank: int, base: str, store: str, secret: str, lie: str, timeout_s: float) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from elastor_ds.checkpoint.planning.manifest import FileEntry, Manifest
    from elastor_ds.checkpoint.snapshot import peer_copy as pc
    os.environ["ELASTOR_JOB_SECRET_FILE"] = secret
    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=timeout_s))
    nodedir = os.path.join(base, f"elastor-node{0 if rank < 2 else 1}")
    d = os.path.join(nodedir, "local", "step_000000005")
    os.makedirs(d, exist_ok=True)
    for rel, b in _files(rank).items():
        with open(os.path.join(d, rel), "wb") as f:
            f.write(b)
    files = {rel: FileEntry(rel, len(b), zlib.crc32(b), r) for r in range(3) for rel, b in _files(r).items()}
    with open(os.path.join(d, f".m{rank}"), "w") as f:
        f.write(Manifest(step=5, tensors={}, files=files, world_size=3).dumps())
    os.replace(os.path.join(d, f".m{rank}"), os.path.join(d, "manifest.json"))
    cp = pc.PeerCopier.create([2, 1], nodedir, peer_copies=1, timeout_s=timeout_s)
    if rank != 1:
        st = cp.submit(d, [pc.PeerFile(rel, len(b), zlib.crc32(b)) for rel, b in _files(rank).items()])
        cp.wait()
        return 0 if st.error is None and cp.close(30) else 1
    rel, body = next(iter(_files(1).items()))
    other = _files(0)["data_00000.safetensors"]
    entry = {"huge": [rel, 1 << 34, zlib.crc32(body)], "unlisted": ["data_09999.safetensors", len(body), zlib.crc32(body)],
             "other-rank": ["data_00000.safetensors", len(other), zlib.crc32(other)]}[lie]
    entry.append(pc.file_mac(cp.key, cp.origin, "step_000000005", entry[0], body))
    header = json.dumps({"origin": cp.origin, "step": "step_000000005", "seq": 1, "src": 1, "files": [entry]}).encode()
    cp.transport.isend(torch.tensor([len(header)], dtype=torch.int64), 2, tag=1).wait()
    cp.transport.isend(header, 2, tag=2).wait()
    cp.transport.isend(body, 2, tag=16)
    return 0


def run_peer_sender(work: str, rng: random.Random, reps: int) -> fc.Row:
    from elastor_ds.checkpoint.snapshot.peer_copy import origin_id
    row = fc.Row()
    for i in range(max(1, reps)):
        for lie in ("huge", "unlisted", "other-rank"):
            base = os.path.join(work, f"p{i}_{lie}")
            os.makedirs(base)
            st = _peer_world(base, lie)
            got = os.path.join(base, "elastor-node1", "peer", origin_id(os.path.join(base, "elastor-node0")),
                               "step_000000005")
            on_disk = {}
            for dp, _, fs in os.walk(got):
                for f in fs:
                    if not f.startswith(".from_"):
                        on_disk[os.path.relpath(os.path.join(dp, f), got)] = os.lstat(os.path.join(dp, f)).st_size
            honest = {"data_00000.safetensors": len(_files(0)["data_00000.safetensors"])}
            back = os.path.exists(os.path.join(base, "elastor-node0", "peer",
                                               origin_id(os.path.join(base, "elastor-node1")), "step_000000005",
                                               "COMPLETE"))
            written = on_disk != honest   # anything of the liar's (or a part file) on this node
            row.add(f"sender announces {lie} (ranks {st}; on disk {on_disk}; other direction complete {back})",
                    st == [0, 0, 0] and not written and back, written, fc.HANG in st)
    return row
