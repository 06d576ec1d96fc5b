"""Megatron-LM's hooks through the one checkpoint session, without a Megatron-LM checkout: memory
snapshots (``--elastor-memory-snapshot-interval``) and the restore chain, on 2 gloo ranks with a real
megatron-core GPTModel and torch Adam.

Run 1 (TP2): 3 iterations, a snapshot after each (``after_iteration``), Megatron's own storage save
at iteration 2. The processes "die" (sessions dropped, nothing finalized beyond the writes).
Run 2 (TP1 x DP2, a new layout, fresh weights): ``load_checkpoint`` restores iteration 3 from the
node's memory with 0 bytes from storage, the restore event says so, the consumed samples and the
scheduler come back, and storage gets iteration 3 (made durable at once). Oracles: run 1's own
tensors (consolidated from the memory snapshot by the converter) against run 2's storage save of
the restored state: bit-identical; the restored local weights against run 1's at the same TP.
"""
from __future__ import annotations

import argparse
import json
import os

import pytest

from dist_utils import run_world
from megatron_standins import _Sched


def _args(cfg, root: str, **kw) -> argparse.Namespace:
    base = dict(elastor=True, elastor_async=True, elastor_keep=2, vocab_size=cfg.vocab_size,
                make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, num_layers=cfg.num_layers,
                save=os.path.join(root, "ck"), load=os.path.join(root, "ck"), consumed_train_samples=0,
                global_batch_size=4, finetune=False, no_load_optim=False, no_load_rng=False,
                distributed_timeout_minutes=2, elastor_memory_snapshot_interval=1,
                elastor_memory_snapshot_dir=os.path.join(root, "shm"), elastor_memory_snapshot_peer_copies=0)
    base.update(kw)
    return argparse.Namespace(**base)


def _worker(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()

    from elastor_ds.checkpoint.convert import to_consolidated
    from elastor_ds.integrations.megatron import initialize_from_layout, training_hooks as th
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import consolidated_differences, fixed_batch, tiny_gpt_config, train_step

    cfg = tiny_gpt_config(num_layers=2)
    batch = fixed_batch(cfg)
    out: dict = {}

    # run 1: TP2, snapshots every iteration, storage at 2
    torch.manual_seed(1)
    grid = initialize_from_layout(Layout.uniform(2, 1, 1, cfg.num_layers))
    m = build_gpt(cfg, grid, parallel_output=False)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = _Sched()
    args = _args(cfg, root)
    th.configure(args)
    assert th.load_checkpoint([m], opt, sched, args) == (0, 0)  # nothing yet
    for it in range(1, 4):
        train_step(m, cfg, batch, opt)
        sched.num_steps = it
        args.consumed_train_samples = 4 * it
        th.after_iteration(it, [m], opt, sched, float(it), args)
        if it == 2:
            th.save_checkpoint(it, [m], opt, sched, float(it), args)
    th.finalize()   # the writes of this run are committed (a SIGKILL after the commit)
    run1 = {n: p.detach().clone() for n, p in m.named_parameters()}
    out["storage_after_run1"] = sorted(d for d in os.listdir(args.save) if d.startswith("step_"))
    th.reset()
    dist.barrier()

    # run 2: TP1 x DP2 (the world re-planned), fresh weights, a plain resume
    events = os.path.join(root, "events.jsonl")
    os.environ["ELASTOR_EVENTS_FILE"] = events
    torch.manual_seed(2)
    grid = initialize_from_layout(Layout.uniform(1, 1, 2, cfg.num_layers))
    m2 = build_gpt(cfg, grid, parallel_output=False)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    sched2 = _Sched()
    args2 = _args(cfg, root)
    it, flops = th.load_checkpoint([m2], opt2, sched2, args2)
    sess = th.session(args2, args2.save)
    out["loaded"] = [it, flops, sched2.num_steps, args2.consumed_train_samples]
    out["restore"] = {k: sess.restore[k] for k in ("tier", "step", "bytes", "durable_step")}
    th.finalize()
    out["storage_after_run2"] = sorted(d for d in os.listdir(args2.save) if d.startswith("step_"))
    th.reset()
    dist.barrier()
    if rank == 0:
        snap = os.path.join(args.elastor_memory_snapshot_dir, "local", "step_000000003")
        to_consolidated(snap, os.path.join(root, "c_mem"), progress=False)
        to_consolidated(os.path.join(args2.save, "step_000000003"), os.path.join(root, "c_run2"), progress=False)
        out["diff"] = consolidated_differences(os.path.join(root, "c_mem"), os.path.join(root, "c_run2"))
        out["n_tensors"] = len(os.listdir(os.path.join(root, "c_mem")))
        with open(events) as f:
            out["events"] = [json.loads(line) for line in f if line.strip()]
        # run 1's weights on rank 0 (TP2) against the consolidated memory snapshot: the snapshot is run 1's state
        from safetensors.torch import load_file
        model_t = load_file(os.path.join(root, "c_mem", "model.safetensors"))
        emb = next(v for k, v in model_t.items() if "word_embeddings" in k)
        mine = next(v for k, v in run1.items() if "word_embeddings" in k)
        out["emb_rows_match"] = bool(torch.equal(emb[:mine.shape[0]], mine))
        with open(os.path.join(root, "res.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()


def test_megatron_hooks_restore_from_memory_under_a_new_layout(tmp_path):
    pytest.importorskip("megatron.core")
    run_world(_worker, 2, str(tmp_path), timeout_s=240)
    r = json.load(open(tmp_path / "res.json"))
    assert r["storage_after_run1"] == ["step_000000002"]
    # iteration 3 from memory: flops, scheduler and consumed samples as run 1 left them
    assert r["loaded"] == [3, 3.0, 3, 12]
    assert r["restore"]["tier"] == "memory" and r["restore"]["step"] == 3
    assert r["restore"]["durable_step"] == 2
    assert r["restore"]["bytes"].get("storage", 0) == 0 and r["restore"]["bytes"]["local-memory"] > 0
    # the restored step is made durable right away
    assert r["storage_after_run2"] == ["step_000000002", "step_000000003"]
    assert r["n_tensors"] >= 2 and r["diff"] == []
    assert r["emb_rows_match"]
    restores = [e for e in r["events"] if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["tier"] == "memory" and restores[0]["step"] == 3
