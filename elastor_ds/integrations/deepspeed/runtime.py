"""Elastor checkpointing attached to a live DeepSpeed engine: when to save, what to save, how to resume.

:class:`ElastorCheckpointer` owns the foundation :class:`CheckpointEngine` for one DeepSpeed engine.

Save (``save``), collective over every rank of the job:
1. collect shards (:mod:`.state`): module weights, fp32 master + optimizer moments as per-parameter
   regions, and JSON extra (engine counters, LR scheduler, optimizer scalars, client state);
2. hand them to the checkpoint engine, which snapshots (the stall) and writes/commits in a
   background thread; the next save (or ``finalize``) surfaces a background failure on every rank.

Policy (``maybe_save``, after every optimizer step): see :mod:`.config`.

Load (``load``), inside ``initialize`` for ``"load": "latest"``:
1. resolve the step dir and read its manifest (which optimizer state keys exist);
2. create missing optimizer state tensors (a fresh torch optimizer has none), then fill module
   weights, master weights and optimizer state in place through region overlap, whatever the
   saved PP/DP degree, stage boundaries or ZeRO stage;
3. restore counters, scheduler, optimizer scalars, client state; RNG only under the same layout.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

from ...checkpoint import commit as commit_mod
from ...checkpoint import CheckpointEngine, LoadResult, Manifest, SaveStats, VerifyMode
from ...checkpoint.state import capture_rng_state, restore_rng_state, to_jsonable
from ...comm import TorchComm
from ...errors import ConfigError, IncompleteCheckpointError
from ...layout import Layout
from . import state as st
from .config import CheckpointConfig, save_due

log = logging.getLogger(__name__)

FORMAT = "elastor_ds.deepspeed/1"


def engine_layout(engine: Any) -> Layout:
    """The TP x PP x DP grid the engine runs (TP = the topology's "model" axis), with its actual
    stage boundaries over the pipeline's layer list (a heterogeneous plan's layout as is)."""
    module = engine.module
    rt = getattr(module, "_elastor_runtime", None)
    if rt is not None:
        return rt.layout
    parts = getattr(module, "parts", None)
    num_layers = len(getattr(module, "_layer_specs", [])) or 1
    pp = int(getattr(engine, "num_stages", 1) or 1)
    dp = int(engine.dp_world_size)
    gas = int(engine.gradient_accumulation_steps())
    grid = getattr(engine, "grid", None)
    tp = int(grid.get_slice_parallel_world_size()) if grid is not None else 1
    if parts is None or pp == 1:
        parts = [0, num_layers]
    return Layout.uniform(tp, pp, dp, num_layers, boundaries=list(parts), micro_batches=gas)


class ElastorCheckpointer:
    def __init__(self, engine: Any, cfg: CheckpointConfig):
        self.cfg = cfg
        self.engine = engine
        self.comm = TorchComm.create(cfg.timeout_s)
        # main-thread agreement (policy, load) gets its own group: the background writer runs
        # collectives on ``self.comm`` and two threads must never interleave collectives on one group
        self.policy_comm = TorchComm.create(cfg.timeout_s)
        self.ckpt = CheckpointEngine(cfg.dir, self.comm, keep=cfg.keep, async_save=cfg.async_save)
        self.layout = engine_layout(engine)
        self.last_save_step: Optional[int] = None
        self.last_save_time = time.monotonic()
        self.stats: list[SaveStats] = []
        self.client_state: dict[str, Any] = {}
        self.loaded: Optional[LoadResult] = None
        self.last_collect_s = 0.0

    # ---------------------------------------------------------------- save
    def maybe_save(self) -> Optional[SaveStats]:
        """After an optimizer step: save when the policy says so (identical decision on every rank)."""
        cfg = self.cfg
        step = int(self.engine.global_steps)
        due = save_due(cfg, step, self.last_save_step, time.monotonic() - self.last_save_time, self.ckpt.local_idle())
        if cfg.min_interval_s > 0 and cfg.periodic and step != self.last_save_step:
            due = all(self.policy_comm.all_gather_object(due))  # clocks differ per rank: agree
        if not due:
            return None
        return self.save()

    def save(self, client_state: Optional[dict[str, Any]] = None) -> SaveStats:
        eng = self.engine
        if client_state is not None:
            self.client_state = dict(client_state)
        t0 = time.perf_counter()
        shards = st.model_shards(eng) + st.optimizer_shards(eng, include_master=not st.master_is_weight(eng))
        self.last_collect_s = time.perf_counter() - t0
        sched = eng.lr_scheduler
        extra = {
            "format": FORMAT,
            "global_steps": int(eng.global_steps),
            "global_samples": int(eng.global_samples),
            "skipped_steps": int(getattr(eng, "skipped_steps", 0)),
            "train_batch_size": int(eng.train_batch_size()),
            "zero_stage": int(eng.zero_optimization_stage()),
            "optimizer": st.optimizer_scalars(eng),
            "lr_scheduler": _jsonable(sched.state_dict(), "lr_scheduler") if sched is not None else None,
            "client_state": _jsonable(self.client_state, "client_state"),
        }
        import deepspeed
        model = {"framework": "deepspeed", "deepspeed_version": deepspeed.__version__,
                 "module_class": type(eng.module).__name__, "num_layers": self.layout.num_layers}
        geo_model = getattr(getattr(eng.module, "elastor_geometry", None), "model", None)
        if isinstance(geo_model, dict):  # e.g. a megatron-core GPT description: exporters can use it
            model = {**geo_model, **{k: v for k, v in model.items() if k != "num_layers"},
                     "pipeline_layers": self.layout.num_layers}
        step = int(eng.global_steps)
        stats = self.ckpt.save(step, shards, extra=extra, rank_state={"rng": capture_rng_state()}, model=model,
                               layout=self.layout.to_json())
        self.last_save_step = step
        self.last_save_time = time.monotonic()
        self.stats.append(stats)
        if self.comm.rank == 0:
            log.info("elastor save of step %d: stall %.1f ms (%d bytes on rank 0)", step, stats.stall_s * 1e3,
                     stats.bytes_written)
        return stats

    def wait(self) -> Optional[SaveStats]:
        return self.ckpt.wait()

    def finalize(self) -> Optional[SaveStats]:
        return self.ckpt.finalize()

    # ---------------------------------------------------------------- load
    def resolve(self, load: str) -> Optional[str]:
        """The root or step dir to load for ``load`` (``latest``/a path), or None when there is nothing yet."""
        if load == "none":
            return None
        if load != "latest":
            return os.path.abspath(load)
        root = os.path.abspath(self.cfg.dir)
        if not os.path.isdir(root) or (commit_mod.read_latest(root) is None and not commit_mod.list_committed(root)):
            return None
        return root

    def load(self, path: Optional[str] = None) -> Optional[LoadResult]:
        eng = self.engine
        step_dir = self.resolve(path or self.cfg.load)
        agreed = self.policy_comm.all_gather_object(step_dir is not None)
        if not any(agreed):
            log.info("no elastor checkpoint under %s: starting fresh", self.cfg.dir)
            return None
        if not all(agreed):
            raise IncompleteCheckpointError(f"some ranks see a checkpoint under {self.cfg.dir} and others do not: "
                                            f"the directory must be on storage shared by every rank")
        assert step_dir is not None

        def shards_for(man: Manifest) -> list:
            """This engine's shards for the checkpoint actually loaded (the engine reads its manifest)."""
            names = set(man.tensors)
            keys = st.state_keys_in(names)
            shards = st.model_shards(eng)
            if any(st.is_optim(n) for n in names) or not names:
                for sh in st.optimizer_shards(eng, state_keys=keys):
                    src = st.master_from_weight_name(sh.name)
                    if src is not None and sh.name not in names and src in names:
                        sh.name = src  # fp32 checkpoints keep one copy: the master comes from the weights
                    shards.append(sh)
            else:
                log.warning("checkpoint %s has no optimizer state: the optimizer starts fresh", step_dir)
            return shards
        res = self.ckpt.load(step_dir, shards_for, strict=True,
                             verify_checksums=VerifyMode.CHUNKS if self.cfg.verify_on_load else VerifyMode.NONE,
                             fallback=self.cfg.fallback_to_previous)
        self._restore_extra(res)
        self.loaded = res
        self.last_save_step = res.step
        if self.comm.rank == 0:
            log.info("resumed from %s (step %d) under %s in %.2f s", res.step_dir, res.step, self.layout.describe(),
                     res.seconds)
        return res

    def _restore_extra(self, res: LoadResult) -> None:
        eng = self.engine
        ex = res.extra
        if ex.get("format") not in (None, FORMAT):
            raise ConfigError(f"checkpoint {res.step_dir} has format {ex.get('format')!r}; this reader knows {FORMAT}")
        eng.global_steps = int(ex.get("global_steps", res.step))
        eng.global_samples = int(ex.get("global_samples", 0))
        if "skipped_steps" in ex:
            eng.skipped_steps = int(ex["skipped_steps"])
        if ex.get("optimizer"):
            st.restore_optimizer_scalars(eng, ex["optimizer"])
        if ex.get("lr_scheduler") is not None:
            if eng.lr_scheduler is None:
                log.warning("checkpoint has LR scheduler state but the engine has no scheduler: ignored")
            else:
                eng.lr_scheduler.load_state_dict(ex["lr_scheduler"])
        self.client_state = dict(ex.get("client_state") or {})
        tbs = ex.get("train_batch_size")
        if tbs is not None and int(tbs) != int(eng.train_batch_size()):
            log.warning("global batch changed from %s to %s samples: the loss curve will not continue exactly",
                        tbs, eng.train_batch_size())
        saved_layout = res.manifest.layout
        same = saved_layout is not None and Layout.from_json(saved_layout).fingerprint() == self.layout.fingerprint()
        if same and res.rank_state and "rng" in res.rank_state:
            restore_rng_state(res.rank_state["rng"])
        elif self.comm.rank == 0:
            log.info("layout changed (%s -> %s): RNG states start fresh",
                     Layout.from_json(saved_layout).describe() if saved_layout else "?", self.layout.describe())


def _jsonable(obj: Any, where: str) -> Any:
    try:
        return to_jsonable(obj, where)
    except TypeError as e:
        raise ConfigError(f"{e} (elastor stores {where} as JSON in the manifest)") from None
