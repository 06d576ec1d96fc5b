"""Small object collectives over a process group, with failures raised on every rank.

:class:`Comm` is the one interface the checkpoint engine talks to: ``rank``, ``world_size``,
``all_gather_object``, ``broadcast_object``, ``barrier``; the objects are plain data, sent through
the restricted codec (:mod:`.wire`, :mod:`.objects`), never pickled. :class:`TorchComm` implements it over a
dedicated gloo group (created once, collectively, with its own timeout, so checkpoint traffic
never mixes with training collectives and works from a background thread). :class:`LocalComm`
is the single-process version used by the CLI and unit tests.

:func:`agree` runs a local function on every rank and gathers the outcome: if it raised anywhere,
every rank raises :class:`CollectiveError` naming the failing ranks and their errors.
:func:`agree_world` and :func:`world_outcome` do the same over the default world without a comm
(set-up steps before any comm exists: a rank that failed there would otherwise leave the others
waiting in their next collective until the process group's timeout).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar

from ..errors import CollectiveError, PeerFailedError, RankFailure, ranks_failed
from ..threads import NamedThread
from . import objects, wire
from .objects import FAILURE_BYTES, _failure_bytes, _failure_of  # noqa: F401 - world_outcome's report format

log = logging.getLogger(__name__)
T = TypeVar("T")

# Every heartbeat still running, stopped and joined at interpreter exit (see _Liveness.close).
_RUNNING: "weakref.WeakSet[_Liveness]" = weakref.WeakSet()
_ATEXIT = threading.Lock()
_atexit_on = False


def _close_all_heartbeats() -> None:
    running = list(_RUNNING)
    for lv in running:  # stop all first, then wait: one period's sleep at most, not one per heartbeat
        lv._stop.set()
    for lv in running:
        lv.close()


def _track(lv: "_Liveness") -> None:
    global _atexit_on
    with _ATEXIT:
        _RUNNING.add(lv)
        if not _atexit_on:
            import atexit

            atexit.register(_close_all_heartbeats)
            _atexit_on = True


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def barrier(self) -> None: ...
    def duplicate(self) -> "Comm": ...
    def all_equal(self, value: int) -> bool: ...
    def all_gather_ints(self, values: list[int], width: int) -> list[list[int]]: ...
    def broadcast_ints(self, values: list[int], src: int = 0) -> list[int]: ...


class LocalComm:
    """One process: the object collectives return the value itself, after checking that a
    :class:`TorchComm` could send it (plain data, :mod:`.wire`: else :class:`.wire.WireTypeError`)."""

    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        wire.encode(obj)
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        wire.encode(obj)
        return obj

    def barrier(self) -> None:
        return None

    def duplicate(self) -> "LocalComm":
        return self

    def all_equal(self, value: int) -> bool:
        return True

    def all_gather_ints(self, values: list[int], width: int) -> list[list[int]]:
        return [_padded(values, width)]

    def broadcast_ints(self, values: list[int], src: int = 0) -> list[int]:
        return list(values)


def _padded(values: list[int], width: int) -> list[int]:
    if len(values) > width:
        raise ValueError(f"{len(values)} values do not fit a row of {width}")
    return [int(v) for v in values] + [0] * (width - len(values))


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _store_client(address: tuple[str, int], timeout: datetime.timedelta, role: str, owner: Any = None) -> Any:
    """This process's TCP store client for ``role`` ("wait": arrival barriers, "beat": heartbeat
    threads) with ``timeout``, made on first use and shared by every liveness group after that.
    Each group used to open four connections per rank (a client and a heartbeat client for each
    of its two groups): with a few groups per rank, connections opened by all ranks at once made
    the store's accept queue overflow and a connect wait ~5 s (measured: the third TorchComm of a
    process took 5.0 s on every rank). A client serialises its own operations, so sharing is safe.
    ``owner``: the default process group's store the address came from; a process group destroyed
    and created again (a new store, perhaps on the same port) gets new clients (the cache keeps the
    owner alive, so its id is not reused)."""
    import torch.distributed as dist

    key = (address[0], int(address[1]), timeout.total_seconds(), role, id(owner))
    with _CLIENTS_LOCK:
        got = _CLIENTS.get(key)
        if got is None:
            got = _CLIENTS[key] = (owner, dist.TCPStore(address[0], int(address[1]), is_master=False,
                                                        timeout=timeout, wait_for_workers=False))
        return got[1]


class _Liveness:
    """Store-based liveness for one checkpoint group: a heartbeat thread per process and arrival
    barriers that notice a dead or stopped peer within ``liveness_s`` (not the gloo timeout).

    Every rank bumps its heartbeat counter in the rendezvous store every ``liveness_s / 10``
    seconds from a daemon thread (a SIGKILLed or SIGSTOPped process stops bumping). Before each
    collective a rank marks its arrival and waits until every rank has arrived; while waiting it
    watches the other ranks' counters, and raises :class:`PeerFailedError` naming the ranks whose
    counter has not moved for ``liveness_s``. Store clients have their own connection (one per
    process and role, timeout ``liveness_s``), so an unreachable store is a PeerFailedError too,
    never a long hang."""

    def __init__(self, address: Optional[tuple[str, int]], tag: str, rank: int, world_size: int,
                 liveness_s: float, shared_store: Any = None, poll_share: float = 1 / 8):
        self.address, self.tag, self.rank, self.world = address, tag, rank, world_size
        self.liveness_s = liveness_s
        self.poll_share = poll_share   # the pause between polls, as a share of the time waited so far
        self._timeout = datetime.timedelta(seconds=max(1.0, liveness_s))
        self._shared = shared_store  # a server-less store (FileStore, HashStore): used directly
        self._owner = _default_store() if address is not None else None
        self._store = self._client()
        self._seq = 0        # arrivals that agree on a value (marks per rank)
        self._plain = 0      # arrivals without a value (one shared counter)
        self._beat(self._store)  # visible before any collective of this group
        self._stop = threading.Event()
        self._thread = NamedThread(target=self._run, name=f"elastor-heartbeat-{tag}", daemon=True)
        self._thread.start()
        _track(self)

    def _client(self, role: str = "wait") -> Any:
        """A TCP store client with a short timeout (one per process, role and timeout: see
        :func:`_store_client`), or the shared server-less store."""
        if self.address is None:
            return self._shared
        return _store_client(self.address, self._timeout, role, self._owner)

    def _hb_key(self, r: int) -> str:
        return f"elastor/{self.tag}/hb/{r}"

    def _beat(self, store: Any) -> None:
        store.add(self._hb_key(self.rank), 1)

    def _run(self) -> None:
        try:
            store = self._client("beat")
        except Exception as e:  # noqa: BLE001 - peers will notice the missing heartbeat
            log.warning("elastor heartbeat: cannot reach the store at %s (%s)", self.address, e)
            return
        period = max(0.05, self.liveness_s / 10)
        while not self._stop.wait(period):
            try:
                self._beat(store)
            except Exception as e:  # noqa: BLE001 - the store is gone: nothing left to tell
                log.debug("elastor heartbeat stopped: %s", e)
                return

    def _get_all(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` (all present), in one round trip where the store can."""
        multi = getattr(self._store, "multi_get", None)
        if multi is not None:
            try:
                return [bytes(v) for v in multi(keys)]
            except (NotImplementedError, RuntimeError) as e:   # a store without it: one get each
                if "not implemented" not in str(e).lower() and not isinstance(e, NotImplementedError):
                    raise
        return [bytes(self._store.get(k)) for k in keys]

    def close(self) -> None:
        """Stop the heartbeat and wait until its thread has left the store client (at most about
        ``liveness_s``, the client's timeout). Also run for every heartbeat at interpreter exit:
        a daemon thread still inside ``TCPStore.add`` (C++, GIL released) when Python finalizes is
        killed by a forced unwind on its way back to the GIL, and the C++ runtime aborts the whole
        process ("terminate called without an active exception", SIGABRT) after a clean run."""
        self._stop.set()
        _RUNNING.discard(self)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.liveness_s + 5.0)
            if self._thread.is_alive():  # pragma: no cover - a store call stuck past its own timeout
                log.warning("elastor heartbeat %s did not stop within %.0f s", self.tag, self.liveness_s + 5.0)

    def arrive(self, what: str, value: Optional[bytes] = None) -> bool:
        """Wait until every rank reached this point of the group's collective sequence. With
        ``value`` (bytes), also agree on it: True on every rank iff every rank passed the same
        bytes (each rank's mark holds its value; a rank that finds every mark reads them all and
        writes the verdict into the "done" key, which the others read once they see it). Without
        ``value``: True, through one shared counter (:meth:`_arrive_counted`).

        With a value, each rank marks its arrival (a key of its own) and reads every rank's mark once; a rank
        that finds them all (the last to arrive, perhaps others too) sets one "done" key, which
        the others poll: a poll is one store round trip reading one key, whatever the world size.
        The pause between polls grows with the time already waited (``poll_share`` of it, 1 ms to
        50 ms). With the default eighth a rank notices the last arrival within about 12 % of its
        wait: a pause that doubled each time made a rank that waited 38 ms notice after 66 ms, and
        its peer waited that long in the all-reduce that ends every load
        (bench/results/2026-12-03-load-fixed-costs.md). The background writer's group polls at a
        share of 1 (about the doubling pause): its waits delay no training step, and each poll
        costs CPU that a snapshot every iteration takes from training."""
        if value is None:
            return self._arrive_counted(what)
        self._seq += 1
        base = f"elastor/{self.tag}/arrive/{self._seq}"
        keys = [f"{base}/{r}" for r in range(self.world)]
        done = f"{base}/done"
        try:
            self._store.set(keys[self.rank], b"1" if value is None else b"v" + value)
            if self._seq > 2:
                self._store.delete_key(f"elastor/{self.tag}/arrive/{self._seq - 2}/{self.rank}")
            if self._store.check(keys):   # every rank is here (and past sequence - 2: its done key goes)
                verdict = b"1"
                if value is not None:
                    marks = self._get_all(keys)
                    verdict = b"1" if all(m == marks[0] for m in marks) else b"0"
                self._store.set(done, verdict)
                if self._seq > 2:
                    self._store.delete_key(f"elastor/{self.tag}/arrive/{self._seq - 2}/done")
                return verdict == b"1"
            self._wait(what, lambda: self._store.check([done]),
                       lambda: f"ranks {[r for r, k in enumerate(keys) if not self._store.check([k])]} never reached "
                               f"this collective")
            # (a done key goes only when every rank has reached sequence + 2: this rank has not)
            return bytes(self._store.get(done)) == b"1"
        except PeerFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - the store itself is unreachable
            raise self._store_lost(what, e) from None

    def depart(self, cap_s: Optional[float] = None) -> bool:
        """The last touch of this store before the process may exit: every rank counts itself out;
        rank 0, whose process hosts the default store when the job was started the usual way
        (``MASTER_ADDR``), waits until every rank has, so that it does not take the store away from
        a rank still inside a collective (its next poll would find "Connection reset" and fail a
        save that rank 0 committed). Bounded: a rank that died (its heartbeat stops), or ``cap_s``
        (default ``liveness_s``) without every rank, ends the wait. True when every rank left."""
        self._departs = getattr(self, "_departs", 0) + 1
        target = self._departs * self.world
        key = f"elastor/{self.tag}/departs"
        try:
            got = [int(self._store.add(key, 1))]
        except Exception as e:  # noqa: BLE001 - the store is gone: nothing left to protect
            log.debug("depart: store unreachable (%s)", e)
            return False
        if self.rank != 0 or got[0] >= target:
            return True
        deadline = time.monotonic() + (self.liveness_s if cap_s is None else cap_s)

        def complete() -> bool:
            got[0] = int(self._store.add(key, 0))
            if got[0] < target and time.monotonic() > deadline:
                raise TimeoutError(f"{target - got[0]} of {self.world} ranks did not finish within the wait")
            return got[0] >= target
        try:
            self._wait("depart", complete, lambda: f"{target - got[0]} of {self.world} ranks have not finished")
            return True
        except Exception as e:  # noqa: BLE001 - leaving anyway: a dead or stuck rank cannot be waited for
            log.warning("rank 0 leaves the checkpoint group before every rank did (%s)", e)
            return False

    def _arrive_counted(self, what: str) -> bool:
        """An arrival without a value: one shared counter per group, never reset. The k-th such
        arrival of the group is complete once the counter reaches ``k * world`` (no rank passes
        arrival k before every rank reached it, so the counter of arrival k stays within
        ``((k-1) * world, k * world]`` until it completes). One store round trip for the last rank
        to arrive, one plus the polls for the others, and no keys to delete: the marks and "done"
        key of :meth:`arrive` with a value cost 3-5 round trips (each also the store's host CPU)."""
        self._plain += 1
        target = self._plain * self.world
        key = f"elastor/{self.tag}/arrivals"
        try:
            got = [int(self._store.add(key, 1))]
            if got[0] >= target:
                return True

            def complete() -> bool:
                got[0] = int(self._store.add(key, 0))
                return got[0] >= target
            self._wait(what, complete,
                       lambda: f"{target - got[0]} of {self.world} ranks never reached this collective")
            return True
        except PeerFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - the store itself is unreachable
            raise self._store_lost(what, e) from None

    def _wait(self, what: str, complete: Callable[[], bool], missing: Callable[[], str]) -> None:
        """Poll ``complete`` (one store round trip) with pauses growing with the wait; raise
        :class:`PeerFailedError` when a peer's heartbeat stops for ``liveness_s`` (``missing``
        says who never arrived, for the message)."""
        seen: dict[int, tuple[int, float]] = {}
        # peers' heartbeats are read every hb_every s, not every poll: reading all heartbeats
        # is world - 1 more round trips (each also costs the store's host CPU)
        hb_every = min(0.25, self.liveness_s / 20)
        start = time.monotonic()
        next_hb = start + hb_every
        while not complete():
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + hb_every
                dead = []
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    beat = int(self._store.add(self._hb_key(r), 0))
                    prev = seen.get(r)
                    if prev is None or prev[0] != beat:
                        seen[r] = (beat, now)
                    elif now - prev[1] > self.liveness_s:
                        dead.append(r)
                if dead:
                    raise PeerFailedError(
                        f"{what}: rank(s) {dead} stopped answering (no heartbeat for {self.liveness_s:g} s: "
                        f"killed, hung or stopped); {missing()}",
                        [RankFailure(r, "PeerFailedError", f"no heartbeat for {self.liveness_s:g} s")
                         for r in dead], what)
            time.sleep(min(0.05, max(0.001, (now - start) * self.poll_share)))

    def _store_lost(self, what: str, e: BaseException) -> PeerFailedError:
        return PeerFailedError(f"{what}: the rendezvous store ({self.address or 'shared'}) did not answer within "
                               f"{self.liveness_s:g} s (the process hosting it died or hangs): {e}",
                               [RankFailure(-1, type(e).__name__, str(e))], what)


def _default_store() -> Any:
    """The default process group's store, or None without one (a liveness group over a store
    given by address only)."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError):
        return None


def _store_for_liveness() -> tuple[Optional[tuple[str, int]], Any]:
    """(host, port) of the default process group's TCP store, or (None, the store itself) when it
    is server-less (FileStore, HashStore: nothing can hang there)."""
    import os

    import torch.distributed as dist

    st = dist.distributed_c10d._get_default_store()
    base = st
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return (str(base.host), int(base.port)), None
    if base is None and "MASTER_PORT" in os.environ:  # pragma: no cover - torchrun agent store
        return (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])), None
    return None, dist.PrefixStore("elastor_liveness/", st)


class TorchComm:
    """Object collectives on a dedicated gloo group of the default world, with liveness checks.

    ``timeout_s`` bounds one collective once every rank has arrived (gloo's timeout);
    ``liveness_s`` bounds how long a rank waits for a peer that died or stopped before the
    collective (see :class:`_Liveness`). Every failure is a :class:`PeerFailedError`."""

    def __init__(self, group: Any, rank: int, world_size: int, ranks: Any = None, timeout_s: float = 600.0,
                 writer_group: Any = None, liveness: Optional[_Liveness] = None,
                 writer_liveness: Optional[_Liveness] = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))
        self.timeout_s = timeout_s
        self.writer_group = writer_group
        self.liveness = liveness
        self.writer_liveness = writer_liveness

    @staticmethod
    def create(timeout_s: float = 600.0, liveness_s: Optional[float] = None) -> "TorchComm":
        """Collective: every rank must call it, in the same order relative to other group creations.
        ``liveness_s`` (default: min(30, timeout_s)): a peer silent that long fails the collective."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialised: call init_process_group (or "
                                  "deepspeed.init_distributed) first, or use LocalComm for one process")
        live = float(min(30.0, timeout_s) if liveness_s is None else liveness_s)
        if not live > 0:
            raise ValueError(f"liveness_s={liveness_s!r}: must be > 0 seconds")
        td = datetime.timedelta(seconds=timeout_s)
        group = dist.new_group(backend="gloo", timeout=td)
        writer = dist.new_group(backend="gloo", timeout=td)
        box = [objects.broadcast_object(f"{os.getpid():x}{int(time.time() * 1e6):x}", 0, group,
                                        what="TorchComm.create")]  # one tag for this comm on every rank
        rank, world = dist.get_rank(), dist.get_world_size()
        liveness = writer_liveness = None
        if world > 1:
            address, shared = _store_for_liveness()
            liveness = _Liveness(address, box[0], rank, world, live, shared)
            writer_liveness = _Liveness(address, box[0] + "w", rank, world, live, shared, poll_share=1.0)
        return TorchComm(group, rank, world, timeout_s=timeout_s, writer_group=writer, liveness=liveness,
                         writer_liveness=writer_liveness)

    def duplicate(self) -> "TorchComm":
        """The same ranks on a second group, for the checkpoint writer thread: two threads must never
        run collectives on one group (their order could differ per rank and hang). Uses the
        ``writer_group`` made with this comm; without one, creates a group now, which every rank of
        the default world must call in the same order."""
        import torch.distributed as dist

        group = self.writer_group
        if group is None:
            group = dist.new_group(ranks=self.ranks, backend="gloo",
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        return TorchComm(group, self.rank, self.world_size, self.ranks, self.timeout_s,
                         liveness=self.writer_liveness)

    def close(self) -> None:
        """Stop this comm's heartbeats when done with it (peers waiting in a later collective of this comm
        would report this rank dead after ``liveness_s``). Done for every comm at interpreter exit."""
        for lv in (self.liveness, self.writer_liveness):
            if lv is not None:
                lv.close()

    def depart(self) -> bool:
        """Collective, once every rank is done with this comm (the engine's ``finalize``): see
        :meth:`_Liveness.depart`. A no-op with one rank."""
        return self.liveness.depart() if self.liveness is not None else True

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        if self.liveness is not None:
            self.liveness.arrive(what)
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - gloo: a peer died mid-collective, or the timeout
            raise PeerFailedError(f"{what} on the checkpoint group failed: a peer died or did not answer within "
                                  f"{self.timeout_s:g} s ({type(e).__name__}: {str(e).splitlines()[0][:300]})",
                                  [RankFailure(-1, type(e).__name__, str(e)[:500])], what) from e

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order. ``obj`` is plain data (:mod:`.wire`; never pickled):
        another type raises :class:`.wire.WireTypeError` here and a RanksFailedError on the other
        ranks; a peer's malformed bytes raise :class:`.wire.WireFormatError`; a peer that died, a
        PeerFailedError (:mod:`.objects`)."""
        return objects.all_gather_object(obj, self.group, what="all_gather_object",
                                         run=lambda fn: self._run("all_gather_object", fn))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (a rank of this group) on every rank, as :meth:`all_gather_object`."""
        return objects.broadcast_object(obj, src, self.group, what="broadcast_object",
                                        run=lambda fn: self._run("broadcast_object", fn))

    def barrier(self) -> None:
        import torch.distributed as dist

        self._run("barrier", lambda: dist.barrier(group=self.group))

    def all_gather_ints(self, values: list[int], width: int) -> list[list[int]]:
        """Every rank's ``values`` (signed 64-bit ints, at most ``width``, zero-padded to it), in rank
        order: one fixed-size all-gather, no pickling and no size exchange (the object collectives
        cost two rounds each)."""
        from .groups import all_gather_int_rows

        row = _padded(values, width)   # a row too long is the caller's error, not a peer's
        return self._run("all_gather_ints", lambda: all_gather_int_rows(row, group=self.group))

    def broadcast_ints(self, values: list[int], src: int = 0) -> list[int]:
        """``values`` of rank ``src`` (every rank passes a list of the same length)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self._run("broadcast_ints", lambda: dist.broadcast(t, group=self.group, group_src=src))
        return t.tolist()

    def all_equal(self, value: int) -> bool:
        """True on every rank iff every rank passed the same ``value``. With liveness checks (more
        than one rank) the values travel with the arrival marks in the store and no gloo operation
        runs: the all-reduce after the arrival cost a load 1-1.5 ms on each of its two agreements
        (bench/results/2026-12-03-memory-loads.md). Otherwise one tiny all-reduce of the value's
        62 low bits."""
        if self.liveness is not None:
            return self.liveness.arrive("all_equal", str(int(value)).encode())
        import torch
        import torch.distributed as dist

        v = int(value) & ((1 << 62) - 1)
        t = torch.tensor([v, -v], dtype=torch.int64)
        self._run("all_equal", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group))
        return int(t[0]) == v and -int(t[1]) == v


def agree(comm: Comm, fn: Callable[[], T], what: str = "operation") -> T:
    """Run ``fn`` locally; if it raised on any rank, raise one typed error on all ranks.

    Only the outcome is gathered (ok, or the exception's class names and message as plain
    strings), never the result. The error raised is a :class:`RanksFailedError` listing every
    failing rank's class and message, and also an instance of the most specific elastor error
    class they share (e.g. CorruptCheckpointError), so callers decide by type. Returns the local
    result."""
    local: BaseException | None = None
    try:
        result: Any = fn()
        status: tuple = ("ok",)
    except BaseException as e:  # noqa: BLE001 - re-raised on every rank below
        local = e
        status = ("error", RankFailure.of(comm.rank, e).to_wire())
        result = None
    # every rank ok (the usual case): one all_equal; the outcomes are gathered only when some
    # rank failed (every rank reaches the same answer, so all of them gather then)
    all_equal = getattr(comm, "all_equal", None)
    if all_equal is not None and comm.world_size > 1 and all_equal(int(local is None)) and local is None:
        return result
    statuses = comm.all_gather_object(status)
    failures = [RankFailure.from_wire(s[1]) for s in statuses if s[0] != "ok"]
    if failures:
        err = ranks_failed(what, failures, comm.world_size)
        if local is not None:
            raise err from local
        raise err
    return result


def world_outcome(local: Optional[BaseException], what: str, values: Sequence[int] = ()) -> list[list[int]]:
    """Collective over the default world: tell every rank whether this one failed (``local``, the
    exception it caught, or None) and gather ``values`` (ints; the same count on every rank: a
    failed rank passes zeros) in the same all-gather. No rank failed: every rank's ``values``, in
    rank order. Some ranks failed: each failed rank's class and message follow (JSON bytes, no
    pickling, at most :data:`FAILURE_BYTES` each) and every rank raises one
    :class:`~elastor_ds.errors.RanksFailedError` naming them (also an instance of the elastor error
    class they share, e.g. ConfigError: :func:`~elastor_ds.errors.ranks_failed`). Every rank
    failed: each raises its own exception (no rank waits; the messages stay as they were). Without
    an initialised world, or with one rank: ``local`` is raised as is."""
    import torch.distributed as dist

    from .groups import all_gather_int_rows, all_gather_world_bytes

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if local is not None:
            raise local
        return [[int(v) for v in values]]
    rows = all_gather_int_rows([0 if local is None else 1, *[int(v) for v in values]])
    failed = [r for r, row in enumerate(rows) if row[0]]
    if not failed:
        return [row[1:] for row in rows]
    if local is not None and len(failed) == len(rows):
        raise local
    rank = dist.get_rank()
    blobs = all_gather_world_bytes(_failure_bytes(rank, local) if local is not None else b"", FAILURE_BYTES)
    raise_failures([_failure_of(r, blobs[r]) for r in failed], len(rows), local, what)
    raise AssertionError("unreachable")  # pragma: no cover


def raise_failures(failures: list[RankFailure], world_size: int, local: Optional[BaseException], what: str) -> None:
    """The verdict on outcomes every rank gathered: nothing when ``failures`` is empty; this rank's
    own ``local`` exception when every rank failed; else one typed
    :class:`~elastor_ds.errors.RanksFailedError` naming the failing ranks (:func:`~elastor_ds.errors.ranks_failed`)."""
    if not failures:
        return
    if local is not None and len(failures) == world_size:
        raise local
    err = ranks_failed(what, failures, world_size)
    if local is not None:
        raise err from local
    raise err


def agree_world(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` (a local set-up step) and agree on its outcome over the default world
    (:func:`world_outcome`): if it raised on some rank, every rank raises a typed error naming
    those ranks and their errors. Returns the local result. Collective: every rank calls it at the
    same point, whether or not its own earlier steps succeeded."""
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - re-raised on every rank by world_outcome
        world_outcome(e, what)
        raise   # unreachable: world_outcome raised
    world_outcome(None, what)
    return result
