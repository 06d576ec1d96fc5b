"""The test suite's own layout: every test module's file name is unique across tests/ (pytest
imports them by basename; two of one name in two folders broke a CI run with "import file
mismatch", and spawned workers of the other one imported the wrong module)."""
from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique():
    names = collections.defaultdict(list)
    for p in TESTS.rglob("test_*.py"):
        names[p.name].append(str(p.relative_to(TESTS)))
    dup = {n: ps for n, ps in names.items() if len(ps) > 1}
    assert not dup, f"test modules sharing a file name (rename one): {dup}"
