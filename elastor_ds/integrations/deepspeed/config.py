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
        "on_save_checkpoint": true, "deepspeed_native": true, "timeout_s": 600, "direct_io": true,
        "live_write": false                      # saves read the live CPU tensors until the next step
      },
      "memory_snapshot": {                       # needs "checkpoint" (storage stays the durable tier)
        "interval_steps": 1, "keep": 1, "peer_copies": 1,
        "dir": "<node dir>",                     # default: $ELASTOR_SNAPSHOT_DIR (set by `elastor run`)
        "max_bytes": N,                          # optional cap on this node's snapshot bytes
        "peer_copy_interval_steps": N,           # copy only every N-th step's snapshot (default: every one)
        "live_write": false                      # the writer copies the live CPU tensors until the next step
      }
    }

Save policy: ``interval_steps`` N > 0 saves every N optimizer steps (and, when ``min_interval_s`` S > 0,
not sooner than S seconds after the previous save); N = 0 with S > 0 is the reference's policy:
save as soon as the previous save has finished everywhere and S seconds have passed. N = 0 and
S = 0 disables periodic saves (``engine.save_checkpoint`` still writes one).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ...checkpoint.settings import (CheckpointConfig, MemorySnapshotConfig, _check_object, _unknown, parse_checkpoint,
                                   parse_memory_snapshot, save_due)
from ...errors import ConfigError, ElastorError

SECTION = "elastor"


@dataclass(frozen=True)
class ElastorConfig:
    plan: Union[None, str, Mapping[str, Any]] = None
    checkpoint: Optional[CheckpointConfig] = None
    memory_snapshot: Optional[MemorySnapshotConfig] = None
    model: Optional[Mapping[str, Any]] = None   # ModelSpec fields for "plan": "auto"
    profile: Optional[str] = None               # profile JSON for "plan": "auto"


_TOP_KEYS = ("plan", "checkpoint", "memory_snapshot", "model", "profile")


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
        if v.strip().lower() == "auto" and v != "auto":   # not a file named so
            raise ConfigError(f"{where}: {v!r}; did you mean \"auto\"? (a plan file here is written \"./{v}\")")
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
    if model is not None:
        import dataclasses
        from ...plan.model import ModelSpec
        fields = {f.name for f in dataclasses.fields(ModelSpec)}
        for k in model:
            if k not in fields:
                raise _unknown(f"{SECTION}.model", k, fields)
        try:   # the values too, here at initialize, not first when a plan is made (num_layers may come later)
            ModelSpec(**{"num_layers": 1, **dict(model)})
        except TypeError as e:
            missing = sorted(f.name for f in dataclasses.fields(ModelSpec)
                             if f.default is dataclasses.MISSING and f.name not in model and f.name != "num_layers")
            raise ConfigError(f"{SECTION}.model: {e}" + (f"; give {', '.join(missing)}" if missing else "")) from None
        except (ValueError, ElastorError) as e:
            raise ConfigError(f"{SECTION}.model: {e}") from None
    profile = section.get("profile")
    if profile is not None and (not isinstance(profile, str) or not profile.strip()):
        raise ConfigError(f"{SECTION}.profile: expected a path to a profile JSON (elastor plan --profile format)")
    if profile is not None and not os.path.isfile(profile):
        raise ConfigError(f"{SECTION}.profile: {profile} is not a file; give a profile JSON (the file `elastor plan "
                          f"--profile` reads), or leave the key out to plan from the cost model alone")
    return ElastorConfig(plan=plan, checkpoint=ckpt, memory_snapshot=mem,
                         model=dict(model) if model is not None else None,
                         profile=profile)


def split_ds_config(config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple[dict[str, Any], ElastorConfig]:
    """(DeepSpeed config without the ``"elastor"`` key, validated :class:`ElastorConfig`)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        config = read_ds_config_file(path)
    if not isinstance(config, Mapping):
        raise ConfigError(f"DeepSpeed config: expected a dict or a JSON file path, got {type(config).__name__}")
    ds = dict(config)
    section = ds.pop(SECTION, None)
    ecfg = parse_elastor_section(section) if section is not None else ElastorConfig()
    return ds, ecfg


def read_ds_config_file(config: Union[str, os.PathLike]) -> Any:
    """The DeepSpeed config named by ``config``, read as DeepSpeed reads it
    (``deepspeed.runtime.config.DeepSpeedConfig``): an existing path as hjson (JSON that may carry
    comments, trailing commas and unquoted keys), a key given twice in one object refused; a string
    that is no path, as base64 of such a document. Only the read is elastor's: a regular file, at most
    :data:`MAX_JSON_BYTES`, a FIFO or a device never read (:func:`elastor_ds.user_json.read_user_file`);
    a symlink is resolved first (the user's own file, as DeepSpeed follows it)."""
    from ...user_json import read_user_file
    path = os.fspath(config)
    fix = "give the path of the DeepSpeed config JSON file"
    what = f"DeepSpeed config file {path!r}"
    if not os.path.lexists(path):
        doc = _base64_config(path)
        if doc is None:
            raise ConfigError(f"{what} does not exist (nor is it a base64-encoded config, which DeepSpeed also "
                              f"takes); {fix}")
        return doc
    data = read_user_file(os.path.realpath(path), "DeepSpeed config file", MAX_JSON_BYTES, "a JSON file read here", fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON: not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    return _parse_ds_json(text, what, fix)


def _parse_ds_json(text: str, what: str, fix: str) -> Any:
    try:
        import hjson   # DeepSpeed's own config parser (a dependency of deepspeed)
    except ImportError:   # pragma: no cover - deepspeed absent: plain JSON
        hjson = None

    def pairs(items: list) -> dict:
        d = dict(items)
        if len(d) != len(items):
            seen: set = set()
            twice = sorted({str(k) for k, _ in items if k in seen or seen.add(k)})
            raise _DuplicateKeys(twice)
        return d
    try:
        return (hjson.loads(text, object_pairs_hook=pairs) if hjson is not None
                else json.loads(text, object_pairs_hook=pairs))
    except _DuplicateKeys as e:
        raise ConfigError(f"{what}: key {', '.join(repr(k) for k in e.keys)} given twice in one object "
                          f"(DeepSpeed refuses it too); keep one") from None
    except RecursionError:
        raise ConfigError(f"{what} is not valid JSON here: nested too deeply for the parser; {fix}") from None
    except ValueError as e:
        raise ConfigError(f"{what} is not valid JSON: {e}") from None


class _DuplicateKeys(Exception):
    def __init__(self, keys: list) -> None:
        super().__init__(keys)
        self.keys = keys


def _base64_config(text: str) -> Optional[dict]:
    """``text`` as DeepSpeed's base64 form of a config (the launcher's), or None when it is not one."""
    import base64
    try:
        decoded = base64.b64decode(text, altchars=b"-_", validate=True).decode("utf-8")   # urlsafe, strict
        doc = _parse_ds_json(decoded, "a base64 DeepSpeed config", "") if decoded.strip() else None
    except (ValueError, UnicodeDecodeError, ConfigError):
        return None
    return doc if isinstance(doc, Mapping) else None


def load_plan_document(plan: Union[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The plan JSON document named by ``plan`` (a path) or the inline dict."""
    if isinstance(plan, Mapping):
        return dict(plan)
    return read_json_file(plan, f"{SECTION}.plan:", "run `elastor plan` to make one, or use \"plan\": "
                          "\"auto\"")


MAX_JSON_BYTES = 64 * 2 ** 20   # a config or plan file: a plan for 100,000 devices is a few MiB


def read_json_file(path: str, what: str, fix: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in the regular file ``path``, or a :class:`ConfigError` naming ``what``, the
    path and ``fix``. Read as :func:`elastor_ds.user_json.read_user_file` reads a file someone else
    may have made (a plan shared between nodes or users): a directory, a FIFO or a device (which would
    block or never end), a symlink, more than ``max_bytes``, text that is not UTF-8 and JSON nested too
    deeply for the parser are each refused with that error, never a traceback of another type, a hang
    or unbounded memory."""
    from ...user_json import read_user_file
    if not os.path.lexists(path):
        raise ConfigError(f"{what} {path!r} does not exist; {fix}")
    data = read_user_file(path, what, max_bytes, "a JSON file read here", fix)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path!r} is not valid JSON: not UTF-8 text ({e.reason} at byte {e.start}); "
                          f"{fix}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {path!r} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path!r} is not valid JSON here: nested too deeply for the parser; {fix}") from None


__all__ = ["CheckpointConfig", "MemorySnapshotConfig", "parse_memory_snapshot", "save_due", "ElastorConfig", "parse_elastor_section", "parse_checkpoint", "parse_plan",
           "split_ds_config", "load_plan_document", "read_json_file", "read_ds_config_file", "SECTION"]
