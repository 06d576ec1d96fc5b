"""A generated corpus with learnable structure, so the demo's loss visibly falls on CPU.

Records are lines of short sentences drawn from a small grammar with deterministic choices
(subject-verb agreement, fixed adjective/noun pairings, arithmetic facts), seeded, so every run and
every layout sees the same text. Written as JSONL (``{"text": ...}``) like a user's own data.
"""
from __future__ import annotations

import json
import os
import random

_NOUNS = ["cat", "dog", "bird", "fish", "fox", "owl", "bee", "cow"]
_ADJ = {"cat": "black", "dog": "brown", "bird": "small", "fish": "blue", "fox": "red", "owl": "wise",
        "bee": "busy", "cow": "big"}
_VERBS = ["sees", "likes", "chases", "finds"]
_PLACES = ["in the park", "by the river", "on the hill", "near the barn"]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        a, b = rng.choice(_NOUNS), rng.choice(_NOUNS)
        return f"the {_ADJ[a]} {a} {rng.choice(_VERBS)} the {_ADJ[b]} {b} {rng.choice(_PLACES)}."
    x, y = rng.randint(0, 9), rng.randint(0, 9)
    return f"{x} plus {y} is {x + y}."


def write_synthetic_corpus(path: str, num_records: int = 20000, chars_per_record: int = 200, seed: int = 0) -> str:
    """Write ``num_records`` JSONL records of about ``chars_per_record`` characters (atomically)."""
    rng = random.Random(seed)
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        for _ in range(num_records):
            parts: list[str] = []
            while sum(len(p) + 1 for p in parts) < chars_per_record:
                parts.append(_sentence(rng))
            f.write(json.dumps({"text": " ".join(parts)}) + "\n")
    os.replace(tmp, path)
    return path
