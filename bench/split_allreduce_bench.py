"""The split all-reduce on its own: time and bytes per rank, against a uniform DP all-reduce.

One world of gloo CPU ranks (default 7, the "one of 8 lost" case of ``bench/hetero_bench.py``). Each
rank allocates gradients of the local shapes its plan gives it (the bench model of hetero_bench: 8
GPT layers, hidden 64, FFN 256) and times, with nothing else running in the job:

* ``split``: :class:`elastor_ds.runtime.hetero_comm.SplitAllReduce` for the planner's best heterogeneous
  plan on those ranks (cells of every parameter reduced among exactly its holders);
* ``split-uniform``: the same code on the best uniform grid (it degenerates to one buffer per DP
  group: the cost of our packing);
* ``dp``: a plain flat ``all_reduce`` of each rank's whole local gradient over its DP group of the
  uniform grid (DeepSpeed's data-parallel all-reduce, the baseline);
* ``zero1``: the heterogeneous plan's ZeRO-1 exchange (reduce-scatter of the gradients into the
  shares + all-gather of the updated weights, :class:`~elastor_ds.runtime.hetero_comm.HeteroZero1`).

Bytes are those each rank sends (ring algorithm, from the pure plan); times are the median of
``--reps`` repetitions of the slowest rank (a barrier before each). Ranks outside a plan (a uniform
grid that leaves processes idle) only join the barriers.

    python bench/split_allreduce_bench.py [--world 7] [--reps 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
from elastor_ds.cli_types import positive_int  # noqa: E402


def specs():
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig, gpt_tensor_specs
    cfg = GPTSpecConfig(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=4, vocab_size=104,
                        ffn_hidden_size=256, gated_linear_unit=False, add_bias_linear=False, normalization="RMSNorm",
                        make_vocab_size_divisible_by=8, max_sequence_length=32)
    return gpt_tensor_specs(cfg)


def _odd_world(text: str) -> int:
    n = positive_int(text)
    if n < 7 or n % 2 == 0:
        raise argparse.ArgumentTypeError(f"{n}: an odd number >= 7 (a TP1+TP2 replica and k >= 2 TP2 replicas: 3 + 2k; the uniform grid takes 6)")
    return n


def plans(world: int):
    """The layouts this bench compares on ``world`` (odd, >= 7) ranks: the heterogeneous plan of the
    recorded run, R0 [TP1 0-3 | TP2 3-8] + k x [TP2 0-8] (world = 3 + 2k), and the uniform grid
    tp1.pp3.dp2 on the first 6 ranks (ranks beyond a grid's size idle). Fixed here: the planner's
    choice for this tiny model depends on the machine's measured costs (bench/hetero_bench.py)."""
    from elastor_ds.plan.cluster import Device
    from elastor_ds.plan.plan_doc import Plan, PlanReplica, PlanStage

    def devs(*ids: int) -> tuple:
        return tuple(Device(0, "node0", i) for i in ids)
    k = (world - 3) // 2
    het = [PlanReplica((PlanStage(1, (0, 3), devs(0)), PlanStage(2, (3, 8), devs(1, 2))), 10)]
    het += [PlanReplica((PlanStage(2, (0, 8), devs(3 + 2 * j, 4 + 2 * j)),), 22 // k + (j < 22 % k))
            for j in range(k)]
    uni = [PlanReplica(tuple(PlanStage(1, lay, devs(3 * r + s)) for s, lay in enumerate(((0, 3), (3, 6), (6, 8)))),
                       16) for r in range(2)]
    return (Plan(8, tuple(het), kind="heterogeneous").to_layout(),
            Plan(8, tuple(uni), unused=devs(*range(6, world)), kind="uniform").to_layout())


def worker(rank: int, world: int, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from elastor_ds.runtime.hetero_comm import HeteroZero1, SplitAllReduce, create_groups
    from elastor_ds.layout import rank_tensors
    from elastor_ds.runtime import (layout_held, reduce_groups, replica_of, split_reduce_bytes, split_reduce_plan,
                                    uniform_dp_bytes, zero_partition)
    torch.manual_seed(rank)
    sp = specs()
    het, uni = plans(world)
    res: dict = {}

    def setup(layout):
        plan = split_reduce_plan(layout_held(sp, layout), replica_of(layout))
        return plan, create_groups(reduce_groups(plan))  # every rank, same order

    def timed(fn, active: bool) -> float:
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            if active:
                fn()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            ts.append(float(dt))
        return statistics.median(ts[1:]) if len(ts) > 1 else ts[0]

    for name, layout in (("het", het), ("uni", uni)):
        plan, groups = setup(layout)
        active = rank < layout.world_size
        grads = {}
        if active:
            for s, h in rank_tensors(sp, layout, rank):
                grads[s.name] = torch.randn(tuple(h.local_shape))
        cells = plan.get(rank, [])
        red = SplitAllReduce(cells, groups) if active else None
        t_split = timed(lambda: red.reduce(grads.get, 0.5), active)
        res[f"{name}_split_s"] = t_split
        res[f"{name}_split_bytes"] = split_reduce_bytes(cells) if active else 0
        res[f"{name}_plan"] = layout.describe()
        if name == "uni":
            # plain DP all-reduce of the rank's whole local gradient over its DP group
            dp_groups = sorted({tuple(sorted(r for r in range(layout.world_size)
                                             if layout.position(r).stage == layout.position(q).stage
                                             and layout.position(r).tp_rank == layout.position(q).tp_rank))
                                for q in range(layout.world_size)})
            made = create_groups(dp_groups)
            mine = next((g for g in dp_groups if rank in g), None)
            flat = torch.cat([g.flatten() for g in grads.values()]) if active else None
            t_dp = timed(lambda: dist.all_reduce(flat, group=made[mine]), active and len(mine or ()) > 1)
            res["uni_dp_s"] = t_dp
            res["uni_dp_bytes"] = uniform_dp_bytes(flat.numel(), len(mine)) if active else 0
        if name == "het":
            params = {n: torch.randn_like(g) for n, g in grads.items()}
            parts = zero_partition(cells, rank, {c.name: 0 for c in cells})
            z = HeteroZero1(parts, cells, groups, params.get)

            def zero1():
                z.reduce_scatter(grads.get, 0.5)
                z.all_gather(params.get)
            res["het_zero1_s"] = timed(zero1, True)
            res["het_zero1_bytes"] = z.bytes_sent
    allres: list = [None] * world
    dist.all_gather_object(allres, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(allres, f)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=_odd_world, default=7,
                    help="gloo ranks (processes): odd, >= 7 (the heterogeneous plan: 3 + 2k ranks)")
    ap.add_argument("--reps", type=positive_int, default=10, help="repetitions of each exchange (the first is "
                    "warm-up when there are 2 or more)")
    a = ap.parse_args()
    import tempfile

    from dist_utils import run_world
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        run_world(worker, a.world, a.reps, out, timeout_s=600)
        rows = json.load(open(out))
    r0 = rows[0]
    load = os.getloadavg()[0]
    print(f"world {a.world}, {a.reps} reps, load average {load:.1f}")
    print(f"heterogeneous plan: {r0['het_plan']}\nuniform plan:       {r0['uni_plan']}")
    print("| exchange | median s (slowest rank) | max bytes sent by a rank |\n|---|---|---|")
    for key, label in (("het_split", "split all-reduce, heterogeneous plan"),
                       ("het_zero1", "ZeRO-1 reduce-scatter + all-gather, heterogeneous plan"),
                       ("uni_split", "split all-reduce code on the uniform grid"),
                       ("uni_dp", "plain DP all-reduce, uniform grid")):
        print(f"| {label} | {r0[key + '_s']:.4f} | {max(r[key + '_bytes'] for r in rows):,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
