"""``first_overlap``: the sweep against brute force (every pair intersected) on random boxes, and
the cases a manifest check leans on (column tiles of one row band, scalars, empty boxes)."""
from __future__ import annotations

import itertools
import random

import pytest

from elastor_ds.layout.region import Region, first_overlap

pytestmark = pytest.mark.unit


def _brute(regions):
    return any(a.intersect(b) is not None for a, b in itertools.combinations(regions, 2))


@pytest.mark.parametrize("seed", range(40))
def test_agrees_with_brute_force(seed):
    rnd = random.Random(seed)
    ndim = rnd.choice([1, 2, 3])
    regions = []
    for _ in range(rnd.randint(0, 12)):
        offs = tuple(rnd.randint(0, 8) for _ in range(ndim))
        sizes = tuple(rnd.randint(0, 4) for _ in range(ndim))
        regions.append(Region(offs, sizes))
    hit = first_overlap(regions)
    assert (hit is not None) == _brute(regions)
    if hit is not None:
        i, j = hit
        assert i < j and regions[i].intersect(regions[j]) is not None


def test_a_tiling_is_disjoint_and_a_duplicated_tile_is_not():
    tiles = [Region((r, c), (4, 2)) for r in (0, 4) for c in (0, 2, 4, 6)]   # 2 row bands x 4 column tiles
    assert first_overlap(tiles) is None
    assert first_overlap(tiles + [Region((4, 2), (4, 2))]) == (5, 8)
    assert first_overlap([Region((), ()), Region((), ())]) == (0, 1)          # a scalar held twice
    assert first_overlap([Region((0, 0), (0, 8)), Region((0, 0), (4, 8))]) is None   # an empty box holds nothing
