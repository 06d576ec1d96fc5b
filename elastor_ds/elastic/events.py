"""Event records of an elastic run and what they add up to (pure: no torch).

One JSON object per line: ``{"event": KIND, "time": unix seconds, "node": node id, ...}``. The
controller writes most kinds; rank 0 of the workers appends ``worker_started`` (its start-up marks)
and ``restore`` (where its resumed bytes came from) and an external fault injector may append ``injected`` (when it broke something). Lines are
written with one ``write`` on an ``O_APPEND`` descriptor, so writers on one machine do not
interleave.

:func:`recoveries` turns failure and scale-up events into a breakdown: detection, teardown, probe,
rendezvous + spawn, start-up (imports, process group), planning, model build + load, and the time
from the failure to resumed training, plus the iterations lost (taken from the metrics file). Part
names: ``detect`` (fault -> noticed), ``teardown`` (rest of the group killed), ``graceful stop``
(scale-up: workers checkpoint and exit), ``probe``, ``rdzv+spawn`` (rendezvous until the worker
process runs; with standby workers: until the standby is assigned its rank), ``start-up`` (imports
+ process group), ``planning``, ``build+load`` (model, engine and checkpoint load), ``first iter``
(the first resumed iteration, from the metrics file; not part of "to training", which ends when it
starts). Each recovery also carries the relaunched trainer's restore record (``restore``: tier
memory/storage, step, bytes per source, seconds) and names how its workers were made (``launch_mode``: spawned processes,
standbys that had done their imports, standbys still importing, or a mix of those).
"""
from __future__ import annotations

import enum
import json
import logging
import os
import stat
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_JSONL_BYTES = 1 << 30   # an events or metrics file read back for the report (~500 B per iteration)


class EventKind(str, enum.Enum):
    START = "start"                      # controller started (pid, flags)
    RENDEZVOUS = "rendezvous"            # about to rendezvous for a launch
    LAUNCH = "launch"                    # workers spawned (round, world, devices)
    WORKER_STARTED = "worker_started"    # trainer rank 0: start-up marks, resumed step, layout
    RESTORE = "restore"                  # trainer rank 0: restore tier, step, bytes per source, seconds
    INJECTED = "injected"                # a fault injector broke something (demo/tests)
    FAILURE = "failure"                  # detected: ranks, devices, causes
    TEARDOWN = "teardown"                # remaining workers stopped
    PROBE = "probe"                      # device probe results
    DECISION = "decision"                # shrink/restart/stop and why
    SCALE_UP_REQUESTED = "scale_up_requested"
    SCALE_UP = "scale_up"                # devices added back; graceful stop done
    MEMBERSHIP = "membership"            # another node joins/leaves: relaunch
    PREEMPT_REQUESTED = "preempt_requested"
    PREEMPTED = "preempted"              # workers saved and exited
    FINISHED = "finished"                # all workers exited 0
    STOPPED = "stopped"                  # gave up (infeasible, max restarts, no device)
    RECOVERY = "recovery"                # at the end: lost iterations, time to resumed training, parts
    STANDBY = "standby"                  # standby worker interpreters spawned (pids)
    FENCED = "fenced"                    # this node lost the round's store: its workers were killed


class EventLog:
    """Append-only JSONL event file (``path=None``: keep events in memory only)."""

    def __init__(self, path: str | None, node: str = "0"):
        self.path = path
        self.node = node
        self.records: list[dict] = []
        self._broken = False
        if path:
            check_events_file(path)
            # create it now, ours and checked: once it exists in a sticky folder nobody else can swap
            # it, so nothing another user plants at the name later is appended to or read back
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW, 0o600)
            except OSError as e:
                from ..errors import ConfigError
                raise ConfigError(f"--events {path}: cannot create it ({e.strerror}; a symlink is never followed); "
                                  f"remove it or name a file in a folder of your own") from None
            try:
                _check_ours(fd, path)
            finally:
                os.close(fd)

    def emit(self, kind: EventKind | str, **fields: Any) -> dict:
        rec = {"event": EventKind(kind).value, "time": fields.pop("time", None) or time.time(), "node": self.node}
        rec.update(fields)
        self.records.append(rec)
        if self.path and not self._broken:
            try:
                append_line(self.path, rec)
            except Exception as e:  # noqa: BLE001 - a lost event log never ends the job (QA round 7, Q7-3)
                self._broken = True
                log.error("events file %s: %s; no more events are written to it (the job goes on)", self.path, e)
        return rec


def check_events_file(path: str) -> None:
    """At start: ``path`` is not a symlink, and if it exists it is a regular file of ours that no
    other user may write (it is appended to and read back for the report)."""
    from ..errors import ConfigError
    if os.path.islink(path):   # never append through a link another user may have planted
        raise ConfigError(f"--events {path}: is a symlink; remove it or name a file in a folder of your own")
    if os.path.lexists(path):
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ConfigError(f"--events {path}: cannot open it ({e.strerror}); name a file in a folder of your "
                              f"own") from None
        try:
            _check_ours(fd, path)
        finally:
            os.close(fd)


def _check_ours(fd: int, path: str) -> None:
    """``fd`` (of ``path``) is a regular file of this user that no other user may write: a file
    another user made beforehand (in a shared /tmp) could feed the report forged records."""
    from ..errors import ConfigError
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--events {path}: not a regular file; remove it or name a file in a folder of your own")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"--events {path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); remove it "
                          f"or name a file in a folder of your own")
    if st.st_mode & 0o022:
        raise ConfigError(f"--events {path}: other users may write it (mode {stat.S_IMODE(st.st_mode):04o}); "
                          f"chmod go-w it, or name a new file")


def append_line(path: str, rec: dict) -> None:
    data = (json.dumps(rec, sort_keys=False) + "\n").encode()
    # 0600: the events name the script, its pids, hosts and snapshot-server addresses
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW, 0o600)
    try:
        _check_ours(fd, path)
        os.write(fd, data)
    finally:
        os.close(fd)


def read_jsonl(path: str | None) -> list[dict]:
    """Records of a JSONL file; a torn last line (being written) is skipped. Only a regular file
    of this user that other users may not write is read (its records make the run's report), never
    through a symlink (a FIFO would block: opened non-blocking, then checked), of at most
    :data:`MAX_JSONL_BYTES`; anything else reads as no records (logged)."""
    if not path or not os.path.lexists(path):
        return []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError as e:
        log.warning("cannot read %s: %s%s", path, e, " (a symlink is never followed)" if os.path.islink(path) else "")
        return []
    st = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
           f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})" if st.st_uid != os.geteuid() else
           f"any user may write it (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & stat.S_IWOTH else
           f"{st.st_size:,} bytes, more than {MAX_JSONL_BYTES:,}" if st.st_size > MAX_JSONL_BYTES else None)
    if why:
        os.close(fd)
        log.warning("not reading %s: %s", path, why)
        return []
    out = []
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


WARMUP_ITERATIONS = 2  # a launch's first iterations, left out of its median (the example trainer's profile skips them)


@dataclass
class Phase:
    """One launch that trained: its world, layout and iterations. ``median_iter_s``: the median
    iteration time after the first :data:`WARMUP_ITERATIONS` (after the first one when the phase
    ran at most that many more)."""
    index: int
    world_size: int
    layout: str
    resumed_from: int
    first_iteration: int | None = None
    last_iteration: int | None = None
    median_iter_s: float | None = None
    samples_per_s: float | None = None
    t_begin: float = 0.0
    t_end: float = 0.0
    plan: dict = field(default_factory=dict)   # chosen plan / predicted times when the trainer logs them
    ended_by: str = ""
    loss_first: float | None = None
    loss_last: float | None = None


@dataclass
class Recovery:
    """From a failure (or scale-up request) to training again."""
    kind: str                      # "failure" | "scale_up"
    t0: float                      # failure injected / last heartbeat / request time
    cause: str
    world_before: int | None
    world_after: int | None
    last_iteration_before: int | None
    resumed_from: int | None
    parts: dict[str, float] = field(default_factory=dict)   # seconds: detection, teardown, ...
    total_s: float | None = None   # t0 -> first resumed iteration starts
    launch_mode: str | None = None  # protocol.LaunchMode value of the relaunched rank 0
    restore: dict | None = None     # the relaunched trainer's restore record (tier, step, bytes per source, seconds)

    @property
    def lost_iterations(self) -> int | None:
        if self.last_iteration_before is None or self.resumed_from is None:
            return None
        return max(0, self.last_iteration_before - self.resumed_from)


def restore_bytes(restore: dict | None) -> dict[str, int] | None:
    """A restore record's bytes per source grouped by tier: ``local`` (this node's memory,
    ``local-memory``), ``peer`` (copies held here for other nodes, ``peer-memory``, and other
    nodes' servers, ``remote:<host:port>``) and ``storage``; None without a record."""
    if not isinstance(restore, dict) or not isinstance(restore.get("bytes"), dict):
        return None
    out = {"local": 0, "peer": 0, "storage": 0}
    for name, n in restore["bytes"].items():
        key = ("local" if name == "local-memory" else "storage" if name == "storage"
               else "peer" if name == "peer-memory" or name.startswith("remote:") else None)
        if key is None:
            raise ValueError(f"restore record names an unknown source {name!r}")
        out[key] += int(n)
    return out


PLAN_KEYS = ("plan", "predicted_iteration_s", "predicted_iter_s", "best_uniform_predicted_s",
             "best_uniform_iteration_s", "predicted_speedup")


def this_run(records: list[dict], start: dict) -> list[dict]:
    """The records of the run whose ``start`` record is ``start`` (this controller's own): from that
    record on. An events file given again to a new run keeps the old runs' records above it; the
    new run's report must not count their recoveries and phases as its own."""
    for i, r in enumerate(records):
        if r.get("event") == EventKind.START.value and r.get("node") == start.get("node") and \
                r.get("time") == start.get("time") and r.get("pid") == start.get("pid"):
            return records[i:]
    return records


def _plan_fields(rec: dict) -> dict:
    """The trainer's plan fields of a metrics record (chosen plan, its predicted iteration time, the
    best uniform plan and its prediction), whatever their exact names."""
    return {k: v for k, v in rec.items()
            if k in PLAN_KEYS or "predicted" in k or k.startswith("plan_") or k.startswith("uniform")}


def phases(events: list[dict], metrics: list[dict]) -> list[Phase]:
    starts = [e for e in events if e.get("event") == EventKind.WORKER_STARTED.value]
    starts.sort(key=lambda e: e["time"])
    its = [m for m in metrics if "iteration" in m and "time" in m]
    enders = [e for e in events if e.get("event") in (EventKind.FAILURE.value, EventKind.SCALE_UP_REQUESTED.value,
                                                      EventKind.MEMBERSHIP.value, EventKind.PREEMPT_REQUESTED.value,
                                                      EventKind.FINISHED.value, EventKind.STOPPED.value)]
    out = []
    for i, s in enumerate(starts):
        t_begin = s.get("t_loaded", s["time"])
        t_next = starts[i + 1].get("t_process_start", starts[i + 1]["time"]) if i + 1 < len(starts) else float("inf")
        mine = [m for m in its if t_begin - 1e-3 <= m["time"] - m.get("iter_time_s", 0) and m["time"] <= t_next]
        ph = Phase(index=i, world_size=int(s.get("world_size", 0)), layout=str(s.get("layout", "?")),
                   resumed_from=int(s.get("resumed_from", 0)), t_begin=t_begin)
        if mine:
            ph.first_iteration, ph.last_iteration = mine[0]["iteration"], mine[-1]["iteration"]
            ph.loss_first, ph.loss_last = mine[0].get("lm_loss"), mine[-1].get("lm_loss")
            ph.t_end = mine[-1]["time"]
            skip = WARMUP_ITERATIONS if len(mine) > WARMUP_ITERATIONS + 1 else 1
            steady = [m["iter_time_s"] for m in mine[skip:] if "iter_time_s" in m] or \
                [m.get("iter_time_s", 0) for m in mine]
            ph.median_iter_s = statistics.median(steady) if steady else None
            if len(mine) > 1 and mine[-1]["time"] > mine[0]["time"]:
                samples = mine[-1].get("consumed_samples", 0) - mine[0].get("consumed_samples", 0)
                ph.samples_per_s = samples / (mine[-1]["time"] - mine[0]["time"]) if samples else None
            ph.plan = _plan_fields(mine[-1]) or _plan_fields(s)
        else:
            ph.t_end = t_begin
            ph.plan = _plan_fields(s)
        nxt = [e for e in enders if e["time"] >= t_begin and e["time"] <= t_next]
        ph.ended_by = nxt[0]["event"] if nxt else ""
        out.append(ph)
    return out


def _last_iteration_before(metrics: list[dict], t: float) -> int | None:
    done = [m["iteration"] for m in metrics if "iteration" in m and m.get("time", float("inf")) <= t]
    return max(done) if done else None


def launch_mode_summary(modes: list[str] | None) -> str | None:
    """One word for a node's launch: the common mode of its workers, or e.g. ``"standby 1 warm/3 cold"``
    (a launch is as slow as its slowest worker: every rank waits for the others)."""
    if not modes:
        return None
    if len(set(modes)) == 1:
        return modes[0]
    counts = {m: modes.count(m) for m in dict.fromkeys(modes)}
    return "standby " + "/".join(f"{n} {m.replace('standby-', '')}" for m, n in counts.items())


def recoveries(events: list[dict], metrics: list[dict]) -> list[Recovery]:
    """One :class:`Recovery` per failure relaunch and per scale-up relaunch (events of one node)."""
    ev = sorted(events, key=lambda e: e["time"])
    out: list[Recovery] = []
    starts = [e for e in ev if e["event"] == EventKind.WORKER_STARTED.value]
    for i, e in enumerate(ev):
        kind = e["event"]
        if kind not in (EventKind.FAILURE.value, EventKind.SCALE_UP_REQUESTED.value, EventKind.MEMBERSHIP.value):
            continue
        later = ev[i + 1:]
        nxt_start = next((s for s in starts if s["time"] > e["time"]), None)
        # a following failure/request before any worker started belongs to this recovery
        launch = next((x for x in later if x["event"] == EventKind.LAUNCH.value), None)
        if nxt_start is None or launch is None:
            continue
        t_detect = e["time"]
        if kind == EventKind.FAILURE.value:
            inj = [x for x in ev[:i] if x["event"] == EventKind.INJECTED.value and t_detect - x["time"] < 120]
            if inj:
                t0, origin = inj[-1]["time"], "injected"
            elif e.get("last_heartbeat") and e.get("cause") == "hang":
                t0, origin = float(e["last_heartbeat"]), "last heartbeat"
            else:
                t0, origin = t_detect, "detected"
            cause = e.get("cause", "?")
        else:
            t0, origin, cause = t_detect, "request", kind
        prev_start = [s for s in starts if s["time"] < e["time"]]
        world_before = int(prev_start[-1].get("world_size", 0)) if prev_start else None
        rec = Recovery(kind="failure" if kind == EventKind.FAILURE.value else "scale_up", t0=t0, cause=cause,
                       world_before=world_before, world_after=int(nxt_start.get("world_size", 0)),
                       last_iteration_before=_last_iteration_before(metrics, t_detect),
                       resumed_from=int(nxt_start.get("resumed_from", 0)))
        p = rec.parts
        segment = [x for x in later if x["time"] <= launch["time"]]
        if kind == EventKind.FAILURE.value:
            p["detect"] = t_detect - t0
            td = next((x for x in segment if x["event"] == EventKind.TEARDOWN.value), None)
            p["teardown"] = float(td.get("duration_s", 0.0)) if td else 0.0
        else:
            sd = next((x for x in segment if x["event"] in (EventKind.SCALE_UP.value, EventKind.TEARDOWN.value)), None)
            p["graceful stop"] = float(sd.get("stop_s", sd.get("duration_s", 0.0))) if sd else 0.0
        p["probe"] = sum(float(x.get("duration_s", 0.0)) for x in segment if x["event"] == EventKind.PROBE.value)
        rdzv = next((x for x in segment if x["event"] == EventKind.RENDEZVOUS.value), None)
        s = nxt_start
        if rdzv and "t_process_start" in s:
            p["rdzv+spawn"] = s["t_process_start"] - rdzv["time"]
        if all(k in s for k in ("t_process_start", "t_imports", "t_planned", "t_dist", "t_loaded")):
            p["start-up"] = (s["t_imports"] - s["t_process_start"]) + (s["t_dist"] - s["t_planned"])
            p["planning"] = s["t_planned"] - s["t_imports"]
            p["build+load"] = s["t_loaded"] - s["t_dist"]
            rec.total_s = s["t_loaded"] - t0
            first = next((m for m in metrics if m.get("iteration") == rec.resumed_from + 1
                          and m.get("time", 0) > s["t_loaded"] and "iter_time_s" in m), None)
            if first is not None:
                p["first iter"] = float(first["iter_time_s"])
        rec.launch_mode = launch_mode_summary(launch.get("launch_modes")) or s.get("launch_mode")
        rec.restore = s.get("restore") if isinstance(s.get("restore"), dict) else None
        rec.parts = {k: max(0.0, v) for k, v in p.items()}
        rec.cause = cause if origin != "injected" else f"{cause} (injected)"
        out.append(rec)
    return out
