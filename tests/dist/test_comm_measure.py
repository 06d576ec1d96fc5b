"""The collective-cost calibration (`elastor_ds.comm.calibrate`) measured on real gloo ranks, as the
trainers run it before planning; the pure cost-model side is tests/unit/test_comm_cost.py."""
from __future__ import annotations

from dist_utils import run_world
from elastor_ds.plan import Profile
from elastor_ds.plan.comm_cost import CollectiveKind, CommProfile


# ---- the measurement on real ranks --------------------------------------------------------------
def _measure(rank, world, out):
    import torch.distributed as dist

    from elastor_ds.comm.calibrate import measure_collectives
    doc = measure_collectives([2, 3], reps=3)
    got = [None] * world
    dist.all_gather_object(got, doc)
    if rank == 0:
        out.put(got)


def test_measure_collectives_on_gloo_ranks():
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").SimpleQueue()
    run_world(_measure, 3, q, timeout_s=60)
    docs = q.get()
    assert all(d == docs[0] for d in docs), "ranks disagree on the measured costs"
    prof = CommProfile.from_dict(docs[0])  # a valid profile field
    assert set(docs[0]) == {"tp_all_reduce", "dp_all_reduce", "reduce_scatter", "all_gather", "p2p"}
    assert set(docs[0]["dp_all_reduce"]) == {"2", "3"} and set(docs[0]["p2p"]) == {"2"}
    for kind in CollectiveKind:
        for g in ((2,) if kind is CollectiveKind.P2P else (2, 3)):
            t = prof.time(kind, g, 65536)
            assert 0 < t < 1.0, (kind, g, t)  # a real call on local gloo: more than nothing, less than a second


def _measure_alone(rank, world, out):
    from elastor_ds.comm.calibrate import measure_collectives
    out.put(measure_collectives([2, 3, 4]))


def test_measure_collectives_on_one_process_is_empty_and_loads():
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").SimpleQueue()
    run_world(_measure_alone, 1, q, timeout_s=30)
    doc = q.get()
    assert doc == {}
    prof = Profile.from_dict({"layer_time_s": {"1": 0.1}, "collectives": doc})
    assert not any(prof.collectives.has(k) for k in CollectiveKind)
