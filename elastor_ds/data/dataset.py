"""Records -> fixed-length samples, and which global sample indices each replica takes.

A sample is one record (a line of a text file, or the ``"text"`` field of a JSONL line; a line of
only whitespace is no record: it would train on an empty sample) tokenised,
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


#: bytes of one record at most (a line, or a JSONL line): a file without newlines (binary, a
#: compressed corpus) is refused, not read whole into memory for one sample
MAX_RECORD_BYTES = 64 << 20
_SCAN = 16 << 20   # bytes read at a time while indexing the lines
_WHITESPACE = np.frombuffer(b" \t\r\n\v\f", dtype=np.uint8)   # what str.strip() removes from a line, in ASCII


class RecordDataset:
    """The records of one text or JSONL file (by name: ``.jsonl``/``.json``, any case). The file is
    opened once: every record is read from that open file, so a file replaced under the same name
    during a run is not read with the old file's offsets."""

    def __init__(self, path: str, seq_length: int, seed: int = 1234, tokenizer: CharTokenizer | None = None):
        self.path = path
        self.seq_length = seq_length
        self.seed = seed
        self.tok = tokenizer or CharTokenizer()
        self.jsonl = path.lower().endswith((".jsonl", ".json"))
        self.fd = open_data_file(path)
        try:
            _refuse_compressed(self.fd, path)
            self.starts, self.ends = self._index(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        if not len(self.starts):
            os.close(self.fd)
            raise ConfigError(f"{path} has no records")
        self.tokenised = 0  # records tokenised by this object (resume must not tokenise skipped ones)
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _index(self, fd: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) offsets of every line holding more than whitespace, scanned a piece at a time
        (memory: the offsets)."""
        bounds, pos, last, lines = [np.zeros(1, dtype=np.int64)], 0, 0, 0
        filled: list[np.ndarray] = []   # per line: whether it holds a byte that is not whitespace
        carry = 0   # such bytes since the last line start, from earlier pieces
        while True:
            piece = os.pread(fd, _SCAN, pos)
            if not piece:
                break
            arr = np.frombuffer(piece, dtype=np.uint8)
            nl_rel = np.flatnonzero(arr == ord("\n"))
            nl = nl_rel.astype(np.int64) + (pos + 1)
            cs = np.cumsum(~np.isin(arr, _WHITESPACE), dtype=np.int64)
            if len(nl):
                long_ = np.flatnonzero(np.diff(nl, prepend=last) > MAX_RECORD_BYTES)
                if len(long_):
                    self._too_long(lines + int(long_[0]) + 1)
                at = cs[nl_rel]
                counts = np.diff(at, prepend=0)
                counts[0] += carry
                filled.append(counts > 0)
                carry = int(cs[-1] - at[-1])
                lines += len(nl)
                last = int(nl[-1])
                bounds.append(nl)
            else:
                carry += int(cs[-1])
            pos += len(piece)
            if pos - last > MAX_RECORD_BYTES:
                self._too_long(lines + 1)
        if pos > last:
            bounds.append(np.array([pos], dtype=np.int64))
            filled.append(np.array([carry > 0]))
        edges = np.concatenate(bounds)
        keep = np.concatenate(filled) if filled else np.zeros(0, dtype=bool)
        return edges[:-1][keep], edges[1:][keep]

    def _too_long(self, line: int) -> None:
        raise ConfigError(f"--data-path {self.path}: line {line} is longer than {MAX_RECORD_BYTES >> 20} MiB; records "
                          f"are lines of text or JSONL (is the file compressed or binary?)")

    def __len__(self) -> int:
        return len(self.starts)

    def record_of(self, sample: int) -> int:
        epoch, i = divmod(sample, len(self))
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            self._perm_epoch = epoch
        return int(self._perm[i])

    def text(self, record: int) -> str:
        a, b = int(self.starts[record]), int(self.ends[record])
        line = os.pread(self.fd, b - a, a).decode("utf-8", "replace").strip()
        if self.jsonl and line:
            where = f"{self.path}: line {self._line_number(a)}"
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):   # not JSON, a number too long for int(), nested too deep
                raise ConfigError(f"{where} is not valid JSON; give plain text lines or JSONL with a 'text' "
                                  f"field") from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                found = (f"its 'text' is {type(text).__name__}" if isinstance(obj, dict) and "text" in obj else
                         f"its keys are {sorted(map(str, obj))[:5]}" if isinstance(obj, dict) else
                         f"it is a JSON {type(obj).__name__}")
                raise ConfigError(f"{where}: a JSONL record is an object with a 'text' string ({found}); fix the "
                                  f"line, or give a plain text file")
            return text
        return line

    def _line_number(self, offset: int) -> int:
        """The 1-based line number of the line starting at ``offset`` (an error's message: blank lines
        are no records, so a record's number is not its line's)."""
        n, pos = 0, 0
        while pos < offset:
            piece = os.pread(self.fd, min(_SCAN, offset - pos), pos)
            if not piece:
                break
            n += piece.count(b"\n")
            pos += len(piece)
        return n + 1

    def sample(self, index: int) -> np.ndarray:
        """Tokens of global sample ``index``: ``seq_length + 1`` int64 (inputs = [:-1], labels = [1:])."""
        ids = self.tok.encode(self.text(self.record_of(index)))
        self.tokenised += 1
        out = np.full(self.seq_length + 1, CharTokenizer.PAD, dtype=np.int64)
        ids = np.append(ids, CharTokenizer.EOS)[: self.seq_length + 1]
        out[: len(ids)] = ids
        return out


#: the first bytes of compressed files (gzip, zstd, bzip2, xz, zip): records are lines of plain text
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
               b"PK\x03\x04": "zip"}


def _refuse_compressed(fd: int, path: str) -> None:
    head = os.pread(fd, 8, 0)
    kind = next((k for magic, k in _COMPRESSED.items() if head.startswith(magic)), None)
    if kind is not None:   # its bytes would be read as lines of text (and trained on)
        raise ConfigError(f"--data-path {path} is {kind}-compressed; decompress it first (records are lines of "
                          f"plain text or JSONL)")


def open_data_file(path: str) -> int:
    """A read-only descriptor of the data file ``path`` (a regular file; a link to one is followed,
    as a dataset folder of links is common), or ConfigError naming what it is instead."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)   # a FIFO: no wait for a writer
    except FileNotFoundError:
        raise ConfigError(f"--data-path {path} does not exist; give a text or JSONL file, or omit it to use "
                          f"the built-in corpus") from None
    except OSError as e:
        raise ConfigError(f"--data-path {path}: cannot open it ({e.strerror}); give a readable text or JSONL "
                          f"file") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise ConfigError(f"--data-path {path} is {what}; give a text or JSONL file")
    return fd


def replica_sample_indices(iteration: int, micro_batches: Sequence[int], micro_batch_size: int,
                           replica: int) -> list[int]:
    """Global sample indices replica ``replica`` consumes in ``iteration`` (0-based), in order."""
    global_batch = sum(micro_batches) * micro_batch_size
    start = iteration * global_batch + sum(micro_batches[:replica]) * micro_batch_size
    return list(range(start, start + micro_batches[replica] * micro_batch_size))
