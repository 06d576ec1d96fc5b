"""The ``"elastor"`` section of a DeepSpeed config: typed, validated once, with errors that say the fix.

Pure: no deepspeed, no torch. Shape (a contract; keys may be added, never removed)::

    "elastor": {
      "plan": "auto" | "<plan.json>" | {plan document} | null,
      "model": {"hidden_size": ..., "num_attention_heads": ..., "seq_length": ..., "vocab_size": ...},
                                                 # for "auto": the planner's ModelSpec fields
      "profile": "<profile.json>",               # for "auto": a measured per-layer profile (optional)
      "checkpoint": {
        "dir": "<path>", "interval_steps": N, "min_interval_s": S, "async": true, "keep": 2,
        "load": "latest" | "none" | "<step dir>", "verify_on_load": true, "fallback_to_previous": true,
        "on_save_checkpoint": true, "deepspeed_native": true, "timeout_s": 600
      },
      "memory_snapshot": {                       # needs "checkpoint" (storage stays the durable tier)
        "interval_steps": 1, "keep": 1, "peer_copies": 1,
        "dir": "<node dir>",                     # default: $ELASTOR_SNAPSHOT_DIR (set by `elastor run`)
        "max_bytes": N                           # optional cap on this node's snapshot bytes
      }
    }

Save policy: ``interval_steps`` N > 0 saves every N optimizer steps (and, when ``min_interval_s`` S > 0,
not sooner than S seconds after the previous save); N = 0 with S > 0 is the reference's policy:
save as soon as the previous save has finished everywhere and S seconds have passed. N = 0 and
S = 0 disables periodic saves (``engine.save_checkpoint`` still writes one).
"""
from __future__ import annotations

import difflib
import math
import json
import os
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Union

from ...errors import ConfigError

SECTION = "elastor"


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str
    interval_steps: int = 0
    min_interval_s: float = 0.0
    async_save: bool = True          # JSON key "async"
    keep: int = 2
    load: str = "latest"             # "latest" | "none" | a step dir / root path
    verify_on_load: bool = True
    fallback_to_previous: bool = True
    on_save_checkpoint: bool = True  # engine.save_checkpoint() also writes an elastor checkpoint
    deepspeed_native: bool = True    # engine.save_checkpoint() still writes DeepSpeed's own files
    timeout_s: float = 600.0         # timeout of the checkpoint process group

    @property
    def periodic(self) -> bool:
        return self.interval_steps > 0 or self.min_interval_s > 0


@dataclass(frozen=True)
class MemorySnapshotConfig:
    """Snapshots in the node's memory (tmpfs), restored before storage (see runtime.MemoryTier)."""
    interval_steps: int = 1
    keep: int = 1
    peer_copies: int = 1
    dir: Optional[str] = None        # the node directory; default $ELASTOR_SNAPSHOT_DIR
    max_bytes: Optional[int] = None  # cap on this node's snapshot bytes (all its ranks, all copies)


@dataclass(frozen=True)
class ElastorConfig:
    plan: Union[None, str, Mapping[str, Any]] = None
    checkpoint: Optional[CheckpointConfig] = None
    memory_snapshot: Optional[MemorySnapshotConfig] = None
    model: Optional[Mapping[str, Any]] = None   # ModelSpec fields for "plan": "auto"
    profile: Optional[str] = None               # profile JSON for "plan": "auto"


_CKPT_KEYS = {"dir": "dir", "interval_steps": "interval_steps", "min_interval_s": "min_interval_s",
              "async": "async_save", "keep": "keep", "load": "load", "verify_on_load": "verify_on_load",
              "fallback_to_previous": "fallback_to_previous", "on_save_checkpoint": "on_save_checkpoint",
              "deepspeed_native": "deepspeed_native", "timeout_s": "timeout_s"}
_TOP_KEYS = ("plan", "checkpoint", "memory_snapshot", "model", "profile")
_MEM_KEYS = ("interval_steps", "keep", "peer_copies", "dir", "max_bytes")


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
    """A directory setting: ``~`` expanded; the file-system root (or a path that resolves to it) refused."""
    p = os.path.expanduser(_str(where, v, example))
    if os.path.normpath(os.path.abspath(p)) == os.sep:
        raise ConfigError(f"{where}: {v!r} is the root directory; name a directory of its own, e.g. {example}")
    return p


def _float(where: str, v: Any, lo: float, example: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ConfigError(f"{where}: expected a finite number >= {lo}, got {v!r}; e.g. {example}")
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
    for key in ("async", "verify_on_load", "fallback_to_previous", "on_save_checkpoint", "deepspeed_native"):
        if key in d:
            kw[_CKPT_KEYS[key]] = _bool(f"{where}.{key}", d[key])
    if "load" in d:
        load = _str(f"{where}.load", d["load"], '"load": "latest" (or "none", or a step directory)')
        kw["load"] = load
    return CheckpointConfig(**kw)


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
    if "max_bytes" in d and d["max_bytes"] is not None:
        kw["max_bytes"] = _int(f"{where}.max_bytes", d["max_bytes"], 1, '"max_bytes": 8000000000', MAX_BYTES)
    return MemorySnapshotConfig(**kw)


def parse_plan(v: Any, where: str = f"{SECTION}.plan") -> Union[None, str, Mapping[str, Any]]:
    if v is None or v == "auto":
        return v
    if isinstance(v, Mapping):
        if "replicas" not in v:
            raise ConfigError(f"{where}: an inline plan needs a 'replicas' list (the planner's plan document); "
                              f"got keys {sorted(v)}")
        return dict(v)
    if isinstance(v, str):
        if not v.strip():
            raise ConfigError(f"{where}: empty string; use \"auto\", a plan JSON path, or omit the key")
        return v
    raise ConfigError(f"{where}: expected \"auto\", a path to a plan JSON file or an inline plan object, got "
                      f"{type(v).__name__} {v!r}")


def parse_elastor_section(section: Any) -> ElastorConfig:
    """Validate the ``"elastor"`` section (the value, not the whole DeepSpeed config)."""
    _check_object(SECTION, section, _TOP_KEYS, '{"checkpoint": {"dir": "/ckpt"}}')
    plan = parse_plan(section.get("plan"))
    ckpt = parse_checkpoint(section["checkpoint"]) if section.get("checkpoint") is not None else None
    mem = parse_memory_snapshot(section["memory_snapshot"]) if section.get("memory_snapshot") is not None else None
    if mem is not None and ckpt is None:
        raise ConfigError(f"{SECTION}.memory_snapshot needs {SECTION}.checkpoint (storage checkpoints stay the durable "
                          f"tier; memory snapshots come on top), e.g. \"checkpoint\": {{\"dir\": \"/ckpt\", "
                          f"\"interval_steps\": 100}}")
    model = section.get("model")
    if model is not None and not isinstance(model, Mapping):
        raise ConfigError(f"{SECTION}.model: expected an object of the planner's model fields (hidden_size, "
                          f"num_attention_heads, seq_length, vocab_size, ...), got {type(model).__name__}")
    profile = section.get("profile")
    if profile is not None and (not isinstance(profile, str) or not profile.strip()):
        raise ConfigError(f"{SECTION}.profile: expected a path to a profile JSON (elastor plan --profile format)")
    return ElastorConfig(plan=plan, checkpoint=ckpt, memory_snapshot=mem,
                         model=dict(model) if model is not None else None,
                         profile=profile)


def split_ds_config(config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple[dict[str, Any], ElastorConfig]:
    """(DeepSpeed config without the ``"elastor"`` key, validated :class:`ElastorConfig`)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"DeepSpeed config file {path!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, Mapping):
        raise ConfigError(f"DeepSpeed config: expected a dict or a JSON file path, got {type(config).__name__}")
    ds = dict(config)
    section = ds.pop(SECTION, None)
    ecfg = parse_elastor_section(section) if section is not None else ElastorConfig()
    return ds, ecfg


def load_plan_document(plan: Union[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The plan JSON document named by ``plan`` (a path) or the inline dict."""
    if isinstance(plan, Mapping):
        return dict(plan)
    try:
        with open(plan, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{SECTION}.plan: plan file {plan!r} does not exist; run `elastor plan` to make one, "
                          f"or use \"plan\": \"auto\"") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{SECTION}.plan: {plan!r} is not valid JSON: {e}") from None


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


__all__ = ["CheckpointConfig", "MemorySnapshotConfig", "parse_memory_snapshot", "save_due", "ElastorConfig", "parse_elastor_section", "parse_checkpoint", "parse_plan",
           "split_ds_config", "load_plan_document", "SECTION"]
