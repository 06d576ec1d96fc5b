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


def _writer_records():
    """Saves at 4, 8, 12 (stall 0.05 s); the writer busy as 5, 9, 13 start (and 10: save 8's write
    is longer than one iteration). Idle iterations take 1.0 s."""
    times = {i: 1.0 for i in range(1, 15)}
    times.update({4: 7.0, 8: 7.0, 12: 7.0})        # saving iterations: never idle or writing
    times.update({5: 1.2, 9: 1.1, 10: 1.1, 13: 1.3})
    busy = {5, 9, 10, 13}
    recs = []
    for i in range(1, 15):
        r = {"iteration": i, "iter_time_s": times[i], "storage_writer_busy": i in busy}
        if i in (4, 8, 12):
            r["save_stall_s"] = 0.05
        if i == 8:
            r.update(prev_save_durable_s=0.85, prev_save_writer_cpu_s=0.2)    # save 4: writes 0.8 s
        if i == 12:
            r.update(prev_save_durable_s=1.65, prev_save_writer_cpu_s=0.4)    # save 8: writes 1.6 s
        recs.append(r)
    return recs


def test_writer_effect_hand_computed():
    from elastor_ds.elastic.overhead import writer_effect
    r = writer_effect(_writer_records(), skip=0)
    # idle: 1 2 3 6 7 11 14 (1.0 s); writing: 5 9 10 13
    assert (r["iterations_idle"], r["iterations_writing"]) == (7, 4)
    assert r["median_iter_s_idle"] == pytest.approx(1.0)
    assert r["iter_writing_over_idle"] == pytest.approx(1.15)            # median of 1.2 1.1 1.1 1.3
    # save 4: 0.8 s written, 0.2 s extra -> 0.8 / 0.6; save 8: 1.6 s, 0.1 + 0.1 extra -> 1.6 / 1.4
    # (save 12 has no later save reporting its times)
    assert r["per_save_compute_while_writing_over_idle"] == pytest.approx([0.8 / 0.6, 1.6 / 1.4])
    assert r["compute_while_writing_over_idle"] == pytest.approx((0.8 / 0.6 + 1.6 / 1.4) / 2)
    assert r["median_write_s"] == pytest.approx(1.2)
    assert r["save_stall_over_iter"] == pytest.approx(0.05)
    assert r["writer_cpu_over_iter"] == pytest.approx(0.3)


def test_writer_effect_skips_warm_up_and_names_a_missing_kind():
    from elastor_ds.elastic.overhead import writer_effect
    r = writer_effect(_writer_records(), skip=4)
    assert r["iterations_idle"] == 4 and r["saves_measured"] == 1      # save 4 is warm-up
    assert r["per_save_compute_while_writing_over_idle"] == pytest.approx([1.6 / 1.4])
    with pytest.raises(ValueError, match="no writing iterations"):
        writer_effect([{"iteration": i, "iter_time_s": 1.0, "storage_writer_busy": False} for i in range(1, 5)], skip=0)
    with pytest.raises(ValueError, match="no idle iterations"):
        writer_effect([{"iteration": i, "iter_time_s": 1.0} for i in range(1, 5)], skip=0)


def test_writer_effect_reports_live_fences_hand_computed():
    from elastor_ds.elastic.overhead import writer_effect
    recs = _writer_records()
    recs[7].update(prev_save_fence_s=0.3, prev_save_fence_bytes=25, prev_save_bytes=100)    # iteration 8
    recs[11].update(prev_save_fence_s=0.1, prev_save_fence_bytes=75, prev_save_bytes=100)   # iteration 12
    r = writer_effect(recs, skip=0)
    assert r["live_saves"] == 2
    assert r["live_fence_over_iter"] == pytest.approx(0.2)           # median of 0.3 and 0.1 s, idle 1.0 s
    assert r["live_fence_share_of_bytes"] == pytest.approx(0.5)      # median of 0.25 and 0.75
    assert "live_saves" not in writer_effect(_writer_records(), skip=0)
