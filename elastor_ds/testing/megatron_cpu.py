"""CPU shims that let megatron-core 0.16 run (forward, backward, pipeline schedules,
dist_checkpointing) on machines without CUDA. Tests, benchmarks and dev runs only.

What it changes, and why (see ``/work/shared/design/ENV.md``):

1. ``torch.cuda.current_device`` -> ``"cpu"``: megatron allocates buffers on
   ``torch.cuda.current_device()`` (tensor_parallel layers/mappings, p2p communication).
2. ``torch.cuda.synchronize`` -> no-op (p2p communication, the async checkpoint writer).
3. The CUDA RNG functions (``torch.cuda.get_rng_state/set_rng_state/manual_seed`` and
   ``megatron.core.tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state``) -> the CPU
   generator, so the model-parallel RNG tracker works.
4. ``megatron.core.pipeline_parallel.schedules`` allocates with ``device="cuda"`` literals: its
   module-level ``torch`` is replaced by a proxy whose ``zeros/empty/ones/tensor`` map a CUDA
   device to CPU.

Every patched symbol is a row of :mod:`elastor_ds.integrations.megatron.overrides`.

How to drop it: run on a CUDA machine (:func:`apply` is a no-op when CUDA is available).
Every patched symbol is checked first; when one moved :class:`MegatronShimError` names it, so a
megatron-core upgrade fails loudly instead of silently running unpatched code.
"""
from __future__ import annotations

import importlib
import logging
import types
from typing import Any

import torch

from ..errors import ElastorError
from ..integrations.megatron import overrides

log = logging.getLogger(__name__)

SUPPORTED_MEGATRON = ("0.16",)
_applied = False


class MegatronShimError(ElastorError, RuntimeError):
    """A symbol the megatron CPU shims patch is missing (megatron-core changed)."""


def _require(mod: Any, name: str) -> Any:
    if not hasattr(mod, name):
        raise MegatronShimError(f"{getattr(mod, '__name__', mod)}.{name} is missing: the megatron CPU shims "
                                f"were written for megatron-core {SUPPORTED_MEGATRON}; update "
                                f"elastor_ds/testing/megatron_cpu.py for the installed version")
    return getattr(mod, name)


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuTorchProxy(types.ModuleType):
    """``torch`` for modules that hard-code ``device="cuda"``: allocation functions go to CPU."""

    _ALLOC = ("zeros", "empty", "ones", "tensor", "full", "arange")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in self._ALLOC:
            def alloc(*args: Any, __f=attr, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return __f(*args, **kwargs)
            return alloc
        return attr


def apply(force: bool = False) -> bool:
    """Patch megatron-core for CPU. Returns True when the shims are (now) active.

    Never applied when CUDA is available (unless ``force``): GPU runs use stock megatron."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        log.info("CUDA is available: megatron CPU shims not applied")
        return False
    import megatron.core
    version = getattr(megatron.core, "__version__", "?")
    if not str(version).startswith(SUPPORTED_MEGATRON):
        log.warning("megatron-core %s: CPU shims were written for %s", version, SUPPORTED_MEGATRON)
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    sched = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    for mod, names in ((torch.cuda, ("current_device", "synchronize", "get_rng_state", "set_rng_state",
                                     "manual_seed")),
                       (rnd, ("_get_cuda_rng_state", "_set_cuda_rng_state")),
                       (sched, ("torch",))):
        for n in names:
            _require(mod, n)

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    def get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        s = torch.get_rng_state()
        return s.clone() if clone else s

    def set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    for path, value in (("torch.cuda:current_device", lambda: "cpu"),
                        ("torch.cuda:synchronize", lambda *a, **k: None),
                        ("torch.cuda:get_rng_state", get_rng_state),
                        ("torch.cuda:set_rng_state", set_rng_state),
                        ("torch.cuda:manual_seed", lambda seed: torch.manual_seed(seed)),
                        ("megatron.core.tensor_parallel.random:_get_cuda_rng_state", get_cuda_rng_state),
                        ("megatron.core.tensor_parallel.random:_set_cuda_rng_state", set_cuda_rng_state),
                        ("megatron.core.pipeline_parallel.schedules:torch", _CpuTorchProxy())):
        overrides.patch(path, value)   # every patched symbol is a row of the Megatron overrides table
    _applied = True
    log.info("megatron-core %s CPU shims applied", version)
    return True
