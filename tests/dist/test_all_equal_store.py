"""``TorchComm.all_equal`` with liveness checks agrees through the arrival marks in the store: no
gloo operation runs (issue 23: the all-reduce after the arrival barrier cost each of a load's two
agreements 1-1.5 ms on two busy cores).

Three gloo ranks:
- equal values give True on every rank, one different value gives False on every rank;
- the comparison is exact: values that differ only above bit 62, or in sign, are not equal (the
  all-reduce compared the 62 low bits);
- ``torch.distributed.all_reduce`` raises in every rank here, so a gloo all-reduce would fail the
  test;
- 60 rounds mixing ``all_equal`` with gloo collectives on the same group in one seeded random
  order, each verdict checked against the values the test chose.

Oracle: the values the test hands each rank, compared by the test itself."""
from __future__ import annotations

import random

import pytest

from dist_utils import run_world
from elastor_ds.comm import TorchComm

pytestmark = [pytest.mark.timeout(120)]


def _worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    comm = TorchComm.create(60)

    def no_all_reduce(*a, **k):
        raise AssertionError("all_equal ran a gloo all-reduce")
    dist.all_reduce = no_all_reduce

    assert comm.all_equal(7) is True
    assert comm.all_equal(8 if rank == 2 else 7) is False
    assert comm.all_equal(-(2 ** 70) + 3) is True
    assert comm.all_equal(5 + (2 ** 63 if rank == 1 else 0)) is False   # equal in the 62 low bits
    assert comm.all_equal(5 if rank else -5) is False

    rng = random.Random(11)   # the same sequence on every rank
    for i in range(60):
        kind = rng.choice(["equal", "differ", "gather", "barrier"])
        if kind == "equal":
            v = rng.randrange(-2 ** 64, 2 ** 64)
            assert comm.all_equal(v) is True, i
        elif kind == "differ":
            odd = rng.randrange(world)
            v = rng.randrange(2 ** 40)
            assert comm.all_equal(v + (1 if rank == odd else 0)) is False, i
        elif kind == "gather":
            rows = comm.all_gather_ints([rank, i], 2)
            assert rows == [[r, i] for r in range(world)], i
        else:
            comm.barrier()
    comm.close()


def test_all_equal_agrees_through_the_store_exactly():
    run_world(_worker, 3, timeout_s=60)
