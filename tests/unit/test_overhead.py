"""paired_overhead (the snapshot step overhead within one run) against hand-computed values."""
from __future__ import annotations

import pytest

from elastor_ds.elastic.overhead import paired_overhead


def _records():
    snapped = {4, 5, 6, 7, 12, 13, 14, 15}
    times = {i: 1.0 for i in range(1, 17)}
    times.update({5: 1.1, 6: 1.1, 7: 1.3, 13: 1.1, 14: 1.1, 15: 1.3, 11: 0.8})
    times.update({4: 9.0, 8: 9.0, 12: 9.0, 16: 9.0})   # "neither" iterations: must not count anywhere
    return [{"iteration": i, "iter_time_s": times[i], **({"snapshot_stall_s": 0.001} if i in snapped else {})}
            for i in range(1, 17)]


def test_paired_overhead_hand_computed():
    r = paired_overhead(_records(), block=4, skip=0)
    # with: 5 6 7 13 14 15; without: 1 2 3 9 10 11; 4 8 12 16 are neither
    assert (r["iterations_with"], r["iterations_without"]) == (6, 6)
    assert r["median_iter_s_with"] == pytest.approx(1.1) and r["median_iter_s_without"] == pytest.approx(1.0)
    assert r["step_overhead"] == pytest.approx(0.1)
    assert r["step_overhead_of_means"] == pytest.approx((7.0 / 6) / (5.8 / 6) - 1)
    assert r["block_pair_overheads"] == pytest.approx([0.1])   # block 1 (with) vs block 2 (without)


def test_paired_overhead_skips_warm_up_and_names_a_missing_kind():
    r = paired_overhead(_records(), block=4, skip=3)
    assert r["iterations_without"] == 3                        # 1-3 left out
    with pytest.raises(ValueError, match="no with-snapshot iterations"):
        paired_overhead([{"iteration": i, "iter_time_s": 1.0} for i in range(1, 9)], block=4, skip=0)
    with pytest.raises(ValueError, match="block=0"):
        paired_overhead(_records(), block=0)


def test_process_cpu_added_hand_computed():
    recs = _records()
    for r in recs:   # with: 0.5 s of CPU (5 6 7 13 14 15); without: 0.4 (1 2 3 9 10 11); neither: 9
        i = r["iteration"]
        r["process_cpu_s"] = 0.5 if i in (5, 6, 7, 13, 14, 15) else 0.4 if i in (1, 2, 3, 9, 10, 11) else 9.0
    r = paired_overhead(recs, block=4, skip=0)
    assert r["process_cpu_added_over_iter"] == pytest.approx((0.5 - 0.4) / 1.0)
    assert r["process_cpu_added_over_iter_of_means"] == pytest.approx((0.5 - 0.4) / (5.8 / 6))
    assert paired_overhead(_records(), block=4, skip=0)["process_cpu_added_over_iter"] is None   # not recorded
