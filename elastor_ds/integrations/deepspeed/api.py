"""``initialize``: a drop-in for ``deepspeed.initialize`` that adds elastor checkpointing.

1. Split the ``"elastor"`` section off the DeepSpeed config and validate it (:mod:`.config`);
   check the DeepSpeed version; on CPU avoid just-in-time op builds. A rank that fails here (or in
   step 4's checks) makes every rank raise a typed error naming it (one agreement over the world).
2. Call ``deepspeed.initialize`` with the rest of the config, unchanged otherwise.
3. Give the returned engine elastor behaviour: its class becomes a subclass of its own class
   (``ElastorPipelineEngine`` for a ``PipelineEngine``) whose ``train_batch``/``step`` save when the
   policy says so and whose ``save_checkpoint`` also writes an elastor checkpoint. The engine is
   still an instance of the DeepSpeed class; ``engine.elastor`` is its :class:`~elastor_ds.checkpoint.session.CheckpointSession`.
4. Check the plan (if any) against the module's stage boundaries; with ``"load"`` set, resume.

Returns what ``deepspeed.initialize`` returns.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

from ...errors import ConfigError
from .compat import bound_collective_timeouts, check_version, disable_cpu_jit_ops, harden_optimizer_config
from . import overrides
from .config import ElastorConfig, split_ds_config
from ...checkpoint.session import CheckpointSession
from .runtime import ElastorCheckpointer, engine_layout

log = logging.getLogger(__name__)


class ElastorEngineMixin:
    """Hooks layered over a DeepSpeed engine class (kept as small as possible)."""

    elastor: Optional[CheckpointSession]
    elastor_config: ElastorConfig

    def train_batch(self, *args: Any, **kwargs: Any):  # PipelineEngine
        loss = super().train_batch(*args, **kwargs)  # type: ignore[misc]
        if self.elastor is not None:
            self.elastor.maybe_save()
        return loss

    def step(self, *args: Any, **kwargs: Any):  # DeepSpeedEngine (non-pipeline)
        # an optimizer step happened iff global_steps moved: is_gradient_accumulation_boundary() asked
        # afterwards answers for the *next* micro-step (step() has advanced micro_steps already)
        before = int(self.global_steps)  # type: ignore[attr-defined]
        out = super().step(*args, **kwargs)  # type: ignore[misc]
        if self.elastor is not None and int(self.global_steps) != before:  # type: ignore[attr-defined]
            self.elastor.maybe_save()
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DS signature
                        exclude_frozen_parameters=False):
        ok = True
        ec = self.elastor
        rt = getattr(self, "elastor_runtime", None)
        if ec is not None and ec.cfg.on_save_checkpoint:
            # the client state is checked (on every rank, agreed) before anything is written: a value JSON
            # cannot hold is refused with DeepSpeed's files unwritten and the session's client state as it was
            # (was: DeepSpeed's files written, then the refusal, and every later periodic save refused too)
            _set_client_state(ec, client_state)
        if rt is not None:   # a heterogeneous plan: DeepSpeed's own files cannot hold it (see _hetero_save)
            return _hetero_save(self, save_dir, client_state)
        if ec is None or ec.cfg.deepspeed_native:
            if ec is not None and save_latest and _same_dir(save_dir, ec.cfg.dir):
                # one folder, two `latest` files: DeepSpeed's tag name would replace elastor's step
                # pointer (or the other way round, depending on timing), and a resume then refuses it
                save_latest = False
                if not getattr(self, "_elastor_warned_latest", False):
                    self._elastor_warned_latest = True
                    if int(getattr(self, "global_rank", 0)) == 0:   # once per job, not once per rank
                        log.warning("engine.save_checkpoint(%s): this is also the elastor checkpoint directory, "
                                    "whose 'latest' names elastor's newest step; DeepSpeed's own files are written "
                                    "there without DeepSpeed's 'latest' (load them with engine.load_checkpoint(dir, "
                                    "tag='global_step<N>')), or give save_checkpoint a directory of its own", save_dir)
            ok = super().save_checkpoint(save_dir, tag=tag, client_state=client_state,  # type: ignore[misc]
                                         save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
        if ec is not None and ec.cfg.on_save_checkpoint:
            ec.save()
        return ok

    def load_checkpoint(self, load_dir, tag=None, *args: Any, **kwargs: Any):
        """DeepSpeed's own loader, for DeepSpeed's own files. Without ``tag``, on a folder whose
        ``latest`` is elastor's (it names a ``step_<N>`` directory), DeepSpeed would fail deep
        inside with a bare AssertionError: say what to do instead. Under a heterogeneous plan there
        are no DeepSpeed files to load (:func:`_hetero_save`): refused, naming elastor's loader."""
        rt = getattr(self, "elastor_runtime", None)
        if rt is not None:
            raise ConfigError(f"engine.load_checkpoint({load_dir}) under heterogeneous plan {rt.layout.describe()}: "
                              f"DeepSpeed's own checkpoint cannot hold such a plan and none is written; elastor "
                              f"restores at initialize (\"elastor\": {{\"checkpoint\": {{\"load\": \"latest\"}}}}) "
                              f"or with engine.elastor.load({load_dir!r})")
        if tag is None and self.elastor is not None:
            from ...checkpoint import commit as commit_mod
            try:
                name = commit_mod.read_latest(os.path.abspath(load_dir))
            except Exception:  # noqa: BLE001 - not ours to judge: DeepSpeed reads it
                name = None
            if name is not None and commit_mod.step_of(os.path.basename(name)) is not None:
                raise ConfigError(f"engine.load_checkpoint({load_dir}): its 'latest' names the elastor step "
                                  f"{os.path.basename(name)}, "
                                  f"not a DeepSpeed tag. elastor restores at initialize (\"elastor\": "
                                  f"{{\"checkpoint\": {{\"load\": \"latest\"}}}}) or with engine.elastor.load("
                                  f"{load_dir!r}); for DeepSpeed's own files pass tag='global_step<N>'")
        return super().load_checkpoint(load_dir, tag, *args, **kwargs)  # type: ignore[misc]

    def elastor_client_state(self) -> dict[str, Any]:
        """The client state of the checkpoint resumed from (empty when none)."""
        return dict(self.elastor.state.client_state) if self.elastor is not None else {}


def _hetero_save(engine: Any, save_dir: Any, client_state: Any) -> bool:
    """``engine.save_checkpoint`` under a heterogeneous plan: elastor's checkpoint only.

    DeepSpeed names its files by (stage, TP rank) within a grid with one data-parallel axis
    (``mp_rank_00_model_states.pt``, ``layer_NN-model_states.pt``): the replicas of a heterogeneous
    plan would all write the same names, the last writer silently winning, and DeepSpeed's loader
    then fails. So DeepSpeed's native write is skipped (with a one-time warning when
    ``deepspeed_native`` was left at its default; an explicit ``true`` is refused at initialize), and
    elastor's checkpoint, which holds every replica's state, is written."""
    ec = engine.elastor
    rt = engine.elastor_runtime
    plan = rt.layout.describe()
    if ec is None:
        raise ConfigError(f"engine.save_checkpoint({save_dir}) under heterogeneous plan {plan}: DeepSpeed's own "
                          f"checkpoint files cannot hold such a plan (every replica writes the same file names); add "
                          f"\"elastor\": {{\"checkpoint\": {{\"dir\": \"<dir>\"}}}} to the config and "
                          f"save_checkpoint writes elastor's checkpoint")
    if not ec.cfg.on_save_checkpoint:
        raise ConfigError(f"engine.save_checkpoint({save_dir}) under heterogeneous plan {plan} writes nothing with "
                          f"\"on_save_checkpoint\": false (DeepSpeed's own files cannot hold such a plan): set "
                          f"elastor.checkpoint.on_save_checkpoint to true, or save with engine.elastor.save()")
    if ec.cfg.deepspeed_native and not getattr(engine, "_elastor_warned_native", False):
        engine._elastor_warned_native = True
        if rt.rank == 0:
            log.warning("engine.save_checkpoint(%s) under heterogeneous plan %s: DeepSpeed's own checkpoint files are "
                        "not written (every replica would write the same file names, the last one winning); "
                        "elastor's checkpoint in %s holds the state (resume with \"load\": \"latest\"). Set "
                        "\"deepspeed_native\": false in elastor.checkpoint to silence this", save_dir, plan, ec.cfg.dir)
    ec.save()
    return True


def _set_client_state(ec: Any, client_state: Any) -> None:
    """``save_checkpoint``'s ``client_state`` as the session's, once its JSON form is made on every
    rank (:func:`~elastor_ds.comm.collectives.agree_world`: a rank whose value JSON cannot hold makes
    every rank raise, naming it, instead of the others waiting in the save's collectives). On a
    refusal nothing changes: the next periodic save carries the previous client state."""
    from ...comm.collectives import agree_world
    from .runtime import _client_json

    def made() -> tuple:
        try:
            cs = dict(client_state or {})
        except (TypeError, ValueError):
            raise ConfigError(f"engine.save_checkpoint: client_state must be a dict (as DeepSpeed's), got "
                              f"{type(client_state).__name__}") from None
        try:
            return cs, _client_json(cs)
        except ConfigError as e:
            raise ConfigError(f"engine.save_checkpoint: {e}; nothing was written. Or set "
                              f"elastor.checkpoint.on_save_checkpoint to false: save_checkpoint then writes "
                              f"DeepSpeed's files only, which pickle it") from None

    cs, js = agree_world(made, "engine.save_checkpoint (its client_state)")
    ec.state.client_state = cs
    ec.state._client_json = (cs, js)


def _native_requested(config: Any) -> bool:
    """Whether the elastor section sets ``checkpoint.deepspeed_native`` to true explicitly (the
    config was validated by split_ds_config already)."""
    if isinstance(config, (str, os.PathLike)):
        from .config import read_ds_config_file
        config = read_ds_config_file(config)
    ck = ((config or {}).get("elastor") or {}).get("checkpoint") or {}
    return ck.get("deepspeed_native") is True


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, TypeError, ValueError):
        return False


_CLASSES: dict[type, type] = {}


def _elastor_class(cls: type) -> type:
    if issubclass(cls, ElastorEngineMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Elastor{cls.__name__}", (ElastorEngineMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _check_plan(engine: Any, ecfg: ElastorConfig) -> None:
    if ecfg.plan is None:
        return
    layout = engine_layout(engine)
    rt = getattr(engine.module, "_elastor_runtime", None)
    if rt is not None:
        if ecfg.plan != "auto":
            from .pipe import layout_from_plan
            plan = layout_from_plan(ecfg.plan, layout.num_layers)
            if plan.fingerprint() != rt.layout.fingerprint():
                raise ConfigError(f"elastor.plan {plan.describe()} differs from the plan the PipelineModule was built "
                                  f"with ({rt.layout.describe()}): pass the same plan to both")
        return
    if ecfg.plan == "auto":   # the planner never ran: say so where the user looks (it was INFO, unseen)
        if getattr(engine.module, "_elastor_plan", None) is not None:
            return   # built as documented, PipelineModule(layers, plan=resolve_plan(config, ...)): it did run
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            log.warning("elastor.plan='auto' has no effect here: the module was not built from the plan, so the "
                        "launch's layout %s (boundaries %s) runs, not the planner's; build it with "
                        "elastor_ds.deepspeed.PipelineModule(layers, plan=elastor_ds.deepspeed.resolve_plan(config, "
                        "num_layers=len(layers))) to train under the plan",
                        layout.describe(), layout.boundaries())
        return
    from .pipe import grid_boundaries, layout_from_plan
    plan = layout_from_plan(ecfg.plan, layout.num_layers)
    import deepspeed.comm as ds_dist
    from .hetero import needs_hetero
    if needs_hetero(plan):
        raise ConfigError(f"elastor.plan {plan.describe()} is heterogeneous but the PipelineModule was built without "
                          f"it: build it with elastor_ds.deepspeed.PipelineModule(layers, plan=<the same plan>) so "
                          f"each rank builds its own replica's stage")
    want = grid_boundaries(plan, len(layout.replicas[0].stages), layout.world_size, ds_dist.get_rank())
    if want != layout.boundaries():
        raise ConfigError(f"elastor.plan gives stage boundaries {want} but the PipelineModule was partitioned as "
                          f"{layout.boundaries()}: build it with elastor_ds.deepspeed.PipelineModule(layers, "
                          f"num_stages={len(want) - 1}, plan=<the same plan>)")


def initialize(*args: Any, config: Any = None, config_params: Any = None, **kwargs: Any):
    """Same arguments and return values as ``deepspeed.initialize``; reads the ``"elastor"`` section.

    A set-up step of this rank that fails before the next collective (its config or ``"elastor"``
    section unreadable or invalid, a check of the engine) is agreed on over the world
    (:func:`~elastor_ds.comm.collectives.agree_world`): where other ranks succeeded, every rank raises
    a typed error naming the failing ranks and their errors (a
    :class:`~elastor_ds.errors.RanksFailedError` that is also the failures' common error class,
    e.g. ConfigError), instead of the others waiting in their next collective until the process
    group's timeout. The distributed backend is therefore initialised first (as
    ``deepspeed.initialize`` would, with its ``distributed_port`` and ``dist_init_required``)."""
    check_version()
    import deepspeed

    from ...comm.collectives import agree_world
    _init_world(kwargs)
    ds_config, ecfg, rt, clip, args, kwargs = agree_world(
        lambda: _prepare(args, config, config_params, kwargs), "eds.initialize (reading the config)")
    _agree_settings(ecfg)
    engine, optimizer, loader, sched = deepspeed.initialize(*args, config=ds_config, **kwargs)
    if rt is not None:
        from .hetero import HeteroPipelineEngine
        overrides.reclass(engine, _elastor_class(HeteroPipelineEngine))
        # collective; a rank's local failure in it travels in its gathers (hetero._gathered)
        engine.hetero_setup(rt, clip, int(ds_config["train_micro_batch_size_per_gpu"]) * rt.total_micro_batches)
    else:
        overrides.reclass(engine, _elastor_class(type(engine)))
    engine.elastor_config = ecfg
    engine.elastor = None

    def check_engine() -> None:
        _check_plan(engine, ecfg)
        if ecfg.checkpoint is not None:
            from .state import check_optimizer
            check_optimizer(engine)   # an unsupported wrapper is refused now, not at the first save
    agree_world(check_engine, "eds.initialize (checking the engine)")
    if ecfg.checkpoint is not None:
        engine.elastor = ElastorCheckpointer(engine, ecfg.checkpoint, ecfg.memory_snapshot)
        if ecfg.checkpoint.load != "none":
            try:
                engine.elastor.load()
            except BaseException:
                engine.elastor.discard_if_unused()   # a rejected load leaves no empty folders of ours
                raise
    return engine, optimizer, loader, sched


def _agreed_settings(ecfg: ElastorConfig) -> dict:
    """The settings of the ``"elastor"`` section every rank must share, flat (``checkpoint.dir`` as an
    absolute path); not the node's own: ``memory_snapshot.dir`` and ``max_bytes``. The plan is
    agreed where the module is built (:func:`.hetero.agreed_plan`)."""
    import dataclasses
    out: dict = {}
    for name in ("checkpoint", "memory_snapshot"):
        part = getattr(ecfg, name)
        out[name] = "none" if part is None else "set"
        if part is None:
            continue
        for k, v in dataclasses.asdict(part).items():
            if name == "memory_snapshot" and k in ("dir", "max_bytes"):
                continue
            if name == "checkpoint" and k == "dir":
                v = os.path.abspath(v)
            out[f"{name}.{k}"] = v.value if hasattr(v, "value") else v
    return out


def _agree_settings(ecfg: ElastorConfig) -> None:
    """Collective over the world: every rank holds the same ``"elastor"`` checkpoint settings
    (:func:`_agreed_settings`). A checkpoint is one folder every rank writes into, and a save is
    collective: a ``checkpoint.dir`` that differs by rank (a config made per node, a relative path
    under different working directories) failed only at the first save, as another writer's
    interference; a different ``interval_steps`` on one node, or a rank without the section, left the
    others waiting in a save or in the checkpoint set-up until the timeout. One all-gather of a 60-bit
    hash (no pickling); on a difference, each rank's settings follow as JSON and every rank raises the
    same ConfigError naming the keys, the ranks and their values."""
    import hashlib
    import json

    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from ...comm.collectives import world_outcome
    from ...comm.groups import all_gather_world_bytes
    mine = json.dumps(_agreed_settings(ecfg), sort_keys=True, ensure_ascii=True)
    key = int(hashlib.sha256(mine.encode()).hexdigest()[:15], 16)
    keys = [row[0] for row in world_outcome(None, "eds.initialize (comparing the \"elastor\" sections)", [key])]
    if len(set(keys)) == 1:
        return
    rows = []
    for b in all_gather_world_bytes(mine.encode(), 16384):
        try:
            rows.append(json.loads(b.decode()))
        except ValueError:   # cut at the limit: compared as unreadable
            rows.append({})
    names = sorted({k for r in rows for k in r})
    # a section some ranks have and others lack: that is the difference, not each of its keys
    split = {k for k in ("checkpoint", "memory_snapshot") if len({r.get(k) for r in rows}) > 1}
    parts = []
    for k in names:
        if k.split(".")[0] in split and "." in k:
            continue
        vals = [r.get(k, "?") for r in rows]
        if len({json.dumps(v) for v in vals}) == 1:
            continue
        by: dict[str, list[int]] = {}
        for rank, v in enumerate(vals):
            by.setdefault(repr(v), []).append(rank)
        def who(rs: list[int]) -> str:
            return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:8]))}{' ...' if len(rs) > 8 else ''}"
        shown = "; ".join(f"{who(rs)}: {v}" for v, rs in sorted(by.items(), key=lambda kv: kv[1])[:4])
        parts.append(f"elastor.{k} ({shown})")
    raise ConfigError(f"the \"elastor\" section differs between ranks: {', '.join(parts[:6])}"
                      f"{' ...' if len(parts) > 6 else ''}: give every rank the same section (one config for every "
                      f"node); checkpoint.dir an absolute path on storage every node shares (one checkpoint is one "
                      f"folder all ranks write into)")


def _init_world(kwargs: dict) -> None:
    """The distributed backend, initialised now where ``deepspeed.initialize`` would initialise it
    (it then finds it ready): the set-up agreements of :func:`initialize` run over it."""
    import torch.distributed as dist
    if not dist.is_available() or dist.is_initialized() or kwargs.get("dist_init_required") is False:
        return
    from deepspeed.accelerator import get_accelerator
    extra = {"distributed_port": kwargs["distributed_port"]} if "distributed_port" in kwargs else {}
    init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                     dist_init_required=kwargs.get("dist_init_required"), **extra)


def _prepare(args: tuple, config: Any, config_params: Any, kwargs: dict) -> tuple:
    """This rank's local set-up before ``deepspeed.initialize``: the config (a dict or a JSON path,
    from ``config``, ``config_params`` or ``args.deepspeed_config``) split into DeepSpeed's part and
    the validated ``"elastor"`` section; for a heterogeneous plan, the replica's DeepSpeed config and
    the p2p routing. Returns (ds_config, ElastorConfig, runtime or None, clip, args, kwargs) with
    ``args``/``kwargs`` as ``deepspeed.initialize`` gets them. No collective."""
    kwargs = dict(kwargs)
    ds_args = kwargs.get("args", args[0] if args else None)
    if config is None:
        config = config_params
    if config is None and ds_args is not None and getattr(ds_args, "deepspeed_config", None):
        config = ds_args.deepspeed_config
        # DeepSpeed refuses a config given twice: its copy of args goes without one (the caller's
        # args stay as they were: a second initialize with them reads the config again)
        ds_args = copy.copy(ds_args)
        ds_args.deepspeed_config = None
        if "args" in kwargs:
            kwargs["args"] = ds_args
        else:
            args = (ds_args, *args[1:])
    if config is None:
        raise ConfigError("no DeepSpeed config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    ds_config, ecfg = split_ds_config(config)
    ds_config = harden_optimizer_config(ds_config)
    disable_cpu_jit_ops()
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    rt = getattr(model, "_elastor_runtime", None)
    clip = 0.0
    if rt is not None:  # a heterogeneous plan: this rank's replica runs its own PipelineEngine
        if ecfg.checkpoint is not None and ecfg.checkpoint.deepspeed_native and _native_requested(config):
            raise ConfigError(f"elastor.checkpoint.deepspeed_native: true with heterogeneous plan "
                              f"{rt.layout.describe()}: DeepSpeed's own checkpoint files cannot hold such a plan "
                              f"(every replica would write the same file names); set \"deepspeed_native\": false "
                              f"(elastor's checkpoint holds the state) or use a uniform plan")
        from .hetero import install_p2p, prepare_config
        ds_config, clip = prepare_config(ds_config, rt)
        install_p2p()  # before the engine: its constructor already sends between stages
    return ds_config, ecfg, rt, clip, args, kwargs


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` without the CPU just-in-time op build. Under ``elastor run``
    every collective is bounded by the launch's ``ELASTOR_COLLECTIVE_TIMEOUT_S`` (the world group's
    ``timeout`` unless the caller gives one, and the default of every group created later:
    :func:`~.compat.bound_collective_timeouts`)."""
    check_version()
    disable_cpu_jit_ops()
    from ...elastic.protocol import collective_timeout_s
    bound = collective_timeout_s()
    if bound is not None:
        kwargs.setdefault("timeout", bound_collective_timeouts(bound))
    import deepspeed
    deepspeed.init_distributed(*args, **kwargs)
