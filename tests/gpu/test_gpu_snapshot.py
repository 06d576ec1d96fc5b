"""GPU path of snapshots (``-m gpu``; skipped without CUDA; run by ``scripts/gpu_check.sh``).

The staging buffer is pinned (page-locked) when CUDA is present and device-to-host copies of CUDA
shards run on a side stream; a snapshot of CUDA tensors restores bit for bit into CUDA tensors of
another layout, from a memory root (tmpfs) through the chunk sources. Oracle: the tensors saved."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine, TensorShard
from elastor_ds.checkpoint.sources import LOCAL_MEMORY, DirSource
from elastor_ds.checkpoint.storage import PosixStorage, TmpfsStorage
from elastor_ds.layout.region import Region

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _shm_dir(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    return tempfile.mkdtemp(prefix="elastor-gpu-test-", dir=base)


def test_pinned_staging_and_cuda_snapshot_restores_bit_exact_under_reshard(tmp_path):
    import shutil
    root = _shm_dir(tmp_path)
    try:
        eng = CheckpointEngine(root, storage=PosixStorage(root, sync=False), keep=1)
        g = torch.Generator(device="cuda").manual_seed(7)
        full = torch.randn(1024, 512, device="cuda", generator=g)
        bias = torch.randn(512, device="cuda", generator=g).to(torch.bfloat16)
        shards = [TensorShard("w", (1024, 512), Region((0, 0), (1024, 512)), full),
                  TensorShard("b", (512,), Region((0,), (512,)), bias)]
        st = eng.save(3, shards)
        assert eng.staging.pin and eng.staging.buf is not None and eng.staging.buf.is_pinned()
        assert st.stall_s > 0
        eng.wait()
        # reshard: column halves and a bias half, on the GPU, read through the memory source
        left = torch.zeros(1024, 256, device="cuda")
        right = torch.zeros(1024, 256, device="cuda")
        bhalf = torch.zeros(256, device="cuda", dtype=torch.bfloat16)
        dst = [TensorShard("w", (1024, 512), Region((0, 0), (1024, 256)), left),
               TensorShard("w", (1024, 512), Region((0, 256), (1024, 256)), right),
               TensorShard("b", (512,), Region((256,), (256,)), bhalf)]
        res = eng.load(None, dst, sources=lambda step_dir, man: [DirSource(step_dir, LOCAL_MEMORY)])
        assert torch.equal(left, full[:, :256]) and torch.equal(right, full[:, 256:])
        assert torch.equal(bhalf, bias[256:])
        assert res.bytes_by_source.get(LOCAL_MEMORY, 0) >= (1024 * 512 * 4 + 256 * 2)
        eng.finalize()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_side_stream_copy_does_not_block_the_default_stream(tmp_path):
    """The snapshot's D2H copies are ordered after the work already queued on the default stream
    (the side stream waits for it): a tensor still being written by a queued kernel is saved with
    its final value."""
    import shutil
    root = _shm_dir(tmp_path)
    try:
        eng = CheckpointEngine(root, storage=PosixStorage(root, sync=False), keep=1)
        x = torch.ones(4096, 4096, device="cuda")
        for _ in range(20):            # queue work; no synchronize before the save
            x.mul_(1.0001)
        eng.save(1, [TensorShard("x", (4096, 4096), Region((0, 0), (4096, 4096)), x)])
        want = x.clone()               # queued after the same work: the value the save must hold
        eng.wait()
        back = torch.zeros_like(x)
        eng.load(None, [TensorShard("x", (4096, 4096), Region((0, 0), (4096, 4096)), back)])
        assert torch.equal(back, want)
        eng.finalize()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shm_root(tmp_path):
    import shutil
    root = _shm_dir(tmp_path)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_node_local_snapshot_stages_into_a_page_locked_mapping(shm_root):
    """A memory-snapshot engine (node_local) copies CUDA shards straight into its mapped tmpfs data
    file, page-locked with cudaHostRegister; two steps later the same mapping is reused (no new
    mapping, no new registration), and the snapshot restores bit for bit."""
    eng = CheckpointEngine(shm_root, storage=TmpfsStorage(shm_root), keep=1, optimistic_plan=True)
    x = torch.randn(2048, 1024, device="cuda")
    shards = [TensorShard("x", (2048, 1024), Region((0, 0), (2048, 1024)), x)]
    for step in range(1, 5):
        x.add_(1.0)
        eng.save(step, shards)
        eng.wait()
    assert eng.storage.files is not None and eng.storage.files.new_mappings == 2
    assert all(m.pinned for m in eng.storage.files._maps.values())
    back = torch.zeros_like(x)
    eng.load(None, [TensorShard("x", (2048, 1024), Region((0, 0), (2048, 1024)), back)])
    assert torch.equal(back, x)
    eng.finalize()


def test_deferred_device_copy_is_ordered_before_the_next_update_by_the_fence(shm_root):
    """defer_device_copies: save() returns while the D2H copy is still queued on the side stream;
    fence() makes the next in-place update (the optimizer step's role) wait for it on the device,
    so the snapshot holds the value before the update, and the update's result is intact."""
    eng = CheckpointEngine(shm_root, storage=TmpfsStorage(shm_root), keep=1, optimistic_plan=True)
    eng.defer_device_copies = True
    x = torch.ones(8192, 8192, device="cuda")        # 256 MiB: the copy takes milliseconds
    shards = [TensorShard("x", (8192, 8192), Region((0, 0), (8192, 8192)), x)]
    eng.save(1, shards)
    eng.wait()
    want = x.clone()
    eng.save(2, shards)
    assert eng.staging.pending is not None
    eng.fence()
    x.mul_(3.0)                                       # the "optimizer step", queued after the fence
    eng.wait()
    back = torch.zeros_like(x)
    eng.load(None, [TensorShard("x", (8192, 8192), Region((0, 0), (8192, 8192)), back)])
    assert torch.equal(back, want)
    assert torch.equal(x, want * 3.0)
    eng.finalize()


def test_cuda_scalars_in_the_state_cost_the_training_thread_no_device_sync(shm_root):
    """Adam's ``step`` and a loss scale as one-element CUDA tensors in a snapshot's JSON state: the
    training thread's save() runs under ``set_sync_debug_mode("error")`` (any synchronizing call,
    e.g. ``.item()``, raises), and the snapshot holds the values as they were at save() even though
    both tensors change right after it (oracle: the values set before the save)."""
    eng = CheckpointEngine(shm_root, storage=TmpfsStorage(shm_root), keep=1, optimistic_plan=True)
    eng.defer_device_copies = True
    x = torch.randn(1024, 1024, device="cuda")
    shards = [TensorShard("x", (1024, 1024), Region((0, 0), (1024, 1024)), x)]
    eng.save(1, shards)   # the first save plans and maps its file (not the path under test)
    eng.wait()
    step = torch.tensor(41.0, device="cuda")
    scale = torch.tensor(65536.0, device="cuda")
    for _ in range(50):   # queued work the scalars' copies must not wait for on the CPU
        x.mul_(1.0001)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.save(2, shards, extra={"optimizer": [{"scalars": {"step": {"value": step}}}]},
                 rank_state={"grad_scaler": [{"scale": scale}]})
        eng.fence()
        step.add_(1.0)
        scale.mul_(0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eng.wait()
    res = eng.load(None, [TensorShard("x", (1024, 1024), Region((0, 0), (1024, 1024)), torch.zeros_like(x))])
    assert res.extra["optimizer"][0]["scalars"]["step"]["value"] == 41.0
    assert res.rank_state == {"grad_scaler": [{"scale": 65536.0}]}
    eng.finalize()


def test_cuda_shards_of_one_flat_buffer_are_one_copy_and_the_program_is_reused(shm_root):
    """200 parameters viewing one flat CUDA buffer (a ZeRO partition, a DDP bucket): the snapshot's
    device-to-host copies merge into one ``copy_``, the program is built once for both saves, and
    the snapshot restores bit for bit (oracle: the flat buffer)."""
    from elastor_ds.checkpoint.staging import _DeviceCopyProgram
    # one reused pinned staging buffer (a memory snapshot's destination is the file of the step)
    eng = CheckpointEngine(shm_root, storage=PosixStorage(shm_root, sync=False), keep=1)
    flat = torch.randn(200 * 4096, device="cuda")
    shards = [TensorShard(f"p{i}", (4096,), Region((0,), (4096,)), flat[i * 4096:(i + 1) * 4096]) for i in range(200)]
    for step in (1, 2):
        flat.add_(1.0)
        eng.save(step, shards)
        eng.wait()
    progs = [p for p in eng.staging._programs if isinstance(p, _DeviceCopyProgram)]
    assert len(progs) == 1 and len(progs[0].pairs) == 1
    back = torch.zeros_like(flat)
    eng.load(None, [TensorShard(f"p{i}", (4096,), Region((0,), (4096,)), back[i * 4096:(i + 1) * 4096])
                    for i in range(200)])
    assert torch.equal(back, flat)
    eng.finalize()
