"""Overlapped preprocessing: a background process tokenises ahead of training into a bounded queue.

``PrefetchLoader(dataset_args, indices_fn, start_iteration)`` starts a worker process (spawn) that
walks the iterations from ``start_iteration``, builds each iteration's samples for this replica
(``indices_fn(iteration)``) and keeps at most ``prefetch`` iterations ready. Training blocks in
:meth:`next` only when it catches up with the worker. A worker failure is re-raised in the trainer
with the worker's message; :meth:`close` stops the worker.

The two processes share one anonymous pipe and nothing else: no multiprocessing Queue or Event,
whose named semaphores (``/dev/shm/sem.mp-*``) outlive a trainer that is SIGKILLed or leaves
through ``os._exit`` together with its resource tracker. The worker stops when the pipe closes
(the trainer closed it, or died) or when it notices that it was re-parented (within
``_PARENT_CHECK_S``): it never outlives its trainer.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import traceback
from typing import Optional

import numpy as np

from ..errors import ConfigError, ElastorError
from ..threads import NamedThread


_PARENT_CHECK_S = 0.2


def _worker(conn, path: str, seq_length: int, seed: int, schedule: tuple, start_iteration: int,
            prefetch: int, parent_pid: int = 0) -> None:
    from .dataset import RecordDataset, replica_sample_indices

    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    done = threading.Event()

    def orphaned() -> bool:   # the trainer died: this process was handed to another parent
        return bool(parent_pid) and os.getppid() != parent_pid

    def produce() -> None:
        try:
            ds = RecordDataset(path, seq_length, seed)
            it = start_iteration
            micro_batches, mbs, replica = schedule
            while not done.is_set():
                idx = replica_sample_indices(it, micro_batches, mbs, replica)
                batch = np.stack([ds.sample(i) for i in idx]) if idx else np.zeros((0, seq_length + 1), np.int64)
                item = (it, idx[0] if idx else -1, batch, ds.tokenised)
                while not done.is_set():
                    try:
                        ready.put(item, timeout=_PARENT_CHECK_S)
                        break
                    except queue.Full:
                        pass
                it += 1
        except ConfigError as e:   # bad input (the data file): its one line, raised as itself in the trainer
            ready.put(("error", str(e), True))
        except BaseException:  # noqa: BLE001 - forwarded to the trainer
            ready.put(("error", traceback.format_exc(), False))

    NamedThread(target=produce, name="elastor-data-produce", daemon=True).start()
    try:
        while not orphaned():
            try:
                item = ready.get(timeout=_PARENT_CHECK_S)
            except queue.Empty:
                continue
            try:
                conn.send(item)          # blocks while the trainer is behind: the pipe is the back-pressure
            except OSError:              # BrokenPipeError: the trainer closed its end or died
                return
            if item[0] == "error":
                return
    finally:
        done.set()
        conn.close()


class PrefetchLoader:
    def __init__(self, path: str, seq_length: int, seed: int, micro_batches: tuple[int, ...],
                 micro_batch_size: int, replica: int, start_iteration: int = 0, prefetch: int = 4):
        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_worker, daemon=True, name="elastor-data",
                                 args=(child_end, path, seq_length, seed,
                                       (tuple(micro_batches), micro_batch_size, replica), start_iteration,
                                       max(1, prefetch), os.getpid()))
        self._proc.start()
        child_end.close()                # the worker holds the only write end: its exit reads as EOF here
        self.next_iteration = start_iteration
        self.tokenised = 0
        self._first = True

    def next(self, timeout: Optional[float] = 120.0) -> np.ndarray:
        """The next iteration's samples for this replica: int64 [m * mbs, seq_length + 1]. The first
        waits as long as the worker lives (it indexes the whole file first: minutes for a large
        corpus); each later one at most ``timeout`` seconds."""
        try:
            if self._first:
                while not self._conn.poll(1.0):
                    if not self._proc.is_alive():
                        break   # its end of the pipe is closed: recv() says so
            elif not self._conn.poll(timeout):
                raise ElastorError(f"data worker produced nothing in {timeout}s (alive={self._proc.is_alive()})")
            item = self._conn.recv()
        except (EOFError, OSError):
            raise ElastorError(f"data worker exited (exit code {self._proc.exitcode}) without "
                               f"sending iteration {self.next_iteration}") from None
        if item[0] == "error":
            if len(item) > 2 and item[2]:
                raise ConfigError(item[1])
            raise ElastorError(f"data worker failed:\n{item[1]}")
        it, _, batch, tokenised = item
        self._first = False
        assert it == self.next_iteration, (it, self.next_iteration)
        self.next_iteration += 1
        self.tokenised = tokenised
        return batch

    def close(self) -> None:
        self._conn.close()               # the worker's next send fails: it stops
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
