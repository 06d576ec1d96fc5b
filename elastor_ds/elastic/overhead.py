"""The step overhead of memory snapshots, measured within one run (pure: trainer metric records in, numbers out).

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
