"""The ``exclusive`` marker (tests/conftest.py): under pytest-xdist a test so marked runs while no other
test runs, and the other tests still run side by side. Checked on a throw-away suite run by a real
pytest on 2 workers with this suite's conftest; every test logs its own start and end times."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one worker takes group a (the timed test first), the other group b: without the lock the timed test
# would start beside b0
BODY = '''
import os, time, pytest

def _log(name):
    t0 = time.monotonic()
    time.sleep(0.8)
    with open(os.environ["LOCK_TEST_LOG"], "a") as f:
        f.write(f"{name} {t0} {time.monotonic()}\\n")

@pytest.mark.xdist_group("a")
@pytest.mark.exclusive
def test_timed():
    _log("timed")

@pytest.mark.xdist_group("a")
@pytest.mark.parametrize("i", range(3))
def test_plain_a(i):
    _log(f"a{i}")

@pytest.mark.xdist_group("b")
@pytest.mark.parametrize("i", range(4))
def test_plain_b(i):
    _log(f"b{i}")
'''


def test_an_exclusive_test_overlaps_no_other_test_and_the_others_overlap(tmp_path):
    suite = tmp_path / "suite"
    (suite / "unit").mkdir(parents=True)
    shutil.copy(os.path.join(HERE, "conftest.py"), suite / "conftest.py")
    shutil.copytree(os.path.join(HERE, "helpers"), suite / "helpers")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    exclusive: x\n    unit: x\n")
    (suite / "unit" / "test_lock.py").write_text(BODY)
    log = tmp_path / "log"
    tmp = tmp_path / "tmp"   # the run's lock folder is made here (tempfile honours TMPDIR)
    tmp.mkdir()
    env = dict(os.environ, LOCK_TEST_LOG=str(log), TMPDIR=str(tmp))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", str(suite)],
                       cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    spans = {}
    for line in log.read_text().split("\n"):
        if line:
            name, t0, t1 = line.split()
            spans[name] = (float(t0), float(t1))
    assert len(spans) == 8, spans

    def overlap(a, b):
        return a[0] < b[1] and b[0] < a[1]

    timed = spans.pop("timed")
    assert not [n for n, s in spans.items() if overlap(s, timed)], (timed, spans)
    # the two groups ran on the two workers, side by side, whenever the timed test was not running
    assert any(overlap(a, b) for n, a in spans.items() for m, b in spans.items() if n < m and n[0] != m[0]), spans
    assert not [d for d in os.listdir(tmp) if d.startswith("elastor-tests-")], "the run's lock folder was left"
