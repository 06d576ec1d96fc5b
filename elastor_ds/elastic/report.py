"""The end-of-run report of ``elastor run``: a summary table (phases, recoveries with their time
broken down, lost iterations) and a timeline PNG (loss and throughput over wall time, events marked)."""
from __future__ import annotations

import logging
import os

from .events import EventKind, Phase, Recovery, phases, read_jsonl, recoveries, restore_bytes

log = logging.getLogger("elastor.run")


def metrics_file(events: list[dict]) -> str | None:
    for e in reversed(events):
        if e.get("event") == EventKind.WORKER_STARTED.value and e.get("metrics_file"):
            return e["metrics_file"]
    return None


def _fmt(x, spec=".2f", none="-") -> str:
    return none if x is None else format(x, spec)


def _predicted(ph: Phase) -> float | None:
    """The chosen plan's predicted seconds per iteration (the trainer's ``predicted_iter_s``)."""
    p = ph.plan or {}
    v = p.get("predicted_iter_s")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    num = {k: v for k, v in p.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return next((v for k, v in num.items() if "predicted" in k and "uniform" not in k and "idle" not in k), None)


def _ms(seconds: float) -> str:
    """Milliseconds, 3 significant digits below 100 ms, whole milliseconds above."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _plan_text(ph: Phase) -> str:
    """Chosen plan, predicted vs measured ms/iteration, and the best uniform plan on the same world
    (how many processes it leaves idle), from the trainer's fields."""
    p = ph.plan
    if not p:
        return ""
    pred = _predicted(ph)
    uni = p.get("uniform_predicted_iter_s")
    uni = uni if isinstance(uni, (int, float)) and not isinstance(uni, bool) else None
    bits = []
    if isinstance(p.get("plan_source"), str):
        bits.append(f"source {p['plan_source']}")
    if pred is not None:
        meas = ph.median_iter_s
        bits.append(f"predicted {_ms(pred)} ms/it" + (
            f" vs measured {_ms(meas)} (predicted/measured {pred / meas:.2f})" if meas and pred > 0 else ""))
    uplan = p.get("uniform_plan")
    if uni is not None or isinstance(uplan, str):
        idle = p.get("uniform_idle_processes")
        bits.append("best uniform on this world" + (f" {uplan}" if isinstance(uplan, str) else "")
                    + (f" {_ms(uni)} ms/it" if uni is not None else "")
                    + (f" ({uni / pred:.3f}x)" if uni and pred else "")
                    + (f", {idle} of {ph.world_size} process(es) idle" if isinstance(idle, int) and idle > 0 else
                       ", every process used" if idle == 0 else ""))
    src = p.get("predicted_sources")
    if isinstance(src, dict) and src:
        kinds: dict[str, list[str]] = {}
        for term, kind in src.items():
            kinds.setdefault(str(kind), []).append(str(term).replace("_", " "))
        bits.append("priced from " + ", ".join(f"{k}: {' + '.join(v)}" for k, v in kinds.items()))
    return "; ".join(bits)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n else "0"


def restore_text(r: Recovery) -> str:
    """Where the relaunched trainer restored from: tier, step, bytes per tier, load seconds."""
    rs = r.restore
    by = restore_bytes(rs)
    if rs is None or by is None:
        return ""
    return (f"restored step {rs.get('step')} from {rs.get('tier')} in {_fmt(rs.get('seconds'))} s"
            f"{' (fell back)' if rs.get('fell_back') else ''}; bytes from local memory {_mb(by['local'])}, "
            f"peers {_mb(by['peer'])}, storage {_mb(by['storage'])}")


def summary_table(events: list[dict], metrics: list[dict]) -> str:
    phs = phases(events, metrics)
    recs = recoveries(events, metrics)
    lines = ["=" * 100, "elastor run: phases"]
    lines.append(f"{'#':<3}{'world':>6}  {'layout':<34}{'iterations':<14}{'ms/iter':>9}{'pred ms':>9}"
                 f"{'samples/s':>11}  ended by")
    for ph in phs:
        its = f"{ph.first_iteration}-{ph.last_iteration}" if ph.first_iteration is not None else "-"
        lay = ph.layout if len(ph.layout) <= 33 else ph.layout[:30] + "..."
        pred = _predicted(ph)
        lines.append(f"{ph.index:<3}{ph.world_size:>6}  {lay:<34}{its:<14}"
                     f"{_fmt(ph.median_iter_s and ph.median_iter_s * 1e3, '.0f'):>9}"
                     f"{_fmt(pred and pred * 1e3, '.0f'):>9}{_fmt(ph.samples_per_s, '.1f'):>11}  "
                     f"{ph.ended_by or '-'}")
        if len(ph.layout) > 33:
            lines.append(f"{'':<11}layout: {ph.layout}")
        pt = _plan_text(ph)
        if pt:
            lines.append(f"{'':<11}plan: {pt}")
    if recs:
        keys: list[str] = []
        for r in recs:
            for k in r.parts:
                if k not in keys:
                    keys.append(k)
        lines.append("-" * 100)
        lines.append("recoveries (seconds)")
        head = f"{'kind':<10}{'cause':<22}{'world':<8}{'lost its':>9}  {'workers':<22}" + \
               "".join(f"{k[:13]:>14}" for k in keys) + f"{'to training':>13}"
        lines.append(head)
        for r in recs:
            world = f"{r.world_before}->{r.world_after}"
            row = f"{r.kind:<10}{r.cause[:21]:<22}{world:<8}{_fmt(r.lost_iterations, 'd'):>9}  " + \
                  f"{(r.launch_mode or '-')[:21]:<22}" + "".join(f"{_fmt(r.parts.get(k)):>14}" for k in keys) + \
                  f"{_fmt(r.total_s):>13}"
            lines.append(row)
        for r in recs:
            text = restore_text(r)
            if text:
                lines.append(f"  {r.kind} {r.world_before}->{r.world_after}: {text}")
        lines.append("  detect: fault -> noticed; rdzv+spawn: rendezvous until the worker runs (standby: is assigned); "
                     "start-up: imports + process group;\n  build+load: model, engine, checkpoint load; to training: "
                     "fault (or request) -> first resumed iteration starts; first iter: that iteration's time;\n"
                     "  workers: spawned fresh (spawn), a standby that had done its imports (standby-warm) or one still "
                     "importing (standby-cold)")
    stops = [e for e in events if e.get("event") in (EventKind.STOPPED.value, EventKind.PREEMPTED.value,
                                                     EventKind.FINISHED.value)]
    if stops:
        e = stops[-1]
        lines.append("-" * 100)
        lines.append(f"end: {e['event']}" + (f" - {e['reason']}" if e.get("reason") else ""))
    lines.append("=" * 100)
    return "\n".join(lines)


def timeline_png(events: list[dict], metrics: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no timeline plot")
        return False
    its = [m for m in metrics if "iteration" in m and "time" in m]
    if not its:   # nothing trained: the table says what happened
        return False
    t0 = min([e["time"] for e in events] + [m["time"] for m in its])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    phs = phases(events, metrics)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ph in phs:
        pts = [m for m in its if ph.t_begin - 1e-3 <= m["time"] - m.get("iter_time_s", 0) and m["time"] <= ph.t_end + 1e-6]
        if not pts:
            continue
        c = colors[ph.index % len(colors)]
        ax1.plot([m["time"] - t0 for m in pts], [m["lm_loss"] for m in pts], color=c, lw=1.1,
                 label=f"{ph.layout} on {ph.world_size}")
        tp = [(m["time"] - t0, m.get("consumed_samples", 0) / max(1, m["iteration"]) / m["iter_time_s"])
              for m in pts if m.get("iter_time_s")]
        ax2.plot([p[0] for p in tp], [p[1] for p in tp], color=c, lw=0.8)
        ax2.axvspan(ph.t_begin - t0, ph.t_end - t0, color=c, alpha=0.08)
    for a, b in zip(phs, phs[1:]):   # recovering: no training between two phases
        for ax in (ax1, ax2):
            ax.axvspan(a.t_end - t0, b.t_begin - t0, color="gray", alpha=0.15,
                       label="recovering" if (ax is ax1 and a is phs[0]) else None)
    style = {"failure": ("red", "--"), "scale_up_requested": ("green", "-."), "preempt_requested": ("purple", ":"),
             "injected": ("black", ":"), "stopped": ("red", "-")}
    seen = set()
    for e in events:
        k = e.get("event")
        if k not in style:
            continue
        c, ls = style[k]
        for ax in (ax1, ax2):
            ax.axvline(e["time"] - t0, color=c, ls=ls, lw=0.9, label=k if (ax is ax1 and k not in seen) else None)
        seen.add(k)
    ax1.set_ylabel("lm loss")
    ax2.set_ylabel("samples / s")
    ax2.set_xlabel("wall time (s)")
    ax1.set_title("elastor run: loss and throughput; failures, relaunches and scale-ups marked")
    ax1.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    try:
        replace_file(path, buf.getvalue())
    except OSError as e:   # a report, never a reason to fail the run
        log.warning("could not write the timeline %s: %s", path, e.strerror or e)
        return False
    return True


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` as a new file: a temp file of our own in the same folder
    (``O_EXCL | O_NOFOLLOW``), renamed over ``path``. A symlink someone planted at ``path`` is
    replaced, never followed (``savefig(path)`` wrote through it into the link's target); an
    entry of another user in a sticky folder makes the rename fail (EPERM), and nothing is written."""
    import secrets
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_report(events_path: str, png_path: str | None = None,
                 events: list[dict] | None = None) -> tuple[str, str | None]:
    """The table and the timeline of ``events`` (default: every record of ``events_path``)."""
    events = read_jsonl(events_path) if events is None else events
    metrics = read_jsonl(metrics_file(events))
    table = summary_table(events, metrics)
    png = None
    if png_path:
        if timeline_png(events, metrics, png_path):
            png = png_path
    return table, png


__all__ = ["Phase", "Recovery", "summary_table", "timeline_png", "write_report"]
