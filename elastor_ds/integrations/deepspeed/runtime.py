"""Elastor checkpointing of a live DeepSpeed engine: the engine's side of a checkpoint session.

:class:`DeepSpeedState` is the :class:`~elastor_ds.checkpoint.session.TrainerState` of one DeepSpeed
engine; :func:`ElastorCheckpointer` builds the job's :class:`~elastor_ds.checkpoint.session.CheckpointSession`
over it (save policy, storage engine, memory tier, device fence and restore chain all live there).

What a save carries (:meth:`DeepSpeedState.collect`): module weights, fp32 master + optimizer
moments as per-parameter regions (:mod:`.state`), and JSON extra (engine counters, LR scheduler,
optimizer scalars, client state), per-rank RNG. A load creates missing optimizer state tensors (a
fresh torch optimizer has none), fills module weights, master weights and optimizer state in place
through region overlap, whatever the saved PP/DP degree, stage boundaries or ZeRO stage, then
restores counters, scheduler, optimizer scalars and client state; RNG only under the same layout.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ...checkpoint import LoadResult, Manifest
from ...checkpoint.engine import RankExtra
from ...checkpoint.session import Collected, CheckpointSession, check_roots_apart
from ...checkpoint.settings import CheckpointConfig, MemorySnapshotConfig
from ...checkpoint.state import capture_rng_state, like, restore_rng_state, tensors_to_json, to_jsonable, typed_to_json
from ...errors import ConfigError, TensorMismatchError
from ...layout import Layout
from . import overrides, state as st

log = logging.getLogger(__name__)

__all__ = ["DeepSpeedState", "ElastorCheckpointer", "engine_layout", "check_roots_apart", "FORMAT"]

FORMAT = "elastor_ds.deepspeed/1"


def engine_layout(engine: Any) -> Layout:
    """The TP x PP x DP grid the engine runs (TP = the topology's "model" axis), with its actual
    stage boundaries over the pipeline's layer list (a heterogeneous plan's layout as is)."""
    module = engine.module
    rt = getattr(module, "_elastor_runtime", None)
    if rt is not None:
        return rt.layout
    parts = getattr(module, "parts", None)
    num_layers = len(overrides.layer_specs(module)) or 1
    pp = int(getattr(engine, "num_stages", 1) or 1)
    dp = int(engine.dp_world_size)
    gas = int(engine.gradient_accumulation_steps())
    grid = getattr(engine, "grid", None)
    tp = int(grid.get_slice_parallel_world_size()) if grid is not None else 1
    if parts is None or pp == 1:
        parts = [0, num_layers]
    return Layout.uniform(tp, pp, dp, num_layers, boundaries=list(parts), micro_batches=gas)



def _with_every_stage_groups(extra: dict, everyone: list) -> dict:
    """Rank 0's ``extra`` with every pipeline stage's param groups (:func:`.state.merge_scalars`;
    ``everyone``: each rank's groups, as JSON)."""
    return {**extra, "optimizer": st.merge_scalars(extra["optimizer"], everyone)}

class DeepSpeedState:
    """The :class:`~elastor_ds.checkpoint.session.TrainerState` of one DeepSpeed engine."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.client_state: dict[str, Any] = {}
        self._client_json: Optional[tuple[Any, Any]] = None   # (the client_state dict, its JSON form)
        self._layout = engine_layout(engine)
        self._shards_cache: Optional[tuple[Any, list, list]] = None   # (state_fingerprint, shards, optimizer groups)
        # the session's main-thread group (set by ElastorCheckpointer): pipeline stages hold param
        # groups of their own, gathered into every save and agreed on at restore
        self.comm: Any = None
        self._stages_differ = any(len(r.stages) > 1 for r in self._layout.replicas)

    def step(self) -> int:
        return int(self.engine.global_steps)

    def layout(self) -> Layout:
        return self._layout

    def fence_optimizer(self) -> Any:
        """The base optimizer (ZeRO's inner one): its pre-step hook orders a snapshot's device
        copies and ends a live write's reads of the live tensors; None when there is none."""
        try:
            return st.base_optimizer(self.engine)
        except ConfigError:
            return None

    def live_write_hazard(self) -> Optional[str]:
        """What makes live writes unsafe for this model, or None: a module whose forward pass changes a
        saved buffer in place (batch norm's running statistics), before the optimizer step's fence;
        on CPU torch does not bump those buffers' version counters, so the guard would not see it.
        The optimizer is not inspected: torch's fused optimizers (``fused=True``) do not bump the
        counters either, but they write in ``step()``, after the session's fence (its step pre-hook),
        which is the contract; only a caller who skips the fence would commit their step unseen."""
        for name, m in self.engine.module.named_modules():
            # torch's batch and instance norms (and look-alikes) that track running statistics
            if getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None:
                return (f"module {name or '(root)'!r} ({type(m).__name__}) updates its running statistics in the "
                        f"forward pass, before the optimizer step's fence")
        return None

    def snapshot_bytes(self, comm: Any) -> int:
        """Bytes this rank writes per snapshot, estimated before the optimizer has state: the save
        plan of the model's shards (deduplicated like a real save) scaled by the optimizer's fp32
        per-element state (Adam-like: 2 moments; else 1) and the fp32 master when it is separate.
        Collective (one all-gather of shard metadata)."""
        from ...checkpoint.planning.save_plan import ShardMeta, metas_from_text, metas_to_text, plan_save
        from ...checkpoint.shards import dtype_name
        eng = self.engine
        shards = st.model_shards(eng)
        metas = [ShardMeta(sh.name, sh.shape, dtype_name(sh.tensor.dtype), sh.region) for sh in shards]
        gathered = comm.all_gather_object(metas_to_text(metas))
        plan = plan_save([metas_from_text(g, r) for r, g in enumerate(gathered)])
        mine = plan.items[comm.rank]
        model_bytes = sum(it.nbytes for it in mine)
        itemsize = max(1, shards[0].tensor.element_size()) if shards else 4
        opt = type(st.base_optimizer(eng)).__name__.lower()
        per_elem = (2 if ("adam" in opt or "lamb" in opt) else 1) + (0 if st.master_is_weight(eng) else 1)
        return model_bytes + model_bytes * per_elem * 4 // itemsize

    def collect(self) -> Collected:
        """The shards and JSON of a save (storage checkpoint or memory snapshot). The shard list is
        rebuilt only when a tensor behind it changed (:func:`.state.state_fingerprint`): building it
        walks the module and the optimizer's layout, milliseconds per save."""
        eng = self.engine
        key = st.state_fingerprint(eng)
        if self._shards_cache is not None and self._shards_cache[0] == key:
            shards, groups = self._shards_cache[1], self._shards_cache[2]
        else:
            shards = st.model_shards(eng) + st.optimizer_shards(eng, include_master=not st.master_is_weight(eng))
            groups = st.optimizer_groups(eng)
            self._shards_cache = (key, shards, groups)
        sched = eng.lr_scheduler
        opt_groups = st.optimizer_scalars(eng, groups)
        # every stage's groups (by their parameters' names), so a resume under any layout finds each
        # group's hyper-parameters, not rank 0's by index: gathered by the writer, off this thread
        rank_extra = (RankExtra(opt_groups, _with_every_stage_groups)
                      if self._stages_differ and self.comm is not None and self.comm.world_size > 1 else None)
        extra = {
            "format": FORMAT,
            "global_steps": int(eng.global_steps),
            "global_samples": int(eng.global_samples),
            "skipped_steps": int(getattr(eng, "skipped_steps", 0)),
            "train_batch_size": _global_batch(eng),
            "zero_stage": int(eng.zero_optimization_stage()),
            "optimizer": opt_groups,
            "loss_scaler": st.loss_scaler_state(eng),
            "lr_scheduler": _jsonable(typed_to_json(sched.state_dict()), "lr_scheduler") if sched is not None else None,
            "client_state": self._client_state_json(),
        }
        import deepspeed
        model = {"framework": "deepspeed", "deepspeed_version": deepspeed.__version__,
                 "module_class": type(eng.module).__name__, "num_layers": self._layout.num_layers}
        geo_model = getattr(getattr(eng.module, "elastor_geometry", None), "model", None)
        if isinstance(geo_model, dict):  # e.g. a megatron-core GPT description: exporters can use it
            model = {**geo_model, **{k: v for k, v in model.items() if k != "num_layers"},
                     "pipeline_layers": self._layout.num_layers}
        return Collected(shards=shards, extra=extra, rank_state={"rng": capture_rng_state()}, model=model,
                         rank_extra=rank_extra)

    def _client_state_json(self) -> Any:
        """The client state's JSON, made once per ``save_checkpoint(client_state=...)`` (every
        snapshot carries it; a CUDA tensor in it would otherwise be copied to the host each time)."""
        if self._client_json is None or self._client_json[0] is not self.client_state:
            self._client_json = (self.client_state, _client_json(self.client_state))
        return self._client_json[1]

    def shards_for(self, man: Manifest) -> list:
        """This engine's shards for the checkpoint actually loaded (the engine reads its manifest)."""
        eng = self.engine
        names = set(man.tensors)
        keys = st.state_keys_in(names)
        shards = self._fp32_weights_for_half(man, st.model_shards(eng))
        old = [sh.name for sh in shards if sh.name not in names and not sh.tensor.is_floating_point()]
        if old and names:   # written before integer buffers were saved: they keep the module's values
            log.warning("checkpoint %s has no integer buffers (written by an older elastor_ds): %s keep the "
                        "module's values", man.step, ", ".join(old[:4]) + (" ..." if len(old) > 4 else ""))
            shards = [sh for sh in shards if sh.name not in old]
        if any(st.is_optim(n) for n in names) or not names:
            for sh in st.optimizer_shards(eng, state_keys=keys):
                src = st.master_from_weight_name(sh.name)
                if src is not None and sh.name not in names and src in names:
                    sh.name = src  # fp32 checkpoints keep one copy: the master comes from the weights
                shards.append(sh)
        else:
            log.warning("checkpoint %s has no optimizer state: the optimizer starts fresh", man.step)
        return shards

    def _fp32_weights_for_half(self, man: Manifest, shards: list) -> list:
        """A checkpoint with fp32 weights for this bf16/fp16 model (a DeepSpeed universal export
        imported back: that format keeps every tensor in fp32): those weights are read into fp32
        buffers and cast into the parameters by :meth:`restore`, as DeepSpeed's own universal load
        does; any other dtype mismatch is the reader's to refuse."""
        self._casts: list = []
        for sh in shards:
            e = man.tensors.get(sh.name)
            if e is not None and e.dtype == "float32" and sh.tensor.dtype in (torch.bfloat16, torch.float16):
                tmp = torch.empty(sh.tensor.shape, dtype=torch.float32, device=sh.tensor.device)
                self._casts.append((tmp, sh.tensor))
                sh.tensor = tmp
        if self._casts and self.comm is not None and self.comm.rank == 0:
            log.info("checkpoint %s holds fp32 weights for this %s model: cast on load", man.step,
                     str(self._casts[0][1].dtype).replace("torch.", ""))
        return shards

    def restore(self, res: LoadResult, same_layout: bool) -> None:
        eng = self.engine
        for tmp, param in getattr(self, "_casts", ()):   # fp32 weights read for bf16/fp16 parameters
            with torch.no_grad():
                param.copy_(tmp)
        self._casts = []
        ex = res.extra
        if ex.get("format") not in (None, FORMAT):
            raise ConfigError(f"checkpoint {res.step_dir} has format {ex.get('format')!r}; this reader knows {FORMAT}")
        eng.global_steps = int(ex.get("global_steps", res.step))
        eng.global_samples = int(ex.get("global_samples", 0))
        if "skipped_steps" in ex:
            eng.skipped_steps = int(ex["skipped_steps"])
        if ex.get("optimizer"):
            self._restore_groups(ex["optimizer"], res.step_dir)
        if ex.get("loss_scaler"):   # absent from checkpoints of older versions: the scaler starts afresh
            st.restore_loss_scaler(eng, ex["loss_scaler"])
        if ex.get("lr_scheduler") is not None:
            if eng.lr_scheduler is None:
                log.warning("checkpoint has LR scheduler state but the engine has no scheduler: ignored")
            else:
                # like(): a checkpoint written before typed_to_json holds {"5": 1} for MultiStepLR's {5: 1}
                eng.lr_scheduler.load_state_dict(like(ex["lr_scheduler"], eng.lr_scheduler.state_dict()))
        self.client_state = dict(ex.get("client_state") or {})   # tensors and inf restored by the engine's load
        tbs = ex.get("train_batch_size")
        if tbs is not None and int(tbs) != _global_batch(eng):
            log.warning("global batch changed from %s to %s samples: the loss curve will not continue exactly",
                        tbs, _global_batch(eng))
        if same_layout and res.rank_state and "rng" in res.rank_state:
            restore_rng_state(res.rank_state["rng"])
        hook = getattr(eng, "elastor_weights_loaded", None)
        if hook is not None:  # e.g. the heterogeneous runtime's ZeRO-1 shares follow the loaded weights
            hook()


    def _restore_groups(self, saved: list, step_dir: str) -> None:
        """The saved param groups' hyper-parameters and scalars, each group of this rank found by its
        parameters (:func:`.state.restore_optimizer_scalars`); a group no saved group holds raises
        :class:`TensorMismatchError` on every rank (agreed: one rank alone would leave the others
        waiting in their next collective)."""
        problem = st.restore_optimizer_scalars(self.engine, saved)
        if not all(isinstance(s, dict) and "params" in s for s in saved):
            return   # an older checkpoint: restored by index, nothing to agree on
        rows = self.comm.all_gather_object(problem) if self.comm is not None else [problem]
        bad = [(r, p) for r, p in enumerate(rows) if p]
        if bad:
            raise TensorMismatchError(f"checkpoint {step_dir} has no optimizer param group holding "
                                      + "; ".join(f"rank {r}'s {p}" for r, p in bad[:4])
                                      + (" ..." if len(bad) > 4 else "")
                                      + ": was it saved from another model, or were the groups built differently?")


def _global_batch(eng: Any) -> int:
    """Samples per optimizer step over the whole job. A heterogeneous plan's engine is configured for
    its own replica (``train_batch_size()`` is that replica's share); it knows the job's total."""
    total = getattr(eng, "elastor_global_batch", None)
    return int(total) if total else int(eng.train_batch_size())


def ElastorCheckpointer(engine: Any, cfg: CheckpointConfig, memory: Optional[MemorySnapshotConfig] = None
                        ) -> CheckpointSession:
    """Collective: the job's checkpoint session over a DeepSpeed engine (``engine.elastor``)."""
    state = DeepSpeedState(engine)
    session = CheckpointSession(state, cfg, memory, dir_setting="elastor.checkpoint.dir")
    state.comm = session.policy_comm
    return session


def _client_json(state: dict[str, Any]) -> Any:
    """A ``client_state`` as JSON, its tensors kept as tensors (:func:`tensors_to_json`), its tuples
    tuples and its keys of other types than strings as they are (:func:`typed_to_json`)."""
    try:
        return to_jsonable(tensors_to_json(typed_to_json(state), "client_state"), "client_state")
    except TypeError as e:
        raise ConfigError(f"{e} (elastor stores client_state as JSON in the manifest)") from None


def _jsonable(obj: Any, where: str) -> Any:
    try:
        return to_jsonable(obj, where)
    except TypeError as e:
        raise ConfigError(f"{e} (elastor stores {where} as JSON in the manifest)") from None
