"""The checkpoint group's arrival barrier (``collectives._Liveness.arrive``): a rank that waited
notices the last arrival soon after it (an eighth of its wait, 1 ms at least), every arrival of a
long sequence completes with random skews, the store keeps a bounded number of arrival keys, and a
peer that never arrives and stops beating is named.

The ranks are two threads, each with its own ``_Liveness`` on one in-process store (torch's
``HashStore``); times are the test's own clock."""
from __future__ import annotations

import random
import statistics
import threading
import time

import pytest
import torch.distributed as dist

from elastor_ds.comm import collectives as C
from elastor_ds.errors import PeerFailedError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def _pair(store, liveness_s: float = 5.0):
    return [C._Liveness(None, "t", r, 2, liveness_s, shared_store=store) for r in range(2)]


def _close(lvs):
    for lv in lvs:
        lv.close()


def test_a_waiting_rank_notices_the_last_arrival_within_an_eighth_of_its_wait():
    lvs = _pair(dist.HashStore())
    late = []
    try:
        for skew in (0.035, 0.035, 0.035, 0.120, 0.120):
            t_late = []

            def second():
                time.sleep(skew)
                t_late.append(time.monotonic())
                lvs[1].arrive("test")
            th = threading.Thread(target=second)
            t0 = time.monotonic()
            th.start()
            lvs[0].arrive("test")
            back = time.monotonic()
            th.join()
            assert back >= t_late[0]
            late.append((skew, back - t_late[0]))
    finally:
        _close(lvs)
    # a doubling pause (1, 2, 4, ... ms) noticed a 35 ms wait after 63 ms (28 ms late) and a
    # 120 ms wait after 163 ms (43 ms late)
    for skew in (0.035, 0.120):
        lag = statistics.median(l for s, l in late if s == skew)
        assert lag < max(0.001, skew / 8) + 0.008, late


def test_a_long_sequence_with_random_skews_completes_and_keeps_few_keys():
    store = dist.HashStore()
    lvs = _pair(store)
    rng = random.Random(5)
    skews = [[rng.choice((0, 0, 0.0005, 0.002, 0.006)) for _ in range(300)] for _ in range(2)]
    errors = []

    def run(r):
        try:
            for s in skews[r]:
                time.sleep(s)
                lvs[r].arrive("seq")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    try:
        ths = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in ths)
        assert lvs[0]._plain == lvs[1]._plain == 300
        # plain arrivals share one counter key: it + 2 heartbeats
        assert store.num_keys() <= 1 + 2, store.num_keys()
    finally:
        _close(lvs)


def test_three_ranks_mixing_plain_and_value_arrivals_stay_in_step():
    """Plain arrivals (one shared counter) and value agreements (marks per rank) interleaved, three
    ranks with random skews: every arrival completes only once all three reached it (each rank
    records, when it leaves arrival k, how many ranks had entered it: always 3), the agreements
    give the right verdicts, and the store keeps a bounded number of keys."""
    store = dist.HashStore()
    lvs = [C._Liveness(None, "t3", r, 3, 5.0, shared_store=store) for r in range(3)]
    rng = random.Random(9)
    plan = [rng.choice(("plain", "plain", "same", "differ")) for _ in range(200)]
    skews = [[rng.choice((0, 0, 0.0005, 0.003)) for _ in plan] for _ in range(3)]
    entered = [[0] * len(plan) for _ in range(1)][0]
    lock = threading.Lock()
    seen_at_exit: list[list[int]] = [[], [], []]
    verdicts: list[list] = [[], [], []]
    errors = []

    def run(r):
        try:
            for k, kind in enumerate(plan):
                time.sleep(skews[r][k])
                with lock:
                    entered[k] += 1
                if kind == "plain":
                    lvs[r].arrive("seq")
                else:
                    verdicts[r].append(lvs[r].arrive("eq", b"x" if kind == "same" or r else b"y"))
                with lock:
                    seen_at_exit[r].append(entered[k])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    try:
        ths = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in ths)
        assert all(v == [3] * len(plan) for v in seen_at_exit)
        want = [k == "same" for k in plan if k != "plain"]
        assert verdicts[0] == verdicts[1] == verdicts[2] == want
        # the counter, value arrivals' two newest sequences (3 marks + done each), 3 heartbeats
        assert store.num_keys() <= 1 + 2 * 4 + 3, store.num_keys()
    finally:
        _close(lvs)


def test_a_peer_that_never_arrives_and_stops_beating_is_named():
    store = dist.HashStore()
    lvs = _pair(store, liveness_s=0.6)
    lvs[1].close()   # its heartbeat stops; it never arrives
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerFailedError, match=r"rank\(s\) \[1\] stopped answering.*1 of 2 ranks never reached"):
            lvs[0].arrive("the test's collective")
        assert time.monotonic() - t0 < 0.6 + 1.0
    finally:
        _close(lvs)


class _Counting:
    """The store, counting the polls (``check``) of each thread."""

    def __init__(self, store):
        self.store = store
        self.checks: dict[str, int] = {}

    def _count(self) -> None:
        name = threading.current_thread().name
        self.checks[name] = self.checks.get(name, 0) + 1

    def check(self, keys):
        self._count()
        return self.store.check(keys)

    def add(self, key, amount):   # a plain arrival polls its group's counter with add(key, 0)
        if amount == 0 and key.endswith("/arrivals"):
            self._count()
        return self.store.add(key, amount)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_the_writer_groups_share_polls_about_as_the_doubling_pause_did():
    """poll_share 1 (the background writer's groups): polls at about 1, 2, 4, 8, 16, 32 ms; the
    default eighth polls about three times as often over a 60 ms wait, and notices sooner."""
    counts, lags = {}, {}
    for share in (1 / 8, 1.0):
        store = _Counting(dist.HashStore())
        lvs = [C._Liveness(None, "t", r, 2, 5.0, shared_store=store, poll_share=share) for r in range(2)]
        try:
            t_late = []

            def second():
                time.sleep(0.060)
                t_late.append(time.monotonic())
                lvs[1].arrive("test")
            th = threading.Thread(target=second, name="late")
            th.start()
            lvs[0].arrive("test")
            lags[share] = time.monotonic() - t_late[0]
            th.join()
            counts[share] = store.checks[threading.current_thread().name]
        finally:
            _close(lvs)
    assert 5 <= counts[1.0] <= 11 and counts[1 / 8] >= 2 * counts[1.0], counts
    assert lags[1 / 8] < 0.060 / 8 + 0.008, lags
