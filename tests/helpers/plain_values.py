"""Comparing plain data (what the object collectives' codec carries) exactly."""
from __future__ import annotations

import math


def same(a, b) -> bool:
    """Equal values of exactly the same types, all the way down: a tuple is not a list, ``1`` is not
    ``True`` or ``1.0``, dict keys in the same order and of the same types; NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is type(kb) for k, kb in zip(a, b)) and \
            all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b
