"""Run Megatron-LM's own ``pretrain_gpt.py`` on CPU (gloo), through shims only.

Megatron-LM's code and the elastor patches are not changed: this runner patches a few ``torch`` /
megatron symbols in memory, then runs ``pretrain_gpt.py`` as ``__main__`` with the remaining
arguments. Dev/test use only (the real thing runs on GPUs, where :func:`install` is a no-op).

usage (one process per rank; set MASTER_ADDR/PORT or use torchrun; ``CUDA_DEVICE_MAX_CONNECTIONS``
defaults to 1, which Megatron-LM asserts for ``--tensor-model-parallel-size`` above 1)::

    PYTHONPATH=MEGATRON_LM_DIR:ELASTOR_DS_DIR \\
    torchrun --nproc-per-node 2 examples/megatron_lm/cpu_pretrain_gpt.py \\
        --megatron-lm MEGATRON_LM_DIR  <pretrain_gpt.py flags...>

Shims (each target is checked first; a missing one raises :class:`MegatronShimError` naming it):

1. megatron-core's four (``elastor_ds.testing.megatron_cpu``): ``torch.cuda.current_device``,
   ``synchronize``, the CUDA RNG functions, ``device="cuda"`` in the pipeline schedules.
2. ``Tensor.cuda`` / ``Module.cuda`` return the object itself (CPU).
3. ``initialize_megatron(allow_no_cuda=True)`` as called by ``megatron.training.training.pretrain``.
4. In the ``megatron.*`` modules listed in :data:`TORCH_PROXY_MODULES`, ``torch`` is a proxy whose
   allocation functions send ``device='cuda'`` to CPU and whose ``torch.cuda`` answers memory /
   stream / event calls with CPU stand-ins.
5. Inside ``megatron/training/initialize.py``: ``torch.cuda.device_count()`` -> 1 (else model
   parallel init and RNG seeding are skipped), ``torch.cuda.set_device`` -> no-op; the fused-kernel
   build and the JIT warm-up are skipped; ``get_device_arch_version`` -> 0.
6. ``--bf16``/``--fp16`` and ``--use-distributed-optimizer``: Megatron asserts ``torch.cuda.*Tensor``
   parameter types and allocates its buffers with ``torch.cuda.current_device()``; the proxy covers
   the allocations and ``Tensor.type()`` is answered as ``torch.cuda.<X>Tensor`` for CPU tensors
   while ``MEGATRON_CPU_CUDA_TYPE=1`` (set by this runner for those flags).

Fault injection for the ``elastor run`` end-to-end cases (:func:`install_fault`):
``ELASTOR_MLM_FAULT=iteration-N:RANK`` SIGKILLs global rank RANK as it starts 1-based iteration N
(its peers are already inside it), in the first launch of an ``elastor run`` job only
(``ELASTOR_ROUND`` 0), after its in-flight elastor save committed: a real kill at a point a signal
from outside cannot hit reliably.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
import types
from typing import Any

# modules whose ``torch`` becomes the CPU proxy (they allocate on "cuda" or ask torch.cuda)
TORCH_PROXY_MODULES = (
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.checkpointing",
    "megatron.training.initialize",
    "megatron.training.arguments",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.transformer.utils",  # the default causal mask of middle pipeline stages (PP > 2)
)
_ALLOC = ("zeros", "empty", "ones", "tensor", "full", "arange", "rand", "randn", "randint",
          "zeros_like", "empty_like", "ones_like", "full_like", "as_tensor")


def _cpu(dev: Any) -> Any:
    import torch

    if isinstance(dev, int):
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


class _Stream:
    """A CPU stand-in for torch.cuda.Stream / Event (everything is synchronous on CPU)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *a: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: (0.0 if name == "elapsed_time" else True if name == "query" else None)


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as the proxied megatron modules see it."""

    _ZERO = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
    _NOOP = ("empty_cache", "synchronize", "reset_peak_memory_stats", "set_device", "nvtx")

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        import torch

        if name in self._ZERO:
            return lambda *a, **k: 0
        if name in self._NOOP:
            return lambda *a, **k: None
        if name in ("Stream", "Event"):
            return _Stream
        if name in ("current_stream", "default_stream", "stream"):
            return lambda *a, **k: _Stream()
        if name == "memory_stats":
            return lambda *a, **k: {}
        if name == "mem_get_info":
            return lambda *a, **k: (0, 0)
        if name == "current_device":
            return lambda: "cpu"
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` for megatron modules that hard-code CUDA: allocations go to CPU."""

    def __init__(self, cuda: Any = None) -> None:
        super().__init__("torch")
        self._cuda = cuda or _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        import torch

        if name == "cuda":
            return self._cuda
        attr = getattr(torch, name)
        if name in _ALLOC:
            def alloc(*a: Any, __f: Any = attr, **k: Any) -> Any:
                if "device" in k:
                    k["device"] = _cpu(k["device"])
                return __f(*a, **k)
            return alloc
        return attr


def _need(mod: Any, name: str) -> Any:
    from elastor_ds.testing.megatron_cpu import MegatronShimError

    if not hasattr(mod, name):
        raise MegatronShimError(f"{getattr(mod, '__name__', mod)}.{name} is missing: the Megatron-LM CPU runner "
                                f"was written for core_v0.16.1; update examples/megatron_lm/cpu_pretrain_gpt.py")
    return getattr(mod, name)


class _InitCuda(_CpuCuda):
    """``torch.cuda`` inside megatron/training/initialize.py: one (pretend) device."""

    def __getattr__(self, name: str) -> Any:
        if name == "device_count":
            return lambda: 1
        if name == "get_device_properties":
            return lambda *a, **k: types.SimpleNamespace(major=0, minor=0, name="cpu", total_memory=0)
        return super().__getattr__(name)


def _cuda_type_shim() -> None:
    """``Tensor.type()`` -> 'torch.cuda.<X>Tensor' for CPU tensors (Megatron's optimizers assert it)."""
    import torch

    orig = _need(torch.Tensor, "type")

    def type_(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)
        if not a and not k and isinstance(out, str) and out.startswith("torch.") and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = type_  # type: ignore[assignment]


def install(cuda_types: bool = False) -> None:
    """Apply every shim (see the module docstring). Raises MegatronShimError when a target moved."""
    import torch

    from elastor_ds.testing import megatron_cpu

    if torch.cuda.is_available():
        return
    megatron_cpu.apply()
    _need(torch.Tensor, "cuda")
    _need(torch.nn.Module, "cuda")
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    proxy = _CpuTorch()
    for name in TORCH_PROXY_MODULES:
        mod = importlib.import_module(name)
        _need(mod, "torch")
        mod.torch = proxy  # type: ignore[attr-defined]
    init = importlib.import_module("megatron.training.initialize")
    init.torch = _CpuTorch(_InitCuda())  # type: ignore[attr-defined]
    _need(init, "fused_kernels")
    init.fused_kernels = types.SimpleNamespace(load=lambda args: None)  # type: ignore[attr-defined]
    _need(init, "_warmup_jit_function")
    init._warmup_jit_function = lambda: None  # type: ignore[attr-defined]
    arguments = importlib.import_module("megatron.training.arguments")
    _need(arguments, "get_device_arch_version")
    arguments.get_device_arch_version = lambda: 0  # type: ignore[attr-defined]
    training = importlib.import_module("megatron.training.training")
    orig_init = _need(training, "initialize_megatron")

    def initialize_megatron(*a: Any, **k: Any) -> Any:
        k["allow_no_cuda"] = True
        return orig_init(*a, **k)

    training.initialize_megatron = initialize_megatron  # type: ignore[attr-defined]
    if cuda_types:
        _cuda_type_shim()


def install_fault(spec: str) -> None:
    """``iteration-N:RANK`` (see the module docstring): wrap Megatron-LM's ``train_step`` so that
    global rank RANK kills itself (SIGKILL) when called for 1-based iteration N. Empty: nothing."""
    if not spec or os.environ.get("ELASTOR_ROUND", "0") != "0":
        return
    point, _, who = spec.partition(":")
    if not point.startswith("iteration-") or not point[len("iteration-"):].isdigit() or not who.isdigit():
        raise ValueError(f"ELASTOR_MLM_FAULT={spec!r}: expected iteration-N:RANK, e.g. iteration-8:3")
    at, rank = int(point[len("iteration-"):]), int(who)
    training = importlib.import_module("megatron.training.training")
    orig = _need(training, "train_step")

    def train_step(*a: Any, iteration: Any = None, **k: Any) -> Any:
        import signal

        import torch.distributed as dist

        if iteration is not None and int(iteration) + 1 == at and dist.get_rank() == rank:
            from elastor_ds.integrations.megatron import training_hooks

            training_hooks.finalize()   # the last save is committed: the relaunch resumes from it
            sys.stderr.write(f"injected fault: SIGKILL of rank {rank} at iteration {at}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, iteration=iteration, **k)

    training.train_step = train_step  # type: ignore[attr-defined]


def main(argv: list[str]) -> None:
    if "--megatron-lm" in argv:
        i = argv.index("--megatron-lm")
        mlm = os.path.abspath(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    else:
        mlm = os.environ.get("MEGATRON_LM_DIR", "")
    script = os.path.join(mlm, "pretrain_gpt.py")
    if not mlm or not os.path.isfile(script):
        sys.stderr.write("cpu_pretrain_gpt.py: pass --megatron-lm DIR (a Megatron-LM checkout) or set "
                         "MEGATRON_LM_DIR\n")
        sys.exit(2)
    if mlm not in sys.path:
        sys.path.insert(0, mlm)
    os.environ.setdefault("PYENV_VERSION", "%d.%d.%d" % sys.version_info[:3])
    # Megatron-LM's validate_args asserts it for TP (or CP) > 1 below Blackwell (arch 0 here): the CUDA
    # setting its GPU launch scripts export, meaningless on CPU
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    install(cuda_types=any(f in argv for f in ("--bf16", "--fp16", "--use-distributed-optimizer")))
    install_fault(os.environ.get("ELASTOR_MLM_FAULT", ""))
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
