"""``agree`` on two gloo ranks: every rank ok costs one ``all_equal`` and returns each rank's own
result; one rank failing (or both) raises the same typed error, naming the failing ranks, on both."""
from __future__ import annotations

import pytest

from dist_utils import run_world
from elastor_ds.comm import TorchComm
from elastor_ds.comm.collectives import agree
from elastor_ds.errors import CorruptCheckpointError, RanksFailedError


def _worker(rank: int, world: int) -> None:
    comm = TorchComm.create(60)
    gathers = []
    real = comm.all_gather_object

    def counting(obj):
        gathers.append(obj)
        return real(obj)
    comm.all_gather_object = counting
    assert agree(comm, lambda: rank * 10, what="ok everywhere") == rank * 10
    assert gathers == []    # every rank ok: no outcome gather

    def fail_on_1():
        if rank == 1:
            raise CorruptCheckpointError("bad bytes in data_00001")
        return "fine"
    with pytest.raises(RanksFailedError) as ei:
        agree(comm, fail_on_1, what="one rank fails")
    assert isinstance(ei.value, CorruptCheckpointError)
    assert "bad bytes in data_00001" in str(ei.value) and "rank 1" in str(ei.value)
    assert len(gathers) == 1

    def fail_everywhere():
        raise CorruptCheckpointError(f"rank {rank} saw a bad byte")
    with pytest.raises(RanksFailedError) as ei:
        agree(comm, fail_everywhere, what="all fail")
    assert "rank 0 saw a bad byte" in str(ei.value) and "rank 1 saw a bad byte" in str(ei.value)
    comm.close()


def test_agree_is_one_all_reduce_when_all_ranks_succeed_and_names_every_failure():
    run_world(_worker, 2, timeout_s=60)
