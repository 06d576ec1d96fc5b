"""The manifest parser's fast path for chunk entries accepts exactly what its checks accept.

``_chunk_fast`` parses a chunk entry without building messages and gives up (None) on anything it
doubts; the field-by-field checks then name the failure. The oracle here is those checks alone
(the fast path switched off): for thousands of mutated entries, both ways give an equal manifest
or the same error."""
from __future__ import annotations

import copy
import json
import random

import pytest

from elastor_ds.checkpoint.planning import manifest as M
from elastor_ds.errors import ManifestError

pytestmark = pytest.mark.unit


def _document() -> dict:
    files = {"data_00000.safetensors": {"size": 1 << 20, "crc32": "0000abcd", "writer_rank": 0},
             "data_00000.crc32": {"size": 1024, "crc32": "12345678", "writer_rank": 0}}
    chunks = [{"file": "data_00000.safetensors", "key": f"w#{r},0", "region": [[r, 0], [16, 64]],
               "offset": 4096 + r * 64 * 4, "length": 16 * 64 * 4, "crc32": "89abcdef",
               "blocks": {"size": 4096, "table": "data_00000.crc32", "index": r}} for r in (0, 16)]
    d = {"format": M.FORMAT_NAME, "format_version": 2, "step": 7, "world_size": 1, "created_unix": 1.0,
         "layout": None, "model": None, "extra": {}, "rank_state_files": {}, "files": files,
         "tensors": {"w": {"shape": [32, 64], "dtype": "float32", "chunks": chunks}}}
    d["checksum"] = M.document_checksum(d)
    return d


VALUES = [None, True, False, -1, 0, 1, 3, 16, 64, 4096, 1 << 40, 1.5, "", "x", "data_00000.crc32",
          "data_00000.safetensors", "../data_00000.safetensors", "a/b", "0000000g", "0x123456", " 1234567",
          "ABCDEF01", [], [0], [0, 0], [-1, 0], [True, 0], [[0, 0], [16, 64]], [[0, 0], [16, 65]],
          [[0, 0], [33, 64]], [[0], [16]], [[0, 0, 0], [1, 1, 1]], {}, {"size": 4096}]
FIELDS = ["file", "key", "region", "offset", "length", "crc32", "blocks", "region.0", "region.1",
          "region.0.0", "region.1.1", "blocks.size", "blocks.table", "blocks.index", "drop"]


def _mutate(d: dict, rng: random.Random) -> dict:
    d = copy.deepcopy(d)
    c = rng.choice(d["tensors"]["w"]["chunks"])
    for _ in range(rng.randint(1, 2)):
        field, value = rng.choice(FIELDS), copy.deepcopy(rng.choice(VALUES))
        if field == "drop":
            c.pop(rng.choice(list(c)), None)
            continue
        parts = field.split(".")
        obj = c
        try:
            for p in parts[:-1]:
                obj = obj[int(p)] if isinstance(obj, list) else obj[p]
            last = parts[-1]
            if isinstance(obj, list):
                obj[int(last)] = value
            elif isinstance(obj, dict):
                obj[last] = value
        except (KeyError, IndexError, TypeError, ValueError):
            pass
    d["checksum"] = M.document_checksum(d)
    return d


def _parse(text: str, fast: bool, monkeypatch) -> object:
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(M, "_chunk_fast", lambda *a, **k: None)
        try:
            return M.Manifest.loads(text, where="m")
        except ManifestError as e:
            return ("error", str(e))


def test_the_fast_path_agrees_with_the_checks_on_mutated_chunks(monkeypatch):
    rng = random.Random(23)
    base = _document()
    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):
        text = json.dumps(_mutate(base, rng))
        fast, slow = _parse(text, True, monkeypatch), _parse(text, False, monkeypatch)
        assert fast == slow, text
        outcomes["error" if isinstance(slow, tuple) else "ok"] += 1
    # the mutations exercise both outcomes (a sweep of only errors, or only successes, shows nothing)
    assert outcomes["ok"] > 100 and outcomes["error"] > 1000, outcomes


def test_the_fast_path_takes_the_valid_entries(monkeypatch):
    calls = []
    real = M._chunk_fast

    def spy(*a, **k):
        r = real(*a, **k)
        calls.append(r is not None)
        return r
    monkeypatch.setattr(M, "_chunk_fast", spy)
    man = M.Manifest.loads(json.dumps(_document()))
    assert calls == [True, True]
    c = man.tensors["w"].chunks[1]
    assert (c.region.offsets, c.region.sizes, c.offset, c.length, c.crc32, c.blocks.index) == \
        ((16, 0), (16, 64), 4096 + 16 * 64 * 4, 4096, 0x89abcdef, 16)
