"""Device health probes: each GPU is tested in its own subprocess (allocate, compute, synchronise)
with a timeout, so a wedged device cannot hang the controller."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

_PROBE = r"""
import sys, torch
d = torch.device("cuda", int(sys.argv[1]))
a = torch.randn(1024, 1024, device=d)
b = (a @ a).sum()
torch.cuda.synchronize(d)
ok = bool(torch.isfinite(b).item())
sys.exit(0 if ok else 3)
"""


def probe_gpus(devices: list[int], timeout_s: float = 60.0,
               visible: str | None = None) -> tuple[dict[int, bool], float]:
    """Probe ``devices`` (indices into ``visible``, the controller's original CUDA_VISIBLE_DEVICES;
    None: all GPUs) in parallel subprocesses; returns (device -> passed, seconds)."""
    t0 = time.monotonic()
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible

    def one(dev: int) -> bool:
        try:
            r = subprocess.run([sys.executable, "-c", _PROBE, str(dev)], capture_output=True, timeout=timeout_s,
                               env=env)
            if r.returncode != 0:
                log.warning("probe of GPU %d failed (exit %d): %s", dev, r.returncode,
                            r.stderr.decode(errors="replace").strip().splitlines()[-1:] or "")
            return r.returncode == 0
        except subprocess.TimeoutExpired:
            log.warning("probe of GPU %d timed out after %.0f s", dev, timeout_s)
            return False

    with ThreadPoolExecutor(max_workers=max(1, len(devices))) as pool:
        res = dict(zip(devices, pool.map(one, devices)))
    return res, time.monotonic() - t0
