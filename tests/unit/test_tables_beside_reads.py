"""The reader loads a load's block-CRC tables on its verify thread, beside the first data reads
(issue 23: the tables cost a cold load 3-7 ms before its first data read).

- With sources that say they are thread-safe, the table read and the first data read are in flight
  at once: here the table read waits until a data read has started, which the old order (tables
  first, on the reading thread) never lets happen.
- A source that does not say so is still used from one thread, tables first.
- A corrupt table still fails the load with the table's own error: the data file being read is not
  blamed (no "reading it from ... instead"), and no byte lands in a destination that a direct read
  would fill.

Oracle: the tensors that were saved (kept here) and the order of reads recorded by the test's own
source wrapper; never the reader's own account."""
from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from elastor_ds.checkpoint import CheckpointEngine
from elastor_ds.checkpoint import commit as commit_mod
from elastor_ds.checkpoint.planning.manifest import Manifest
from elastor_ds.checkpoint.reader import read_shards
from elastor_ds.checkpoint.shards import TensorShard
from elastor_ds.checkpoint.sources import STORAGE, DirSource
from elastor_ds.errors import CorruptCheckpointError
from elastor_ds.layout.region import Region

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# 2 MiB of float32 saved as row halves of 1 MiB: each half is cut into 8 column tiles, so a column
# half is read as 4 tiles per file (512 KiB, staged: not straight into the destination)
SHAPE = (64, 8192)
WAIT_S = 5.0


def _save(root: str) -> torch.Tensor:
    w = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(5))
    eng = CheckpointEngine(root, async_save=False)
    eng.save(2, [TensorShard("w", SHAPE, Region((0, 0), (32, 8192)), w[:32]),
                 TensorShard("w", SHAPE, Region((32, 0), (32, 8192)), w[32:])])
    eng.wait()
    return w


class _Recording(DirSource):
    """A storage source that records its reads; with ``hold_tables``, a table read waits (up to
    WAIT_S) until a data read has started, and notes whether one had."""

    def __init__(self, step_dir: str, thread_safe: bool, hold_tables: bool):
        super().__init__(step_dir, STORAGE)
        self.thread_safe = thread_safe
        self.hold_tables = hold_tables
        self.events: list[tuple[str, str]] = []
        self.data_started = threading.Event()
        self.table_saw_data_in_flight: list[bool] = []

    def _note(self, relpath: str) -> None:
        if relpath.endswith(".crc32"):
            self.events.append(("table", relpath))
            if self.hold_tables:
                self.table_saw_data_in_flight.append(self.data_started.wait(WAIT_S))
        else:
            self.events.append(("data", relpath))
            self.data_started.set()

    def read_into(self, relpath, offset, views):
        self._note(relpath)
        return super().read_into(relpath, offset, views)

    def read_direct(self, relpath, offset, view):
        self._note(relpath)
        return super().read_direct(relpath, offset, view)


def _column_half(step: str, src: DirSource) -> torch.Tensor:
    man = Manifest.loads(open(os.path.join(step, "manifest.json")).read())
    dst = torch.zeros(64, 4096)
    read_shards(step, man, [TensorShard("w", SHAPE, Region((0, 4096), (64, 4096)), dst)], sources=[src])
    return dst


def test_a_table_is_read_while_a_data_read_is_in_flight(tmp_path):
    root = str(tmp_path / "ck")
    w = _save(root)
    step = commit_mod.resolve(root)
    src = _Recording(step, thread_safe=True, hold_tables=True)
    dst = _column_half(step, src)
    assert torch.equal(dst, w[:, 4096:])
    assert src.table_saw_data_in_flight and all(src.table_saw_data_in_flight), src.events
    # every byte read once: the data reads plus the two tables, nothing twice
    assert src.bytes_read == 64 * 4096 * 4 + sum(os.path.getsize(os.path.join(step, f))
                                                 for f in os.listdir(step) if f.endswith(".crc32"))


def test_a_source_that_is_not_thread_safe_is_read_tables_first_from_one_thread(tmp_path):
    root = str(tmp_path / "ck")
    w = _save(root)
    step = commit_mod.resolve(root)
    src = _Recording(step, thread_safe=False, hold_tables=False)
    readers: set[str] = set()
    orig = src._note

    def note(relpath):
        readers.add(threading.current_thread().name)
        orig(relpath)
    src._note = note
    dst = _column_half(step, src)
    assert torch.equal(dst, w[:, 4096:])
    kinds = [k for k, _ in src.events]
    assert "table" in kinds and "data" in kinds, src.events
    assert max(i for i, k in enumerate(kinds) if k == "table") < kinds.index("data"), src.events
    assert readers == {threading.current_thread().name}


@pytest.mark.parametrize("box", [Region((0, 4096), (64, 4096)), Region((32, 0), (32, 8192))],
                         ids=["staged", "direct"])
def test_a_corrupt_table_fails_with_its_own_error_and_blames_no_data_file(tmp_path, caplog, box):
    root = str(tmp_path / "ck")
    _save(root)
    step = commit_mod.resolve(root)
    table = sorted(f for f in os.listdir(step) if f.endswith(".crc32"))[-1]
    with open(os.path.join(step, table), "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0x40]))
    dst = torch.zeros(box.sizes)
    man = Manifest.loads(open(os.path.join(step, "manifest.json")).read())
    with caplog.at_level(logging.WARNING), pytest.raises(CorruptCheckpointError, match=table):
        read_shards(step, man, [TensorShard("w", SHAPE, box, dst)],
                    sources=[DirSource(step, STORAGE), DirSource(step, STORAGE)])
    assert "instead" not in caplog.text
    if box.offsets[0] == 32:   # the row half lands straight in dst: not before its table is good
        assert not dst.any()
