"""elastic.liveness: the peer book (pure, hand-computed times), the bound from torch's keep-alive
settings, the bounded store call (a call that never returns, one that raises, fencing), and the
beacon's self-fence when its store stops answering."""
from __future__ import annotations

import threading
import time

import pytest

from elastor_ds.elastic.liveness import Beacon, LivenessConfig, PeerBook, StoreTimeout, bounded, read_peers

pytestmark = pytest.mark.unit


def test_peer_book_counts_silence_from_the_last_change():
    book = PeerBook(timeout=4.0)
    book.observe(1, 0, now=10.0)
    book.observe(2, 0, now=10.0)
    book.observe(1, 1, now=11.0)     # node 1 beats, node 2 does not
    book.observe(2, 0, now=13.0)
    assert book.lost(14.0) == [] and book.lost(14.01) == [2]
    book.observe(1, 1, now=15.0)     # unchanged since 11.0
    assert book.lost(15.0) == [2] and book.lost(15.01) == [1, 2]
    assert book.silent_for(1, 15.5) == pytest.approx(4.5)


def test_config_from_torch_keep_alive():
    c = LivenessConfig.from_rdzv_conf({"keep_alive_interval": 1, "keep_alive_max_attempt": 4})
    assert (c.interval, c.timeout, c.fence_after) == (1.0, 4.0, 3.0)
    d = LivenessConfig.from_rdzv_conf({})        # torch's defaults: 5 s x 3
    assert (d.interval, d.timeout, d.fence_after) == (5.0, 15.0, 10.0)
    with pytest.raises(ValueError, match="keep_alive_max_attempt"):
        LivenessConfig(interval=2, timeout=2)


def test_bounded_gives_up_on_a_call_that_never_returns():
    never = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        bounded(never.wait, 0.3, "stuck")
    assert 0.3 <= time.monotonic() - t0 < 1.0
    fenced = threading.Event()
    threading.Timer(0.1, fenced.set).start()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        bounded(never.wait, 30, "stuck", give_up=fenced.is_set)
    assert time.monotonic() - t0 < 1.0
    assert bounded(lambda: 7, 1, "ok") == 7
    with pytest.raises(KeyError):
        bounded(lambda: {}["x"], 1, "raises")


class _Store:
    def __init__(self):
        self.values: dict[str, int] = {}
        self.dead = threading.Event()
        self.lock = threading.Lock()

    def add(self, key, n):
        if self.dead.is_set():
            threading.Event().wait()     # a store whose packets vanish: never answers
        with self.lock:
            self.values[key] = self.values.get(key, 0) + n
            return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return str(self.values[key]).encode()


def _beating_node():
    """A beacon of node 1 beating into a fake store every 0.1 s (timeout 0.4 s), recording its fences."""
    store = _Store()
    fences: list[float] = []
    cfg = LivenessConfig(interval=0.1, timeout=0.4)
    beacon = Beacon(cfg, fences.append)
    beacon.retarget(store, 1)
    return store, fences, cfg, beacon


def test_beacon_beats_and_fences_itself_when_the_store_goes_silent():
    store, fences, cfg, beacon = _beating_node()
    time.sleep(0.35)
    assert store.values["elastor/alive/1"] >= 3 and not beacon.fenced
    book = PeerBook(cfg.timeout)
    assert read_peers(store, book, [1], now=0.0) == [] and book.seen[1][0] >= 3
    t_cut = time.monotonic()
    store.dead.set()
    t_end = time.monotonic() + 5
    while not beacon.fenced and time.monotonic() < t_end:
        time.sleep(0.01)
    assert beacon.fenced and len(fences) == 1
    # fenced after fence_after (0.3 s) without a beat; the last beat was at most one interval before the cut
    assert cfg.fence_after - cfg.interval <= beacon.fenced_at - t_cut <= cfg.fence_after + 0.2
    assert fences[0] > cfg.fence_after
    beacon.silence()


def test_one_hung_beat_does_not_fence_when_the_next_beats_are_answered():
    """An etcd write in flight when the cluster's leader died waits for etcd's request timeout
    (5 s + 2 election timeouts) while the new leader answers new requests within ~1 s. One such
    beat must not fence the node: the next beat goes out on time (before the fix the beat thread
    waited in the hung call and the watchdog fenced a healthy node)."""
    store = _Store()
    hang = threading.Event()
    release = threading.Event()
    plain_add = store.add

    def add(key, n):
        if hang.is_set():
            hang.clear()
            release.wait(5)               # this one request hangs (far past fence_after)
        return plain_add(key, n)
    store.add = add
    fences: list[float] = []
    # fence after 1.0 - 0.2 = 0.8 s of silence: the hung request (5 s) is far past it, and a loaded
    # machine's scheduling delays (up to ~0.5 s seen with pytest-xdist and other jobs) are not
    cfg = LivenessConfig(interval=0.2, timeout=1.0)
    beacon = Beacon(cfg, fences.append)
    beacon.retarget(store, 0)
    time.sleep(0.5)
    before = store.values["elastor/alive/0"]
    hang.set()
    time.sleep(3.0)
    assert not beacon.fenced and not fences
    assert store.values["elastor/alive/0"] >= before + 8      # ~14 more beats in 3 s, one of them hung
    release.set()
    beacon.silence()


def test_a_rendezvous_against_a_vanished_store_reads_as_store_lost():
    """The survivor of a c10d store host's loss may meet it first in the next round's rendezvous (its
    workers exited on the lost peer before the monitor loop read the store): torch's own handler,
    against a TCPStore that was there and is gone, must read as 'store lost', and a closed rendezvous
    must not."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from elastor_ds.elastic.agent import RunConfig, store_lost_reason, store_unreachable

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{server.port}"
    handler = get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id="gone", min_nodes=1, max_nodes=2,
        is_host="0", read_timeout="5", join_timeout="5"))
    del server
    with pytest.raises(Exception) as info:
        handler.next_rendezvous()
    assert store_unreachable(info.value), repr(info.value)
    assert not store_unreachable(RendezvousClosedError())
    assert not store_unreachable(RuntimeError("the trainer rejected the world"))
    cfg = RunConfig(script="train.py", script_args=[], nproc_per_node=1, rdzv_endpoint=endpoint)
    msg = store_lost_reason(cfg, info.value, "it has no workers left")
    assert msg.startswith(f"lost contact with the rendezvous store at {endpoint} (")
    assert "--rdzv-conf is_host=0" in msg and "etcd-v2" in msg


def test_a_disarmed_beacon_keeps_beating_and_never_fences():
    """After the node's workers all exited 0 (``disarm``), a store that stops answering while the
    node waits at the exit barrier does not fence it; beats go on while the store answers."""
    store, fences, cfg, beacon = _beating_node()
    time.sleep(0.25)
    beacon.disarm()
    n = store.values["elastor/alive/1"]
    time.sleep(0.25)
    assert store.values["elastor/alive/1"] > n         # still beating
    store.dead.set()
    time.sleep(cfg.fence_after + 0.5)                   # silent well past the fence bound
    assert not beacon.fenced and fences == []
    beacon.silence()
