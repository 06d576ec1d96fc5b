import contextlib
import fcntl
import os
import shutil
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "helpers"))   # the test helpers live in one place: tests/helpers/

import pytest  # noqa: E402

# Tiers are folders (run one with `pytest tests/<tier>`, or `scripts/test.sh --quick` for unit):
#   unit    pure code and local I/O in one process (seconds)
#   dist    multi-process gloo ranks (tests/helpers/dist_utils.run_world) and subprocess CLIs
#   e2e     the controller (`elastor run`), the trainers, the demo, Megatron-LM
#   faults  injected faults and attackers (the fault campaign lives here too)
#   netns   nodes as network namespaces (root)
#   gpu     needs CUDA (skipped without it)
# Every test gets its folder's marker, so `-m "not e2e"` works too.
TIERS = ("unit", "dist", "e2e", "faults", "netns", "gpu")


def tier_of(path: str) -> str:
    rel = os.path.relpath(path, HERE).split(os.sep)
    return rel[0] if len(rel) > 1 and rel[0] in TIERS else "unsorted"


# Under pytest-xdist (scripts/test.sh runs the full suite on 2 workers) the longest waits go first so
# that the short tests fill the end: the netns tier (one worker, one group: fixed namespace names),
# then e2e, faults, dist, unit, and the tests marked ``exclusive`` (below) at the very end. A stable sort:
# the order within a tier stays the files' order.
XDIST_ORDER = ("netns", "e2e", "faults", "dist", "gpu", "unsorted", "unit")


def _shares_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(d.scope in ("module", "class", "package")
                              for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    import torch

    config._elastor_collected_tiers = sorted({tier_of(str(item.fspath)) for item in items})
    if os.environ.get("PYTEST_XDIST_WORKER"):   # exclusive tests last: they then wait for short unit tests only
        items.sort(key=lambda item: len(XDIST_ORDER) if item.get_closest_marker("exclusive")
                   else XDIST_ORDER.index(tier_of(str(item.fspath))))
    for item in items:
        tier = tier_of(str(item.fspath))
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "netns":   # fixed namespace names and addresses: one pytest-xdist worker runs them all
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif _shares_a_module_fixture(item):   # a module's reference run is computed once, on one worker
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        if (tier == "gpu" or item.get_closest_marker("gpu")) and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA (gpu tier)"))


# Tests marked ``exclusive`` compare a measured wall time with a prediction made for an otherwise idle
# machine (the demo's predicted vs measured iteration time). Under pytest-xdist such a test waits for the
# running tests to finish and no test starts until it ends: a readers-writer lock of two flock files in
# one private folder per run (a "gate" that a waiting exclusive test holds so that it is not starved,
# and the "room", shared by ordinary tests, exclusive for the timing test).
_LOCK_DIR_KEY = "elastor_test_lock_dir"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):   # pytest-xdist's controller, once per worker
    config = node.config
    if getattr(config, "_elastor_lock_dir", None) is None:
        config._elastor_lock_dir = tempfile.mkdtemp(prefix="elastor-tests-")   # mode 0700, ours
    node.workerinput[_LOCK_DIR_KEY] = config._elastor_lock_dir


def pytest_unconfigure(config):
    lock_dir = getattr(config, "_elastor_lock_dir", None)
    if lock_dir:
        shutil.rmtree(lock_dir, ignore_errors=True)   # the folder made above, holding our two lock files


@contextlib.contextmanager
def _run_lock(lock_dir: str, exclusive: bool):
    def open_lock(name: str) -> int:
        return os.open(os.path.join(lock_dir, name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    gate, room = open_lock("gate"), open_lock("room")
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(room, fcntl.LOCK_EX)   # holds the gate too, until the test ends
        else:
            fcntl.flock(room, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        for fd in (room, gate):   # unlock first: a process the test forked may still hold a copy of the fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    lock_dir = getattr(item.config, "workerinput", {}).get(_LOCK_DIR_KEY)
    exclusive = item.get_closest_marker("exclusive") is not None
    with _run_lock(lock_dir, exclusive) if lock_dir else contextlib.nullcontext(), _cpu_log(item.nodeid):
        yield


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


# ELASTOR_TEST_CPU_LOG=FILE: one line per test with its wall seconds and the CPU seconds it used (this
# process plus the children it reaped). CPU / wall near 2 on this 2-core machine means the test is
# compute-bound; near 0 means it waits (timeouts, sleeps), which running tests side by side can hide.
_CPU_LOG = os.environ.get("ELASTOR_TEST_CPU_LOG")


@contextlib.contextmanager
def _cpu_log(nodeid: str):
    if not _CPU_LOG:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    t0, c0 = time.monotonic(), cpu()
    yield
    with open(_CPU_LOG, "a") as f:
        f.write(f"{time.monotonic() - t0:.2f}\t{cpu() - c0:.2f}\t{nodeid}\n")
