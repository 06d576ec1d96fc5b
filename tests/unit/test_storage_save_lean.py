"""Storage saves send CRCs as int rows and render the manifest from the plan's template (issue 23:
the object collectives and the manifest built and printed anew cost 8-10 ms between the last write
and durable). A comm without int collectives still takes the object route.

Oracle: the object route (``write_rank_files`` results gathered as objects, ``build_manifest``,
``Manifest.dumps``), a separate code path; the tensors saved, for the loads."""
from __future__ import annotations

import json
import os

import pytest
import torch

from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint import writer as writer_mod
from elastor_ds.checkpoint.engine import CheckpointEngine
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.storage import PosixStorage
from elastor_ds.comm.collectives import LocalComm
from elastor_ds.layout.region import Region

pytestmark = pytest.mark.unit


class _ObjectsOnly:
    """A one-rank comm with the object collectives only (as a third-party comm may be)."""
    rank, world_size = 0, 1

    def all_gather_object(self, obj):
        return [obj]

    def broadcast_object(self, obj, src=0):
        return obj

    def barrier(self):
        return None

    def duplicate(self):
        return self

    def all_equal(self, value):
        return True


def _shards():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 2048, generator=g)      # 512 KiB: one chunk
    big = torch.randn(128, 8192, generator=g)   # 4 MiB: column tiles
    b = torch.randn(100, generator=g)
    return ([TensorShard("w", (64, 2048), Region((0, 0), (64, 2048)), w),
             TensorShard("big", (128, 8192), Region((0, 0), (128, 8192)), big),
             TensorShard("b", (100,), Region((0,), (100,)), b)], {"w": w, "big": big, "b": b})


def _save(root: str, comm, shards) -> str:
    eng = CheckpointEngine(root, comm, storage=PosixStorage(root, sync=False))
    for step in (3, 4):   # the second save reuses the plan and its template
        eng.save(step, shards, extra={"it": step}, rank_state={"seed": step})
        eng.wait()
    eng.finalize()
    return commit_mod.resolve(root)


def test_the_template_route_writes_the_manifest_the_object_route_writes(tmp_path, monkeypatch):
    shards, _ = _shards()
    built = []
    real = writer_mod.build_manifest

    def spy(*a, **k):
        built.append(1)
        return real(*a, **k)
    monkeypatch.setattr("elastor_ds.checkpoint.engine.build_manifest", spy)
    lean_dir = _save(str(tmp_path / "lean"), LocalComm(), shards)
    assert not built                                # the template route
    obj_dir = _save(str(tmp_path / "obj"), _ObjectsOnly(), shards)
    assert len(built) == 2                          # the object route, once per save
    texts = [open(os.path.join(d, "manifest.json")).read() for d in (lean_dir, obj_dir)]
    assert "\n" not in texts[0].strip() and "\n" in texts[1]   # compact / indented
    docs = [json.loads(t) for t in texts]
    for d in docs:
        d.pop("checksum")
        d.pop("created_unix")
    assert docs[0] == docs[1]
    for name in os.listdir(lean_dir):   # the same bytes in every data, table and state file
        if name != "manifest.json" and os.path.isfile(os.path.join(lean_dir, name)):
            assert open(os.path.join(lean_dir, name), "rb").read() == open(os.path.join(obj_dir, name), "rb").read()


def test_a_storage_save_by_the_template_route_loads_under_another_layout(tmp_path):
    shards, want = _shards()
    root = str(tmp_path / "ck")
    _save(root, LocalComm(), shards)
    cols = torch.zeros(128, 4096)
    rows = torch.zeros(32, 2048)
    eng = CheckpointEngine(root)
    res = eng.load(None, [TensorShard("big", (128, 8192), Region((0, 4096), (128, 4096)), cols),
                          TensorShard("w", (64, 2048), Region((32, 0), (32, 2048)), rows)], strict=False)
    assert torch.equal(cols, want["big"][:, 4096:]) and torch.equal(rows, want["w"][32:])
    assert res.step == 4 and res.extra == {"it": 4} and res.rank_state == {"seed": 4}
