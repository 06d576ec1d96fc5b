"""``fileformat.pread_into``: a file range read into many views back to back (the reader's scatter
reads). Oracle: slicing the bytes the test wrote."""
from __future__ import annotations

import os
import random

import pytest

from elastor_ds.checkpoint.fileformat import pread_into
from elastor_ds.errors import CorruptCheckpointError

pytestmark = pytest.mark.unit


def test_random_splits_into_views_equal_the_slice(tmp_path):
    data = os.urandom(3 << 20)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    rng = random.Random(7)
    try:
        for trial in range(60):
            off = rng.randrange(0, 1 << 20)
            total = rng.randrange(0, 2 << 20)
            # up to 3,000 views (more than one preadv's 1,024), some of them empty
            cuts = sorted(rng.randrange(0, total + 1) for _ in range(rng.randrange(0, 3000)))
            buf = bytearray(total)
            mv = memoryview(buf)
            pread_into(fd, [mv[a:b] for a, b in zip([0] + cuts, cuts + [total])], off)
            assert bytes(buf) == data[off:off + total], f"trial {trial}"
    finally:
        os.close(fd)


def test_a_file_shorter_than_the_views_is_an_error_naming_the_bytes(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 1000)
    fd = os.open(p, os.O_RDONLY)
    try:
        views = [memoryview(bytearray(60)) for _ in range(2000)]
        with pytest.raises(CorruptCheckpointError, match="file ended after 990 of 120000 bytes"):
            pread_into(fd, views, 10)
    finally:
        os.close(fd)
