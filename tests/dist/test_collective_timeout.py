"""Workers under ``elastor run`` bound every collective by ``ELASTOR_COLLECTIVE_TIMEOUT_S``
(2 x ``--hang-timeout``). Before, a survivor whose peer vanished without a reset waited in gloo for
torch's default, 30 minutes: also in the groups DeepSpeed and Megatron create with
``new_group(ranks)``, which do not inherit the world group's timeout.

Two real processes, gloo, ``elastor_ds.deepspeed.init_distributed`` (what the example trainer
calls); both make a data-parallel-like group with ``new_group`` (no timeout given); rank 1 then
never enters the all-reduce. Rank 0 must fail within the bound, on the world group and on the
subgroup."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from elastor_ds.elastic.protocol import ENV_COLLECTIVE_TIMEOUT, collective_bound, collective_timeout_s
from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_S = 3.0

WORKER = r"""
import os, sys, time, json
import torch, torch.distributed as dist
from elastor_ds.deepspeed import init_distributed
init_distributed(dist_backend="gloo")
rank = dist.get_rank()
sub = dist.new_group([0, 1])                       # as DeepSpeed's grid and Megatron do: no timeout
out = {}
if rank == 1:
    time.sleep(float(sys.argv[1]))                   # never enters a collective: a silent peer
    os._exit(0)
for name, group in (("subgroup", sub), ("world", None)):
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        out[name] = ["returned", time.monotonic() - t0]
    except Exception as e:
        out[name] = [type(e).__name__, time.monotonic() - t0]
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


def test_collective_timeout_is_parsed_strictly():
    assert collective_timeout_s({}) is None and collective_timeout_s({ENV_COLLECTIVE_TIMEOUT: ""}) is None
    assert collective_timeout_s({ENV_COLLECTIVE_TIMEOUT: "300"}) == 300.0
    assert collective_bound(300) == 600.0      # the controller's hang check (300 s) acts first
    for bad in ("0", "-1", "inf", "nan", "5m"):
        with pytest.raises(ValueError, match=ENV_COLLECTIVE_TIMEOUT):
            collective_timeout_s({ENV_COLLECTIVE_TIMEOUT: bad})


@pytest.mark.timeout(240)
def test_a_silent_peer_fails_the_collective_within_the_bound(tmp_path):
    port = free_port()
    silent_s = 60                                   # far past the bound; the test's own limit is 240 s
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", **{ENV_COLLECTIVE_TIMEOUT: f"{BOUND_S:g}"})
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(silent_s)], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0 = time.monotonic()
    try:
        out0, _ = procs[0].communicate(timeout=200)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    line = next((ln for ln in out0.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out0[-4000:]
    import json
    res = json.loads(line[len("RESULT "):])
    for group in ("subgroup", "world"):
        kind, waited = res[group]
        assert kind != "returned", res                            # rank 1 never joined: it cannot succeed
        assert BOUND_S * 0.9 <= waited <= BOUND_S + 5, res        # failed after the bound, not 30 minutes
    assert time.monotonic() - t0 < silent_s, "rank 0 did not finish before the silent peer's sleep ended"
