"""Megatron-LM's own training loop inside ``elastor run``: start-up report, heartbeat, agreed stop.

The patch of ``megatron/training/training.py`` (``patches/megatron-lm/0007-training-elastor-loop.patch``)
calls, with ``--elastor``:

1. :func:`attach` once in ``train()``, before the first iteration (model built, checkpoint loaded):
   marks ``t_loaded``; rank 0 appends a ``worker_started`` event (world size, the layout megatron-core
   runs, the plan flag, the iteration it resumed from) to ``elastor run``'s events file. Returns the
   loop's handle, or None when the process was not launched by ``elastor run``.
2. :func:`stop_point` at the end of every iteration (before Megatron-LM's own save / exit checks):
   heartbeat, then one all-reduce (MAX) of the stop requests of every rank. On a stop it saves this
   iteration through ``save`` (Megatron-LM's ``save_checkpoint_and_time``, i.e. the elastor hooks),
   waits until the save is committed (:func:`training_hooks.finalize`) and returns the exit code:
   ``EXIT_OK`` (0) for a preemption (SIGTERM/SIGINT), ``EXIT_RESIZE`` (75) for a resize (SIGUSR1).
   Otherwise None.

The worker hooks come from the caller (``elastor_ds.elastic.worker.ElasticWorker.from_env()``, whose
signal handlers ``elastor run``'s worker entry point installs before any import): the elastic
controller sits a floor above the integrations and this module does not import it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ...elastic.protocol import StopCode

log = logging.getLogger(__name__)

__all__ = ["WorkerHooks", "ElasticLoop", "attach", "stop_point", "describe_layout"]


class WorkerHooks(Protocol):
    """What the loop needs from ``elastor run``'s per-process hooks (``ElasticWorker``)."""

    def mark(self, name: str) -> None: ...

    def heartbeat(self, iteration: int) -> None: ...

    def agree_stop(self) -> StopCode: ...

    def report_started(self, rank: int, **fields: Any) -> None: ...


@dataclass(frozen=True)
class ElasticLoop:
    """The handle :func:`attach` returns: the worker hooks, this process's global rank and whether
    the run saves (``--save``)."""
    worker: WorkerHooks
    rank: int
    saves: bool = True


def describe_layout(args: Any) -> str:
    """The grid megatron-core runs, e.g. ``tp1 x pp3 x dp1 (layout Ett|t|tL)``."""
    from megatron.core import parallel_state as ps

    text = (f"tp{ps.get_tensor_model_parallel_world_size()} x pp{ps.get_pipeline_model_parallel_world_size()}"
            f" x dp{ps.get_data_parallel_world_size()}")
    pipe = getattr(args, "pipeline_model_parallel_layout", None)
    return f"{text} (layout {pipe})" if pipe else text


def attach(worker: Optional[WorkerHooks], args: Any, iteration: int) -> Optional[ElasticLoop]:
    """Start of training: mark ``t_loaded`` and report the start (rank 0). None without a worker
    (not under ``elastor run``): :func:`stop_point` then does nothing, not even a collective."""
    if worker is None:
        return None
    import torch.distributed as dist

    worker.mark("t_loaded")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    worker.report_started(rank, world_size=world, layout=describe_layout(args), resumed_from=int(iteration),
                          plan_source=getattr(args, "elastor_plan", None) or "flags",
                          trainer="megatron-lm")
    return ElasticLoop(worker, rank, saves=bool(getattr(args, "save", None)))


def stop_point(loop: Optional[ElasticLoop], iteration: int, save: Callable[[], Any]) -> Optional[int]:
    """End of iteration ``iteration`` (1-based, just completed). Collective when ``loop`` is set:
    every rank calls it once per iteration. Returns the exit code after a durable save of this
    iteration when the ranks agreed to stop, else None."""
    if loop is None:
        return None
    loop.worker.heartbeat(iteration)
    code = loop.worker.agree_stop()
    if code == StopCode.NONE:
        return None
    if not loop.saves:
        if loop.rank == 0:
            log.warning("elastor: stop requested (%s) at iteration %d; no --save, so nothing is saved; exiting "
                        "with %d", code.name.lower(), iteration, code.exit_code())
        return code.exit_code()
    from . import training_hooks

    save()
    training_hooks.finalize()   # committed (data, manifest, latest) before the process may exit
    if loop.rank == 0:
        log.info("elastor: stop requested (%s): iteration %d saved durably; exiting with %d",
                 code.name.lower(), iteration, code.exit_code())
    return code.exit_code()
