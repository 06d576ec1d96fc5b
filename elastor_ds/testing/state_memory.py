"""Measure the training-state memory a DeepSpeed engine's rank actually holds (parameters, gradients,
optimizer state, optimizer-owned copies of weights such as ZeRO shares), to compare with the
planner's memory model (:meth:`elastor_ds.plan.CostModel.stage_state_bytes`).

What is counted: every live tensor reachable from the module's parameters (``.data`` and ``.grad``),
from the optimizer's param groups (weights it steps that are not module parameters: DeepSpeed's
fp32 partitions, the heterogeneous runtime's ZeRO-1 shares, and their ``.grad``) and from the
optimizer's per-parameter state (Adam's moments and step counters), each storage once (by its data
pointer, so views of one flat buffer count once). Not counted: activations, communication buffers
(transient, at most one holder-set buffer at a time) and allocator slack.

:func:`track` measures at the two points where the training state peaks: when the last
backward of the first iteration is done (all gradients, the optimizer's state and copies) and right
after the first optimizer step (under ZeRO-1 on the heterogeneous runtime the full gradients are
freed by then, but the shares' gradients exist).
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def _base(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer) if not isinstance(optimizer, torch.optim.Optimizer) else optimizer


def state_bytes(module: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes per category (``params``, ``grads``, ``optimizer``: optimizer-owned weight copies, their
    gradients and per-parameter state) and ``total``, each storage counted once."""
    seen: set[tuple[int, int]] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t: Optional[torch.Tensor]) -> None:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            return
        seen.add(key)
        out[kind] += t.numel() * t.element_size()

    module_ids = set()
    for p in module.parameters():
        module_ids.add(id(p))
        add("params", p.data)
        add("grads", p.grad)
    opt = _base(optimizer)
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in module_ids:
                add("optimizer", p.data)
                add("optimizer", p.grad)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                add("optimizer", v)
    out["total"] = sum(out.values())
    return out


def track(engine: Any, steps: int = 2) -> dict[str, dict[str, int]]:
    """Measure :func:`state_bytes` at the two points where the training state peaks, keeping the
    largest total seen at each: ``"after_step"`` right after the base optimizer's ``step()`` (the
    engine frees gradients only after it) and, on the heterogeneous runtime, ``"backward_end"`` when
    an iteration's last backward is done (before the gradient reduction, which under ZeRO-1 frees
    the full gradients). The optimizer creates its state in the first step, so the backward end of
    the *second* iteration is the first with everything allocated. Only the first ``steps``
    optimizer steps are measured (the walk over every tensor stays off the later training steps);
    read the result with :func:`peak` after them."""
    got: dict[str, dict[str, int]] = {}
    done = [0]

    def keep(point: str) -> None:
        if done[0] >= steps:
            return
        now = state_bytes(engine.module, engine.optimizer)
        if point not in got or now["total"] > got[point]["total"]:
            got[point] = now

    def after_step(*_a: Any, **_k: Any) -> None:
        keep("after_step")
        done[0] += 1
        if done[0] >= steps:
            handle.remove()

    handle = _base(engine.optimizer).register_step_post_hook(after_step)
    if hasattr(engine, "elastor_probes"):
        engine.elastor_probes = tuple(engine.elastor_probes) + (lambda: keep("backward_end"),)
    return got


def peak(got: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The measured points and the one with the largest total (``"peak"``, with ``"at"``)."""
    out: dict[str, Any] = {k: dict(v) for k, v in got.items()}
    if got:
        at = max(got, key=lambda k: got[k]["total"])
        out["peak"] = dict(got[at], at=at)
    return out
