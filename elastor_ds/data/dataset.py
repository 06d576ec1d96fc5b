"""Records -> fixed-length samples, and which global sample indices each replica takes.

A sample is one record (a line of a text file, or the ``"text"`` field of a JSONL line) tokenised,
with EOS appended, truncated or PAD-padded to ``seq_length + 1`` tokens. The record behind global
sample ``i`` is ``perm_epoch(i mod N)``: a seeded permutation per epoch, so the sample order is a
function of the global sample index only, never of the layout. A line-offset index (found by
scanning for newlines, no tokenising) gives random access, so resuming at ``consumed_samples``
tokenises nothing that was already consumed.

Heterogeneous plans: replica ``r`` with ``m_r`` micro-batches takes the contiguous slice of every
global batch starting at ``sum(m_j for j < r) * micro_batch_size`` (:func:`replica_sample_indices`).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from .tokenizer import CharTokenizer


class RecordDataset:
    def __init__(self, path: str, seq_length: int, seed: int = 1234, tokenizer: CharTokenizer | None = None):
        if not os.path.isfile(path):
            raise ConfigError(f"--data-path {path} does not exist; give a text or JSONL file, or omit it to use "
                              f"the built-in corpus")
        self.path = path
        self.seq_length = seq_length
        self.seed = seed
        self.tok = tokenizer or CharTokenizer()
        self.jsonl = path.endswith((".jsonl", ".json"))
        self.offsets = self._index(path)
        if len(self.offsets) < 2:
            raise ConfigError(f"{path} has no records")
        self.tokenised = 0  # records tokenised by this object (resume must not tokenise skipped ones)
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @staticmethod
    def _index(path: str) -> np.ndarray:
        data = np.fromfile(path, dtype=np.uint8)
        ends = np.flatnonzero(data == ord("\n")) + 1
        if len(data) and data[-1] != ord("\n"):
            ends = np.append(ends, len(data))
        return np.concatenate([[0], ends]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def record_of(self, sample: int) -> int:
        epoch, i = divmod(sample, len(self))
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            self._perm_epoch = epoch
        return int(self._perm[i])

    def text(self, record: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[record]))
            line = f.read(int(self.offsets[record + 1] - self.offsets[record])).decode("utf-8", "replace").strip()
        if self.jsonl and line:
            try:
                return str(json.loads(line).get("text", ""))
            except json.JSONDecodeError:
                raise ConfigError(f"{self.path}: line {record + 1} is not valid JSON; give plain text lines or "
                                  f"JSONL with a 'text' field") from None
        return line

    def sample(self, index: int) -> np.ndarray:
        """Tokens of global sample ``index``: ``seq_length + 1`` int64 (inputs = [:-1], labels = [1:])."""
        ids = self.tok.encode(self.text(self.record_of(index)))
        self.tokenised += 1
        out = np.full(self.seq_length + 1, CharTokenizer.PAD, dtype=np.int64)
        ids = np.append(ids, CharTokenizer.EOS)[: self.seq_length + 1]
        out[: len(ids)] = ids
        return out


def replica_sample_indices(iteration: int, micro_batches: Sequence[int], micro_batch_size: int,
                           replica: int) -> list[int]:
    """Global sample indices replica ``replica`` consumes in ``iteration`` (0-based), in order."""
    global_batch = sum(micro_batches) * micro_batch_size
    start = iteration * global_batch + sum(micro_batches[:replica]) * micro_batch_size
    return list(range(start, start + micro_batches[replica] * micro_batch_size))
