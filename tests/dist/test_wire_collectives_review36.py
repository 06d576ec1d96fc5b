"""elastor_ds's object collectives never unpickle what a peer sent (3 gloo ranks).

torch's ``all_gather_object`` / ``broadcast_object_list`` unpickle every peer's bytes: a peer that
sends a pickle whose ``__reduce__`` runs code made every other rank run it. Now values travel through
the restricted codec (elastor_ds.comm.wire): a rank that passes such an object gets a TypeError
naming its type, the others a RanksFailedError naming that rank, and nothing runs; a peer that
sends raw pickle bytes anyway (or announces an absurd size) is refused with WireFormatError. The
same group then still works: every rank took the same steps.

Oracles: the values each rank built itself (every rank computes every other rank's value), exact
types compared recursively, and a marker file that the pickle payload appends the pid of whichever
process unpickled it to."""
from __future__ import annotations

import os
import pickle

import pytest

from dist_utils import run_world
from plain_values import same
from elastor_ds.comm import GlooTransport, TorchComm
from elastor_ds.errors import RanksFailedError

pytestmark = pytest.mark.timeout(300)


def _touch(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"ran in pid {os.getpid()} (rank {os.environ.get('RANK')})\n")


class Payload:
    """Unpickling it appends to ``path``: the code a hostile peer would run in every other rank."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def value_of(rank: int):
    """A value of every kind the codec carries, different per rank."""
    return {"rank": rank, "shape": (rank + 1, 4), "names": [f"w{rank}", "b"], "crc": 2**40 + rank,
            "ratio": rank / 3, "raw": bytes([rank]) * 3, 7: None, "flags": (True, False), "nested": [(rank,), []]}


def _round_trips(rank: int, world: int) -> None:
    from elastor_ds.comm import objects

    comm = TorchComm.create(60, liveness_s=20)
    expect = [value_of(r) for r in range(world)]
    got = comm.all_gather_object(value_of(rank))
    assert same(got, expect), got
    assert same(comm.broadcast_object(value_of(rank) if rank == 1 else "ignored", src=1), value_of(1))
    # the writer group (duplicate) and the engine's usual shapes: metas as tuples, a failure's wire form
    w = comm.duplicate()
    metas = [("layers.%d.w" % rank, (8, 4), "float32", (rank * 2, 0), (2, 4))]
    rows = w.all_gather_object((metas, ("nonce", "k" * 32), None))
    assert same(rows, [([("layers.%d.w" % r, (8, 4), "float32", (r * 2, 0), (2, 4))], ("nonce", "k" * 32), None)
                       for r in range(world)])
    big = "x" * (1 << 20) if rank == 2 else ""   # payloads of different sizes: padded to the longest
    assert [len(s) for s in comm.all_gather_object(big)] == [0, 0, 1 << 20]
    # the default world (what the DeepSpeed and Megatron integrations use) and a transport
    assert same(objects.all_gather_object((rank, [rank])), [(r, [r]) for r in range(world)])
    assert objects.broadcast_object("from 2" if rank == 2 else None, 2) == "from 2"
    t = GlooTransport.create(None, 60)
    assert same(t.all_gather_object((rank, b"x")), [(r, b"x") for r in range(world)])
    t.close()
    comm.close()


def test_object_collectives_round_trip_plain_data_with_its_types():
    run_world(_round_trips, 3, timeout_s=120)


def _pickle_payload(rank: int, world: int, marker: str, which: str) -> None:
    from elastor_ds.integrations.deepspeed.hetero import _gathered

    comm = TorchComm.create(60, liveness_s=20)
    transport = GlooTransport.create(None, 60)
    calls = {
        "all_gather": lambda v: comm.all_gather_object(v),
        "broadcast": lambda v: comm.broadcast_object(v, src=1),
        "transport": lambda v: transport.all_gather_object(v),
        "hetero": lambda v: _gathered(v, None, "announcing the parameters"),   # over the default world
    }
    mine = Payload(marker) if rank == 1 else ("plain", rank)
    outcome = None
    try:
        calls[which](mine)
    except Exception as e:  # noqa: BLE001 - judged below, after the marker
        outcome = e
    # every rank is past the collective: had any process unpickled the payload, the marker is there
    for _ in range(2):
        comm.barrier()
    assert not os.path.exists(marker), f"{which}: the pickle payload ran: {open(marker).read()}"
    if rank == 1:
        assert isinstance(outcome, TypeError) and "Payload" in str(outcome), repr(outcome)
    else:
        assert isinstance(outcome, RanksFailedError), repr(outcome)
        assert "rank 1" in str(outcome) and "Payload" in str(outcome), str(outcome)
    # the group is still in step: the next collective works on every rank
    assert comm.all_gather_object(rank) == list(range(world))
    transport.close()
    comm.close()


@pytest.mark.parametrize("which", ["all_gather", "broadcast", "transport", "hetero"])
def test_a_pickle_payload_is_a_type_error_at_the_sender_and_runs_nowhere(tmp_path, which):
    run_world(_pickle_payload, 3, str(tmp_path / "marker"), which, timeout_s=120)


def _hostile_sender(rank: int, world: int, marker: str, how: str) -> None:
    from elastor_ds.comm import objects, wire

    comm = TorchComm.create(60, liveness_s=20)
    saved = objects.wire, objects._outgoing
    if rank == 1:   # a peer that does not play by the codec: it sends what it likes
        if how == "pickle":
            objects.wire = type("W", (), {"encode": staticmethod(lambda v, m=0: pickle.dumps(v)),
                                          "WireTypeError": wire.WireTypeError,
                                          "WireLimitError": wire.WireLimitError})
        else:
            objects._outgoing = lambda obj, r, m: (1 << 40, b"", None)
    outcome = None
    try:
        comm.all_gather_object(Payload(marker) if rank == 1 else ("plain", rank))
    except Exception as e:  # noqa: BLE001 - judged below
        outcome = e
    objects.wire, objects._outgoing = saved
    comm.barrier()
    assert not os.path.exists(marker), f"the pickle payload ran: {open(marker).read()}"
    if rank != 1:
        assert isinstance(outcome, wire.WireFormatError), repr(outcome)
        assert "rank 1" in str(outcome), str(outcome)
    assert comm.all_gather_object(rank) == list(range(world))
    comm.close()


@pytest.mark.parametrize("how", ["pickle", "oversize"])
def test_a_peer_sending_pickle_bytes_or_an_absurd_size_is_refused(tmp_path, how):
    run_world(_hostile_sender, 3, str(tmp_path / "marker"), how, timeout_s=120)
