"""Restore sources (elastor_ds.checkpoint.sources): each file from the nearest source that holds it,
every byte checked against the manifest's block CRCs whatever the source, per-file fallback (logged)
on a flipped byte, a missing or short file, a corrupt CRC table; storage bytes counted.

Oracle: the tensors that were saved (kept in this process), never the code under test."""
from __future__ import annotations

import logging
import os
import shutil
import uuid

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.storage import PosixStorage, TmpfsStorage
from elastor_ds.checkpoint.sources import (LOCAL_MEMORY, PEER_MEMORY, STORAGE, ChunkSource, DirSource,
                                          storage_source_for)
from elastor_ds.errors import CorruptCheckpointError, IncompleteCheckpointError
from elastor_ds.layout.region import Region

SHAPE = (64, 1024)   # 256 KiB float32: 64 CRC blocks of 4 KiB


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    import tempfile
    d = tempfile.mkdtemp(prefix=f"elastor-test-sources-{uuid.uuid4().hex[:6]}-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _save_both(mem_root: str, storage_root: str, step: int = 3):
    """The same state saved as a memory snapshot and a storage checkpoint (row halves: two chunks)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(*SHAPE, generator=g)
    b = torch.randn(1000, generator=g)
    shards = [TensorShard("w", SHAPE, Region((0, 0), (32, 1024)), w[:32]),
              TensorShard("w", SHAPE, Region((32, 0), (32, 1024)), w[32:]),
              TensorShard("b", (1000,), Region((0,), (1000,)), b)]
    for root, storage in ((mem_root, TmpfsStorage(mem_root)), (storage_root, PosixStorage(storage_root))):
        eng = CheckpointEngine(root, storage=storage, async_save=False)
        eng.save(step, shards, extra={"it": step}, rank_state={"seed": 11})
        eng.wait()
    return w.clone(), b.clone()


def _resharded():
    """A different layout: column halves of w (strided reads), b split in three."""
    dw = [torch.zeros(64, 512), torch.zeros(64, 512)]
    db = [torch.zeros(300), torch.zeros(300), torch.zeros(400)]
    shards = [TensorShard("w", SHAPE, Region((0, 0), (64, 512)), dw[0]),
              TensorShard("w", SHAPE, Region((0, 512), (64, 512)), dw[1]),
              TensorShard("b", (1000,), Region((0,), (300,)), db[0]),
              TensorShard("b", (1000,), Region((300,), (300,)), db[1]),
              TensorShard("b", (1000,), Region((600,), (400,)), db[2])]
    return shards, dw, db


def _sources(mem_root: str, storage_root: str):
    mem_step = commit_mod.resolve(mem_root)
    st_step = commit_mod.resolve(storage_root)

    def make(step_dir, man):
        out = [DirSource(step_dir, LOCAL_MEMORY)]
        st = storage_source_for(st_step, man, commit_mod.read_manifest(st_step))
        if st is not None:
            out.append(st)
        make.made = out
        return out
    return mem_step, make


def _check(dw, db, w, b):
    assert torch.equal(torch.cat(dw, dim=1), w)
    assert torch.equal(torch.cat(db), b)


def test_memory_restore_reads_nothing_from_storage(shm_dir, tmp_path):
    w, b = _save_both(shm_dir, str(tmp_path))
    mem_step, make = _sources(shm_dir, str(tmp_path))
    shards, dw, db = _resharded()
    res = CheckpointEngine(shm_dir).load(mem_step, shards, sources=make)
    _check(dw, db, w, b)
    assert res.step == 3 and res.rank_state == {"seed": 11}
    assert res.bytes_by_source.get(STORAGE, 0) == 0
    assert res.bytes_by_source[LOCAL_MEMORY] >= res.bytes_needed
    assert all(isinstance(s, ChunkSource) for s in make.made)


def test_flipped_byte_in_memory_falls_back_to_storage_for_that_file(shm_dir, tmp_path, caplog):
    w, b = _save_both(shm_dir, str(tmp_path))
    mem_step, make = _sources(shm_dir, str(tmp_path))
    data = os.path.join(mem_step, "data_00000.safetensors")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:          # flip one byte in the middle of w's second chunk
        f.seek(size - 1000 * 4 - 20000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    shards, dw, db = _resharded()
    with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.reader"):
        res = CheckpointEngine(shm_dir).load(mem_step, shards, sources=make)
    _check(dw, db, w, b)
    st_step = commit_mod.resolve(str(tmp_path))
    assert (f"data_00000.safetensors: the copy in local memory {data} failed ({'local memory ' + data}: tensor 'w': "
            in caplog.text), caplog.text
    assert "fails its CRC32 check" in caplog.text
    assert f"reading it from storage {os.path.join(st_step, 'data_00000.safetensors')} instead" in caplog.text
    assert res.bytes_by_source[STORAGE] > 0
    # without the storage source the same load is a corrupt checkpoint, not wrong tensors
    shards, dw, db = _resharded()
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        CheckpointEngine(shm_dir).load(mem_step, shards, sources=lambda d, m: [DirSource(d, LOCAL_MEMORY)])


def test_missing_or_short_file_and_corrupt_table_fall_back(shm_dir, tmp_path, caplog):
    w, b = _save_both(shm_dir, str(tmp_path))
    mem_step, make = _sources(shm_dir, str(tmp_path))
    data = os.path.join(mem_step, "data_00000.safetensors")
    table = [n for n in os.listdir(mem_step) if n.startswith("data_00000") and n != "data_00000.safetensors"]
    assert len(table) == 1
    # a corrupt CRC table in memory: the table comes from storage (whole-file CRC), data from memory
    tpath = os.path.join(mem_step, table[0])
    with open(tpath, "r+b") as f:
        f.seek(8)
        x = f.read(1)
        f.seek(8)
        f.write(bytes([x[0] ^ 1]))
    shards, dw, db = _resharded()
    with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.sources"):
        res = CheckpointEngine(shm_dir).load(mem_step, shards, sources=make)
    _check(dw, db, w, b)
    assert "fails its CRC32 check" in caplog.text
    assert 0 < res.bytes_by_source[STORAGE] < res.bytes_needed
    # truncated data file in memory: memory does not "have" it; storage serves it whole
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 4)
    shards, dw, db = _resharded()
    res = CheckpointEngine(shm_dir).load(mem_step, shards, sources=make)
    _check(dw, db, w, b)
    assert res.bytes_by_source[STORAGE] >= res.bytes_needed
    # missing everywhere: incomplete, naming the file
    os.remove(data)
    shards, _, _ = _resharded()
    with pytest.raises(IncompleteCheckpointError, match="data_00000.safetensors"):
        CheckpointEngine(shm_dir).load(mem_step, shards, sources=lambda d, m: [DirSource(d, LOCAL_MEMORY)])


def test_storage_source_only_for_the_same_bytes(shm_dir, tmp_path):
    _save_both(shm_dir, str(tmp_path), step=3)
    other = tmp_path / "other"
    eng = CheckpointEngine(str(other), async_save=False)
    eng.save(4, [TensorShard("b", (1000,), Region((0,), (1000,)), torch.ones(1000))])
    eng.wait()
    man = commit_mod.read_manifest(commit_mod.resolve(shm_dir))
    st4 = commit_mod.resolve(str(other))
    assert storage_source_for(st4, man, commit_mod.read_manifest(st4)) is None   # another step
    st3 = commit_mod.resolve(str(tmp_path))
    src = storage_source_for(st3, man, commit_mod.read_manifest(st3))
    assert src is not None and src.files == frozenset(man.files)
    # a name out of the directory is never served
    assert not src.has("../manifest.json", 10) and not DirSource(st3).has("/etc/passwd", 10)
    assert not DirSource(st3).has("../latest", os.path.getsize(os.path.join(str(tmp_path), "latest")))


def test_fallback_messages_name_the_peer_the_bytes_came_from(shm_dir, tmp_path, caplog):
    """A corrupt copy served by another node's snapshot server: the warning and the error name that
    peer (host:port and its file), never a path on this node that the bytes did not come from."""
    from elastor_ds.checkpoint.snapshot.peer_sources import RemoteSource
    from elastor_ds.checkpoint.snapshot.server import SnapshotServer
    w, b = _save_both(shm_dir, str(tmp_path / "storage"))
    mem_step = commit_mod.resolve(shm_dir)
    st_step = commit_mod.resolve(str(tmp_path / "storage"))
    step_name = os.path.basename(mem_step)
    node = tmp_path / "peer_node"                     # the other node's directory: its own copy of the step
    shutil.copytree(mem_step, node / "local" / step_name)
    data = node / "local" / step_name / "data_00000.safetensors"
    with open(data, "r+b") as f:                      # flip one byte of w's second chunk in the peer's copy
        f.seek(os.path.getsize(data) - 1000 * 4 - 20000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    key = bytes(range(32))                            # the job key both nodes share
    with SnapshotServer(str(node), key) as srv:
        peer_file = f"local/{step_name}/data_00000.safetensors"

        def make(step_dir, man):
            st = storage_source_for(st_step, man, commit_mod.read_manifest(st_step))
            return [RemoteSource(srv.address, step_name, key), st]
        shards, dw, db = _resharded()
        with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.reader"):
            res = CheckpointEngine(shm_dir).load(mem_step, shards, sources=make)
        _check(dw, db, w, b)
        assert res.bytes_by_source[STORAGE] > 0 and res.bytes_by_source[f"remote:{srv.address}"] > 0
        warn = [r.getMessage() for r in caplog.records if "reading it from" in r.getMessage()]
        assert len(warn) == 1, caplog.text
        assert warn[0].startswith(f"data_00000.safetensors: the copy in peer {srv.address} ({peer_file}) failed "
                                  f"(peer {srv.address} ({peer_file}): tensor 'w': "), warn[0]
        assert warn[0].endswith(f"reading it from storage {os.path.join(st_step, 'data_00000.safetensors')} instead")
        assert shm_dir not in warn[0]                 # this node's memory served none of these bytes
        # the peer alone: the load fails as corrupt, naming the peer
        shards, _, _ = _resharded()
        with pytest.raises(CorruptCheckpointError, match=rf"rank 0: CorruptCheckpointError: peer {srv.address} \({peer_file}\): "
                                                         r"tensor 'w': .* "
                                                         r"fails its CRC32 check"):
            CheckpointEngine(shm_dir).load(mem_step, shards, sources=lambda d, m: [RemoteSource(srv.address,
                                                                                                step_name, key)])


def test_node_lost_in_its_peer_copy_window_falls_back_to_storage_for_its_files(shm_dir, tmp_path, caplog):
    """Node B died while its newest snapshot was being copied to this node: its files arrived but
    ``COMPLETE`` did not. The restore reads B's files from storage's same step (logged, naming the
    file and the storage path); once the copy is complete the same load reads nothing from storage;
    without a storage twin of that step the load is incomplete (the runtime then falls back to
    storage's newest checkpoint)."""
    from elastor_ds.checkpoint.snapshot.peer_sources import PeerCopySource
    local_root = os.path.join(shm_dir, "local")
    w, b = _save_both(local_root, str(tmp_path / "storage"))
    mem_step = commit_mod.resolve(local_root)
    st_step = commit_mod.resolve(str(tmp_path / "storage"))
    step_name = os.path.basename(mem_step)
    # node-local snapshot: this node holds the manifest, node B's ranks wrote data_00000 (+ CRC table)
    peer = os.path.join(shm_dir, "peer", "nodeB", step_name)
    os.makedirs(peer)
    moved = [f for f in os.listdir(mem_step) if f.startswith("data_00000")]
    assert len(moved) == 2, os.listdir(mem_step)
    for f in moved:
        shutil.move(os.path.join(mem_step, f), os.path.join(peer, f))

    def make(step_dir, man):
        return [DirSource(step_dir, LOCAL_MEMORY), PeerCopySource(shm_dir, step_name),
                storage_source_for(st_step, man, commit_mod.read_manifest(st_step))]
    shards, dw, db = _resharded()
    with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.reader"):
        res = CheckpointEngine(local_root).load(mem_step, shards, sources=make)
    _check(dw, db, w, b)
    rank_state = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(mem_step, "rank_state"))
                     for f in fs)
    assert res.bytes_by_source.get(PEER_MEMORY, 0) == 0
    assert res.bytes_by_source[LOCAL_MEMORY] == rank_state > 0        # only the rank state file came from here
    assert res.bytes_by_source[STORAGE] >= res.bytes_needed
    assert (f"data_00000.safetensors: no memory copy holds it (local-memory, peer-memory); reading it from storage "
            f"{os.path.join(st_step, 'data_00000.safetensors')}") in caplog.text
    # the copy completes: everything from the peer copy held here, nothing from storage, no warning
    open(os.path.join(peer, "COMPLETE"), "w").close()
    caplog.clear()
    shards, dw, db = _resharded()
    with caplog.at_level(logging.WARNING, logger="elastor_ds.checkpoint.reader"):
        res = CheckpointEngine(local_root).load(mem_step, shards, sources=make)
    _check(dw, db, w, b)
    assert res.bytes_by_source[PEER_MEMORY] >= res.bytes_needed and res.bytes_by_source.get(STORAGE, 0) == 0
    assert "no memory copy holds it" not in caplog.text
    # in flight again and no storage checkpoint of this step: incomplete, naming the file
    os.remove(os.path.join(peer, "COMPLETE"))
    shards, _, _ = _resharded()
    with pytest.raises(IncompleteCheckpointError, match="data_00000"):
        CheckpointEngine(local_root).load(mem_step, shards, sources=lambda d, m: [DirSource(d, LOCAL_MEMORY),
                                                                                  PeerCopySource(shm_dir, step_name)])
