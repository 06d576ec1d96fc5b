"""``elastor_ds.deepspeed``: the user-facing name of the DeepSpeed integration (a re-export)."""
from __future__ import annotations

from typing import Any

from .integrations.deepspeed import (CheckpointConfig, ElastorConfig, parse_elastor_section,  # noqa: F401
                                     split_ds_config)

__all__ = ["initialize", "init_distributed", "PipelineModule", "ElastorConfig", "CheckpointConfig",
           "parse_elastor_section", "split_ds_config", "ElastorCheckpointer", "check_version", "resolve_plan"]


def __getattr__(name: str) -> Any:
    from .integrations import deepspeed as _impl
    return getattr(_impl, name)
