"""The restricted codec of the object collectives (elastor_ds.comm.wire): plain data round-trips with
its types (a tuple stays a tuple), anything else is a TypeError at the sender naming the type and
where it sits, and bytes that are not a valid encoding (a pickle, truncated, oversize, too deep,
malformed) raise WireFormatError and run nothing.

Oracles: hand-written bytes from the format table of the module docstring; exact types compared
recursively; a marker file that a pickle payload would write if anything unpickled it."""
from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import random
import struct
import typing

import numpy as np
import pytest
import torch

from elastor_ds.comm import LocalComm, wire
from plain_values import same
from elastor_ds.comm.wire import WireFormatError, WireLimitError, WireTypeError, decode, encode
from elastor_ds.errors import CollectiveError


VALUES = [
    None, True, False, 0, 1, -1, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 7**400, -(7**400),
    0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"),
    "", "a", "héllo wörld ✓", "lone \ud800 surrogate", b"", b"\x00\xffpickle\x80",
    [], (), {}, [()], ([],), [1, (2, [3, (4,)])], ((1, 2), [1, 2]),
    {"a": 1, 2: (None, [b"x"]), -3: {"n": {}}, 2**70: "big key"},
    # what the engine gathers: shard metadata, a nonce, a failure's wire form
    ([("layers.0.w", (8, 4), "float32", (0, 0), (4, 4))], ("123_456", "ab" * 16), None),
    ("error", (1, "CorruptCheckpointError", "bad bytes", ("CorruptCheckpointError", "Exception"))),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: repr(v)[:40])
def test_plain_values_round_trip_with_their_exact_types(value):
    assert same(decode(encode(value)), value)


def test_equal_values_encode_to_equal_bytes_and_tuple_differs_from_list():
    assert encode({"a": (1, 2)}) == encode({"a": (1, 2)})
    assert encode((1, 2)) != encode([1, 2])
    assert type(decode(encode([(1,)]))[0]) is tuple and type(decode(encode(([1],)))[0]) is list


def test_bytes_match_the_format_table_written_by_hand():
    # MAGIC, then t <u32 3>: i <int64 1>, s <u32 1> "a", N
    assert encode((1, "a", None)) == bytes.fromhex("455701" "7400000003" "690000000000000001" "7300000001" "61" "4e")
    # d <u32 2>: key i <int64 -2> -> T; key s "k" -> l <u32 1>: f 0.5; then bytes b <u32 2>
    assert encode({-2: True, "k": [0.5]}) == (b"EW\x01d\x00\x00\x00\x02" + b"i" + struct.pack(">q", -2) + b"T"
                                              + b"s\x00\x00\x00\x01k" + b"l\x00\x00\x00\x01f" + struct.pack(">d", 0.5))
    # outside int64: I <u16 n> minimal two's complement
    assert encode(2**63) == b"EW\x01I\x00\x09\x00\x80\x00\x00\x00\x00\x00\x00\x00"
    assert encode(-2**63 - 1) == b"EW\x01I\x00\x09\xff\x7f\xff\xff\xff\xff\xff\xff\xff"
    assert decode(b"EW\x01b\x00\x00\x00\x03xyz") == b"xyz"


class Colour(enum.IntEnum):
    RED = 1


class Kind(enum.Enum):
    A = "a"


@dataclasses.dataclass
class Meta:
    name: str


class Pair(typing.NamedTuple):
    a: int
    b: int


class Text(str):
    pass


@pytest.mark.parametrize("value, type_name", [
    (Meta("w"), "Meta"), (Colour.RED, "Colour"), (Kind.A, "Kind"), ({1, 2}, "set"), (frozenset(), "frozenset"),
    (ValueError("x"), "ValueError"), (np.int64(3), "numpy.int64"), (np.float32(1.0), "numpy.float32"),
    (np.float64(1.0), "numpy.float64"), (np.bool_(True), "numpy.bool"),
    (torch.Size([2, 3]), "torch.Size"), (Pair(1, 2), "Pair"), (bytearray(b"x"), "bytearray"),
    (Text("s"), "Text"), (torch.zeros(1), "Tensor"), (object(), "object"), (len, "builtin_function_or_method"),
    (complex(1, 2), "complex"),
])
def test_a_type_that_is_not_plain_data_is_a_type_error_naming_it_and_where_it_sits(value, type_name):
    with pytest.raises(TypeError) as ei:
        encode({"rows": [1, ("x", value)]})
    assert isinstance(ei.value, WireTypeError)
    msg = str(ei.value)
    assert type_name in msg and "['rows'][1][1]" in msg and "plain data" in msg


@pytest.mark.parametrize("key", [True, 1.5, (1, 2), None, b"k", Colour.RED])
def test_a_dict_key_that_is_not_str_or_int_is_refused(key):
    with pytest.raises(WireTypeError, match="keys must be str or int"):
        encode({key: 1})


class Payload:
    """Anything that unpickles this writes ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _touch(path: str) -> None:
    with open(path, "a") as f:
        f.write("ran\n")


def test_a_crafted_pickle_payload_is_refused_and_runs_nothing(tmp_path):
    marker = str(tmp_path / "marker")
    crafted = pickle.dumps([Payload(marker)])
    pickle.loads(crafted)                       # the oracle: unpickling it does write the marker
    assert os.path.exists(marker)
    os.unlink(marker)
    for data in (crafted, wire.MAGIC + crafted, wire.MAGIC + b"l\x00\x00\x00\x01" + crafted):
        with pytest.raises(WireFormatError):
            decode(data)
    with pytest.raises(WireTypeError, match="Payload"):
        encode([Payload(marker)])
    assert not os.path.exists(marker)


def test_oversize_values_and_payloads_are_refused():
    with pytest.raises(WireLimitError, match="at most 100"):
        encode("x" * 200, max_bytes=100)
    data = encode("x" * 200)
    with pytest.raises(WireFormatError, match="at most 100"):
        decode(data, max_bytes=100)
    with pytest.raises(WireLimitError):
        encode(1 << (8 * wire.MAX_INT_BYTES + 8))
    # a count or a length larger than what follows: refused before anything is allocated
    for crafted in (wire.MAGIC + b"l\xff\xff\xff\xff", wire.MAGIC + b"d\xff\xff\xff\xffN",
                    wire.MAGIC + b"s\xff\xff\xff\xffab", wire.MAGIC + b"b\x7f\xff\xff\xff",
                    wire.MAGIC + b"I\xff\xff" + b"\x01" * 10):
        with pytest.raises(WireFormatError):
            decode(crafted)


def _nested(depth: int):
    v: typing.Any = 0
    for _ in range(depth):
        v = [v]
    return v


def test_nesting_deeper_than_the_limit_is_refused_both_ways():
    ok = _nested(wire.MAX_DEPTH)
    assert decode(encode(ok)) == ok
    with pytest.raises(WireLimitError, match="nested more than"):
        encode(_nested(wire.MAX_DEPTH + 1))
    loop: list = []
    loop.append(loop)
    with pytest.raises(WireLimitError):
        encode(loop)
    deep = wire.MAGIC + b"l\x00\x00\x00\x01" * (wire.MAX_DEPTH + 1) + b"N"
    with pytest.raises(WireFormatError, match="nested more than"):
        decode(deep)
    very_deep = wire.MAGIC + b"t\x00\x00\x00\x01" * 100_000 + b"N"   # no RecursionError either
    with pytest.raises(WireFormatError):
        decode(very_deep)


@pytest.mark.parametrize("data, what", [
    (b"", "not an elastor wire payload"), (b"EW\x02N", "not an elastor wire payload"),
    (wire.MAGIC, "truncated"), (wire.MAGIC + b"NN", "trailing"), (wire.MAGIC + b"Z", "unknown tag"),
    (wire.MAGIC + b"s\x00\x00\x00\x02\xc3\x28", "UTF-8"),
    (wire.MAGIC + b"d\x00\x00\x00\x02" + b"s\x00\x00\x00\x01kN" * 2, "twice"),
    (wire.MAGIC + b"d\x00\x00\x00\x01" + b"NN", "dict key with tag"),
    (wire.MAGIC + b"d\x00\x00\x00\x01" + b"f" + b"\x00" * 8 + b"N", "dict key with tag"),
    (wire.MAGIC + b"I\x00\x09" + b"\x00" * 9, "non-canonical"),
    (wire.MAGIC + b"I\x00\x0b\x00\x00\x80" + b"\x00" * 8, "non-canonical"),   # 2**71 with a zero byte too many
    (wire.MAGIC + b"i\x00\x00", "truncated"),
])
def test_malformed_payloads_raise_a_typed_error(data, what):
    with pytest.raises(WireFormatError, match=what) as ei:
        decode(data)
    assert isinstance(ei.value, CollectiveError) and isinstance(ei.value, ValueError)


def test_every_truncation_and_random_corruption_is_refused_or_decodes_to_plain_data():
    data = encode(VALUES)
    for n in range(len(data)):
        with pytest.raises(WireFormatError):
            decode(data[:n])
    rng = random.Random(36)
    for _ in range(3000):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            v = decode(bytes(b))
        except WireFormatError:
            continue
        encode(v)   # whatever decodes is plain data again


def test_local_comm_refuses_what_a_torch_comm_could_not_send():
    comm = LocalComm()
    assert comm.all_gather_object((1, [2])) == [(1, [2])]
    with pytest.raises(WireTypeError, match="set"):
        comm.all_gather_object({1})
    with pytest.raises(WireTypeError, match="Meta"):
        comm.broadcast_object(Meta("x"))
