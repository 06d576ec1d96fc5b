"""Every tier folder is collected by a plain ``pytest`` run (pytest's default ``norecursedirs``
contains ``dist``, which once dropped the whole tests/dist tier from CI without a word)."""
from __future__ import annotations

import configparser
import fnmatch
import pathlib

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the tier folders: every folder of tests/ that holds test files
TIERS = sorted(d.name for d in (ROOT / "tests").iterdir() if d.is_dir() and any(d.glob("test_*.py")))


def test_no_tier_folder_is_excluded_from_collection():
    cp = configparser.ConfigParser()
    cp.read(ROOT / "pytest.ini")
    pats = cp["pytest"].get("norecursedirs")
    assert pats is not None, "pytest.ini must set norecursedirs: pytest's default skips a folder named 'dist'"
    skipped = [t for t in TIERS if any(fnmatch.fnmatch(t, p) for p in pats.split())]
    assert not skipped, f"tier folders excluded by norecursedirs {pats!r}: {skipped}"
    assert {"unit", "dist", "e2e", "faults", "netns", "gpu"} <= set(TIERS), TIERS


def test_a_plain_run_collects_the_dist_tier(pytestconfig):
    """The running session itself: when it was started on the whole suite, tests/dist is in it."""
    args = [str(a) for a in pytestconfig.args]
    if args not in (["tests"], [str(ROOT / "tests")], []):
        pytest.skip("not a whole-suite run")
    items = getattr(pytestconfig, "_elastor_collected_tiers", None)
    assert items is not None and "dist" in items, items
