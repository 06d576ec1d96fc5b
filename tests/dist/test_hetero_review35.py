"""Heterogeneous plans on DeepSpeed, review 35 (3 gloo ranks, plan pp2+pp1 of the toy pipeline).

* A rank whose set-up failed before the next collective left the other ranks waiting in that
  collective until the process group's timeout (30 min under DeepSpeed): one rank's config file not
  valid JSON (``eds.initialize`` raised on it alone while the others went into
  ``deepspeed.initialize``), one rank's ``elastor.plan`` differing from the module's (its engine
  check raised, the others waited in the checkpoint session's group creation), one rank's plan file
  unreadable (``agreed_plan``). Now every rank raises the typed error (a RanksFailedError that is also
  a ConfigError) naming rank 1 and its error, within seconds. The failing rank stays alive after its
  error (as a rank of a framework that catches it does, or under NCCL, where nothing notices an exit):
  a hang shows as ranks that never report, with a process-group timeout of 600 s, far beyond the
  test's own wait.
* Each heterogeneous initialize left one world-sized process group (DeepSpeed's
  ``PipelineModule.world_group``) for good. Oracle: the number of process groups this process holds
  (torch's group map), exactly the default group alone after ``HeteroRuntime.release()``, and the
  same count after a second engine as after the first.
"""
from __future__ import annotations

import datetime
import json
import os
import queue
import time

import pytest

pytest.importorskip("deepspeed")

from dist_utils import _start_method, free_port  # noqa: E402

WORLD = 3
PG_TIMEOUT_S = 600      # a rank waiting for its peers would wait this long: the test gives up far sooner
REPORT_WITHIN_S = 240   # every rank reports (success or its error) within this
MB = 2
PLAN = {"version": 1, "replicas": [
    {"micro_batches": 3, "stages": [{"tp": 1, "layers": [0, 3]}, {"tp": 1, "layers": [3, 8]}]},
    {"micro_batches": 1, "stages": [{"tp": 1, "layers": [0, 8]}]}]}
OTHER_PLAN = {"version": 1, "replicas": [
    {"micro_batches": 2, "stages": [{"tp": 1, "layers": [0, 3]}, {"tp": 1, "layers": [3, 8]}]},
    {"micro_batches": 2, "stages": [{"tp": 1, "layers": [0, 8]}]}]}


def _module(plan: dict = PLAN):
    from elastor_ds import deepspeed as eds
    from elastor_ds.layout import Layout
    from elastor_ds.testing import toy_pipe as toy
    layers = toy.layers(num_blocks=6)
    return eds.PipelineModule(layers, loss_fn=toy.loss_fn, plan=Layout.from_json(plan, len(layers)))


def _initialize(model, config):
    from elastor_ds import deepspeed as eds
    return eds.initialize(model=model, model_parameters=list(model.parameters()), config=config)[0]


def _bad_config_file(rank: int, d: str) -> None:
    """Each rank reads its own config file (a node's copy); rank 1's is not valid JSON."""
    import hetero_scenarios as hs
    path = os.path.join(d, f"ds_config_{rank}.json")
    with open(path, "w") as f:
        f.write("{not json" if rank == 1 else json.dumps(hs.ds_config(MB)))
    _initialize(_module(), path)


def _plan_differs(rank: int, d: str) -> None:
    """Rank 1's "elastor.plan" is not the plan its module was built with (its engine check raises)."""
    import hetero_scenarios as hs
    cfg = hs.ds_config(MB)
    cfg["elastor"] = {"plan": OTHER_PLAN if rank == 1 else PLAN, "checkpoint": {"dir": os.path.join(d, "ck")}}
    engine = _initialize(_module(), cfg)
    engine.elastor.finalize()


def _plan_file_unreadable(rank: int, d: str) -> None:
    """Each rank loads its plan file (a node's copy); rank 1's is truncated."""
    from elastor_ds.integrations.deepspeed.hetero import agreed_plan
    from elastor_ds.integrations.deepspeed.pipe import layout_from_plan
    path = os.path.join(d, f"plan_{rank}.json")
    with open(path, "w") as f:
        f.write(json.dumps(PLAN)[:40] if rank == 1 else json.dumps(PLAN))
    agreed_plan(lambda: layout_from_plan(path, 8))


def _module_plan_file_unreadable(rank: int, d: str) -> None:
    """Each rank builds its PipelineModule from its plan file (a node's copy); rank 1's is truncated."""
    from elastor_ds import deepspeed as eds
    from elastor_ds.testing import toy_pipe as toy
    path = os.path.join(d, f"plan_{rank}.json")
    with open(path, "w") as f:
        f.write(json.dumps(PLAN)[:40] if rank == 1 else json.dumps(PLAN))
    eds.PipelineModule(toy.layers(num_blocks=6), loss_fn=toy.loss_fn, plan=path)


SCENARIOS = {"bad_config_file": _bad_config_file, "plan_differs": _plan_differs,
             "plan_file_unreadable": _plan_file_unreadable,
             "module_plan_file_unreadable": _module_plan_file_unreadable}


def _entry(rank: int, port: int, scenario: str, d: str, reports, release) -> None:
    import torch.distributed as dist

    from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    HeteroRuntime.release()
    try:
        SCENARIOS[scenario](rank, d)
        out: tuple = ("ok", "", "", ())
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the test's subject
        out = ("raised", type(e).__name__, str(e), tuple(c.__name__ for c in type(e).__mro__))
    reports.put((rank, out))
    release.wait(REPORT_WITHIN_S + 60)   # alive until every rank reported (or the test gave up)
    dist.destroy_process_group()


def _run(scenario: str, d: str) -> dict:
    """Every rank's (outcome, class, message, class names); ranks that never reported are missing."""
    import torch.multiprocessing as mp
    ctx = mp.get_context(_start_method())
    reports, release = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, port, scenario, d, reports, release), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + REPORT_WITHIN_S
    try:
        while len(got) < WORLD:
            try:
                rank, out = reports.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            got[rank] = out
    finally:
        release.set()
        for p in procs:
            p.join(30)
        for p in procs:
            if p.is_alive():   # hung in a collective: this test started it, this test ends it
                p.kill()
                p.join(10)
    return got


@pytest.mark.parametrize("scenario,what,error", [
    ("bad_config_file", "eds.initialize (reading the config)", "ConfigError: DeepSpeed config file "),
    ("plan_differs", "eds.initialize (checking the engine)",
     "ConfigError: elastor.plan R0(mb2)[tp1:0-3|tp1:3-8] R1(mb2)[tp1:0-8] differs from the plan the "
     "PipelineModule was built with (R0(mb3)[tp1:0-3|tp1:3-8] R1(mb1)[tp1:0-8])"),
    ("plan_file_unreadable", "loading the plan", "ConfigError: elastor.plan: '"),
    ("module_plan_file_unreadable", "PipelineModule(plan=...)", "ConfigError: elastor.plan: '"),
])
def test_one_ranks_setup_failure_is_raised_on_every_rank(tmp_path, scenario, what, error):
    got = _run(scenario, str(tmp_path))
    missing = sorted(set(range(WORLD)) - set(got))
    assert not missing, (f"ranks {missing} never reported within {REPORT_WITHIN_S} s (waiting in a collective for "
                         f"rank 1, which had failed); reported: {got}")
    for rank in range(WORLD):
        status, cls, msg, mro = got[rank]
        assert status == "raised", (rank, got[rank])
        assert "RanksFailedError" in mro and "ConfigError" in mro, (rank, cls, mro)
        assert msg.startswith(f"{what} failed on 1 of 3 ranks: rank 1: {error}"), (rank, msg)
    # the message is rank 1's own error, the same on every rank
    assert len({got[r][2] for r in range(WORLD)}) == 1
    tail = {"bad_config_file": "ds_config_1.json' is not valid JSON: ", "plan_differs": ": pass the same plan to both",
            "plan_file_unreadable": "plan_1.json' is not valid JSON: ",
            "module_plan_file_unreadable": "plan_1.json' is not valid JSON: "}[scenario]
    assert tail in got[0][2], got[0][2]


def _groups_worker(rank: int, d: str) -> None:
    import math

    import torch.distributed as dist

    import hetero_scenarios as hs
    from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime

    def count() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    def train_once(engine) -> None:
        pos = engine.elastor_runtime.pos
        layout = engine.elastor_runtime.layout
        offset = sum(r.micro_batches for r in layout.replicas[:pos.replica])
        it = hs.replica_batches(0, offset, layout.replicas[pos.replica].micro_batches, 4, MB)
        assert math.isfinite(float(engine.train_batch(it)))

    counts = [count()]
    for _ in range(2):   # initialize, train, release: twice
        HeteroRuntime.release()
        train_once(_initialize(_module(), hs.ds_config(MB)))
        HeteroRuntime.release()
        counts.append(count())
    # two engines under one runtime (the same plan: HeteroRuntime.create hands back the current one)
    train_once(_initialize(_module(), hs.ds_config(MB)))
    one = count()
    train_once(_initialize(_module(), hs.ds_config(MB)))
    two = count()
    HeteroRuntime.release()
    counts += [one, two, count()]
    with open(os.path.join(d, f"counts_{rank}.json"), "w") as f:
        json.dump(counts, f)


SCENARIOS["groups"] = _groups_worker


def test_hetero_initialize_leaves_no_world_group_behind(tmp_path):
    got = _run("groups", str(tmp_path))
    assert got == {r: ("ok", "", "", ()) for r in range(WORLD)}, got
    for rank in range(WORLD):
        with open(tmp_path / f"counts_{rank}.json") as f:
            start, after1, after2, one, two, end = json.load(f)
        # only the default group before, and again after each release; a second engine under the same
        # runtime holds no more groups than the first
        assert (start, after1, after2, end) == (1, 1, 1, 1), (rank, start, after1, after2, end)
        assert two == one, (rank, one, two)
