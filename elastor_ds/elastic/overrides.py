"""Every torch.distributed.elastic internal ``elastor run`` patches or reads, pinned to torch==2.13.0.

Where the controller reaches into torch elastic:

* :class:`~.agent.ElastorAgent` is a ``LocalElasticAgent`` whose run loop (``_invoke_run``) is ours;
  it overrides the private ``_rendezvous``, ``_assign_worker_ranks`` and ``_start_workers``, calls
  ``_initialize_workers``, ``_exit_barrier`` and ``_shutdown``, and reads or resets the private
  ``_pcontext``, ``_worker_group`` and ``_remaining_restarts``;
* each launch reads every node's local world size from the round's store through torch's private
  ``_RoleInstanceInfo`` record (:func:`local_world_sizes`); the failure ledger lives in the
  rendezvous handler's private ``_store`` (:func:`rendezvous_store`); the round just joined, bound
  into elastor's sealed store values, is its private ``_state_holder``'s (:func:`rendezvous_round`);
* standby workers (:mod:`.standby`): ``local_elastic_agent.start_processes`` is replaced while the
  agent starts workers (:func:`replaced_start_processes`), by a ``SubprocessContext`` whose
  ``SubprocessHandler`` s override the private ``_start`` / ``_popen``;
* the agent sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (read by ``PContext.start``, which installs a
  terminate handler for each signal it names) to ``SIGPWR`` unless the user set it, so that the
  controller's own stop handling holds while workers start. An environment variable, not a symbol:
  no row of :data:`TABLE` can import it; re-check it in ``torch/distributed/elastic/multiprocessing/api.py``
  with every new torch.

``comm/collectives.py`` reads torch c10d's private ``_get_default_store``, and ``checkpoint/live.py``
the tensors' ``_version`` counters; they are listed here (the torch host's table) but used where
they are: ``comm/`` and ``checkpoint/`` sit below ``elastic/`` and may not import it.

:data:`TABLE` is the one list: ``tests/unit/test_overrides.py`` imports every row, compares the
parameter names with the installed torch, checks the torch version against :data:`PINS`, and fails
when a private torch elastic symbol is touched at a place no row names. To support a new torch
release: re-check every row against its source, then bump the pin.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ..integrations.override_table import Kind, Override, Pin
from ..integrations.override_table import patched as _patched

PINS = (Pin("torch", "2.13.0", "torch"),)

_E = "elastor_ds/elastic/"
_AGENT, _STANDBY = _E + "agent.py", _E + "standby.py"
_API = "torch.distributed.elastic.agent.server.api:"
_LEA = "torch.distributed.elastic.agent.server.local_elastic_agent:"
_SIMPLE, _LOCAL = _API + "SimpleElasticAgent.", _LEA + "LocalElasticAgent."
_MP = "torch.distributed.elastic.multiprocessing."
_START_PROCESSES = _LEA + "start_processes"


def _t(path: str, kind: Kind, where: tuple[str, ...], why: str, params: Any = None, instance: bool = False,
       routed: bool = False) -> Override:
    """A torch row; touched directly in every file of ``where`` (a subclass of torch's, or below this
    floor) unless ``routed`` (every use goes through the accessors below)."""
    return Override(path, kind, where, why, params, instance, host="torch", direct=() if routed else where)


TABLE: tuple[Override, ...] = (
    # --- the agent (agent.py)
    _t(_LOCAL + "__init__", Kind.CALL, (_AGENT,), "ElastorAgent passes spec, logs_specs, start_method, "
       "exit_barrier_timeout and shutdown_timeout through",
       "spec, logs_specs, start_method, exit_barrier_timeout, log_line_prefix_template, shutdown_timeout, "
       "health_check_server, uninterruptible_state_timeout"),
    _t(_SIMPLE + "_invoke_run", Kind.OVERRIDE, (_AGENT,), "elastor's run loop (failures, shrink, scale-up, "
       "preemption, liveness) replaces torch's", "role"),
    _t(_SIMPLE + "_rendezvous", Kind.OVERRIDE, (_AGENT,), "a preemption while waiting in the rendezvous leaves "
       "at once", "worker_group"),
    _t(_SIMPLE + "_assign_worker_ranks", Kind.OVERRIDE, (_AGENT,), "reads every node's local size and publishes "
       "the snapshot servers once ranks are known", "store, group_rank, group_world_size, spec"),
    _t(_LOCAL + "_start_workers", Kind.OVERRIDE, (_AGENT, _STANDBY), "exports the launched world to the workers; "
       "standby workers replace Popen", "worker_group"),
    _t(_SIMPLE + "_initialize_workers", Kind.CALL, (_AGENT,), "a new rendezvous + start for each launch",
       "worker_group"),
    _t(_SIMPLE + "_exit_barrier", Kind.CALL, (_AGENT,), "the other nodes' exit barrier after a clean finish", ""),
    _t(_LOCAL + "_shutdown", Kind.CALL, (_AGENT,), "kill the workers when the run ends", "death_sig, timeout"),
    _t(_LOCAL + "_pcontext", Kind.PATCH, (_AGENT,), "the workers' process handlers and stderr files; closed and "
       "reset to None after a kill", instance=True),
    _t(_SIMPLE + "_worker_group", Kind.READ, (_AGENT,), "the worker group (spec, workers, store)", instance=True),
    _t(_SIMPLE + "_remaining_restarts", Kind.PATCH, (_AGENT,), "torch names the log folder attempt_<max_restarts "
       "minus remaining>: one folder per launch", instance=True),
    _t(_API + "_RoleInstanceInfo", Kind.READ, (_AGENT,), "the record every agent writes at "
       "torchelastic/role_info/<node rank> in the round's store", routed=True),
    _t(_API + "_RoleInstanceInfo.deserialize", Kind.CALL, (_AGENT,), "decode one node's record", "data", routed=True),
    _t(_API + "_RoleInstanceInfo.local_world_size", Kind.READ, (_AGENT,), "that node's worker count",
       instance=True, routed=True),
    _t("torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._store", Kind.READ,
       (_AGENT,), "the rendezvous store outlives rounds: the job's failure ledger lives there", instance=True,
       routed=True),
    _t("torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._state_holder", Kind.READ,
       (_AGENT,), "the round just joined (its store's key prefix is torch.rendezvous.<run id>.<round>): bound "
       "into elastor's sealed store values", instance=True, routed=True),
    _t("torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousState.round", Kind.READ, (_AGENT,),
       "that round's number", instance=True, routed=True),
    # --- standby workers (standby.py)
    _t(_START_PROCESSES, Kind.WRAP, (_STANDBY,), "while the agent starts workers, a StandbyContext is built "
       "instead (a callable entry point still goes to the original)",
       "name, entrypoint, args, envs, logs_specs, log_line_prefixes, start_method, numa_options, "
       "duplicate_stdout_filters, duplicate_stderr_filters", routed=True),
    _t(_MP + "api:SubprocessContext.__init__", Kind.CALL, (_STANDBY,), "StandbyContext takes the same arguments",
       "name, entrypoint, args, envs, logs_specs, log_line_prefixes, numa_options, duplicate_stdout_filters, "
       "duplicate_stderr_filters"),
    _t(_MP + "api:SubprocessContext._start", Kind.OVERRIDE, (_STANDBY,), "builds standby handlers", ""),
    _t(_MP + "api:SubprocessContext._numa_options", Kind.READ, (_STANDBY,), "passed on to each handler",
       instance=True),
    _t(_MP + "subprocess_handler:SubprocessHandler.__init__", Kind.CALL, (_STANDBY,), "the standby handler passes "
       "every argument through", "entrypoint, args, env, stdout, stderr, local_rank_id, numa_options"),
    _t(_MP + "subprocess_handler:SubprocessHandler._popen", Kind.OVERRIDE, (_STANDBY,), "the worker process comes "
       "from the standby pool instead of Popen", "args, env"),
    _t(_MP + "subprocess_handler:SubprocessHandler._stdout", Kind.READ, (_STANDBY,), "the worker's stdout log file",
       instance=True),
    _t(_MP + "subprocess_handler:SubprocessHandler._stderr", Kind.READ, (_STANDBY,), "the worker's stderr log file",
       instance=True),
    # --- the c10d rendezvous backend (store_probe.py)
    _t("torch.distributed.elastic.rendezvous.utils:_matches_machine_hostname", Kind.CALL, (_E + "store_probe.py",),
       "whether torch hosts the c10d store on this node (is_host unset): only a client waits for the store in "
       "Python first", "host", routed=True),
    # --- c10d, read below the elastic floor
    _t("torch.distributed.distributed_c10d:_get_default_store", Kind.CALL, ("elastor_ds/comm/collectives.py",),
       "the default process group's store (liveness beacons, store-based agreement)", ""),
    # --- torch core, read by the checkpoint engine
    _t("torch:Tensor._version", Kind.READ, ("elastor_ds/checkpoint/live.py",), "a live write's guard: the "
       "autograd version counter every in-place op bumps, read at save() and compared at the fence and at the "
       "writer's end"),
)


# ------------------------------------------------------------------ accessors (the only patching code)
@contextlib.contextmanager
def replaced_start_processes(make: Callable[[Callable], Callable]) -> Iterator[None]:
    """While active, ``LocalElasticAgent._start_workers`` calls ``make(original)`` where it would call
    torch's ``start_processes``."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea
    with _patched(TABLE, _START_PROCESSES, make(lea.start_processes)):
        yield


def local_world_sizes(store: Any, group_world_size: int) -> list[int]:
    """Every node's local world size in this round, by node rank (from the records torch's agents
    write to the round's store during rank assignment)."""
    from torch.distributed.elastic.agent.server.api import _RoleInstanceInfo
    raw = store.multi_get([f"torchelastic/role_info/{i}" for i in range(group_world_size)])
    return [_RoleInstanceInfo.deserialize(b).local_world_size for b in raw]


def matches_machine_hostname(host: str) -> bool:
    """torch's own rule for "``host`` is this machine" (the c10d backend then hosts the store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    return bool(_matches_machine_hostname(host))


def rendezvous_round(handler: Any) -> Any:
    """The round a dynamic rendezvous handler has joined (read right after ``next_rendezvous``: the
    round changes only once every participant left it), or None for a handler without one."""
    holder = getattr(handler, "_state_holder", None)
    return getattr(getattr(holder, "state", None), "round", None)


def rendezvous_store(handler: Any) -> Any:
    """The store a rendezvous handler keeps across rounds (None for a handler without one)."""
    return getattr(handler, "_store", None)
