"""Checkpoint settings shared by every trainer: the storage checkpoint's save policy and the memory
snapshots' tier, typed and validated once. Every default lives here, and only here: the DeepSpeed
config section, the example trainer's flags and Megatron-LM's ``--elastor-*`` flags all build
these objects (pure: no torch, no I/O).

Save policy: ``interval_steps`` N > 0 saves every N optimizer steps (and, when ``min_interval_s`` S > 0,
not sooner than S seconds after the previous save); N = 0 with S > 0 is the reference's policy:
save as soon as the previous save has finished everywhere and S seconds have passed. N = 0 and
S = 0 disables periodic saves (an explicit save still writes one).
"""
from __future__ import annotations

import difflib
import enum
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

from ..errors import ConfigError

log = logging.getLogger(__name__)

SECTION = "elastor"
DEFAULT_KEEP = 2   # committed checkpoints kept: the one place this default is written
# added to the nice value of the checkpoint writer thread (Linux, per thread): against a training
# thread that keeps a core busy the writer gets about a tenth of it (CFS weights 110 vs 1024), so
# training keeps its core and a save still progresses (at +19, 15 vs 1024, a trainer that keeps
# every core busy leaves it about 1.5 %; issue 23, bench/ckpt_bench.py)
DEFAULT_WRITER_NICE = 10


class WriterSched(str, enum.Enum):
    """The checkpoint writer's CPU policy while the training loop does not wait for it
    (:mod:`.writer_sched`)."""

    IDLE = "idle"   # SCHED_IDLE: only cycles no other thread wants; normal priority once waited for
    NICE = "nice"   # its nice value throughout (the behaviour before 2026-12-02)


DEFAULT_WRITER_SCHED = WriterSched.IDLE
# at the latest this long after a save starts, an idle-scheduled writer runs at its normal priority:
# a trainer that keeps every core busy delays a save by at most this much
DEFAULT_WRITER_DEADLINE_S = 5.0


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str
    interval_steps: int = 0
    min_interval_s: float = 0.0
    async_save: bool = True          # JSON key "async"
    keep: int = DEFAULT_KEEP
    load: str = "latest"             # "latest" | "none" | a step dir / root path
    verify_on_load: bool = True
    fallback_to_previous: bool = True
    on_save_checkpoint: bool = True  # engine.save_checkpoint() also writes an elastor checkpoint
    deepspeed_native: bool = True    # engine.save_checkpoint() still writes DeepSpeed's own files
    timeout_s: float = 600.0         # timeout of the checkpoint process group
    direct_io: bool = True           # data files written with O_DIRECT where the file system takes it
    writer_sched: WriterSched = DEFAULT_WRITER_SCHED   # the writer's CPU policy until waited for
    writer_deadline_s: float = DEFAULT_WRITER_DEADLINE_S
    # storage saves read the live CPU tensors until the fence before the next optimizer step
    # (checkpoint.live: time to durable without the copy); only where nothing else changes them
    live_write: bool = False

    @property
    def periodic(self) -> bool:
        return self.interval_steps > 0 or self.min_interval_s > 0


@dataclass(frozen=True)
class MemorySnapshotConfig:
    """Snapshots in the node's memory (tmpfs), restored before storage (see checkpoint.snapshot.tier.MemoryTier)."""
    interval_steps: int = 1
    keep: int = 1
    peer_copies: int = 1
    dir: Optional[str] = None        # the node directory; default $ELASTOR_SNAPSHOT_DIR
    max_bytes: Optional[int] = None  # cap on this node's snapshot bytes (all its ranks, all copies)
    # steps between peer copies (a multiple of interval_steps); None: every snapshot is copied
    peer_copy_interval_steps: Optional[int] = None
    # CPU state: the snapshot writer copies the live tensors into the node's memory on idle cycles
    # until the fence before the next optimizer step, which copies the rest (as checkpoint.live_write)
    live_write: bool = False

    def copies_step(self, step: int) -> bool:
        """Whether the snapshot of ``step`` is copied to the next node (peer copies on)."""
        every = self.peer_copy_interval_steps or self.interval_steps
        return self.peer_copies > 0 and step % every == 0

    def keep_for_copies(self) -> int:
        """Snapshots a node must keep so that the newest copied step is still in its own memory
        when a node is lost: the snapshots between two copies, plus one in flight."""
        every = self.peer_copy_interval_steps or self.interval_steps
        return every // self.interval_steps + 1 if every > self.interval_steps else 1


_CKPT_KEYS = {"dir": "dir", "interval_steps": "interval_steps", "min_interval_s": "min_interval_s",
              "async": "async_save", "keep": "keep", "load": "load", "verify_on_load": "verify_on_load",
              "fallback_to_previous": "fallback_to_previous", "on_save_checkpoint": "on_save_checkpoint",
              "deepspeed_native": "deepspeed_native", "timeout_s": "timeout_s", "direct_io": "direct_io",
              "writer_sched": "writer_sched", "writer_deadline_s": "writer_deadline_s", "live_write": "live_write"}
_MEM_KEYS = ("interval_steps", "keep", "peer_copies", "peer_copy_interval_steps", "dir", "max_bytes", "live_write")


def _unknown(where: str, key: str, allowed) -> ConfigError:
    close = difflib.get_close_matches(str(key), list(allowed), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; allowed keys: {', '.join(sorted(allowed))}")


MAX_STEPS = 10 ** 9          # intervals in optimizer steps: a billion steps is beyond any run
MAX_KEEP = 1000
MAX_BYTES = 2 ** 60          # an exbibyte


def _int(where: str, v: Any, lo: int, example: str, hi: int = MAX_STEPS) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{where}: expected an integer >= {lo}, got {v!r}; e.g. {example}")
    if v > hi:
        raise ConfigError(f"{where}: {v} is too large (at most {hi}); e.g. {example}")
    return v


def _dir(where: str, v: Any, example: str) -> str:
    """A directory setting: ``~`` expanded; the file-system root (or a path that resolves to it)
    refused, and so are surrounding spaces (``" /ckpt "`` would be a relative path named " ") and
    control characters (a NUL, a newline)."""
    p = os.path.expanduser(_str(where, v, example))
    if p != p.strip() or any(ord(c) < 32 or ord(c) == 127 for c in p):
        raise ConfigError(f"{where}: {v!r} has surrounding spaces or control characters; write the path alone, "
                          f"e.g. {example}")
    if os.path.normpath(os.path.abspath(p)) == os.sep:
        raise ConfigError(f"{where}: {v!r} is the root directory; name a directory of its own, e.g. {example}")
    return p


MAX_SECONDS = 7 * 86400      # a timeout or interval in seconds: a week is beyond any save or collective


def _float(where: str, v: Any, lo: float, example: str, hi: float = MAX_SECONDS) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ConfigError(f"{where}: expected a finite number >= {lo}, got {v!r}; e.g. {example}")
    if v > hi:
        raise ConfigError(f"{where}: {v!r} is too large (at most {hi:g}); e.g. {example}")
    return float(v)


def _bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: expected true or false, got {v!r}")
    return v


def _str(where: str, v: Any, example: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{where}: expected a non-empty string, got {v!r}; e.g. {example}")
    return v


def _check_object(where: str, d: Any, allowed: Collection[str], example: str) -> None:
    """``d`` must be a JSON object whose keys are all in ``allowed``."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: expected an object like {example}, got {type(d).__name__} {d!r}")
    for k in d:
        if k not in allowed:
            raise _unknown(where, k, allowed)


def parse_checkpoint(d: Any, where: str = f"{SECTION}.checkpoint") -> CheckpointConfig:
    _check_object(where, d, _CKPT_KEYS, '{"dir": "/ckpt", "interval_steps": 100}')
    if "dir" not in d:
        raise ConfigError(f"{where}: missing required key 'dir' (where checkpoints go), e.g. \"dir\": \"/ckpt/run1\"")
    kw: dict[str, Any] = {"dir": _dir(f"{where}.dir", d["dir"], '"dir": "/ckpt/run1"')}
    if "interval_steps" in d:
        kw["interval_steps"] = _int(f"{where}.interval_steps", d["interval_steps"], 0, '"interval_steps": 100')
    if "min_interval_s" in d:
        kw["min_interval_s"] = _float(f"{where}.min_interval_s", d["min_interval_s"], 0.0, '"min_interval_s": 60')
    if "keep" in d:
        kw["keep"] = _int(f"{where}.keep", d["keep"], 1, '"keep": 2 (the last good checkpoint is never deleted)',
                          MAX_KEEP)
    if "timeout_s" in d:
        kw["timeout_s"] = _float(f"{where}.timeout_s", d["timeout_s"], 1.0, '"timeout_s": 600')
        if kw["timeout_s"] <= 0:
            raise ConfigError(f"{where}.timeout_s: must be > 0, got {d['timeout_s']!r}")
    for key in ("async", "verify_on_load", "fallback_to_previous", "on_save_checkpoint", "deepspeed_native",
                "direct_io", "live_write"):
        if key in d:
            kw[_CKPT_KEYS[key]] = _bool(f"{where}.{key}", d[key])
    if "writer_sched" in d:
        v = d["writer_sched"]
        names = ", ".join(f'"{w.value}"' for w in WriterSched)
        if not isinstance(v, str) or v not in {w.value for w in WriterSched}:
            raise ConfigError(f"{where}.writer_sched: expected one of {names}, got {v!r}; e.g. "
                              f'"writer_sched": "idle" (the writer runs on idle cycles until training waits for it)')
        kw["writer_sched"] = WriterSched(v)
    if "writer_deadline_s" in d:
        kw["writer_deadline_s"] = _float(f"{where}.writer_deadline_s", d["writer_deadline_s"], 0.0,
                                         '"writer_deadline_s": 5')
        if kw["writer_deadline_s"] <= 0:
            raise ConfigError(f"{where}.writer_deadline_s: must be > 0, got {d['writer_deadline_s']!r}; "
                              f'e.g. "writer_deadline_s": 5')
    if "load" in d:
        load = _str(f"{where}.load", d["load"], '"load": "latest" (or "none", or a step directory)')
        kw["load"] = _load_value(f"{where}.load", load)
    return CheckpointConfig(**kw)


_LOAD_WORDS = ("latest", "none")


def _load_value(where: str, v: str) -> str:
    """``"latest"``, ``"none"`` or a path. A word that is not a path but reads like one of the two
    (``"Latest"``, ``"lastest"``, ``"None"``) is a typo, not a directory named so."""
    if v in _LOAD_WORDS:
        return v
    pathlike = os.sep in v or v.startswith((".", "~"))
    close = difflib.get_close_matches(v.lower(), _LOAD_WORDS, n=1, cutoff=0.6)
    if not pathlike and (v.lower() in _LOAD_WORDS or v.lower() == "null" or close):
        word = close[0] if close else "none"
        raise ConfigError(f"{where}: {v!r} is neither \"latest\" nor \"none\" nor a path; did you mean {word!r}? (a "
                          f"directory in the current one is written \"./{v}\")")
    return v


def parse_memory_snapshot(d: Any, where: str = f"{SECTION}.memory_snapshot") -> MemorySnapshotConfig:
    _check_object(where, d, _MEM_KEYS, '{"interval_steps": 1, "peer_copies": 1}')
    kw: dict[str, Any] = {}
    if "interval_steps" in d:
        kw["interval_steps"] = _int(f"{where}.interval_steps", d["interval_steps"], 1,
                                    '"interval_steps": 1 (a snapshot after every optimizer step)')
    if "keep" in d:
        kw["keep"] = _int(f"{where}.keep", d["keep"], 1, '"keep": 1', MAX_KEEP)
    if "peer_copies" in d:
        kw["peer_copies"] = _int(f"{where}.peer_copies", d["peer_copies"], 0, '"peer_copies": 1 (0: no copy on '
                                 'another node)')
        if kw["peer_copies"] > 1:
            raise ConfigError(f"{where}.peer_copies: {kw['peer_copies']} is not supported; use 0 or 1 (one copy on "
                              f"the next node of the ring)")
    if "dir" in d:
        kw["dir"] = _dir(f"{where}.dir", d["dir"], '"dir": "/dev/shm/my-job"')
    if "live_write" in d:
        kw["live_write"] = _bool(f"{where}.live_write", d["live_write"])
    if "max_bytes" in d and d["max_bytes"] is not None:
        kw["max_bytes"] = _int(f"{where}.max_bytes", d["max_bytes"], 1, '"max_bytes": 8000000000', MAX_BYTES)
    if d.get("peer_copy_interval_steps") is not None:
        every = _int(f"{where}.peer_copy_interval_steps", d["peer_copy_interval_steps"], 1,
                     '"peer_copy_interval_steps": 10 (copy every 10th step\'s snapshot to the next node)')
        snap = kw.get("interval_steps", MemorySnapshotConfig.interval_steps)
        if every % snap:
            raise ConfigError(f"{where}.peer_copy_interval_steps: {every} is not a multiple of the snapshot interval "
                              f"{snap} (only snapshots can be copied); use e.g. {snap * max(1, round(every / snap))}")
        if every // snap + 1 > MAX_KEEP:   # a node keeps every snapshot between two copies
            raise ConfigError(f"{where}.peer_copy_interval_steps: {every} is too large: a node would keep "
                              f"{every // snap + 1} snapshots between two copies (at most {MAX_KEEP}); use at most "
                              f"{(MAX_KEEP - 1) * snap}")
        kw["peer_copy_interval_steps"] = every
    cfg = MemorySnapshotConfig(**kw)
    if cfg.peer_copies == 0 and cfg.peer_copy_interval_steps is not None:
        log.warning("%s.peer_copy_interval_steps %d does nothing with peer_copies 0 (no copy is made); set "
                    "\"peer_copies\": 1 to copy one snapshot every %d steps to the next node, or drop it", where,
                    cfg.peer_copy_interval_steps, cfg.peer_copy_interval_steps)
    need = cfg.keep_for_copies()
    if cfg.peer_copies > 0 and "keep" not in d and cfg.keep < need:   # the default follows the copy interval
        cfg = MemorySnapshotConfig(**{**kw, "keep": need})
    if cfg.peer_copies > 0 and cfg.keep < need:
        raise ConfigError(f"{where}.keep: {cfg.keep} snapshot(s) per node, but with a peer copy every "
                          f"{cfg.peer_copy_interval_steps} steps and a snapshot every {cfg.interval_steps} a node must "
                          f"keep {need} so that the newest copied step is still in its own memory when another node is "
                          f"lost; set keep to {need} (or copy every snapshot)")
    return cfg


def save_due(cfg: CheckpointConfig, step: int, last_step: Optional[int], seconds_since_last: float,
             previous_done: bool) -> bool:
    """The save policy for one rank's view (pure). The caller makes every rank agree when the
    answer depends on time (``min_interval_s`` > 0)."""
    if not cfg.periodic or step == last_step:
        return False
    if cfg.interval_steps > 0:
        if step - (last_step or 0) < cfg.interval_steps:
            return False
        return seconds_since_last >= cfg.min_interval_s
    return previous_done and seconds_since_last >= cfg.min_interval_s
