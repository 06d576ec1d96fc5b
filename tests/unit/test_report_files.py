"""``elastor run``'s timeline PNG is written as a new file renamed over the path: a symlink another
local user planted there (the default path sits beside ``--events``, often in a shared folder) is
replaced, never written through (QA Q9: ``savefig(path)`` overwrote the link's target)."""
from __future__ import annotations

import os

from elastor_ds.elastic.report import replace_file, timeline_png


def test_a_planted_symlink_is_replaced_and_its_target_left_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("ORIGINAL")
    link = tmp_path / "run_timeline.png"
    os.symlink(victim, link)
    replace_file(str(link), b"\x89PNG data")
    assert victim.read_text() == "ORIGINAL"
    assert not link.is_symlink() and link.read_bytes() == b"\x89PNG data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_timeline.png", "victim.txt"]   # no temp left


def test_the_timeline_goes_through_the_same_path(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("ORIGINAL")
    link = tmp_path / "t.png"
    os.symlink(victim, link)
    events = [{"event": "launch", "time": 100.0, "world": 2}]
    metrics = [{"iteration": i, "time": 100.0 + i, "iter_time_s": 1.0, "lm_loss": 2.0 - 0.1 * i, "consumed_samples": 4 * i}
               for i in range(1, 6)]
    assert timeline_png(events, metrics, str(link))
    assert victim.read_text() == "ORIGINAL" and link.read_bytes()[:4] == b"\x89PNG"
