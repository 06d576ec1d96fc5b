"""Overlapped preprocessing: a background process tokenises ahead of training into a bounded queue.

``PrefetchLoader(dataset_args, indices_fn, start_iteration)`` starts a worker process (spawn) that
walks the iterations from ``start_iteration``, builds each iteration's samples for this replica
(``indices_fn(iteration)``) and puts them in a queue of at most ``prefetch`` iterations. Training
blocks in :meth:`next` only when it catches up with the worker. A worker failure is re-raised in the
trainer with the worker's message; :meth:`close` stops the worker. A worker whose trainer is gone
without closing it (SIGKILLed, or ``os._exit`` after an agreed stop, which skips the daemon cleanup)
notices that it was re-parented within ``_PARENT_CHECK_S`` and exits: it never outlives its trainer.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from typing import Optional

import numpy as np

from ..errors import ElastorError


_PARENT_CHECK_S = 0.2


def _worker(q, stop, path: str, seq_length: int, seed: int, schedule: tuple, start_iteration: int,
            parent_pid: int = 0) -> None:
    from .dataset import RecordDataset, replica_sample_indices

    def orphaned() -> bool:   # the trainer died: this process was handed to another parent
        return bool(parent_pid) and os.getppid() != parent_pid
    try:
        ds = RecordDataset(path, seq_length, seed)
        it = start_iteration
        micro_batches, mbs, replica = schedule
        while not stop.is_set() and not orphaned():
            idx = replica_sample_indices(it, micro_batches, mbs, replica)
            batch = np.stack([ds.sample(i) for i in idx]) if idx else np.zeros((0, seq_length + 1), np.int64)
            while not stop.is_set():
                try:
                    q.put((it, idx[0] if idx else -1, batch, ds.tokenised), timeout=_PARENT_CHECK_S)
                    break
                except queue.Full:
                    if orphaned():
                        return
            it += 1
    except BaseException:  # noqa: BLE001 - forwarded to the trainer
        q.put(("error", traceback.format_exc()))


class PrefetchLoader:
    def __init__(self, path: str, seq_length: int, seed: int, micro_batches: tuple[int, ...],
                 micro_batch_size: int, replica: int, start_iteration: int = 0, prefetch: int = 4):
        ctx = mp.get_context("spawn")
        self._q = ctx.Queue(maxsize=prefetch)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_worker, daemon=True, name="elastor-data",
                                 args=(self._q, self._stop, path, seq_length, seed,
                                       (tuple(micro_batches), micro_batch_size, replica), start_iteration,
                                       os.getpid()))
        self._proc.start()
        self.next_iteration = start_iteration
        self.tokenised = 0

    def next(self, timeout: Optional[float] = 120.0) -> np.ndarray:
        """The next iteration's samples for this replica: int64 [m * mbs, seq_length + 1]."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            alive = self._proc.is_alive()
            raise ElastorError(f"data worker produced nothing in {timeout}s (alive={alive})") from None
        if item[0] == "error":
            raise ElastorError(f"data worker failed:\n{item[1]}")
        it, _, batch, tokenised = item
        assert it == self.next_iteration, (it, self.next_iteration)
        self.next_iteration += 1
        self.tokenised = tokenised
        return batch

    def close(self) -> None:
        self._stop.set()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
