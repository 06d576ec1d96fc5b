import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

# test tiers (registered in pytest.ini): `-m unit` runs in seconds, `-m integration` spawns ranks,
# trainers and CLIs, `-m gpu` needs CUDA. A test module may set its own `pytestmark`; otherwise a
# module that starts processes is integration, the rest unit.
_STARTS_PROCESSES = ("run_world", "subprocess", "torchrun", "start_processes")


def pytest_collection_modifyitems(config, items):
    import torch

    cache: dict[str, bool] = {}
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("unit", "integration", "gpu")):
            path = str(item.fspath)
            if path not in cache:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                cache[path] = any(s in text for s in _STARTS_PROCESSES)
            item.add_marker(pytest.mark.integration if cache[path] else pytest.mark.unit)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA (gpu tier)"))


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path / "tiny"`` (a real full disk for ENOSPC paths); skipped
    where mounting is not allowed (needs root). Unmounted after the test."""
    import subprocess
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        if os.geteuid() == 0:   # CI runs as root: a full-disk test that cannot run is a failure, not a skip
            pytest.fail(f"cannot mount a 1 MiB tmpfs as root: {r.stderr.strip()}")
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
