"""Megatron-core GPT (local spec, GQA, swiglu, fp32) saved at TP2 x PP2 and loaded at TP4, TP1 (x DP4),
TP2 x DP2 and TP1 x PP3 (uneven): bit-identical consolidated tensors (weights + Adam state), same
eval loss; megatron's own dist_checkpointing as ground truth for the sharding rules, import and
export. One spawned 4-rank world runs every scenario (the PP3 one on a re-initialised 3-rank world)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("megatron.core")

from dist_utils import free_port, run_world  # noqa: E402

LOSS_RTOL = 1e-6


def _worker(rank: int, world: int, root: str, port2: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from megatron.core import dist_checkpointing

    from elastor_ds.checkpoint.convert import to_consolidated
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm
    from elastor_ds.integrations.megatron import gpt_shards, initialize_from_layout, load_gpt, save_gpt, teardown
    from elastor_ds.integrations.megatron.convert import export_torch_dist, import_megatron
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import (consolidated_differences, eval_loss, fixed_batch,
                                                 tiny_gpt_config, train_step)
    from safetensors.torch import load_file

    cfg = tiny_gpt_config(num_layers=4)
    batch = fixed_batch(cfg)
    results: dict = {}

    def setup(layout):
        grid = initialize_from_layout(layout)
        m = build_gpt(cfg, grid, parallel_output=False)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def save_and_consolidate(eng, m, opt, layout, tag):
        save_gpt(eng, 2, m, cfg, layout, opt)
        eng.wait()
        dist.barrier()
        if rank == 0:
            to_consolidated(eng.root, os.path.join(root, f"cons_{tag}"), progress=False)
            results[tag + "_diff"] = consolidated_differences(os.path.join(root, "cons_src"), os.path.join(root, f"cons_{tag}"))
        dist.barrier()

    # ---- source: TP2 x PP2, one Adam step, elastor save + megatron torch_dist save
    src = Layout.uniform(2, 2, 1, 4)
    m, opt = setup(src)
    torch.manual_seed(0)
    train_step(m, cfg, batch, opt)
    loss_src = eval_loss(m, cfg, batch)
    comm = TorchComm.create(90)
    eng = CheckpointEngine(os.path.join(root, "el"), comm)
    save_gpt(eng, 1, m, cfg, src, opt)
    os.makedirs(os.path.join(root, "mc_src"), exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(m.sharded_state_dict(), os.path.join(root, "mc_src"))
    eng.wait()
    dist.barrier()
    if rank == 0:
        to_consolidated(eng.root, os.path.join(root, "cons_src"), progress=False)
        results["import"] = import_megatron(os.path.join(root, "mc_src"), os.path.join(root, "el_imp"), cfg)
    dist.barrier()
    cons = load_file(os.path.join(root, "cons_src", "model.safetensors"))

    # ---- TP4: elastor load; megatron's own reshard (TP2 -> TP4) as ground truth for the rules
    lay = Layout.uniform(4, 1, 1, 4)
    m, opt = setup(lay)
    load_gpt(eng, None, m, cfg, lay, opt)
    results["tp4"] = eval_loss(m, cfg, batch)
    e2 = CheckpointEngine(os.path.join(root, "el_tp4"), comm, async_save=False)
    save_and_consolidate(e2, m, opt, lay, "tp4")
    m2, _ = setup(lay)
    dist_checkpointing.load(m2.sharded_state_dict(), os.path.join(root, "mc_src"))
    mism = []
    for s in gpt_shards(m2, cfg, lay, rank):
        want = cons[s.name][tuple(slice(o, o + n) for o, n in zip(s.region.offsets, s.region.sizes))]
        if not torch.equal(s.tensor, want):
            mism.append(s.name)
    results["rules_vs_megatron"] = mism
    results["mc_tp4"] = eval_loss(m2, cfg, batch)

    # ---- TP1 x DP4: elastor load, and load of the checkpoint imported from megatron's torch_dist
    lay = Layout.uniform(1, 1, 4, 4)
    m, opt = setup(lay)
    load_gpt(eng, None, m, cfg, lay, opt)
    results["tp1"] = eval_loss(m, cfg, batch)
    save_and_consolidate(CheckpointEngine(os.path.join(root, "el_tp1"), comm, async_save=False), m, opt, lay, "tp1")
    m, _ = setup(lay)
    load_gpt(CheckpointEngine(os.path.join(root, "el_imp"), comm), None, m, cfg, lay)
    results["imported_tp1"] = eval_loss(m, cfg, batch)

    # ---- TP2 x DP2: elastor load; export to torch_dist, load it with megatron's own loader
    lay = Layout.uniform(2, 1, 2, 4)
    m, opt = setup(lay)
    load_gpt(eng, None, m, cfg, lay, opt)
    results["tp2dp2"] = eval_loss(m, cfg, batch)
    save_and_consolidate(CheckpointEngine(os.path.join(root, "el_tp2dp2"), comm, async_save=False), m, opt, lay,
                         "tp2dp2")
    export_torch_dist(os.path.join(root, "el"), os.path.join(root, "mc_exp"), tp=2)
    m, _ = setup(lay)
    dist_checkpointing.load(m.sharded_state_dict(), os.path.join(root, "mc_exp", "iter_0000001"))
    results["exported_tp2dp2"] = eval_loss(m, cfg, batch)
    teardown()

    # ---- TP1 x PP3 (uneven 1/1/2) on a fresh 3-rank world in the same processes
    dist.destroy_process_group()
    if rank < 3:
        store = dist.TCPStore("127.0.0.1", port2, 3, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=90))
        lay = Layout.uniform(1, 3, 1, 4)
        assert lay.boundaries() == [0, 1, 2, 4]
        m, opt = setup(lay)
        comm3 = TorchComm.create(90)
        load_gpt(CheckpointEngine(os.path.join(root, "el"), comm3), None, m, cfg, lay, opt)
        results["tp1pp3"] = eval_loss(m, cfg, batch)
        save_and_consolidate(CheckpointEngine(os.path.join(root, "el_pp3"), comm3, async_save=False), m, opt, lay,
                             "pp3")
        teardown()
    if rank == 0:
        results["src"] = loss_src
        with open(os.path.join(root, "results.json"), "w") as f:
            json.dump(results, f)


def test_megatron_reshard_import_export(tmp_path):
    root = str(tmp_path)
    run_world(_worker, 4, root, free_port(), timeout_s=150)
    with open(os.path.join(root, "results.json")) as f:
        r = json.load(f)
    src = r["src"]
    for tag in ("tp4", "tp1", "tp2dp2", "pp3"):
        assert r[tag + "_diff"] == [], f"{tag}: tensors differ after consolidation: {r[tag + '_diff'][:5]}"
    assert r["rules_vs_megatron"] == [], f"elastor rules disagree with megatron's reshard: {r['rules_vs_megatron']}"
    assert r["import"]["optimizer"] is False and r["import"]["format"] == "torch_dist"
    for k in ("tp4", "tp1", "tp2dp2", "tp1pp3", "mc_tp4", "imported_tp1", "exported_tp2dp2"):
        assert abs(r[k] - src) <= LOSS_RTOL * abs(src), f"{k}: eval loss {r[k]!r} != source {src!r}"
