"""The netns tier: nodes as Linux network namespaces (root). Skips, with the reason, where
namespaces, veth pairs or tc are not permitted. Every test gets a bed of its own under a prefix
unique to the test session; at the end (passed or failed) every process in it is killed and every
namespace deleted, and the test fails if anything is left."""
from __future__ import annotations

import os
import secrets
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from elastor_ds.testing import netns  # noqa: E402

SESSION = f"el{secrets.token_hex(2)}"
_counter = iter(range(10_000))
_why = None


def pytest_collection_modifyitems(config, items):
    global _why
    here = os.path.dirname(__file__)
    mine = [i for i in items if str(i.fspath).startswith(here)]
    if not mine:
        return
    _why = netns.unavailable()
    for item in mine:
        item.add_marker(pytest.mark.integration)
        if _why:
            item.add_marker(pytest.mark.skip(reason=f"netns tier: {_why}"))


@pytest.fixture
def bed_factory():
    beds: list[netns.Testbed] = []

    def make(names):
        b = netns.Testbed(names, prefix=f"{SESSION}{next(_counter)}x")
        beds.append(b)
        return b.up()
    yield make
    left = {}
    for b in beds:
        left.update(b.down())
        # the nodes' --snapshot-dir folders carry the bed's prefix (a killed node cannot remove its own)
        for d in os.listdir("/dev/shm"):
            if d.startswith(b.prefix) and os.path.isdir(os.path.join("/dev/shm", d)):
                shutil.rmtree(os.path.join("/dev/shm", d), ignore_errors=True)
    assert not left, f"namespaces or processes left behind: {left}"
