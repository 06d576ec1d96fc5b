"""The controller's snapshot server and the cross-node chunk sources (real sockets, real files).

Oracles: the bytes written to the files by the test itself; raw HTTP requests written by hand
(an attacker does not use our client) for the refusals."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from elastor_ds.checkpoint.peer_sources import PeerCopySource, RemoteSource, node_sources
from elastor_ds.elastic.snapshot_server import SnapshotServer, advertised_host
from elastor_ds.errors import IncompleteCheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STEP = "step_000000007"


def _node(tmp_path):
    """A node directory: committed local/STEP, a COMPLETE peer copy of node B, an incomplete one of C,
    a save in progress, and a secret next to the node directory."""
    root = tmp_path / "node"
    data = bytes((i * 7 + 3) % 256 for i in range(300_000))
    (root / "local" / STEP / "rank_state").mkdir(parents=True)
    (root / "local" / STEP / "data_00000.safetensors").write_bytes(data)
    (root / "local" / STEP / "rank_state" / "rank_00000.json").write_text('{"a": 1}')
    (root / "local" / STEP / "manifest.json").write_text("{}")
    (root / "local" / ".tmp_step_000000008_x").mkdir()
    (root / "local" / ".tmp_step_000000008_x" / "data_00000.safetensors").write_bytes(b"partial")
    pb = root / "peer" / "nodeB" / STEP
    pb.mkdir(parents=True)
    (pb / "data_00002.safetensors").write_bytes(data[::-1])
    (pb / "COMPLETE").write_text("")
    pc = root / "peer" / "nodeC" / STEP
    pc.mkdir(parents=True)
    (pc / "data_00003.safetensors").write_bytes(b"x" * 10)   # no COMPLETE: a copy in flight
    (tmp_path / "secret.txt").write_text("top secret")
    return root, data


def _raw(port: int, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        buf = b""
        while True:
            k = s.recv(65536)
            if not k:
                break
            buf += k
    status = int(buf.split(b" ", 2)[1])
    return status, buf.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in buf else b""


def _get(port: int, path: str) -> tuple[int, bytes]:
    return _raw(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())


def test_range_reads_and_index(tmp_path):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root)) as srv:
        st, body = _raw(srv.port, f"GET /f/local/{STEP}/data_00000.safetensors HTTP/1.1\r\nHost: x\r\n"
                                  f"Range: bytes=1000-1999\r\nConnection: close\r\n\r\n".encode())
        assert st == 206 and body == data[1000:2000]
        st, body = _get(srv.port, f"/f/local/{STEP}/rank_state/rank_00000.json")
        assert st == 200 and body == b'{"a": 1}'
        st, body = _get(srv.port, f"/index/{STEP}")
        assert st == 200 and body == b'{"local": true, "peer": ["nodeB"]}'
        st, body = _get(srv.port, "/index/step_000000099")
        assert st == 200 and body == b'{"local": false, "peer": []}'
        assert srv.bytes_served == 1000 + 8


@pytest.mark.parametrize("path", [
    "/f/../secret.txt", "/f/local/../../secret.txt", "/f/%2e%2e/secret.txt", "/f/local/%2E%2E/%2E%2E/secret.txt",
    "/f//etc/passwd", "/f/%2fetc/passwd", "/f/link_out", "/f/local/link_dir/secret.txt", "/f/local",
    "/f/local/.tmp_step_000000008_x/data_00000.safetensors", "/f/fifo", "/f/local\\..\\..\\secret.txt",
    "/f/local/%00x", "/index/../../etc", "/etc/passwd", "/f/link_in",
])
def test_refuses_names_outside_the_node_directory(tmp_path, path):
    root, _ = _node(tmp_path)
    os.symlink(str(tmp_path / "secret.txt"), str(root / "link_out"))
    os.symlink(str(tmp_path), str(root / "local" / "link_dir"))
    os.symlink(str(root / "local" / STEP / "manifest.json"), str(root / "link_in"))   # even inside: no symlinks
    os.mkfifo(str(root / "fifo"))
    with SnapshotServer(str(root)) as srv:
        st, body = _get(srv.port, path)
    assert st in (403, 404), (path, st, body)
    assert b"top secret" not in body and b"root:" not in body


def test_read_only_methods(tmp_path):
    root, _ = _node(tmp_path)
    with SnapshotServer(str(root)) as srv:
        for m in ("PUT", "DELETE", "POST"):
            st, _ = _raw(srv.port, f"{m} /f/local/{STEP}/manifest.json HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                                   f"Connection: close\r\n\r\n".encode())
            assert st == 405
    assert (root / "local" / STEP / "manifest.json").read_text() == "{}"


def test_remote_source_reads_local_and_peer_copies(tmp_path):
    root, data = _node(tmp_path)
    with SnapshotServer(str(root)) as srv:
        src = RemoteSource(srv.address, STEP)
        assert src.name == f"remote:{srv.address}"
        assert src.has("data_00000.safetensors", len(data))
        assert not src.has("data_00000.safetensors", len(data) - 1)       # wrong size: not this file
        assert src.has("data_00002.safetensors", len(data))                # held as node B's peer copy
        assert not src.has("data_00003.safetensors", 10)                   # node C's copy is not COMPLETE
        a, b = bytearray(5000), bytearray(123_456)
        src.read_into("data_00000.safetensors", 70_000, [memoryview(a), memoryview(b)])
        assert bytes(a) + bytes(b) == data[70_000:70_000 + 5000 + 123_456]
        c = bytearray(4096)
        src.read_into("data_00002.safetensors", 0, [memoryview(c)])
        assert bytes(c) == data[::-1][:4096]
        with pytest.raises(IncompleteCheckpointError):                       # past the end: short
            src.read_into("data_00000.safetensors", len(data) - 10, [memoryview(bytearray(100))])
        # from several threads at once (one connection per thread)
        outs = [bytearray(10_000) for _ in range(4)]
        ts = [threading.Thread(target=src.read_into, args=("data_00000.safetensors", 1000 * i, [memoryview(o)]))
              for i, o in enumerate(outs)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert all(bytes(o) == data[1000 * i:1000 * i + 10_000] for i, o in enumerate(outs))
        assert src.bytes_read == 5000 + 123_456 + 4096 + 40_000
        src.close()
    with pytest.raises(IncompleteCheckpointError):                           # the node is gone
        src.read_into("data_00000.safetensors", 0, [memoryview(bytearray(10))])
    gone = RemoteSource(srv.address, STEP)
    assert not gone.has("data_00000.safetensors", len(data))


def test_peer_copy_source_only_complete_copies(tmp_path):
    root, data = _node(tmp_path)
    src = PeerCopySource(str(root), STEP)
    assert src.has("data_00002.safetensors", len(data))
    assert not src.has("data_00003.safetensors", 10)
    assert not src.has("data_00000.safetensors", len(data))   # this node's own files are not peer copies
    buf = bytearray(777)
    src.read_into("data_00002.safetensors", 100, [memoryview(buf)])
    assert bytes(buf) == data[::-1][100:877] and src.bytes_read == 777
    with pytest.raises(Exception):
        src.has("../../secret.txt", 10)


def test_node_sources_skip_this_node(tmp_path):
    root, _ = _node(tmp_path)
    srcs = node_sources(STEP, snapshot_dir=str(root), peers=["127.0.0.1:1", "127.0.0.1:2"], self_address="127.0.0.1:1")
    assert [s.name for s in srcs] == ["peer-memory", "remote:127.0.0.1:2"]
    assert node_sources(STEP, snapshot_dir="", peers=[], self_address="") == []


def test_advertised_host_loopback():
    assert advertised_host("127.0.0.1:29500") == "127.0.0.1"
    assert advertised_host("localhost:0") in ("127.0.0.1", "::1")
