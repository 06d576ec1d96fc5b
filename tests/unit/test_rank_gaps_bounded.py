"""A crafted rank number (10**15) in a plan document or a checkpoint's layout is refused at once,
naming the first missing ranks, without building a set up to that rank (QA round 5, Q5-2: 10**8
took 55 s and 11.6 GB; 10**15 filled the machine's memory)."""
from __future__ import annotations

import resource
import time

import pytest

from elastor_ds.errors import LayoutError
from elastor_ds.layout import Layout
from elastor_ds.layout.layout import first_missing

pytestmark = pytest.mark.unit


def test_first_missing_is_bounded_by_the_count():
    assert first_missing({0, 2, 10 ** 15}, 3) == [1]
    assert first_missing({5, 6}, 2) == [0, 1]
    assert first_missing(set(range(20)) - {3, 4}, 20, k=1) == [3]


def test_a_huge_rank_in_a_layout_is_refused_at_once():
    doc = Layout.uniform(1, 2, 2, 4).to_json()
    doc["replicas"][0]["stages"][0]["ranks"] = [10 ** 15]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    with pytest.raises(LayoutError, match=r"ranks must be 0\.\.3 without gaps; missing \[0\]"):
        Layout.from_json(doc)
    assert time.process_time() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 50 * 1024   # KiB: under 50 MiB grown


def test_a_huge_rank_in_a_previous_plan_document_is_a_one_line_usage_error(tmp_path, capsys):
    import json

    from elastor_ds.cli import main
    base = ["plan", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
            "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size", "16"]
    prev = tmp_path / "prev.json"
    assert main(base + ["--gpus-per-node", "4,4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    d["replicas"][0]["stages"][0]["ranks"] = [10 ** 15]
    prev.write_text(json.dumps(d))
    capsys.readouterr()
    t0 = time.process_time()
    assert main(base + ["--gpus-per-node", "4,3", "--from-plan", str(prev)]) == 2
    assert time.process_time() - t0 < 5.0
    err = capsys.readouterr().err
    assert "without gaps; missing [0" in err and "Traceback" not in err
