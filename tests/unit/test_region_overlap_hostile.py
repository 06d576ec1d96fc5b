"""``first_overlap`` (the manifest's check that a tensor's chunks are disjoint) on a manifest an
attacker shapes: a ``[1, n]`` tensor cut into n one-column chunks made the sweep along the first
dimension compare every pair (n^2 / 2 intersections: a 400 KB manifest took 17 s, 800 KB more than
a minute). Oracle: the number of intersections computed, counted, and brute force for the answer."""
from __future__ import annotations

import itertools
import random

from elastor_ds.layout.region import Region, first_overlap


def _count_intersections(monkeypatch) -> list[int]:
    calls = [0]
    real = Region.intersect

    def counting(self, other):
        calls[0] += 1
        return real(self, other)
    monkeypatch.setattr(Region, "intersect", counting)
    return calls


def test_column_chunks_of_a_one_row_tensor_cost_linear_work(monkeypatch):
    n = 4000
    calls = _count_intersections(monkeypatch)
    assert first_overlap([Region((0, i), (1, 1)) for i in range(n)]) is None
    assert calls[0] <= 2 * n, calls[0]
    calls[0] = 0
    regs = [Region((i, 0), (1, 1)) for i in range(n)]       # the same along the first dimension
    assert first_overlap(regs) is None and calls[0] <= 2 * n


def test_the_answer_matches_brute_force_on_random_boxes():
    rng = random.Random(7)
    for _ in range(300):
        regs = []
        for _ in range(rng.randint(2, 7)):
            off = (rng.randint(0, 5), rng.randint(0, 5))
            regs.append(Region(off, (rng.randint(0, 3), rng.randint(0, 3))))
        brute = [(i, j) for i, j in itertools.combinations(range(len(regs)), 2)
                 if not regs[i].empty and not regs[j].empty and regs[i].intersect(regs[j]) is not None]
        got = first_overlap(regs)
        assert (got is None) == (not brute), (regs, got, brute)
        if got is not None:
            assert got in brute
