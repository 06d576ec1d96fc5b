"""Heterogeneous plans on DeepSpeed: each replica runs DeepSpeed's own ``PipelineEngine`` (its 1F1B
schedule, p2p and optimizer wrapper) on its own process groups; the cross-replica work sits at the
edge.

Where stock DeepSpeed stops, and what this module does instead (see RUNTIME_FACTS.md):

* ``PipelineModule`` wants ``num_stages`` to divide the world and builds a ``PipelineParallelGrid``
  over the whole world ("Invalid Grid" otherwise). :class:`HeteroTopology` gives *one replica's*
  coordinates as global ranks and :class:`HeteroGrid` takes its groups from :class:`HeteroRuntime`
  instead of creating them; the module is built with that grid (``PipelineModule`` constructs the
  grid class by name, so it is swapped for the duration of the constructor).
* ``new_group`` is collective over the world: :meth:`HeteroRuntime.create` creates every group of
  every replica (singletons, stage TP groups, replica groups) on every rank in the one sorted order
  of :func:`elastor_ds.runtime.creation_order`; the split all-reduce groups follow, also sorted,
  once the engine is built and every rank's parameters are known.
* A stage's TP degree may differ from its neighbours' (TP2 -> TP1 -> TP4): DeepSpeed's p2p pairs
  equal TP ranks only. :func:`install_p2p` routes ``deepspeed.runtime.pipe.p2p.send/recv`` through
  :mod:`elastor_ds.runtime.p2p` when the engine's grid is a :class:`HeteroGrid` (one pipeline engine
  per process: p2p keeps one module-level grid). Activation/gradient partitioning across the TP
  group (``pipe_partitioned``) is turned off: it assumes equal widths.
* Gradients: the last stage divides the loss by its own ``gradient_accumulation_steps`` (M_p), so
  replica p holds ``g_p = (1/M_p) sum``; :class:`HeteroPipelineEngine` overrides
  ``_exec_reduce_grads`` -- re-registered in its ``_INSTRUCTION_MAP``, through which the engine
  dispatches (an override of the method alone is silently ignored) -- to run the split all-reduce of
  ``(M_p/M) g_p`` over the finest common sub-regions first, then DeepSpeed's own (DP = 1) reduction.
* Gradient clipping: DeepSpeed's fp32 path computes the norm from model-parallel rank 0's view and
  would clip replicas with different norms. The engine's ``gradient_clipping`` is taken over: the
  norm of the *whole* model gradient (each element once, across the replica set) after the
  reduction, then DeepSpeed's formula ``coef = min(1, max_norm / (norm + 1e-6))`` on every rank.
* Losses: the engine returns the global loss ``sum_p M_p loss_p / M`` on every rank.
* ZeRO: DeepSpeed's ZeRO-1 keeps one data-parallel group for every flat buffer; replicas with
  different partitions have no such group. So DeepSpeed runs ZeRO stage 0 here and ZeRO-1 is ours
  (:class:`elastor_ds.runtime.hetero_comm.HeteroZero1`): the optimizer state of every block is sharded among
  exactly the ranks that hold it (one per replica for TP-split blocks), the torch optimizer's param
  groups are re-pointed at those shares, ``ReduceGrads`` becomes a reduce-scatter and
  ``OptimizerStep`` is followed by an all-gather of the updated weights. ZeRO >= 2 (sharded gradients
  or weights) is refused with :class:`ConfigError`; the planner's memory model shards only the
  optimizer state of heterogeneous plans (``elastor_ds.plan.cost``).
"""
from __future__ import annotations

import logging
from collections import namedtuple
from typing import Any, Callable, Optional

import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from ...runtime.hetero_comm import HeteroZero1, SplitAllReduce, create_groups, global_mean
from ...errors import ConfigError
from ...layout import Layout, Piece, Region
from . import overrides
from ...runtime import (creation_order, recv_source, reduce_groups, send_targets, split_reduce_plan,
                         zero_partition)
from ...runtime import needs_hetero  # noqa: F401 - imported from here by pipe.py and api.py

log = logging.getLogger(__name__)

_Coord = namedtuple("ProcessCoord", ["pipe", "data", "model"])


class HeteroTopology:
    """DeepSpeed topology duck type: one replica's (pipe, data=0, model) coordinates <-> global ranks.
    ``model`` is the TP rank within the stage; the model dimension is this rank's stage TP degree."""

    def __init__(self, layout: Layout, rank: int):
        self.layout, self.rank = layout, rank
        self.pos = layout.position(rank)
        self.stages = layout.replicas[self.pos.replica].stages

    def get_axis_names(self) -> list[str]:
        return ["pipe", "data", "model"]

    def get_dim(self, axis: str) -> int:
        return {"pipe": len(self.stages), "data": 1, "model": self.pos.tp}[axis]

    def get_coord(self, rank: int):
        p = self.layout.position(rank)
        if p.replica != self.pos.replica:
            raise ConfigError(f"rank {rank} is in replica {p.replica}, not in this rank's replica {self.pos.replica}")
        return _Coord(p.stage, 0, p.tp_rank)

    def get_rank(self, pipe: int = 0, data: int = 0, model: int = 0, **_: Any) -> int:
        st = self.stages[pipe]
        return st.ranks[model % st.tp]

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        c = self.get_coord(rank)
        return "" if self.pos.tp == 1 else f"model{inner_sep}{c.model:02d}"

    def world_size(self) -> int:
        return sum(s.tp for s in self.stages)

    def get_axis_comm_lists(self, axis: str):
        raise ConfigError(f"heterogeneous layouts do not support DeepSpeed features that need the '{axis}' axis "
                          f"communicators (tied layers across stages)")

    def __str__(self) -> str:
        return f"HeteroTopology(replica {self.pos.replica}: {self.layout.describe()})"


class HeteroGrid(PipelineParallelGrid):
    """DeepSpeed's grid for one rank of a heterogeneous layout; groups come from :class:`HeteroRuntime`."""

    def __init__(self, rt: "HeteroRuntime"):  # noqa: D401 - deliberately does not call super().__init__
        import deepspeed.comm as dist
        lay, pos = rt.layout, rt.pos
        self.rt = rt
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._topo = rt.topology
        self.data_parallel_size = 1
        self.pipe_parallel_size = len(rt.stages)
        self.model_parallel_size = pos.tp
        self.slice_parallel_size = pos.tp
        self.stage_id = pos.stage
        self.data_parallel_id = 0
        rep = rt.replica_ranks
        self.ds_model_proc_group = rt.groups[rep]
        self.ds_model_world_size = len(rep)
        self.ds_model_rank = rep.index(self.global_rank)
        self.dp_group = [self.global_rank]
        self.dp_groups = [[r] for r in range(self.world_size)]
        self.dp_proc_group = rt.groups[(self.global_rank,)]
        self.is_first_stage = pos.stage == 0
        self.is_last_stage = pos.stage == len(rt.stages) - 1
        self.p2p_groups = []
        self.pp_group = list(rep)
        self.pp_proc_group = rt.groups[rep]
        self.pipe_groups = [list(rep)]
        self.slice_group = list(rt.stage_ranks)
        self.slice_proc_group = rt.groups[rt.stage_ranks]
        self.mp_group = list(rt.stage_ranks)
        del lay

    def stage_to_global(self, stage_id: int, **kwargs: Any) -> int:
        st = self.rt.stages[stage_id]
        return st.ranks[self.rt.pos.tp_rank % st.tp]

    def get_data_parallel_id(self) -> int:
        return 0

    def get_stage_id(self) -> int:
        return self.stage_id

    def send_targets(self, dest_stage: int) -> list[int]:
        return send_targets(self.rt.layout, self.global_rank, dest_stage)

    def recv_source(self, src_stage: int) -> int:
        return recv_source(self.rt.layout, self.global_rank, src_stage)


class HeteroRuntime:
    """This process's place in a heterogeneous layout and every group it needs (one per process)."""

    _current: Optional["HeteroRuntime"] = None

    def __init__(self, layout: Layout, agreed: bool = False):
        import deepspeed.comm as dist
        world = dist.get_world_size()
        if not agreed:   # before anything that could differ per rank: the group creations below
            agree_on_plan(layout)
        if layout.world_size != world:
            raise ConfigError(f"plan {layout.describe()} has {layout.world_size} devices but WORLD_SIZE is {world}: "
                              f"launch {layout.world_size} processes or give a plan for {world}")
        self.layout = layout
        self.rank = dist.get_rank()
        self.pos = layout.position(self.rank)
        self.stages = layout.replicas[self.pos.replica].stages
        self.stage_ranks = tuple(sorted(self.stages[self.pos.stage].ranks))
        self.replica_ranks = tuple(sorted(r for s in self.stages for r in s.ranks))
        self.micro_batches = layout.replicas[self.pos.replica].micro_batches
        self.total_micro_batches = sum(r.micro_batches for r in layout.replicas)
        self.weight = self.micro_batches / self.total_micro_batches
        order = creation_order(layout)
        self.groups = create_groups(order)
        self._made: set[tuple[int, ...]] = set(order)   # every group created (the same set on every rank)
        self.topology = HeteroTopology(layout, self.rank)
        self.grid: Optional[HeteroGrid] = None
        self.reducer: Optional[SplitAllReduce] = None
        self.zero_stage = 0                      # set by prepare_config (0 or 1)
        self.zero: Optional[HeteroZero1] = None
        self.shapes: dict[str, tuple[int, ...]] = {}       # canonical name -> global shape
        self.module_names: dict[str, str] = {}             # canonical name -> module parameter name
        self._dropped: set[int] = set()                    # id() of modules whose world group is destroyed

    @classmethod
    def create(cls, layout: Layout, agreed: bool = False) -> "HeteroRuntime":
        """The process's runtime for ``layout`` (collective on first call; one layout per process).
        ``agreed``: every rank is known to hold ``layout`` (:func:`agree_on_plan` ran)."""
        cur = cls._current
        if cur is not None:
            if cur.layout.fingerprint() != layout.fingerprint():
                raise ConfigError(f"this process already runs plan {cur.layout.describe()}; one heterogeneous "
                                  f"plan (one pipeline engine) per process")
            return cur
        cls._current = cls(layout, agreed)
        return cls._current

    @classmethod
    def release(cls) -> None:
        """Forget the process's runtime and destroy its groups (tests running several plans in one
        process). Collective over the world when there is a runtime: every rank calls it (after the
        last use of its engine, which cannot run afterwards)."""
        cur, cls._current = cls._current, None
        if cur is not None:
            cur.destroy_groups()

    def destroy_groups(self) -> None:
        """Destroy every group this runtime made (stage, replica, split all-reduce and ZeRO-1 groups),
        in creation order, after a world barrier: no peer is still inside a collective on one of them
        when its sockets close. Each rank destroys the groups it belongs to (the others were never
        registered on it)."""
        from ...comm.groups import destroy_group, world_barrier
        groups = list(self.groups.values())
        self.groups.clear()
        self._made.clear()
        self.reducer = None
        self.zero = None
        world_barrier()
        for g in groups:
            destroy_group(g)

    def drop_module_world_group(self, module: Any) -> None:
        """Destroy the world-sized group DeepSpeed's ``PipelineModule.__init__`` creates
        (``module.world_group``) for a module built under this runtime. It serves the constructor
        only (this rank's rank and world size; the grid it would build is the runtime's
        :class:`HeteroGrid`), but nothing destroyed it: every hetero initialize left one world group
        (its sockets and threads under gloo) in the process for good. Called once the engine is built
        and a world collective has run since the module's construction (every rank has created the
        group: none is still connecting to it); a module seen again is left alone."""
        from ...comm.groups import destroy_group
        g = getattr(module, "world_group", None)
        if g is None or id(module) in self._dropped or any(g is h for h in self.groups.values()):
            return
        self._dropped.add(id(module))
        destroy_group(g)

    @property
    def tp_group(self) -> Any:
        return self.groups[self.stage_ranks]

    def make_grid(self) -> HeteroGrid:
        if self.grid is None:
            self.grid = HeteroGrid(self)
        return self.grid

    def build_reducer(self, engine: Any) -> SplitAllReduce:
        """Every rank announces its parameters (canonical name, global shape, pieces); the split
        all-reduce plan and its groups follow (collective)."""
        import torch.distributed as dist

        from .state import _place
        held = []
        self.params: dict[str, torch.nn.Parameter] = {}
        local: Optional[BaseException] = None
        try:
            for n, p in engine.module.named_parameters():
                if not p.requires_grad:
                    continue
                cname, gshape, pieces = _place(engine, n, tuple(p.shape))
                held.append((cname, tuple(gshape), tuple(pieces)))
                self.params[cname] = p
                self.shapes[cname] = tuple(gshape)
                self.module_names[cname] = n
        except Exception as e:  # noqa: BLE001 - raised on every rank by _gathered
            local = e
        rows = _gathered([(n, s, [_piece_row(p) for p in ps]) for n, s, ps in held], local,
                         "announcing the parameters for the split all-reduce")
        everyone = [[(n, tuple(s), tuple(_piece_of(p) for p in ps)) for n, s, ps in row] for row in rows]
        rep = {r: self.layout.position(r).replica for r in range(len(everyone))}
        plan = split_reduce_plan(dict(enumerate(everyone)), rep)
        # a second engine under this runtime reuses the groups of the first (the same plan gives the same
        # groups; creating them again left the first ones alive, never destroyed); the filter is the
        # same on every rank, as create_groups needs
        new = [g for g in reduce_groups(plan) if g not in self._made]
        self._made.update(new)
        self.groups.update(create_groups(new))
        self.reducer = SplitAllReduce(plan[self.rank], self.groups)
        return self.reducer

    def build_zero(self, optimizer: Any) -> HeteroZero1:
        """ZeRO-1 over the holders of each block (collective): the optimizer's param groups are
        re-pointed from this rank's parameters to its shares of the optimizer state."""
        local: Optional[BaseException] = None
        group_of: dict[str, int] = {}
        try:
            group_of = self._param_groups_of(optimizer)
        except Exception as e:  # noqa: BLE001 - raised on every rank by _gathered
            local = e
        everyone = _gathered(group_of, local, "ZeRO-1 set-up")
        seen: dict[str, tuple[int, int]] = {}
        for r, gm in enumerate(everyone):
            for n, gi in gm.items():
                r0, g0 = seen.setdefault(n, (r, gi))
                if g0 != gi:
                    raise ConfigError(f"parameter {n} is in optimizer param group {g0} on rank {r0} but {gi} on rank "
                                      f"{r}: every replica must build the same param groups for ZeRO-1")
        parts = zero_partition(self.reducer.cells, self.rank, group_of)
        self.zero = HeteroZero1(parts, self.reducer.cells, self.groups, self.data_of)
        for gi, g in enumerate(optimizer.param_groups):
            g["params"] = ([sh for pt, sh in zip(parts, self.zero.shards) if pt.group == gi]
                           + [self.params[n] for n in self.zero.local_names if group_of[n] == gi])
        own = sum(sh.numel() for sh in self.zero.shards)
        log.debug("rank %d: ZeRO-1 keeps optimizer state for %d of %d parameter elements", self.rank, own,
                  sum(p.numel() for p in self.params.values()))
        return self.zero

    def _param_groups_of(self, optimizer: Any) -> dict[str, int]:
        """Canonical parameter name -> its param group in ``optimizer`` (this rank's checks of ZeRO-1)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"ZeRO-1 with a heterogeneous plan needs a torch optimizer, got "
                              f"{type(optimizer).__name__}")
        if optimizer.state:
            raise ConfigError("ZeRO-1 with a heterogeneous plan: the optimizer already has state (build it fresh)")
        group_of_param = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = [n for n, p in self.params.items() if id(p) not in group_of_param]
        if missing:
            raise ConfigError(f"parameters {missing[:4]} require grad but are not in the optimizer; ZeRO-1 with a "
                              f"heterogeneous plan shards every trained parameter")
        return {n: group_of_param[id(p)] for n, p in self.params.items()}

    def grad_of(self, name: str) -> Optional[torch.Tensor]:
        p = self.params[name]
        return None if p.grad is None else p.grad.data

    def data_of(self, name: str) -> torch.Tensor:
        return self.params[name].data


def _piece_row(p: Piece) -> tuple:
    """``p`` as plain data for :func:`_gathered` (the object collectives carry no dataclasses)."""
    return (tuple(p.local.offsets), tuple(p.local.sizes), tuple(p.global_.offsets), tuple(p.global_.sizes))


def _piece_of(row: Any) -> Piece:
    return Piece(Region(tuple(row[0]), tuple(row[1])), Region(tuple(row[2]), tuple(row[3])))


def _gathered(mine: Any, local: Optional[BaseException], what: str) -> list:
    """Every rank's ``mine`` (plain data: one object all-gather over the world, never pickled:
    :mod:`~elastor_ds.comm.objects`), where a rank whose local
    step raised (``local``) sends its error instead (class names and message: plain strings): then
    every rank raises the typed error naming it (:func:`~elastor_ds.comm.collectives.raise_failures`)
    rather than the others waiting for it in their next collective."""
    import torch.distributed as dist

    from ...comm.collectives import raise_failures
    from ...comm.objects import all_gather_object
    from ...errors import RankFailure
    rank = dist.get_rank()
    row = ("ok", mine) if local is None else ("error", RankFailure.of(rank, local).to_wire())
    everyone = all_gather_object(row, what=what)
    raise_failures([RankFailure.from_wire(r[1]) for r in everyone if r[0] != "ok"], len(everyone), local, what)
    return [r[1] for r in everyone]


def agree_on_plan(layout: Layout) -> None:
    """Collective over the world: every rank must hold ``layout`` (:func:`agreed_plan`)."""
    agreed_plan(lambda: layout)


def agreed_plan(load: Callable[[], Layout], what: str = "loading the plan") -> Layout:
    """Collective over the world: this rank's plan, ``load()`` (a plan file read, a plan resolved
    from the config), once every rank is known to hold the same one. ``new_group`` is collective over
    the world, so ranks creating the groups of different plans would hang there for good (a plan file
    per node, ``"plan": "auto"`` with different ``LOCAL_WORLD_SIZE`` or profile inputs). One all-gather
    of an ok flag and a 60-bit fingerprint of the layout (no pickling):

    1. a rank whose ``load`` raised (an unreadable or invalid plan) still takes part; every rank then
       raises a typed error naming it and its error (:func:`~elastor_ds.comm.collectives.world_outcome`)
       instead of the others waiting in this all-gather until the process group's timeout;
    2. on a difference of fingerprints, the plans' descriptions follow and every rank raises the same
       ConfigError naming which ranks hold which plan."""
    from ...comm.collectives import world_outcome
    from ...comm.groups import all_gather_world_bytes
    layout: Any = None
    local: Optional[BaseException] = None
    fp = 0
    try:
        layout = load()
        if not isinstance(layout, Layout):
            raise ConfigError(f"{what}: expected a Layout, got {type(layout).__name__}")
        fp = int(layout.fingerprint()[:15], 16)
    except Exception as e:  # noqa: BLE001 - raised on every rank by world_outcome
        local = e
    keys = [row[0] for row in world_outcome(local, what, [fp])]
    if len(set(keys)) == 1:
        return layout
    descs = [b.decode("utf-8", "replace") for b in all_gather_world_bytes(layout.describe().encode()[:300])]
    by_key: dict[int, list[int]] = {}
    for r, k in enumerate(keys):
        by_key.setdefault(k, []).append(r)

    def ranks_text(rs: list[int]) -> str:
        head = ", ".join(str(r) for r in rs[:8])
        return f"rank{'s' if len(rs) > 1 else ''} {head}" + (f", ... ({len(rs)} ranks)" if len(rs) > 8 else "")

    groups = sorted(by_key.values())
    parts = [f"{ranks_text(rs)} hold{'s' if len(rs) == 1 else ''} {descs[rs[0]]} (fingerprint {keys[rs[0]]:015x})" for rs in groups[:4]]
    more = f"; and {len(groups) - 4} more plans" if len(groups) > 4 else ""
    raise ConfigError(f"the ranks hold {len(groups)} different plans: {'; '.join(parts)}{more}: "
                      f"give every rank the same plan (one plan file for all nodes, or the same LOCAL_WORLD_SIZE "
                      f"and profile for \"plan\": \"auto\")")


def install_p2p() -> None:
    """Route DeepSpeed's pipeline p2p through the cross-width pairing when the grid is a HeteroGrid."""
    import deepspeed.comm as dist

    def wrap_send(orig_send):
        def send(tensor, dest_stage, async_op=False):
            grid = overrides.p2p_grid()
            if not isinstance(grid, HeteroGrid):
                return orig_send(tensor, dest_stage, async_op=async_op)
            for r in grid.send_targets(dest_stage):
                dist.send(tensor, r)
        return send

    def wrap_recv(orig_recv):
        def recv(tensor, src_stage, async_op=False):
            grid = overrides.p2p_grid()
            if not isinstance(grid, HeteroGrid):
                return orig_recv(tensor, src_stage, async_op=async_op)
            return dist.recv(tensor, grid.recv_source(src_stage))
        return recv

    overrides.wrap_p2p(wrap_send, wrap_recv)


def prepare_config(ds_config: dict, rt: HeteroRuntime) -> tuple[dict, float]:
    """The DeepSpeed config for this rank's replica; returns it and the clipping norm taken over."""
    cfg = dict(ds_config)
    zero = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    if zero > 1:
        raise ConfigError(f"zero_optimization.stage={zero} with heterogeneous plan {rt.layout.describe()}: heterogeneous "
                          f"plans run ZeRO-1 at most (optimizer state sharded among the holders of each block; "
                          f"gradients and weights are not sharded); use stage 1 or 0, or a uniform plan for ZeRO-{zero}")
    rt.zero_stage = zero
    cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": 0}  # ZeRO-1 is ours (HeteroZero1)
    for key in ("fp16", "bf16"):
        if (cfg.get(key) or {}).get("enabled"):
            raise ConfigError(f"{key} with a heterogeneous plan is not supported yet: the split all-reduce runs on "
                              f"fp32 gradients; use fp32 or a uniform plan")
    mbs = cfg.get("train_micro_batch_size_per_gpu")
    if mbs is None:
        raise ConfigError("heterogeneous plans need train_micro_batch_size_per_gpu in the DeepSpeed config (the "
                          "plan gives micro-batches per replica)")
    tbs = cfg.pop("train_batch_size", None)
    if tbs is not None and int(tbs) != int(mbs) * rt.total_micro_batches:
        raise ConfigError(f"train_batch_size {tbs} != train_micro_batch_size_per_gpu ({mbs}) x the plan's total "
                          f"micro-batches ({rt.total_micro_batches}) = {int(mbs) * rt.total_micro_batches}")
    cfg["gradient_accumulation_steps"] = rt.micro_batches
    clip = float(cfg.get("gradient_clipping", 1.0))  # DeepSpeed's default is 1.0
    cfg["gradient_clipping"] = 0.0
    pipe = dict(cfg.get("pipeline") or {})
    pipe["pipe_partitioned"] = False
    pipe["grad_partitioned"] = False
    cfg["pipeline"] = pipe
    return cfg, clip


def _hetero_reduce_grads(self: "HeteroPipelineEngine") -> None:
    rt: HeteroRuntime = self.elastor_runtime
    for probe in self.elastor_probes:  # e.g. elastor_ds.testing.state_memory: state at the end of backward
        probe()
    zero = rt.zero
    if zero is not None:
        zero.reduce_scatter(rt.grad_of, rt.weight)  # each share's .grad: the global gradient of its elements
    else:
        rt.reducer.reduce(rt.grad_of, rt.weight)
    overrides.stock_reduce_grads(self)
    if zero is not None:  # ZeRO-1: the full gradients are not needed any more (the shares carry theirs)
        for n in zero.sharded_names:
            rt.params[n].grad = None
    if self.elastor_clip > 0:
        norm = zero.grad_norm(rt.grad_of) if zero is not None else rt.reducer.grad_norm(rt.grad_of)
        coef = min(1.0, self.elastor_clip / (norm + 1e-6))
        self.elastor_grad_norm = norm
        if coef < 1.0:
            names = zero.local_names if zero is not None else list(rt.params)
            for n in names:
                p = rt.params[n]
                if p.grad is not None:
                    p.grad.data.mul_(coef)
            if zero is not None:
                zero.scale_grads(coef)


def _hetero_optimizer_step(self: "HeteroPipelineEngine", lr_kwargs: Any = None) -> None:
    overrides.stock_optimizer_step(self, lr_kwargs)
    rt: HeteroRuntime = self.elastor_runtime
    if rt.zero is not None:
        rt.zero.all_gather(rt.data_of)  # the updated shares back into every holder's weights


class HeteroPipelineEngine(PipelineEngine):
    """DeepSpeed's PipelineEngine for one replica of a heterogeneous plan (see the module docstring).
    Instances are created by ``deepspeed.initialize`` as ``PipelineEngine`` and re-classed."""

    _INSTRUCTION_MAP = overrides.instruction_map({schedule.ReduceGrads: _hetero_reduce_grads,
                                                  schedule.OptimizerStep: _hetero_optimizer_step})
    elastor_runtime: HeteroRuntime
    elastor_clip: float = 0.0
    elastor_grad_norm: Optional[float] = None
    elastor_probes: tuple = ()  # callables run when the last backward of an iteration is done

    def _exec_reduce_grads(self) -> None:
        _hetero_reduce_grads(self)

    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        _hetero_optimizer_step(self, lr_kwargs)

    @property
    def elastor_zero(self) -> Optional[HeteroZero1]:
        """The ZeRO-1 shares of this rank (None under ZeRO-0); read by the checkpoint state mapping."""
        rt = getattr(self, "elastor_runtime", None)
        return None if rt is None else rt.zero

    def elastor_weights_loaded(self) -> None:
        """After a load: the ZeRO-1 shares (fp32 copies of weights) follow the loaded weights."""
        rt = self.elastor_runtime
        if rt.zero is not None:
            rt.zero.refresh_from_params(rt.data_of)

    def _aggregate_total_loss(self):
        rt = self.elastor_runtime
        mine = None
        if self.is_last_stage() and rt.pos.tp_rank == 0:
            mine = float(self.total_loss.detach()) / self.gradient_accumulation_steps()
        glob = global_mean(mine, rt.weight)
        self.dp_group_loss = torch.tensor(glob)
        return torch.tensor(glob, device=self.device)

    def eval_batch(self, *args: Any, **kwargs: Any):
        raise ConfigError("eval_batch is not supported under heterogeneous plans yet (its loss broadcast assumes "
                          "equal TP widths); evaluate under a uniform plan")

    def hetero_setup(self, rt: HeteroRuntime, clip: float, global_batch: int) -> None:
        import deepspeed.comm as dist
        self.elastor_runtime = rt
        self.elastor_clip = clip
        self.elastor_global_batch = global_batch
        reducer = rt.build_reducer(self)
        self._sync_initial_weights(rt)
        if rt.zero_stage >= 1:
            rt.build_zero(self.optimizer)
        if dist.get_rank() == 0:
            log.info("heterogeneous plan %s: %d split all-reduce groups", rt.layout.describe(),
                     len(reduce_groups_of(rt)))
        log.debug("rank %d: split all-reduce sends %d bytes per step", rt.rank, reducer.bytes_sent)
        rt.drop_module_world_group(self.module)

    def _sync_initial_weights(self, rt: HeteroRuntime) -> None:
        """Replicas build their stages from their own RNG streams: make every copy of every weight
        equal to its owner's (lowest holder's) copy, so all replicas start from one model."""
        from ...runtime.groups import Cell
        red = rt.reducer
        owner_only = SplitAllReduce.__new__(SplitAllReduce)
        owner_only.cells = [Cell(c.name, c.region, c.local, c.holders, c.owner, c.owner, c.cross_replica)
                            for c in red.cells]
        owner_only.by_group = {g: [Cell(c.name, c.region, c.local, c.holders, c.owner, c.owner, c.cross_replica)
                                   for c in cs] for g, cs in red.by_group.items()}
        owner_only.groups = red.groups
        with torch.no_grad():
            owner_only.reduce(rt.data_of, 1.0)

    def train_batch(self, *args: Any, **kwargs: Any):
        loss = super().train_batch(*args, **kwargs)
        self.global_samples = int(self.global_steps) * self.elastor_global_batch
        return loss


def reduce_groups_of(rt: HeteroRuntime) -> list:
    return sorted(rt.reducer.by_group) if rt.reducer is not None else []
