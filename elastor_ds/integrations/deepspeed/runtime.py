"""Elastor checkpointing attached to a live DeepSpeed engine: when to save, what to save, how to resume.

:class:`ElastorCheckpointer` owns the foundation :class:`CheckpointEngine` for one DeepSpeed engine.

Save (``save``), collective over every rank of the job:
1. collect shards (:mod:`.state`): module weights, fp32 master + optimizer moments as per-parameter
   regions, and JSON extra (engine counters, LR scheduler, optimizer scalars, client state);
2. hand them to the checkpoint engine, which snapshots (the stall) and writes/commits in a
   background thread; the next save (or ``finalize``) surfaces a background failure on every rank.

Policy (``maybe_save``, after every optimizer step): see :mod:`.config`.

Memory snapshots (``"memory_snapshot"``, :mod:`.memory`): a second engine on the node's tmpfs saves
every ``interval_steps`` steps from the same shards; its budget is checked at construction.

Load (``load``), inside ``initialize`` for ``"load": "latest"``:
0. with memory snapshots: the newest committed step across memory and storage wins (memory on a
   tie); a memory restore reads each file from this node's memory, then the registered sources
   (:func:`~elastor_ds.checkpoint.sources.register_source_factory`, ``extra_memory_sources``),
   then storage's identical files of the same step; every byte CRC-checked. A memory snapshot
   that fails on any rank falls back to storage (logged). A ``restore`` record (bytes per source,
   seconds) goes to ``$ELASTOR_EVENTS_FILE``;
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
from .config import CheckpointConfig, MemorySnapshotConfig, save_due

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


def check_roots_apart(storage: str, snapshots: str) -> None:
    """Storage and the memory snapshots each own their root: retention and the commit protocol of
    one would delete or rename the other's steps when one root lies inside the other."""
    from ...checkpoint.paths import overlap
    if overlap(storage, snapshots):
        raise ConfigError(f"the checkpoint directory {os.path.abspath(storage)} and the memory-snapshot directory "
                          f"{os.path.abspath(snapshots)} overlap (one holds the other); give them separate "
                          f"directories, e.g. --save on shared storage and --snapshot-dir on /dev/shm")


class ElastorCheckpointer:
    def __init__(self, engine: Any, cfg: CheckpointConfig, memory: Optional[MemorySnapshotConfig] = None):
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
        self.last_hook_s = 0.0   # wall time of the last save/snapshot on the training thread (collect .. stall)
        self._shards_cache: Optional[tuple[Any, list, list]] = None   # (state_fingerprint, shards, optimizer groups)
        self.restore: Optional[dict[str, Any]] = None   # where the resumed bytes came from
        # sources consulted between this node's memory and storage on a memory restore (peer copies,
        # other nodes' servers): fn(step_dir, manifest) -> [ChunkSource, ...]
        self.extra_memory_sources: list = []
        self.memory = None
        if memory is not None:
            from ...checkpoint.snapshot.tier import MemoryTier, node_dir
            check_roots_apart(cfg.dir, node_dir(memory))
            self.memory = MemoryTier(memory, TorchComm.create(cfg.timeout_s))
            est, estimated = self._snapshot_estimate()
            self.memory.check_budget(est, self.policy_comm, estimated=estimated)
            from ...checkpoint.snapshot.peer import attach   # cross-node half: peer copies and restore sources (collective)
            attach(self, cfg.timeout_s)
        self.device_fence = self._install_device_fence()

    def _install_device_fence(self) -> bool:
        """CUDA: let every snapshot's device-to-host copies run on their side stream while the next
        forward and backward run, and order them before the next optimizer step (the first thing
        that changes a saved tensor) with a device-side wait in an optimizer pre-step hook. Without
        CUDA parameters, or an optimizer without step hooks, snapshots wait for their copies."""
        import torch
        if not torch.cuda.is_available() or not any(p.is_cuda for p in self.engine.module.parameters()):
            return False
        opt = st.base_optimizer(self.engine)
        if not hasattr(opt, "register_step_pre_hook"):
            return False
        engines = [self.ckpt] + ([self.memory.ckpt] if self.memory is not None else [])

        def fence(*_args: Any) -> None:
            for e in engines:
                e.fence()
        opt.register_step_pre_hook(fence)
        for e in engines:
            e.defer_device_copies = True
        return True

    # ---------------------------------------------------------------- save
    def maybe_save(self) -> Optional[SaveStats]:
        """After an optimizer step: save when the policy says so (identical decision on every rank)."""
        cfg = self.cfg
        step = int(self.engine.global_steps)
        due = save_due(cfg, step, self.last_save_step, time.monotonic() - self.last_save_time, self.ckpt.local_idle())
        if cfg.min_interval_s > 0 and cfg.periodic and step != self.last_save_step:
            due = all(self.policy_comm.all_gather_object(due))  # clocks differ per rank: agree
        mem = self.memory
        mem_due = mem is not None and mem.due(step)
        if not due and not mem_due:
            return None
        t0 = time.perf_counter()
        kw = self._collect()
        stats = self.save(collected=kw) if due else None
        if mem_due:
            assert mem is not None
            ms = mem.save(step, kw["shards"], self.policy_comm, extra=kw["extra"], rank_state=kw["rank_state"],
                          model=kw["model"], layout=kw["layout"])
            stats = stats or ms
        self.last_hook_s = time.perf_counter() - t0
        return stats

    def _snapshot_estimate(self) -> tuple[int, bool]:
        """Bytes this rank writes per snapshot, estimated before the optimizer has state: the save
        plan of the model's shards (deduplicated like a real save) scaled by the optimizer's fp32
        per-element state (Adam-like: 2 moments; else 1) and the fp32 master when it is separate.
        Collective (one all-gather of shard metadata)."""
        from ...checkpoint.planning.save_plan import ShardMeta, plan_save
        from ...checkpoint.shards import dtype_name
        eng = self.engine
        shards = st.model_shards(eng)
        metas = [ShardMeta(sh.name, sh.shape, dtype_name(sh.tensor.dtype), sh.region) for sh in shards]
        gathered = self.policy_comm.all_gather_object([m.to_tuple() for m in metas])
        plan = plan_save([[ShardMeta.from_tuple(t) for t in g] for g in gathered])
        mine = plan.items[self.comm.rank]
        model_bytes = sum(it.nbytes for it in mine)
        itemsize = max(1, shards[0].tensor.element_size()) if shards else 4
        opt = type(st.base_optimizer(eng)).__name__.lower()
        per_elem = (2 if ("adam" in opt or "lamb" in opt) else 1) + (0 if st.master_is_weight(eng) else 1)
        return model_bytes + model_bytes * per_elem * 4 // itemsize, True

    def _collect(self) -> dict[str, Any]:
        """The shards and JSON of a save (storage checkpoint or memory snapshot). The shard list is
        rebuilt only when a tensor behind it changed (:func:`.state.state_fingerprint`): building it
        walks the module and the optimizer's layout, milliseconds per save."""
        eng = self.engine
        t0 = time.perf_counter()
        key = st.state_fingerprint(eng)
        if self._shards_cache is not None and self._shards_cache[0] == key:
            shards, groups = self._shards_cache[1], self._shards_cache[2]
        else:
            shards = st.model_shards(eng) + st.optimizer_shards(eng, include_master=not st.master_is_weight(eng))
            groups = st.optimizer_groups(eng)
            self._shards_cache = (key, shards, groups)
        self.last_collect_s = time.perf_counter() - t0
        sched = eng.lr_scheduler
        extra = {
            "format": FORMAT,
            "global_steps": int(eng.global_steps),
            "global_samples": int(eng.global_samples),
            "skipped_steps": int(getattr(eng, "skipped_steps", 0)),
            "train_batch_size": int(eng.train_batch_size()),
            "zero_stage": int(eng.zero_optimization_stage()),
            "optimizer": st.optimizer_scalars(eng, groups),
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
        return {"shards": shards, "extra": extra, "rank_state": {"rng": capture_rng_state()}, "model": model,
                "layout": self.layout.to_json()}

    def save(self, client_state: Optional[dict[str, Any]] = None, collected: Optional[dict[str, Any]] = None
             ) -> SaveStats:
        eng = self.engine
        if client_state is not None:
            self.client_state = dict(client_state)
            collected = None
        kw = collected or self._collect()
        step = int(eng.global_steps)
        stats = self.ckpt.save(step, kw["shards"], extra=kw["extra"], rank_state=kw["rank_state"], model=kw["model"],
                               layout=kw["layout"])
        self.last_save_step = step
        self.last_save_time = time.monotonic()
        self.stats.append(stats)
        if self.comm.rank == 0:
            log.info("elastor save of step %d: stall %.1f ms (%d bytes on rank 0)", step, stats.stall_s * 1e3,
                     stats.bytes_written)
        return stats

    def wait(self) -> Optional[SaveStats]:
        if self.memory is not None:
            self.memory.ckpt.wait()
        return self.ckpt.wait()

    def finalize(self) -> Optional[SaveStats]:
        if self.memory is not None:
            self.memory.ckpt.finalize()
            if self.memory.peer_copier is not None:   # the last snapshot's copy (peer.attach)
                self.memory.peer_copier.close()
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
        step_dir = self.resolve(path or self.cfg.load)
        if self.memory is not None and (path or self.cfg.load) == "latest":
            res = self._load_memory(step_dir)
            if res is not None:
                return res
        agreed = self.policy_comm.all_gather_object(step_dir is not None)
        if not any(agreed):
            log.info("no elastor checkpoint under %s: starting fresh", self.cfg.dir)
            return None
        if not all(agreed):
            raise IncompleteCheckpointError(f"some ranks see a checkpoint under {self.cfg.dir} and others do not: "
                                            f"the directory must be on storage shared by every rank")
        assert step_dir is not None

        res = self.ckpt.load(step_dir, self._shards_for,
                             verify_checksums=VerifyMode.CHUNKS if self.cfg.verify_on_load else VerifyMode.NONE,
                             fallback=self.cfg.fallback_to_previous)
        return self._resumed(res, "storage", durable_step=res.step)

    def _shards_for(self, man: Manifest) -> list:
        """This engine's shards for the checkpoint actually loaded (the engine reads its manifest)."""
        eng = self.engine
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
            log.warning("checkpoint %s has no optimizer state: the optimizer starts fresh", man.step)
        return shards

    def _resumed(self, res: LoadResult, tier: str, durable_step: Optional[int]) -> LoadResult:
        """Bookkeeping after a load. ``durable_step`` is the newest step storage holds (the loaded
        step for a storage load; for a memory restore storage's newest, which may be older): a step
        restored from memory is not saved until storage holds it, so the end-of-run and stop-point
        saves write it again (a relaunch that restored the final step from memory must not exit
        with storage one interval behind)."""
        self._restore_extra(res)
        hook = getattr(self.engine, "elastor_weights_loaded", None)
        if hook is not None:  # e.g. the heterogeneous runtime's ZeRO-1 shares follow the loaded weights
            hook()
        self.loaded = res
        self.last_save_step = durable_step
        if self.memory is not None:
            self.memory.last_step = res.step
        rows = self.policy_comm.all_gather_object((res.bytes_by_source, res.seconds))
        total: dict[str, int] = {}
        for by, _ in rows:
            for k, v in by.items():
                total[k] = total.get(k, 0) + int(v)
        self.restore = {"step": res.step, "tier": tier, "step_dir": res.step_dir, "bytes": total,
                        "durable_step": durable_step,
                        "seconds": max(sec for _, sec in rows), "layout": self.layout.describe(),
                        "fell_back": bool(res.fell_back)}
        if self.comm.rank == 0:
            from ...checkpoint.snapshot.tier import report_restore
            log.info("resumed from %s (step %d, %s) under %s in %.2f s; bytes per source: %s", res.step_dir, res.step,
                     tier, self.layout.describe(), self.restore["seconds"],
                     ", ".join(f"{k} {v}" for k, v in sorted(total.items())) or "none")
            report_restore(0, self.restore)
        return res

    def _load_memory(self, storage_root: Optional[str]) -> Optional[LoadResult]:
        """Collective. Restore from the memory snapshots when their newest committed step is at
        least storage's and every rank's node holds it; None (nothing loaded) otherwise or when the
        snapshot fails its checks on any rank (logged; the caller then loads storage)."""
        from ...checkpoint.sources import LOCAL_MEMORY, DirSource, registered_sources, storage_source_for
        from ...errors import CheckpointError, RanksFailedError
        from ...checkpoint.engine import DATA_ERRORS
        mem = self.memory
        assert mem is not None
        mstep, mdir = mem.newest_local_step()
        sdir = None
        if storage_root is not None:
            try:
                sdir = commit_mod.resolve(storage_root)
            except CheckpointError:
                sdir = None
        sstep = commit_mod.step_of(os.path.basename(sdir)) if sdir else None
        rows = self.policy_comm.all_gather_object((mstep, sstep))
        msteps = {r[0] for r in rows}
        best_storage = max((r[1] for r in rows if r[1] is not None), default=-1)
        if len(msteps) != 1 or mstep is None or mstep < best_storage:
            if self.comm.rank == 0 and any(r[0] is not None for r in rows):
                log.info("memory snapshots not used: steps per rank %s, storage step %s", sorted(
                    {r[0] for r in rows}, key=lambda x: -1 if x is None else x), best_storage)
            return None
        assert mdir is not None

        def sources(step_dir: str, man: Manifest) -> list:
            out = [DirSource(step_dir, LOCAL_MEMORY)]
            for fn in self.extra_memory_sources:
                out.extend(fn(step_dir, man) or [])
            out.extend(registered_sources(step_dir, man))
            if sdir is not None and sstep == man.step:
                try:
                    smt = commit_mod.read_manifest(sdir)
                except CheckpointError as e:
                    log.warning("storage checkpoint %s cannot back the memory snapshot: %s", sdir, e)
                    smt = None
                st_src = storage_source_for(sdir, man, smt)
                if st_src is not None:
                    out.append(st_src)
            return out
        try:
            res = mem.ckpt.load(mdir, self._shards_for, verify_checksums=VerifyMode.CHUNKS, fallback=False,
                                sources=sources)
        except RanksFailedError as e:
            if not e.all_are(*DATA_ERRORS):
                raise
            if self.comm.rank == 0:
                log.error("memory snapshot of step %s is unusable (%s); restoring from storage instead", mstep, e)
            return None
        # storage's newest step on every rank (shared storage: the same); the restored step counts
        # as saved only when storage holds it too
        durable = best_storage if best_storage >= 0 else None
        return self._resumed(res, "memory", durable_step=durable)

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
