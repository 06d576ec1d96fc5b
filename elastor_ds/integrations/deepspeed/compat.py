"""DeepSpeed version check and CPU hardening (no just-in-time C++ op builds).

elastor_ds reads a few DeepSpeed internals (ZeRO-1 flat-partition bookkeeping, the pipeline
module's partition; all listed in :mod:`.overrides`); this module checks the installed version once
and says what to do when it is outside the tested range.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional

from ...errors import ConfigError
from . import overrides

log = logging.getLogger(__name__)

MIN_VERSION = (0, 16, 0)
TESTED = next(p.version for p in overrides.PINS if p.dist == "deepspeed")  # the pin, one place
_BELOW = (0, 21, 0)  # first version we have not read


def _parse(v: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", v)
    if not m:
        raise ConfigError(f"cannot parse the DeepSpeed version {v!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def check_version(version: Optional[str] = None) -> tuple[int, int, int]:
    """Raise ConfigError below the minimum; warn above the tested range."""
    if version is None:
        try:
            import deepspeed
        except ImportError as e:
            raise ConfigError(f"elastor_ds.deepspeed needs DeepSpeed: pip install deepspeed=={TESTED} ({e})") from None
        version = deepspeed.__version__
    v = _parse(version)
    if v < MIN_VERSION:
        raise ConfigError(f"DeepSpeed {version} is too old for elastor_ds (needs >= "
                          f"{'.'.join(map(str, MIN_VERSION))}, tested {TESTED}): pip install deepspeed=={TESTED}")
    if v >= _BELOW:
        log.warning("DeepSpeed %s is newer than the versions elastor_ds was tested with (%s); if saving or loading "
                    "fails on a missing ZeRO attribute, pin deepspeed==%s and report it", version, TESTED, TESTED)
    return v


def on_cpu() -> bool:
    if os.environ.get("DS_ACCELERATOR", "").lower() == "cpu":
        return True
    try:
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().device_name() == "cpu"
    except Exception:  # noqa: BLE001 - accelerator detection is best effort
        return False


def disable_cpu_jit_ops() -> None:
    """On CPU, stop DeepSpeed from compiling its shared-memory comm op (a 40+ s C++ build per process).
    Must run before ``deepspeed.init_distributed``."""
    if not on_cpu():
        return
    overrides.disable_op("deepspeed_shm_comm")


def harden_optimizer_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """On CPU, a config ``Adam``/``AdamW`` optimizer without ``torch_adam`` would JIT-build
    DeepSpeedCPUAdam/FusedAdam: default it to ``torch_adam: true`` (logged)."""
    opt = ds_config.get("optimizer")
    if not on_cpu() or not isinstance(opt, dict):
        return ds_config
    if str(opt.get("type", "")).lower() not in ("adam", "adamw"):
        return ds_config
    params = dict(opt.get("params") or {})
    if "torch_adam" not in params:
        params["torch_adam"] = True
        log.info("CPU accelerator: setting optimizer.params.torch_adam=true to avoid a just-in-time C++ build")
        ds_config = dict(ds_config, optimizer=dict(opt, params=params))
    return ds_config


def bound_collective_timeouts(seconds: float):
    """Host patch (torch 2.13, ``torch.distributed.distributed_c10d``): every process group created
    without an explicit ``timeout`` from now on waits at most ``seconds`` in a collective; returns the
    ``timedelta`` for the world group.

    What it changes: the module defaults ``default_pg_timeout`` (gloo and others, 30 minutes) and
    ``default_pg_nccl_timeout`` (10 minutes), which ``new_group`` reads at call time. Why: DeepSpeed's
    and Megatron's data-, pipeline- and tensor-parallel groups are made with ``new_group(ranks)``,
    which ignores the world group's timeout; a survivor whose peer vanished without a reset would
    wait 30 minutes in their all-reduce. How to drop it: when torch lets ``new_group`` inherit the
    world group's timeout (or DeepSpeed passes one), remove this call; nothing else reads it."""
    from datetime import timedelta

    td = timedelta(seconds=seconds)
    overrides.bound_default_pg_timeouts(td)
    return td
