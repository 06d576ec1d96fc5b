"""What background checkpoint work costs training steps, measured within one run (pure: trainer
metric records in, numbers out): memory snapshots (:func:`paired_overhead`) and the storage
writer (:func:`writer_effect`).

The trainer's ``--elastor-memory-snapshot-ab-blocks B`` pauses snapshots in every other block of
``B`` iterations. An iteration is "with" when it took a snapshot while the previous one's writer
ran (it and the one before it snapshotted: the steady state), "without" when neither did; the
iteration right after a "with" block still carries that block's last writer and counts as
neither. Comparing iterations of the same processes minutes apart cancels what separate runs on
a shared machine cannot (placement, load drift: separate-run pairs swing -11 % .. +39 % here).
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping


def paired_overhead(records: Iterable[Mapping[str, Any]], block: int, skip: int = 3) -> dict[str, Any]:
    """``records``: the trainer's metrics lines (``iteration``, ``iter_time_s``, ``snapshot_stall_s``
    when that iteration took a snapshot); the first ``skip`` iterations are warm-up. Returns the
    medians and means of both kinds, their ratios - 1 and, per "with" block, its median against
    the next "without" block's (``block_pair_overheads``); with ``process_cpu_s`` in the records also
    ``process_cpu_added_over_iter``: the median process CPU of a "with" iteration minus a "without"
    one's, over the median "without" iteration time (the snapshot's whole CPU cost, every thread), and
    the same of means (``..._of_means``: what a cost paid every N-th iteration shows in)."""
    if block < 1:
        raise ValueError(f"block={block}: must be >= 1")
    recs = [r for r in records if r["iteration"] > skip]
    snapped = {r["iteration"] for r in recs if r.get("snapshot_stall_s") is not None}
    with_: list[float] = []
    without: list[float] = []
    blocks: dict[int, tuple[str, list[float]]] = {}
    cpu: dict[str, list[float]] = {"with": [], "without": []}
    for r in recs:
        i = r["iteration"]
        kind = ("with" if i in snapped and i - 1 in snapped else
                "without" if i not in snapped and i - 1 not in snapped else None)
        if kind:
            (with_ if kind == "with" else without).append(r["iter_time_s"])
            if r.get("process_cpu_s") is not None:   # all threads: background writers included
                cpu[kind].append(r["process_cpu_s"])
            blocks.setdefault(i // block, (kind, []))[1].append(r["iter_time_s"])
    if not with_ or not without:
        raise ValueError(f"no {'with' if not with_ else 'without'}-snapshot iterations among {len(recs)} records "
                         f"(block {block}): run more iterations, or pass --elastor-memory-snapshot-ab-blocks")
    order = sorted(blocks)
    pairs = [statistics.median(blocks[b][1]) / statistics.median(blocks[n][1]) - 1
             for b, n in zip(order, order[1:]) if blocks[b][0] == "with" and blocks[n][0] == "without"]
    mw, mo = statistics.median(with_), statistics.median(without)
    aw, ao = statistics.fmean(with_), statistics.fmean(without)
    have_cpu = bool(cpu["with"] and cpu["without"])
    return {"block": block, "iterations_with": len(with_), "iterations_without": len(without),
            "process_cpu_added_over_iter": (statistics.median(cpu["with"]) - statistics.median(cpu["without"])) / mo
            if have_cpu else None,
            "process_cpu_added_over_iter_of_means": (statistics.fmean(cpu["with"]) - statistics.fmean(cpu["without"])) / ao
            if have_cpu else None,
            "median_iter_s_with": mw, "median_iter_s_without": mo, "mean_iter_s_with": aw, "mean_iter_s_without": ao,
            "step_overhead": mw / mo - 1, "step_overhead_of_means": aw / ao - 1,
            "step_overhead_median_of_block_pairs": statistics.median(pairs) if pairs else None,
            "block_pair_overheads": pairs}


def writer_effect(records: Iterable[Mapping[str, Any]], skip: int) -> dict[str, Any]:
    """The storage writer's cost to training in one run of the trainer saving asynchronously every
    few iterations. ``records``: its metrics lines (``iteration``, ``iter_time_s``, ``save_stall_s`` on
    the iterations that saved, ``storage_writer_busy``: the writer was still writing an earlier save
    when the iteration started, ``prev_save_durable_s`` / ``prev_save_writer_cpu_s`` on a saving
    iteration: the save before it, from its call to its commit / the writer thread's CPU); the
    first ``skip`` iterations are warm-up.

    "Writing" iterations started while the writer wrote and did not save; "idle" ones did neither.
    ``write_s`` of a save: its call-to-commit time minus its stall (the writer's wall time, which
    the training overlaps). The writing iterations after one save took ``extra`` seconds more than
    the idle median in all; in ``write_s`` of wall time the training thread then did the work of
    ``write_s - extra`` idle seconds, so the compute rate while the writer writes, as idle time
    over time taken, is ``write_s / (write_s - extra)`` (``compute_while_writing_over_idle``: the
    median over saves; the issue-23 goal is <= 1.3). Also the median iteration ratio, the save
    stall and the writer's CPU per save, each over the median idle iteration; with live writes
    (``prev_save_fence_s``, ``prev_save_fence_bytes``, ``prev_save_bytes``) also the fence's time
    over the idle iteration and the share of the bytes it copied (medians over saves)."""
    recs = sorted((r for r in records if r["iteration"] > skip), key=lambda r: r["iteration"])
    idle = [r["iter_time_s"] for r in recs if r.get("save_stall_s") is None and r.get("storage_writer_busy") is False]
    writing = [r["iter_time_s"] for r in recs if r.get("save_stall_s") is None and r.get("storage_writer_busy")]
    if not idle or not writing:
        raise ValueError(f"no {'idle' if not idle else 'writing'} iterations among {len(recs)} records: run more "
                         f"iterations, with --save-interval of 3 or more (records need storage_writer_busy)")
    base = statistics.median(idle)
    per_save: list[float] = []
    write_s: list[float] = []
    stalls = [r["save_stall_s"] for r in recs if r.get("save_stall_s") is not None]
    cpu = [r["prev_save_writer_cpu_s"] for r in recs if r.get("prev_save_writer_cpu_s") is not None]
    saves = [k for k, r in enumerate(recs) if r.get("save_stall_s") is not None]
    for a, b in zip(saves, saves[1:]):   # save a's writer, the iterations until save b (which reports a's times)
        durable = recs[b].get("prev_save_durable_s")
        if durable is None:
            continue
        w = durable - recs[a]["save_stall_s"]
        extra = sum(r["iter_time_s"] - base for r in recs[a + 1:b] if r.get("storage_writer_busy"))
        write_s.append(w)
        per_save.append(w / (w - extra) if w > extra else float("inf"))
    # checkpoint.live_write: each save's fence (in the next optimizer step) copied what the writer had
    # not read yet; that copy is the save's stall too, in a writing iteration
    fences = [r["prev_save_fence_s"] for r in recs if r.get("prev_save_fence_s") is not None]
    shares = [r["prev_save_fence_bytes"] / r["prev_save_bytes"] for r in recs
              if r.get("prev_save_fence_bytes") is not None and r.get("prev_save_bytes")]
    live = {"live_fence_over_iter": statistics.median(fences) / base,
            "live_fence_share_of_bytes": statistics.median(shares) if shares else None,
            "live_saves": len(fences)} if fences else {}
    return {**live, "iterations_writing": len(writing), "iterations_idle": len(idle), "saves_measured": len(per_save),
            "median_iter_s_idle": base, "median_iter_s_writing": statistics.median(writing),
            "iter_writing_over_idle": statistics.median(writing) / base,
            "compute_while_writing_over_idle": statistics.median(per_save) if per_save else None,
            "per_save_compute_while_writing_over_idle": per_save,
            "median_write_s": statistics.median(write_s) if write_s else None,
            "write_s_over_iter": statistics.median(write_s) / base if write_s else None,
            "save_stall_over_iter": statistics.median(stalls) / base if stalls else None,
            "writer_cpu_over_iter": statistics.median(cpu) / base if cpu else None}
