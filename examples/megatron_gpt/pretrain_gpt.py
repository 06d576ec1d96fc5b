"""Pretrain a GPT (megatron-core TP layers inside DeepSpeed's pipeline engine) with elastor.

Launch with torchrun or the ``deepspeed`` launcher, one process per GPU (or CPU process)::

    torchrun --nproc-per-node 4 examples/megatron_gpt/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 \\
        --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 100 \\
        --save ckpt --load ckpt --save-interval 10 --metrics-file metrics.jsonl

With ``--load`` the run resumes from the newest elastor checkpoint under whatever layout this
launch has (TP, PP, DP and stage boundaries may all differ): weights, Adam state, LR scheduler,
RNG and the data position. ``--elastor-plan plan.json`` runs any valid plan document (the
planner's JSON, ``version: 1``): replicas with different stage counts and layer splits, TP degrees
that differ between replicas and between the stages of one replica, and micro-batches per replica
(heterogeneous plans run one DeepSpeed PipelineEngine per replica on the heterogeneous runtime,
ZeRO-1 by default: the optimizer state of every block sharded among the ranks that hold it).
``--elastor-plan auto`` asks the planner for the best plan that uses exactly the launched processes, searching heterogeneous plans too (``--elastor-layouts uniform`` restricts it), priced with
the per-layer profile this trainer measured in an earlier run (``<save>/profile.json``, written after
``--profile-iters`` timed iterations, in ``elastor plan --profile`` format) when there is one.
Bad plans exit 2 before any work, with the numbers (devices vs world size, layer coverage,
micro-batches vs global batch, TP vs heads/query groups/FFN, a stage spanning nodes).

Metrics file (``--metrics-file``, JSONL, written by rank 0, one record per iteration). Keys, a
contract for readers such as the demo table (keys may be added, never removed):

    iteration, lm_loss (global batch mean), consumed_samples, lr, layout (short description),
    world_size, iter_time_s (measured), process_cpu_s (CPU time of all this rank's threads during the
    iteration), time (unix), save_stall_s (iterations that saved), and on them prev_save_durable_s /
    prev_save_writer_cpu_s (the save before: from its call to its commit / its writer thread's CPU),
    and with checkpoint.live_write prev_save_fence_s / prev_save_fence_bytes / prev_save_bytes (what
    that save's fence, in the next optimizer step, copied of the bytes it wrote),
    storage_writer_busy (with --save-interval: the storage writer was still writing as the iteration began),
    with memory snapshots (iterations that took one): snapshot_stall_s (the copy), snapshot_hook_s
      (the training thread's whole snapshot time), snapshot_wait_s (waiting for the previous one),
      snapshot_writer_cpu_s (the background writer's CPU for the previous one), snapshots_dropped
      (so far, by a changed shard layout), with memory_snapshot.live_write prev_snapshot_fence_s /
      prev_snapshot_fence_bytes / prev_snapshot_bytes (what the previous snapshot's fence, in this
      iteration's optimizer step, copied), and peer_copy_* with peer copies,
    plan_source ("flags" | "file" | "auto"),
    with --elastor-plan auto also: plan_search (a re-plan from the previous launch's <save>/plan.json, used
      only when its plan gives every launched process a place; else why the full search ran),
      predicted_iter_s (the chosen plan's prediction), and when the
      planner's best plan overall would leave processes idle (not supported: the plan using every
      process runs) idle_best_plan, idle_best_processes, idle_best_predicted_iter_s;
      uniform_plan, uniform_predicted_iter_s and uniform_idle_processes (the best uniform grid for the
      launched processes under the same cost model: over all of them, or over fewer, leaving that many
      idle), profile (path of the profile used, or null for the analytical model); once this launch's
      profile is written, uniform_predicted_iter_s and idle_best_predicted_iter_s are re-priced with it
      like predicted_iter_s (the *_at_launch keys keep the first prices);
    with any plan source, once a profile exists: predicted_iter_s, the running plan's predicted seconds
      per iteration -- at launch from the profile of an earlier launch, and from the iteration this
      launch's own profile was written on, re-priced with it; the profile is measured again in every
      further window of --profile-iters iterations (up to PROFILE_WINDOWS) from the median timed
      iteration of all windows so far, and the plan re-priced each time (profile_iterations: the
      iterations timed so far; predicted_iter_s_at_launch keeps the
      first; the profile's measured terms: elastor_ds.plan.cost and layer_profile.in_situ_terms), and
      predicted_terms_s: that re-priced prediction's pipeline, sync and step seconds, and
      predicted_sources: per cost term, "measured" or "assumed" (elastor_ds.plan.CostModel.sources,
      logged in full);
    profile_written (path, from the iteration the profile was written on), profile_comm_s (seconds
    spent measuring the collectives for it);
    plan (the full plan document) and zero_stage: in the first record of each launch only;
    state_bytes (second record of each launch, or the first if it runs one iteration): per rank, the
      training-state bytes (params, grads, optimizer) measured at the end of backward and after the
      optimizer step, and the larger as "peak" (elastor_ds.testing.state_memory; compare with
      plan_specs() and elastor_ds.plan.CostModel.stage_state_bytes).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

log = logging.getLogger("pretrain_gpt")


def builtin_corpus(seed: int, seq_length: int, rank: int) -> str:
    """The built-in corpus (no --data-path): made by each node's local rank 0 when absent, in this
    user's private cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``elastor_ds``: 0700,
    ours, checked), never beside the checkpoints: there another user could have put a file of that
    name first, and it would have been trained on (QA round 8, F4). Deterministic for its seed and
    record length, so nodes that share the folder write the same bytes (atomically)."""
    import stat

    from elastor_ds.checkpoint.private_dir import ensure_private_dir
    from elastor_ds.data import write_synthetic_corpus
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                         "elastor_ds")
    folder = ensure_private_dir(cache, "the built-in corpus's cache folder",
                                fix="set XDG_CACHE_HOME to a folder of your own, or give --data-path FILE (your JSONL)",
                                contents="the corpus")
    chars = seq_length * 2
    path = os.path.join(folder, f"corpus_seed{seed}_chars{chars}.jsonl")
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        try:
            fresh = not stat.S_ISREG(os.lstat(path).st_mode)
        except FileNotFoundError:
            fresh = True
        if fresh:
            write_synthetic_corpus(path, num_records=20000, chars_per_record=chars, seed=seed)
        if rank == 0:
            log.info("built-in corpus: %s", path)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # sizes of 0 divided by zero deep in the set-up (exit 1); snapshot flags were named by their config keys
    from elastor_ds.cli_types import nonnegative_int, positive_int
    p = argparse.ArgumentParser(description="GPT pretraining with elastor (megatron-core layers, DeepSpeed pipeline)")
    a = p.add_argument
    a("--tensor-model-parallel-size", type=positive_int, default=1)
    a("--pipeline-model-parallel-size", type=positive_int, default=1)
    a("--num-layers", type=positive_int, default=4)
    a("--hidden-size", type=positive_int, default=64)
    a("--ffn-hidden-size", type=positive_int, default=None, help="default: 4 * hidden (2/3 of that with --swiglu)")
    a("--num-attention-heads", type=positive_int, default=4)
    a("--num-query-groups", type=positive_int, default=None, help="grouped-query attention (default: = heads)")
    a("--seq-length", type=positive_int, default=64)
    a("--max-position-embeddings", type=positive_int, default=None, help="default: --seq-length")
    a("--micro-batch-size", type=positive_int, default=2)
    a("--global-batch-size", type=positive_int, default=8)
    a("--train-iters", type=positive_int, default=100)
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4)
    a("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    a("--lr-warmup-iters", type=int, default=10)
    a("--weight-decay", type=float, default=0.0)
    a("--seed", type=nonnegative_int, default=1234, help="model init, dropout and the data order")
    a("--swiglu", action=argparse.BooleanOptionalAction, default=True, help="gated MLP (linear_fc1 = [gate; up])")
    a("--save", default=None, help="elastor checkpoint directory")
    a("--load", default=None, help="resume from this elastor checkpoint directory (newest committed step)")
    a("--save-interval", type=nonnegative_int, default=0, help="iterations between asynchronous saves (0: only at the end)")
    a("--elastor-memory-snapshot-interval", type=positive_int, default=None, metavar="N",
      help="also snapshot every N iterations into this node's memory (tmpfs; $ELASTOR_SNAPSHOT_DIR from `elastor run`); "
           "a restart restores from memory first, storage only for what no memory holds (needs --save)")
    a("--elastor-memory-snapshot-peer-copies", type=int, choices=(0, 1), default=None, metavar="K",
      help="copies of each snapshot on other nodes (0 or 1; default 1)")
    a("--elastor-memory-snapshot-peer-copy-interval", type=positive_int, default=None, metavar="N",
      help="copy only every N-th step's snapshot to the next node (a multiple of the snapshot interval; "
           "default: every snapshot); a node then keeps N / interval + 1 snapshots")
    a("--elastor-memory-snapshot-keep", type=positive_int, default=None, metavar="K",
      help="memory snapshots kept per node (default 1)")
    a("--elastor-memory-snapshot-live-write", action="store_true", default=None,
      help="snapshots copy nothing on the training thread: a background writer copies the live tensors into memory "
           "until the next optimizer step, whose pre-hook copies the rest (memory_snapshot.live_write)")
    a("--elastor-memory-snapshot-ab-blocks", type=nonnegative_int, default=0, metavar="B",
      help="benchmarking: pause memory snapshots in every other block of B iterations, so one run times "
           "iterations with and without them on the same processes (bench/snapshot_bench.py; 0: off)")
    a("--log-interval", type=positive_int, default=10)
    a("--eval-interval", type=int, default=0, help="iterations between held-out evaluations (0: off)")
    a("--zero-stage", type=int, choices=[0, 1], default=None,
      help="default: 1 (under a heterogeneous plan the optimizer state of each block is sharded among the ranks "
      "that hold it)")
    a("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
      help="DeepSpeed JSON config; its \"elastor\" section is honoured (flags above fill what it leaves out)")
    a("--deepspeed", action="store_true", help="accepted for launcher compatibility")
    a("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    a("--elastor-plan", default=None, help="plan JSON file, 'auto' to ask the planner for the launched world, or "
      "'on-change' (under `elastor run`): the TP/PP flags on the first launched world, the planner's after it changed")
    a("--elastor-layouts", choices=["heterogeneous", "uniform"], default="heterogeneous",
      help="search space of the planner for --elastor-plan auto (default: heterogeneous plans too)")
    a("--profile-iters", type=int, default=5, help="iterations per profile window: each window that closes "
      "rewrites <save>/profile.json (which --elastor-plan auto uses after a restart) and re-prices the running "
      "plan with it; windows repeat while the launch runs (0: off)")
    a("--data-path", default=None, help="text (one record per line) or JSONL with a 'text' field; default: the built-in "
      "corpus, made in ~/.cache/elastor_ds (\$XDG_CACHE_HOME/elastor_ds)")
    a("--metrics-file", default=None, help="JSONL, one line per iteration")
    a("--exit-after-iters", type=int, default=None, help="stop (as if killed) after this iteration; for demos")
    return p.parse_args(argv)


PROFILE_WINDOWS = 10  # profile windows per launch (each --profile-iters iterations, back to back)


class UsageError(Exception):
    pass


def derive(args: argparse.Namespace, world: int) -> dict:
    """Check the flags against each other and the world size; return the derived layout numbers."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    L, H = args.num_layers, args.num_attention_heads
    groups = args.num_query_groups or H
    boundaries = None
    plan_layout = None
    if args.elastor_plan is not None and not args.elastor_plan.strip():
        raise UsageError("--elastor-plan '': empty; give a plan JSON file or 'auto' (or leave the flag out)")
    if args.elastor_plan:
        from elastor_ds.layout import Layout
        if args.elastor_plan == "auto":
            plan_layout = auto_plan(args, world)
        else:
            if not os.path.isfile(args.elastor_plan):
                what = "is not a file" if os.path.exists(args.elastor_plan) else "no such file"
                raise UsageError(f"--elastor-plan {args.elastor_plan}: {what} (give a plan JSON or 'auto')")
            try:
                with open(args.elastor_plan) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                raise UsageError(f"--elastor-plan {args.elastor_plan}: not a JSON plan document: {e}") from None
            if not isinstance(doc, dict):
                raise UsageError(f"--elastor-plan {args.elastor_plan}: expected a JSON object with 'replicas'")
            if doc.get("num_layers") not in (None, L):
                raise UsageError(f"--elastor-plan covers {doc['num_layers']} layers but --num-layers is {L}")
            try:
                plan_layout = Layout.from_json(doc, L)
            except (KeyError, TypeError, ValueError) as e:
                raise UsageError(f"--elastor-plan {args.elastor_plan}: invalid plan: {e}") from None
        if plan_layout.world_size != world:
            raise UsageError(f"--elastor-plan has {plan_layout.world_size} devices but {world} processes were "
                             f"launched (WORLD_SIZE={world}): launch {plan_layout.world_size} or give a plan for {world}")
    if H % groups:
        raise UsageError(f"--num-attention-heads {H} is not divisible by --num-query-groups {groups}")
    if args.hidden_size % H:
        raise UsageError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {H}")
    ffn = ffn_size(args)
    max_pos = args.max_position_embeddings or args.seq_length
    if args.seq_length > max_pos:
        raise UsageError(f"--seq-length {args.seq_length} > --max-position-embeddings {max_pos}")
    if args.train_iters < 1:
        raise UsageError(f"--train-iters {args.train_iters} must be >= 1")
    if args.load:
        check_load(args)
    common = dict(ffn=ffn, groups=groups, max_pos=max_pos)
    from elastor_ds.runtime import needs_hetero
    if plan_layout is not None and needs_hetero(plan_layout):
        return dict(common, **check_hetero(args, plan_layout, world, ffn, groups))
    if plan_layout is not None:
        tp, pp, _ = plan_layout.uniform_dims()
        boundaries = plan_layout.boundaries()
    if tp < 1 or pp < 1:
        raise UsageError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be >= 1")
    if world % (tp * pp):
        raise UsageError(f"world size {world} is not divisible by TP ({tp}) x PP ({pp}) = {tp * pp}; launch a multiple "
                         f"of {tp * pp} processes or change the parallel sizes")
    dp = world // (tp * pp)
    if pp > L:
        raise UsageError(f"--pipeline-model-parallel-size {pp} > --num-layers {L}: every stage needs a layer")
    if groups % tp or H % tp:
        raise UsageError(f"TP {tp} must divide --num-attention-heads ({H}) and --num-query-groups ({groups})")
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if gbs % (mbs * dp):
        raise UsageError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size ({mbs}) x data-parallel "
                         f"size ({dp}) = {mbs * dp}")
    if ffn % tp:
        raise UsageError(f"--ffn-hidden-size {ffn} is not divisible by TP {tp}")
    from elastor_ds.layout import Layout, balanced_boundaries
    if boundaries is None:
        boundaries = balanced_boundaries(L, pp)
    layout = Layout.uniform(tp, pp, dp, L, boundaries=boundaries, micro_batches=gbs // (mbs * dp))
    return dict(common, tp=tp, pp=pp, dp=dp, gas=gbs // (mbs * dp), boundaries=boundaries, layout=layout,
                hetero=False, zero_stage=1 if args.zero_stage is None else args.zero_stage)


def check_load(args: argparse.Namespace) -> None:
    """``--load DIR`` with ``--save DIR`` (the same directory) is the restartable idiom: an empty or
    missing DIR starts from scratch. Otherwise the user asked to load something: it must hold a
    committed elastor checkpoint (a root with steps, or a step directory), else exit 2."""
    same = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
    if same:
        if not os.path.isdir(args.load):
            log.warning("--load %s does not exist yet: starting from scratch", args.load)
        return
    from elastor_ds.checkpoint import commit
    from elastor_ds.errors import CheckpointError, CheckpointNotFoundError
    try:
        commit.resolve(args.load)
    except CheckpointNotFoundError as e:
        raise UsageError(f"--load {args.load}: {e}; give a checkpoint directory (a root or a step_* directory), or "
                         f"drop --load to start from scratch (--save DIR --load DIR starts fresh while DIR is "
                         f"empty)") from None
    except CheckpointError:
        pass  # damaged or uncommitted: the loader reports it (exit 1) or falls back to an older step


def check_hetero(args: argparse.Namespace, layout, world: int, ffn: int, groups: int) -> dict:
    """Checks of a heterogeneous plan against the model and the launch (before any work)."""
    H, mbs, gbs = args.num_attention_heads, args.micro_batch_size, args.global_batch_size
    total = sum(r.micro_batches for r in layout.replicas)
    if total * mbs != gbs:
        raise UsageError(f"the plan's micro-batches {[r.micro_batches for r in layout.replicas]} sum to {total}; "
                         f"{total} x --micro-batch-size {mbs} = {total * mbs} != --global-batch-size {gbs}")
    from elastor_ds.elastic.protocol import ENV_PROCS_PER_NODE, launched_world, node_of_rank, procs_per_node
    try:   # ELASTOR_PROCS_PER_NODE under `elastor run` (nodes may differ), else WORLD / LOCAL_WORLD_SIZE
        per_node = procs_per_node(dict(os.environ, WORLD_SIZE=str(world)))
        lw = launched_world()
    except ValueError as e:
        raise UsageError(str(e)) from None
    src = ENV_PROCS_PER_NODE if lw is not None and lw.world_size == world else "LOCAL_WORLD_SIZE"
    node = node_of_rank(per_node)
    for ri, rep in enumerate(layout.replicas):
        for si, st in enumerate(rep.stages):
            where = f"replica {ri} stage {si} (TP {st.tp}, layers [{st.layers[0]}, {st.layers[1]}))"
            if st.layers[1] <= st.layers[0]:
                raise UsageError(f"{where} holds no layer: every stage needs one")
            for what, n in (("--num-attention-heads", H), ("--num-query-groups", groups), ("--ffn-hidden-size", ffn)):
                if n % st.tp:
                    raise UsageError(f"{where}: TP {st.tp} does not divide {what} {n}")
            nodes = sorted({node[r] for r in st.ranks})
            if len(nodes) > 1:
                raise UsageError(f"{where} spans nodes {nodes} (ranks {list(st.ranks)}; processes per node "
                                 f"{per_node} from {src}): a TP group must sit inside one node")
    ds_zero = None
    if args.deepspeed_config and os.path.isfile(args.deepspeed_config):
        try:
            with open(args.deepspeed_config) as f:
                ds_zero = ((json.load(f) or {}).get("zero_optimization") or {}).get("stage")
        except (OSError, ValueError, AttributeError):
            ds_zero = None  # reported when DeepSpeed reads it
    if isinstance(ds_zero, int) and ds_zero > 1:
        raise UsageError(f"zero_optimization.stage={ds_zero} in {args.deepspeed_config} with heterogeneous plan "
                         f"{layout.describe()}: heterogeneous plans run ZeRO-1 at most (optimizer state sharded among "
                         f"the holders of each block; gradients and weights are not sharded); use stage 1 or 0, or a "
                         f"uniform plan for ZeRO-{ds_zero}")
    if args.eval_interval:
        raise UsageError("--eval-interval is not supported with a heterogeneous plan yet; use 0")
    return dict(hetero=True, layout=layout, zero_stage=1 if args.zero_stage is None else args.zero_stage,
                boundaries=None, tp=None, pp=None, dp=layout.dp, gas=None)


def ffn_size(args: argparse.Namespace) -> int:
    """--ffn-hidden-size, or megatron's default: 4 h, or 2/3 of that rounded down to 8 with --swiglu."""
    return args.ffn_hidden_size or (int(8 * args.hidden_size / 3 / 8) * 8 if args.swiglu else 4 * args.hidden_size)


def plan_specs(args: argparse.Namespace):
    """The planner's description of this trainer's model and training (fp32 weights, fp32 grads,
    Adam): under ZeRO-0 the fp32 weights are the master copy, so the optimizer holds only the two
    moments (8 bytes per parameter); under ZeRO-1 it also keeps an fp32 copy of its share (12)."""
    from elastor_ds.plan import ModelSpec, TrainingSpec
    zero = 1 if args.zero_stage is None else args.zero_stage
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length, vocab_size=104,
                      ffn_hidden_size=ffn_size(args), num_query_groups=args.num_query_groups,
                      dtype_bytes=4, gated_mlp=args.swiglu, tied_embeddings=False, vocab_divisible_by=8)
    training = TrainingSpec(micro_batch_size=args.micro_batch_size,
                            num_micro_batches=args.global_batch_size // args.micro_batch_size,
                            nominal_tp=args.tensor_model_parallel_size, zero_stage=zero,
                            grad_bytes=4, optimizer_bytes=12 if zero else 8)
    return model, training


def price_layout(args: argparse.Namespace, world: int, layout, profile_doc: dict) -> float | None:
    """The cost model's iteration time of the running ``layout`` with a profile document (rank
    ``r`` on the cluster's ``r``-th device, as launched); None when the profile cannot be read."""
    from elastor_ds.plan import Plan, PlanReplica, PlanStage
    devs = elastic_cluster(world).devices()
    reps = tuple(PlanReplica(tuple(PlanStage(st.tp, tuple(st.layers), tuple(devs[r] for r in st.ranks))
                                   for st in rep.stages), rep.micro_batches) for rep in layout.replicas)
    from elastor_ds.runtime import needs_hetero
    plan = Plan(args.num_layers, reps, (), "heterogeneous" if needs_hetero(layout) else "uniform")
    cb = price_plan(args, world, plan, profile_doc)
    if cb is None:
        return None
    # the terms of the prediction (pipeline: slowest replica's passes, bubble and transfers; sync:
    # gradient sync across replicas; step: the measured per-iteration step time)
    args.last_breakdown = {"pipeline": cb.pipeline_time_s, "sync": cb.sync_time_s, "step": cb.step_time_s}
    return cb.iteration_time_s


def price_plan(args: argparse.Namespace, world: int, plan, profile_doc: dict):  # noqa: ANN001
    """The cost model's :class:`~elastor_ds.plan.CostBreakdown` of a placed ``plan`` on the launched
    world's cluster with a profile document; None when the profile cannot be read."""
    from elastor_ds.errors import ConfigError
    from elastor_ds.plan import CostModel, Profile
    try:
        profile = Profile.from_dict(profile_doc)
    except ConfigError as e:
        log.warning("profile not used for the prediction: %s", e)
        return None
    model, training = plan_specs(args)
    cost = CostModel(model, training, elastic_cluster(world), profile=profile)
    args.last_sources = cost.sources()
    return cost.evaluate(plan)


def source_kinds(sources: dict) -> dict:
    """``CostModel.sources()`` in one word per term (``measured`` / ``assumed`` / the text when it
    is neither, e.g. 'inside the measured layer times'), for the metrics records and the report."""
    out = {}
    for term, text in sources.items():
        head = text.split(":", 1)[0].split(" (", 1)[0]
        out[term] = head if head in ("measured", "assumed") else text[:40]
    return out


def reprice_alternatives(args: argparse.Namespace, world: int, plan_info: dict, profile_doc: dict,
                         first: bool = True) -> None:
    """The planner's alternatives of this launch (best uniform, best plan leaving processes idle)
    re-priced with the same profile as the running plan, so the report compares like with like
    (the ``*_at_launch`` keys keep the prices at launch, set at the ``first`` re-pricing)."""
    for key, plan in (getattr(args, "plan_alternatives", None) or {}).items():
        cb = price_plan(args, world, plan, profile_doc)
        if cb is not None:
            if first:
                plan_info[f"{key}_predicted_iter_s_at_launch"] = plan_info.get(f"{key}_predicted_iter_s")
            plan_info[f"{key}_predicted_iter_s"] = cb.iteration_time_s


def micro_ratios(args: argparse.Namespace) -> dict:
    """Collective: this machine's forward+backward seconds of one layer of this model at each TP
    width dividing the heads (``elastor_ds.plan.profile.measure``, a TP slice on one process), the
    median over ranks, measured on every rank at once so the processes share the cores as in training."""
    import statistics
    import torch.distributed as dist
    from elastor_ds.plan.profile import measure
    groups = args.num_query_groups or args.num_attention_heads
    widths = [t for t in (1, 2, 4, 8) if groups % t == 0 and ffn_size(args) % t == 0]
    mine: dict = {}
    for _ in range(5):   # widths interleaved, the fastest of 5 rounds: robust to other processes' bursts
        got_round = measure(args.hidden_size, args.num_attention_heads, args.seq_length, args.micro_batch_size,
                            ffn_size(args), groups, args.swiglu, widths, device="cpu", warmup=1,
                            iters=3)["layer_time_s"]
        for t, v in got_round.items():
            mine[t] = min(v, mine.get(t, v))
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    return {t: statistics.median(g[t] for g in got if t in g) for t in mine}


def previous_plan(args: argparse.Namespace, cost) -> tuple:  # noqa: ANN001
    """(the previous launch's plan, None) when ``<load or save dir>/plan.json`` exists and reads as a
    plan document, numbered like this launch's cluster (``elastor_ds.plan.best_plan_for_world`` then
    re-plans from it when that gives every launched process a place); (None, why the full search
    runs) when it cannot be read; (None, None) when there is none."""
    import layer_profile
    from elastor_ds.errors import ConfigError
    from elastor_ds.plan import PreviousPlan
    from elastor_ds.plan.plan_doc import plan_from_document
    prev = layer_profile.find(args.load, args.save, name=layer_profile.PLAN_NAME)
    if prev is None:
        return None, None
    try:
        with open(prev) as f:
            doc = json.load(f)
        previous, previous_cluster = plan_from_document(doc, cost.cluster)
    except (OSError, ValueError, ConfigError) as e:
        log.warning("previous plan %s not used: %s", prev, e)
        return None, f"full search (previous plan {prev} not usable)"
    return PreviousPlan(previous, previous_cluster, str(prev)), None


def plan_document_of(layout, world: int) -> dict:  # noqa: ANN001
    """The running layout as a plan document (``elastor plan --json`` format: rank ``r`` on the
    cluster's ``r``-th device), what the next launch re-plans from."""
    from elastor_ds.runtime import needs_hetero
    doc = layout.to_json()
    devs = elastic_cluster(world).devices()
    for rj in doc["replicas"]:
        for sj in rj["stages"]:
            sj["devices"] = [devs[r].name for r in sj["ranks"]]
    doc["kind"] = "heterogeneous" if needs_hetero(layout) else "uniform"
    doc["unused_devices"] = []
    return doc


def auto_plan(args: argparse.Namespace, world: int):
    """The planner's best plan for the ``world`` launched processes (``elastor_ds.plan.best_plan_for_world``:
    heterogeneous plans included unless ``--elastor-layouts uniform``, re-planned from the previous
    launch's plan when there is one), priced with the per-layer profile this trainer measured before
    (``<load or save dir>/profile.json``) when there is one. Sets ``args.plan_info`` (metrics keys)."""
    import layer_profile
    from elastor_ds.errors import PlanningError
    from elastor_ds.plan import CostModel, PlanConstraints, Profile, best_plan_for_world
    model, training = plan_specs(args)
    prof_path = layer_profile.find(args.load, args.save)
    profile = Profile.load(prof_path) if prof_path else None
    cost = CostModel(model, training, elastic_cluster(world), profile=profile)
    previous, note = previous_plan(args, cost)
    try:
        best = best_plan_for_world(cost, PlanConstraints(layouts=args.elastor_layouts), previous)
    except PlanningError as e:
        raise UsageError(f"{e}; plans that leave processes idle are not run (every process joins the runtime's "
                         f"collectives): run `elastor plan ... --json > plan.json` and relaunch with its process "
                         f"count and --elastor-plan plan.json") from None
    prov = best.provenance
    uni, idle = prov.uniform, prov.best_overall
    # re-priced with this launch's own profile once it is measured (reprice_alternatives)
    args.plan_alternatives = {k: v.plan for k, v in (("uniform", uni), ("idle_best", idle)) if v is not None}
    args.plan_info = {"plan_source": "auto", "plan_search": note or prov.search,
                      "predicted_iter_s": best.cost.iteration_time_s,
                      "uniform_plan": uni.plan.describe() if uni else None,
                      "uniform_predicted_iter_s": uni.cost.iteration_time_s if uni else None,
                      # the best grid on the same world leaves these processes idle
                      "uniform_idle_processes": world - uni.plan.num_gpus if uni else None,
                      "profile": prof_path}
    if idle is not None:
        # every launched process must have a place: each joins the runtime's collectives (group
        # creation, split all-reduce planning, loss and norm all-reduces, checkpoint collectives),
        # so a plan that leaves processes idle is not run; say what it would have given
        args.plan_info.update(idle_best_plan=idle.plan.describe(), idle_best_processes=idle.plan.num_gpus,
                              idle_best_predicted_iter_s=idle.cost.iteration_time_s)
        log.warning("the planner's best plan %s uses %d of the %d launched processes (predicted %.4g s/iter vs "
                    "%.4g for the plan chosen, which uses all); idle processes are not supported: relaunch with "
                    "%d processes to run it", idle.plan.describe(), idle.plan.num_gpus, world,
                    idle.cost.iteration_time_s, best.cost.iteration_time_s, idle.plan.num_gpus)
    log.info("planner (%s search, profile %s): %s, predicted %.4g s/iter; best uniform %s, predicted %s s/iter",
             args.elastor_layouts, prof_path or "none: analytical model", best.layout.describe(),
             best.cost.iteration_time_s, uni.plan.describe() if uni else "none",
             f"{uni.cost.iteration_time_s:.4g}" if uni else "-")
    return best.layout


def lr_lambda(args: argparse.Namespace):
    def f(it: int) -> float:
        if args.lr_warmup_iters and it < args.lr_warmup_iters:
            return (it + 1) / args.lr_warmup_iters
        if args.lr_decay_style == "constant":
            return 1.0
        frac = min(1.0, (it - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters))
        lo = args.min_lr / args.lr
        if args.lr_decay_style == "linear":
            return lo + (1 - lo) * (1 - frac)
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


def _read_ds_config(path: str) -> dict:
    """The --deepspeed_config file, or a usage error (exit 2) naming it: missing, unreadable, not a
    JSON object."""
    from elastor_ds.errors import ConfigError
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise ConfigError(f"--deepspeed_config {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--deepspeed_config {path}: holds a {type(cfg).__name__}, expected a JSON object")
    return cfg


def ds_config(args: argparse.Namespace, d: dict) -> dict:
    cfg: dict = {}
    if args.deepspeed_config:
        cfg = _read_ds_config(args.deepspeed_config)
    cfg.setdefault("train_micro_batch_size_per_gpu", args.micro_batch_size)
    if not d["hetero"]:  # heterogeneous: each replica's own micro-batches (set by the runtime)
        cfg.setdefault("gradient_accumulation_steps", d["gas"])
    cfg.setdefault("optimizer", {"type": "Adam", "params": {"lr": args.lr, "weight_decay": args.weight_decay,
                                                            "torch_adam": True}})
    cfg.setdefault("zero_optimization", {"stage": d["zero_stage"]})
    cfg.setdefault("steps_per_print", 10 ** 9)
    cfg.setdefault("wall_clock_breakdown", False)
    el = cfg.setdefault("elastor", {})
    ck = el.setdefault("checkpoint", {})
    if args.save:
        ck.setdefault("dir", args.save)
    elif args.load:  # load only (nothing is saved): the checkpoint root
        from elastor_ds.checkpoint import commit
        ck.setdefault("dir", os.path.dirname(os.path.abspath(args.load)) if commit.is_committed(args.load)
                      else args.load)
    if "dir" not in ck:
        if args.elastor_memory_snapshot_interval is not None or el.get("memory_snapshot") is not None:
            from elastor_ds.errors import ConfigError
            raise ConfigError("memory snapshots need a storage checkpoint directory too: add --save DIR (storage "
                              "stays the durable tier; --save-interval can be large)")
        cfg.pop("elastor")
        return cfg
    ck.setdefault("interval_steps", args.save_interval)
    ck.setdefault("load", "latest" if args.load else "none")
    if args.load and (not args.save or os.path.abspath(args.load) != os.path.abspath(args.save)):
        ck["load"] = args.load  # an explicit root or step dir ("latest" would look for steps *under* a step dir)
    flags = {"interval_steps": args.elastor_memory_snapshot_interval,
             "peer_copies": args.elastor_memory_snapshot_peer_copies, "keep": args.elastor_memory_snapshot_keep,
             "peer_copy_interval_steps": args.elastor_memory_snapshot_peer_copy_interval,
             "live_write": args.elastor_memory_snapshot_live_write}
    if any(v is not None for v in flags.values()):
        ms = el.setdefault("memory_snapshot", {})
        for k, v in flags.items():
            if v is not None:
                ms.setdefault(k, v)
    return cfg


def main(argv: list[str] | None = None) -> int:
    from elastor_ds.errors import CheckpointError, ConfigError
    try:
        return _main(argv)
    except ConfigError as e:  # a bad config section or plan: a message, not a traceback
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # corrupt / incomplete checkpoint (every rank says which file): exit 1
        print(f"pretrain_gpt.py: checkpoint error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        _close_process_groups()


def _close_process_groups() -> None:
    """Tear the process groups down before the interpreter exits: left to C++ static destructors at
    exit, gloo's threads could abort the process ("terminate called without an active exception",
    exit -6: ci54, after an exit-2 config error) and hide the exit code the user should see."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - exiting anyway; the exit code is the one that matters
        log.debug("destroy_process_group at exit: %s", e)


def check_resumed_data(engine, args) -> None:
    """The data position of iteration ``i`` is sample ``i x --global-batch-size`` and its order
    follows ``--seed``: a resume with another global batch would skip or repeat samples (refused),
    one with another seed or data file reads another order (said). The trainer's data settings
    travel in the checkpoint's client state."""
    from elastor_ds.errors import ConfigError
    el = engine.elastor
    if el is None:
        return
    size = os.path.getsize(args.data_path) if args.data_path else None
    mine = {"global_batch_size": args.global_batch_size, "seed": args.seed,
            "data": os.path.basename(args.data_path) if args.data_path else "built-in", "data_bytes": size}
    loaded = el.loaded
    if loaded is not None and int(engine.global_steps) > 0:
        saved_gbs = (loaded.extra or {}).get("train_batch_size")
        if saved_gbs is not None and int(saved_gbs) != args.global_batch_size:
            raise ConfigError(f"--global-batch-size {args.global_batch_size}: the checkpoint of iteration "
                              f"{int(engine.global_steps)} was trained with {int(saved_gbs)}; iteration i reads the "
                              f"data from sample i x the global batch, so another one would skip or repeat samples: "
                              f"resume with --global-batch-size {int(saved_gbs)}")
        was = (el.state.client_state or {}).get("pretrain_gpt_data")
        if isinstance(was, dict):
            changed = [f"{k} {was.get(k)!r} -> {v!r}" for k, v in mine.items()
                       if k != "global_batch_size" and was.get(k) != v]
            if changed and int(os.environ.get("RANK", "0")) == 0:
                log.warning("resumed with other data settings (%s): the samples from here on are not the ones the "
                            "uninterrupted run would have read", ", ".join(changed))
    el.state.client_state = {**(el.state.client_state or {}), "pretrain_gpt_data": mine}


def _main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctl = elastic_attach()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("DeepSpeed", "deepspeed", "megatron"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import torch
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from elastor_ds.testing import megatron_cpu
        megatron_cpu.apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from elastor_ds.errors import ElastorError
    elastic_mark(ctl, "t_imports")
    elastic_plan_mode(args, world)
    try:
        d = derive(args, world)
        if args.data_path is not None:   # a missing or odd file: said now, not by the data worker after the set-up
            from elastor_ds.data.dataset import open_data_file
            os.close(open_data_file(args.data_path))
    except (UsageError, ElastorError) as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    elastic_mark(ctl, "t_planned")

    from elastor_ds import deepspeed as eds
    eds.init_distributed(dist_backend="nccl" if cuda else "gloo")
    import torch.distributed as dist
    elastic_mark(ctl, "t_dist")
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    import gpt_pipe
    from elastor_ds.data import CharTokenizer, PrefetchLoader
    from elastor_ds.integrations.megatron.specs import GPTSpecConfig

    rank = dist.get_rank()
    tp, pp, dp, gas = d["tp"], d["pp"], d["dp"], d["gas"]
    rt = None
    if d["hetero"]:  # each replica its own pipeline; megatron's TP group = this rank's stage's
        from elastor_ds.integrations.deepspeed.hetero import HeteroRuntime
        from elastor_ds.integrations.megatron.parallel import use_stage_tp_group
        rt = HeteroRuntime.create(gpt_pipe.pipe_layout(d["layout"]))
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        use_stage_tp_group(rt.tp_group, rt.stage_ranks)
        tp, pp, gas = rt.pos.tp, len(rt.stages), rt.micro_batches
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    tok = CharTokenizer()
    spec_cfg = GPTSpecConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                             num_attention_heads=args.num_attention_heads, vocab_size=tok.vocab_size,
                             ffn_hidden_size=d["ffn"], num_query_groups=d["groups"],
                             gated_linear_unit=args.swiglu, add_bias_linear=False, normalization="RMSNorm",
                             make_vocab_size_divisible_by=8, max_sequence_length=d["max_pos"])
    tcfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=d["groups"], ffn_hidden_size=d["ffn"], gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=False, normalization="RMSNorm", use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    padded_vocab = spec_cfg.padded_vocab(tp)
    layers = gpt_pipe.build_layers(tcfg, args.num_layers, padded_vocab, d["max_pos"], seed=args.seed,
                                   true_vocab=tok.vocab_size)
    if rt is not None:
        model = eds.PipelineModule(layers, loss_fn=gpt_pipe.make_loss_fn(CharTokenizer.PAD), plan=rt.layout)
    else:
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        model = eds.PipelineModule(layers, topology=topo, loss_fn=gpt_pipe.make_loss_fn(CharTokenizer.PAD),
                                   boundaries=gpt_pipe.ds_parts(d["boundaries"], args.num_layers))
    model.elastor_geometry = gpt_pipe.Geometry(spec_cfg, tp, ps.get_tensor_model_parallel_rank(), args.num_layers)
    cfg = ds_config(args, d)
    engine, optimizer, _, sched = eds.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args)))
    layout = d["layout"]
    start = int(engine.global_steps)
    check_resumed_data(engine, args)
    from elastor_ds.elastic.protocol import ENV_PROFILE_BREAKDOWN
    from elastor_ds.testing import state_memory
    state_mem = state_memory.track(engine)  # training-state bytes (metrics "state_bytes", vs the planner's model)
    elastic_mark(ctl, "t_loaded")
    if ctl is not None:
        ctl.report_started(rank, world_size=world, layout=layout.describe(), resumed_from=start,
                           restore=engine.elastor.restore if engine.elastor is not None else None,
                           metrics_file=os.path.abspath(args.metrics_file) if args.metrics_file else None)
    gbs = args.global_batch_size
    if rank == 0:
        if rt is not None:
            log.info("%s layout %s on %d processes; starting at iteration %d",
                     "uniform" if layout.is_uniform() else "heterogeneous", layout.describe(), world, start)
        else:
            log.info("layout %s on %d processes (TP %d x PP %d x DP %d, gas %d); starting at iteration %d",
                     layout.describe(), world, tp, pp, dp, gas, start)

    # data: built-in corpus unless --data-path; each replica takes its slice of every global batch
    data_path = args.data_path
    if data_path is None:
        data_path = builtin_corpus(args.seed, args.seq_length, rank)
        dist.barrier()
    stage = engine.stage_id
    needs_data = stage == 0 or stage == pp - 1
    per_replica = tuple(r.micro_batches for r in layout.replicas) if rt is not None else tuple([gas] * dp)
    replica = rt.pos.replica if rt is not None else engine.grid.get_data_parallel_id()
    loader = PrefetchLoader(data_path, args.seq_length, args.seed, per_replica, args.micro_batch_size,
                            replica=replica, start_iteration=start) if needs_data else None

    def batches():
        while True:
            b = torch.from_numpy(loader.next())
            for k in range(gas):
                mb = b[k * args.micro_batch_size:(k + 1) * args.micro_batch_size]
                yield mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
    it_data = batches() if needs_data else None
    prof = None
    # skip the launch's warm-up: its first iteration, and the second when there are enough (after a
    # relaunch the first few run up to 1.5x slower than the launch's median on CPU processes)
    skip = 2 if start + 2 < args.train_iters else 1

    def profiler(first: int, n: int):
        import layer_profile
        p = layer_profile.LayerProfiler(engine.module, gpt_pipe.TransformerLayerPipe, tp, gas, first, n)
        p.attach(engine)
        return p
    if args.save and args.profile_iters > 0 and start + skip < args.train_iters:
        prof = profiler(start + skip, min(args.profile_iters, args.train_iters - start - skip))
    shared = None   # (single-layer ratios, calibrated collectives) of the launch's first window
    timed = None    # every rank's counters of every timed iteration of this launch (all windows so far)
    windows = 0
    plan_info = dict(getattr(args, "plan_info", None) or {"plan_source": "file" if args.elastor_plan else "flags"})
    if rank == 0 and args.save:   # what the next launch re-plans from (--elastor-plan auto)
        import layer_profile
        layer_profile.write(plan_document_of(layout, world), args.save, name=layer_profile.PLAN_NAME)
    if "predicted_iter_s" not in plan_info:   # a given plan, priced with the profile of an earlier launch
        import layer_profile
        prof_path = layer_profile.find(args.load, args.save)
        if prof_path:
            with open(prof_path) as f:
                plan_info.update(predicted_iter_s=price_layout(args, world, layout, json.load(f)), profile=prof_path)
    mfile = open(args.metrics_file, "a") if (args.metrics_file and rank == 0) else None
    t_start = time.time()
    last = args.train_iters if args.exit_after_iters is None else min(args.train_iters, args.exit_after_iters)
    try:
        for it in range(start, last):
            injected_fault(f"iteration-{it + 1}", rank)   # dies as it starts iteration it + 1 (1-based)
            t0 = time.perf_counter()
            c0 = time.process_time()   # every thread of this process (writer, peer copy, gloo's I/O)
            n_saves = len(engine.elastor.stats) if engine.elastor else 0
            # the storage writer still writing an earlier save as this iteration starts: it overlaps it
            writing = engine.elastor is not None and not engine.elastor.ckpt.local_idle()
            mem = engine.elastor.memory if engine.elastor else None
            n_snaps = len(mem.stats) if mem is not None else 0
            if mem is not None and args.elastor_memory_snapshot_ab_blocks > 0:   # step it + 1 is saved after it
                mem.paused = ((it + 1) // args.elastor_memory_snapshot_ab_blocks) % 2 == 1
            if prof is not None:
                prof.begin(it)
            loss = float(engine.train_batch(it_data))
            dt = time.perf_counter() - t0
            cpu_dt = time.process_time() - c0
            state_all = None
            if it == min(start + 1, last - 1):  # the second iteration: the optimizer's state exists
                state_all = [None] * world
                dist.all_gather_object(state_all, state_memory.peak(state_mem))
            if prof is not None and prof.end(it, dt):
                import layer_profile
                doc = prof.gather(args.micro_batch_size, args.seq_length)
                windows += 1
                if timed is None:
                    first_timed = prof.first + 1
                    timed = [dict(r, per_iter=list(r["per_iter"])) for r in prof.breakdown]
                else:   # the terms of the median timed iteration of all the launch's windows so far
                    for acc, r in zip(timed, prof.breakdown):
                        acc["per_iter"].extend(r["per_iter"])
                    doc = dict({k: doc[k] for k in ("version", "micro_batch_size", "seq_length", "device")},
                               **layer_profile.in_situ_terms(timed))
                if rank == 0 and os.environ.get(ENV_PROFILE_BREAKDOWN):  # per-rank raw timings (bench)
                    with open(os.environ[ENV_PROFILE_BREAKDOWN], "a") as f:
                        f.write(json.dumps({"world": world, "layout": layout.describe(), "ranks": prof.breakdown})
                                + "\n")
                # the job's own collective costs (per call, per group size) for the planner; collective.
                # Measured in the launch's first window only; later windows refresh the in-situ terms
                first_window = shared is None
                t_comm = time.perf_counter()
                if first_window:
                    from elastor_ds.comm.calibrate import measure_collectives
                    shared = (micro_ratios(args), measure_collectives((2, 3, 4), reps=3))
                layer_profile.scale_widths(doc, shared[0])
                doc["collectives"] = json.loads(json.dumps(shared[1]))
                doc.setdefault("sources", {})["collectives"] = ("measured: per-call latency and seconds per byte "
                                                                "of this job's groups of 2-4 ranks, 3 repetitions; "
                                                                "this width's TP all-reduce and p2p as the job ran "
                                                                "them")
                ins = layer_profile.apply_in_situ(doc)
                if not cuda:   # CPU processes share the node's cores: the cost model's bubble needs it
                    aff = getattr(os, "sched_getaffinity", None)   # Linux; elsewhere all of the machine's
                    doc["cores_per_node"] = len(aff(0)) if aff else (os.cpu_count() or 1)
                    doc.setdefault("sources", {})["cores_per_node"] = (
                        "measured: the CPUs this node's trainer processes may run on (sched_getaffinity)")
                # the gradient sync as this job ran it: the calibration's sync collectives scaled to it
                if ins.get("grad_reduce_s") and price_layout(args, world, layout, doc) is not None:
                    layer_profile.scale_sync(doc, ins["grad_reduce_s"], args.last_breakdown["sync"],
                                             prof.last - first_timed + 1)
                if first_window:
                    plan_info["profile_comm_s"] = time.perf_counter() - t_comm
                    plan_info["predicted_iter_s_at_launch"] = plan_info.get("predicted_iter_s")
                plan_info["profile_iterations"] = [first_timed, prof.last]   # 1-based, inclusive
                if rank == 0:
                    plan_info["profile_written"] = layer_profile.write(doc, args.save)
                # the running plan re-priced with the profile just measured (the launch's own numbers)
                plan_info["predicted_iter_s"] = price_layout(args, world, layout, doc)
                plan_info["predicted_terms_s"] = getattr(args, "last_breakdown", None)
                plan_info["predicted_sources"] = source_kinds(getattr(args, "last_sources", None) or {})
                if rank == 0:   # about 2 KB: at INFO for the first window, DEBUG for the later ones
                    log.log(logging.INFO if first_window else logging.DEBUG,
                            "running plan re-priced with this launch's profile: %.4g s/iter; priced from: %s",
                            plan_info["predicted_iter_s"] or float("nan"),
                            "; ".join(f"{k}: {v}" for k, v in (getattr(args, "last_sources", None) or {}).items()))
                reprice_alternatives(args, world, plan_info, doc, first_window)
                # the next window: the profile, the median timed iteration of all windows, follows the
                # launch past its start-up transients (the controller's standby workers importing,
                # relaunch warm-up) and bursts of other work; only windows that can close
                prof = (profiler(it + 1, args.profile_iters)
                        if it + 1 + args.profile_iters <= last and windows < PROFILE_WINDOWS else None)
            saved = engine.elastor is not None and len(engine.elastor.stats) > n_saves
            stall = engine.elastor.stats[-1].stall_s if saved else None
            snapped = mem is not None and len(mem.stats) > n_snaps
            if mfile:
                rec = {"iteration": it + 1, "lm_loss": loss, "consumed_samples": (it + 1) * gbs,
                       "lr": float(sched.get_last_lr()[0]) if sched else args.lr, "layout": layout.describe(),
                       "world_size": world, "iter_time_s": dt, "process_cpu_s": cpu_dt, "time": time.time()}
                if saved:
                    rec["save_stall_s"] = stall
                    if len(engine.elastor.stats) > 1:   # the save before this one has finished (this one waited)
                        prev = engine.elastor.stats[-2]
                        rec["prev_save_durable_s"] = prev.durable_s
                        rec["prev_save_writer_cpu_s"] = prev.writer_cpu_s
                        if prev.live:   # checkpoint.live_write: what its fence (the next optimizer step) copied
                            rec["prev_save_fence_s"] = prev.fence_s
                            rec["prev_save_fence_bytes"] = prev.fence_bytes
                            rec["prev_save_bytes"] = prev.bytes_written
                if engine.elastor is not None and args.save_interval > 0:
                    rec["storage_writer_busy"] = writing
                if snapped:
                    rec["snapshot_stall_s"] = mem.stats[-1].stall_s
                    # the training thread's whole share (shard list, plan, waiting for the previous
                    # snapshot, the copy), and the background writer's CPU for the previous snapshot
                    rec["snapshot_hook_s"] = engine.elastor.last_hook_s
                    rec["snapshot_wait_s"] = mem.stats[-1].wait_s
                    if len(mem.stats) > 1:
                        rec["snapshot_writer_cpu_s"] = mem.stats[-2].writer_cpu_s
                        if mem.stats[-2].live:   # memory_snapshot.live_write: what its fence (this step) copied
                            rec["prev_snapshot_fence_s"] = mem.stats[-2].fence_s
                            rec["prev_snapshot_fence_bytes"] = mem.stats[-2].fence_bytes
                            rec["prev_snapshot_bytes"] = mem.stats[-2].bytes_written
                    rec["snapshots_dropped"] = mem.ckpt.saves_dropped
                    pc = getattr(mem, "peer_copier", None)
                    done = [c for c in pc.stats if c.copy_s > 0] if pc is not None else []
                    if done:   # rank 0's newest finished peer copy (background) and the wait before it
                        rec.update(peer_copy_s=done[-1].copy_s, peer_copy_wait_s=done[-1].wait_s,
                                   peer_copy_cpu_s=done[-1].cpu_s, peer_copy_seq=done[-1].seq,
                                   peer_copy_bytes=done[-1].bytes_sent, peer_copy_ok=done[-1].error is None)
                rec.update(plan_info)
                if it == start:
                    rec["plan"] = layout.to_json()
                    rec["zero_stage"] = d["zero_stage"]
                if state_all is not None:
                    rec["state_bytes"] = state_all  # per rank: params/grads/optimizer bytes at their peak
                mfile.write(json.dumps(rec) + "\n")
                mfile.flush()
            if rank == 0 and ((it + 1) % args.log_interval == 0 or it == start):
                log.info("iteration %d/%d | lm loss %.4f | %.0f ms/iter%s", it + 1, args.train_iters, loss, dt * 1e3,
                         f" | saved (stall {stall * 1e3:.1f} ms)" if saved else "")
            code = elastic_stop_point(ctl, engine, args, it + 1, rank)
            if code is not None:
                return code
        if args.exit_after_iters is None and engine.elastor is not None and args.save:
            injected_fault("before-final-save", rank, settle=engine.elastor.wait)
            if engine.elastor.last_save_step != int(engine.global_steps):
                engine.elastor.save()
        if engine.elastor is not None:
            engine.elastor.finalize()
    finally:
        if loader is not None:
            loader.close()
        if mfile:
            mfile.close()
    if rank == 0:
        log.info("done: %d iterations in %.1f s", last - start, time.time() - t_start)
    return 0


def injected_fault(point: str, rank: int, settle=None) -> None:
    """Fault injection for tests: ``ELASTOR_EXAMPLE_FAULT=<point>:<rank>`` SIGKILLs that rank when it
    reaches ``point`` in the first launch of an ``elastor run`` job (``ELASTOR_ROUND`` 0), a real
    kill at a moment a signal from outside cannot hit reliably; ``settle`` runs first on that rank
    (e.g. wait until the in-flight saves committed). Points: ``before-final-save``, ``iteration-N``
    (as the rank starts 1-based iteration N, its peers already inside it). Unset: nothing happens."""
    spec = os.environ.get("ELASTOR_EXAMPLE_FAULT", "")
    if not spec:
        return
    from elastor_ds.elastic.protocol import launch_context
    if launch_context().round != 0:
        return
    want, _, who = spec.partition(":")
    if want == point and who.isdigit() and int(who) == rank:
        if settle is not None:
            settle()
        log.warning("injected fault: SIGKILL of rank %d at %s", rank, point)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- elastic controller hooks (`elastor run`)
def elastic_attach():
    """The hooks of ``elastor run`` (heartbeat, graceful stop, start-up marks), or None without it."""
    from elastor_ds.elastic.worker import ElasticWorker
    return ElasticWorker.from_env()


def elastic_mark(ctl, name: str) -> None:
    if ctl is not None:
        ctl.mark(name)


def elastic_cluster(world: int):
    """The cluster the planner sees: the processes per node (and device memory) ``elastor run``
    launched, else one node of ``world`` processes."""
    from elastor_ds.elastic.protocol import launched_world
    from elastor_ds.plan import Cluster
    lw = launched_world()
    if lw is None or lw.world_size != world:
        return Cluster.from_gpus_per_node([world])
    kw = {"gpu_memory_gb": lw.gpu_memory_gb} if lw.gpu_memory_gb else {}
    return Cluster.from_gpus_per_node(list(lw.procs_per_node), **kw)


def elastic_plan_mode(args: argparse.Namespace, world: int) -> None:
    """``--elastor-plan on-change``: the TP/PP flags while the world is the one ``elastor run``
    first launched, the planner's layout ('auto') once it changed."""
    if args.elastor_plan != "on-change":
        return
    from elastor_ds.elastic.protocol import launched_world
    lw = launched_world()
    initial = lw.initial_world_size if lw is not None and lw.initial_world_size else world
    args.elastor_plan = None if world == initial else "auto"


def elastic_stop_point(ctl, engine, args: argparse.Namespace, iteration: int, rank: int) -> int | None:
    """End of an iteration under ``elastor run``: heartbeat, then agree on a stop request; on one,
    checkpoint this iteration, wait until it is durable and return the exit code."""
    if ctl is None:
        return None
    ctl.heartbeat(iteration, last=iteration == args.train_iters)
    code = ctl.agree_stop()
    if not code:
        return None
    el = engine.elastor
    if el is not None and (args.save or args.load):
        if el.last_save_step != int(engine.global_steps):
            el.save()
        el.finalize()
    if rank == 0:
        log.info("stop requested (%s): iteration %d checkpointed durably; exiting", code.name.lower(), iteration)
    return code.exit_code()


if __name__ == "__main__":
    sys.exit(main())
