"""Megatron-LM's own training loop, once per iteration: memory snapshots, and inside ``elastor run``
the start-up report, the heartbeat and the agreed stop.

The patch of ``megatron/training/training.py`` (``patches/megatron-lm/0007-training-elastor-loop.patch``)
calls, with ``--elastor``:

1. :func:`attach` once in ``train()``, before the first iteration (model built, checkpoint loaded).
   Under ``elastor run`` (a worker given): marks ``t_loaded``; rank 0 appends a ``worker_started``
   event (world size, the grid megatron-core runs, the plan flag and the plan it applied, the
   iteration it resumed from, the restore record) to the job's events file.
2. :func:`iteration_end` at the end of every iteration, before Megatron-LM's own save / exit checks
   (collective: every rank, same point):

   a. under ``elastor run``: the heartbeat, then one all-reduce (MAX) of every rank's stop request.
      On a stop: save this iteration through ``save`` (Megatron-LM's ``save_checkpoint_and_time``,
      i.e. the elastor hooks), wait until it is committed (:func:`training_hooks.finalize`) and
      return the exit code, ``EXIT_OK`` (0) for a preemption (SIGTERM/SIGINT), ``EXIT_RESIZE`` (75)
      for a resize (SIGUSR1). The stop ends the loop before Megatron-LM's own exit checks, so on an
      iteration where Megatron-LM would end the run (``--exit-interval``, ``--phase-transition-iterations``)
      a resize exits 0 too: the job ends there, as it would have without the stop, instead of a
      relaunch training on past it (:func:`megatron_exits_at`);
   b. otherwise a memory snapshot when one is due (:func:`training_hooks.after_iteration`,
      ``--elastor-memory-snapshot-interval``) and None.

The worker hooks come from the caller (``elastor_ds.elastic.worker.ElasticWorker.from_env()``, whose
signal handlers ``elastor run``'s worker entry point installs before any import): the elastic
controller sits a floor above the integrations and this module does not import it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ...elastic.protocol import EXIT_OK, StopCode

log = logging.getLogger(__name__)

__all__ = ["WorkerHooks", "ElasticLoop", "attach", "iteration_end", "describe_layout", "megatron_exits_at"]


class WorkerHooks(Protocol):
    """What the loop needs from ``elastor run``'s per-process hooks (``ElasticWorker``)."""

    def mark(self, name: str) -> None: ...

    def heartbeat(self, iteration: int, last: bool = False) -> None: ...

    def agree_stop(self) -> StopCode: ...

    def report_started(self, rank: int, **fields: Any) -> None: ...


@dataclass(frozen=True)
class ElasticLoop:
    """What :func:`attach` hands the loop: Megatron-LM's args, ``elastor run``'s worker hooks (None
    outside it) and this process's global rank."""
    args: Any
    worker: Optional[WorkerHooks]
    rank: int

    @property
    def saves(self) -> bool:
        return bool(getattr(self.args, "save", None))


def describe_layout(args: Any) -> str:
    """The grid megatron-core runs, e.g. ``tp1 x pp3 x dp1 (layout Ett|t|tL)``."""
    from megatron.core import parallel_state as ps

    text = (f"tp{ps.get_tensor_model_parallel_world_size()} x pp{ps.get_pipeline_model_parallel_world_size()}"
            f" x dp{ps.get_data_parallel_world_size()}")
    pipe = getattr(args, "pipeline_model_parallel_layout", None)
    return f"{text} (layout {pipe})" if pipe else text


def _restore_record(args: Any) -> Optional[dict]:
    """The restore record (tier, step, bytes per source, seconds) of the session this launch loaded
    from, or None (nothing loaded)."""
    from . import training_hooks

    return training_hooks.restore_record(args)


def attach(worker: Optional[WorkerHooks], args: Any, iteration: int) -> ElasticLoop:
    """Start of training. Under ``elastor run`` (``worker`` set): mark ``t_loaded``, report the start."""
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if up else 0
    if worker is not None:
        worker.mark("t_loaded")
        plan = getattr(args, "elastor_plan_layout", None)   # the plan --elastor-plan applied (a Layout)
        worker.report_started(rank, world_size=dist.get_world_size() if up else 1, layout=describe_layout(args),
                              resumed_from=int(iteration), plan_source=getattr(args, "elastor_plan", None) or "flags",
                              plan=plan.to_json() if plan is not None else None,
                              restore=_restore_record(args), trainer="megatron-lm")
    return ElasticLoop(args, worker, rank)


def iteration_end(loop: ElasticLoop, iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                  num_floating_point_operations_so_far: float, save: Callable[[], Any]) -> Optional[int]:
    """End of iteration ``iteration`` (1-based, just completed; collective). Returns the exit code
    after a durable save of this iteration when the ranks agreed to stop, else None (after a memory
    snapshot, when one is due)."""
    from . import training_hooks

    if loop.worker is not None:
        last = iteration == getattr(loop.args, "train_iters", None) or megatron_exits_at(loop.args, iteration)
        loop.worker.heartbeat(iteration, last=last)
        code = loop.worker.agree_stop()
        if code != StopCode.NONE:
            return _stop(loop, code, iteration, save)
    training_hooks.after_iteration(iteration, model, optimizer, opt_param_scheduler,
                                   num_floating_point_operations_so_far, loop.args)
    return None


def megatron_exits_at(args: Any, iteration: int) -> bool:
    """Whether Megatron-LM's ``checkpoint_and_decide_exit`` ends the run after ``iteration``
    (``--exit-interval``, ``--phase-transition-iterations`` as validate_args leaves it: a list of ints;
    core_v0.16.1's conditions)."""
    every = getattr(args, "exit_interval", None)
    phases = getattr(args, "phase_transition_iterations", None)
    return bool(every and iteration % every == 0) or bool(phases and iteration in phases)


def _stop(loop: ElasticLoop, code: StopCode, iteration: int, save: Callable[[], Any]) -> int:
    """Save ``iteration`` and wait until it is committed (data, manifest, latest), then the exit code:
    the stop's, or 0 where Megatron-LM would end the run after this iteration (the job ends)."""
    from . import training_hooks

    exit_code = EXIT_OK if megatron_exits_at(loop.args, iteration) else code.exit_code()
    why = "" if exit_code == code.exit_code() else "; Megatron-LM's exit interval ends the run here"
    if not loop.saves:
        if loop.rank == 0:
            log.warning("elastor: stop requested (%s) at iteration %d; no --save, so nothing is saved%s; exiting "
                        "with %d", code.name.lower(), iteration, why, exit_code)
        return exit_code
    save()
    training_hooks.finalize()
    if loop.rank == 0:
        log.info("elastor: stop requested (%s): iteration %d saved durably%s; exiting with %d",
                 code.name.lower(), iteration, why, exit_code)
    return exit_code
