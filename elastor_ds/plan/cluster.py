"""The GPUs left to train on: nodes with their usable GPU ids, per-GPU relative speed, memory and
bandwidths (:class:`Cluster`), parsed from ``--gpus-per-node 8,8,8,7`` or a YAML/JSON file.

File format (YAML or JSON)::

    gpu_memory_gb: 80                 # optional, default 80
    intra_node_bandwidth_gbs: 150     # optional, per GPU (NVLink), GB/s
    inter_node_bandwidth_gbs: 25      # optional, per GPU (NIC), GB/s
    gpus_per_node: [8, 8, 8, 7]       # either this (GPUs 0..k-1 usable) ...
    nodes:                            # ... or explicit nodes
      - {name: node0, gpus: [0, 1, 2, 3, 4, 5, 6, 7]}
      - {name: node1, gpus: [0, 1, 2, 4, 5, 6, 7], speed: {"5": 0.6}}   # GPU 5 is a straggler

Pure: no torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain, repeat
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..errors import ConfigError
from .gcpause import gc_paused

# Sizes the planner accepts (its time and memory grow with them; beyond these a typo, not a cluster).
MAX_GPUS_PER_NODE = 64
MAX_NODES = 1 << 18        # 262,144
MAX_GPUS = 1 << 18         # 262,144 usable GPUs in all
CLUSTER_FILE_MAX = 128 * 1024 * 1024   # bytes of a cluster file (262,144 nodes with GPU speeds fit)


class Device(NamedTuple):
    """One usable GPU: ``node`` is the node's index in the cluster, ``local_id`` its GPU id there.
    A named tuple (immutable, hashable): a 131,072-GPU cluster makes one per GPU, cheaply."""

    node: int
    node_name: str
    local_id: int
    speed: float = 1.0

    @property
    def name(self) -> str:
        return f"{self.node_name}:{self.local_id}"


@dataclass(frozen=True)
class Node:
    name: str
    gpus: tuple[int, ...]
    speeds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        gpus = self.gpus
        if len(gpus) > MAX_GPUS_PER_NODE:
            raise ConfigError(f"node {self.name}: {len(gpus)} GPUs; at most {MAX_GPUS_PER_NODE} per node are supported")
        if gpus != _IDS.get(len(gpus)):  # the common case 0..k-1 needs no checks
            if len(set(gpus)) != len(gpus) or any(g < 0 or g >= 1 << 20 for g in gpus):
                raise ConfigError(f"node {self.name}: GPU ids {list(gpus)} must be distinct, >= 0 and < {1 << 20}")
        if not self.speeds:
            object.__setattr__(self, "speeds", _ONES[len(gpus)])
            return
        if len(self.speeds) != len(gpus):
            raise ConfigError(f"node {self.name}: {len(self.speeds)} speeds for {len(gpus)} GPUs")
        if any(not (s > 0) or not math.isfinite(s) for s in self.speeds):
            raise ConfigError(f"node {self.name}: relative speeds {list(self.speeds)} must be > 0")


# the plausible range of each hardware figure (per GPU): outside it the cost model's arithmetic
# overflows or its predictions are meaningless (the flags and cluster files are checked against it)
HARDWARE_RANGES = {"gpu_memory_gb": (0.1, 1e9), "intra_node_bandwidth_gbs": (0.001, 1e12),
                   "inter_node_bandwidth_gbs": (0.001, 1e12)}


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    gpu_memory_gb: float = 80.0
    intra_node_bandwidth_gbs: float = 150.0
    inter_node_bandwidth_gbs: float = 25.0

    def __post_init__(self) -> None:
        for k, (lo, hi) in HARDWARE_RANGES.items():
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{k}={v!r}: must be a finite number > 0")
            if not lo <= v <= hi:
                raise ConfigError(f"{k}={v!r}: out of range, give {lo:g} to {hi:,g}")
        if len(self.nodes) > MAX_NODES:
            raise ConfigError(f"{len(self.nodes):,} nodes; at most {MAX_NODES:,} are supported")
        names = list(map(_NAME, self.nodes))
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:5] if len(names) < 4096 else "some"
            raise ConfigError(f"node names must be distinct (repeated: {dup})")
        n = sum(map(len, map(_GPUS, self.nodes)))
        if n > MAX_GPUS:
            raise ConfigError(f"{n:,} usable GPUs; at most {MAX_GPUS:,} are supported")

    # ---- constructors -------------------------------------------------------------------------
    @staticmethod
    def from_gpus_per_node(spec: str | list[int] | tuple[int, ...], **kw: Any) -> "Cluster":
        """``"8,8,8,7"`` -> nodes ``node0..node3`` with GPUs ``0..k-1`` usable."""
        if isinstance(spec, str):
            try:
                fields = spec.replace(" ", "").split(",")
                if fields and fields[-1] == "" and len(fields) > 1:
                    fields.pop()   # a trailing comma
                counts = [int(x) for x in fields]   # an empty field ("8,,8") is a typo, not a node dropped
            except ValueError:
                raise ConfigError(f"--gpus-per-node {spec!r}: expected comma-separated integers like 8,8,8,7") from None
            if not counts:
                raise ConfigError(f"--gpus-per-node {spec!r}: expected comma-separated integers like 8,8,8,7")
        else:
            counts = [int(x) for x in spec]
        if any(c < 0 for c in counts):
            raise ConfigError(f"gpus per node: counts must be >= 0 (got {min(counts)})")
        if len(counts) > MAX_NODES:
            raise ConfigError(f"gpus per node: {len(counts):,} nodes; at most {MAX_NODES:,} are supported")
        if max(counts, default=0) > MAX_GPUS_PER_NODE:
            raise ConfigError(f"gpus per node: {max(counts)} GPUs on a node; at most {MAX_GPUS_PER_NODE} are supported")
        nodes = tuple(Node(f"node{i}", _IDS[c]) for i, c in enumerate(counts))
        return Cluster(nodes, **kw)

    @staticmethod
    def from_dict(d: Mapping[str, Any], **overrides: Any) -> "Cluster":
        try:
            return Cluster._from_dict(d, **overrides)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed cluster description ({type(e).__name__}: {e}); see "
                              f"elastor_ds.plan.cluster for the format") from None

    @staticmethod
    def _from_dict(d: Mapping[str, Any], **overrides: Any) -> "Cluster":
        kw: dict[str, Any] = {k: float(d[k]) for k in ("gpu_memory_gb", "intra_node_bandwidth_gbs",
                                                        "inter_node_bandwidth_gbs") if k in d}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(d) - {"gpu_memory_gb", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs",
                            "gpus_per_node", "nodes"}
        if unknown:
            raise ConfigError(f"cluster file has unknown keys {sorted(unknown)}")
        if ("nodes" in d) == ("gpus_per_node" in d):
            raise ConfigError("cluster file needs exactly one of 'nodes' or 'gpus_per_node'")
        if "gpus_per_node" in d:
            return Cluster.from_gpus_per_node(list(d["gpus_per_node"]), **kw)
        nodes = []
        for i, nd in enumerate(d["nodes"]):
            name = str(nd.get("name", f"node{i}"))
            gpus = tuple(int(g) for g in nd.get("gpus", ()))
            sp = nd.get("speed", {})
            if isinstance(sp, Mapping):
                bad = {int(k) for k in sp} - set(gpus)
                if bad:
                    raise ConfigError(f"node {name}: speed given for GPUs {sorted(bad)} that are not usable")
                speeds = tuple(float(sp.get(str(g), sp.get(g, 1.0))) for g in gpus)
            else:
                speeds = tuple(float(s) for s in sp)
            nodes.append(Node(name, gpus, speeds))
        return Cluster(tuple(nodes), **kw)

    @staticmethod
    def from_file(path: str | Path, **overrides: Any) -> "Cluster":
        p = Path(path)
        from ..user_json import read_user_file
        raw = read_user_file(str(p), "cluster file", CLUSTER_FILE_MAX, "a cluster file",
                             "name a JSON or YAML file of nodes and their GPUs")
        try:
            text = raw.decode("utf-8")
            if p.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml  # PyYAML; JSON is valid YAML too
                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - any parse error is a config error
            raise ConfigError(f"cannot parse cluster file {p}: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"cluster file {p} must hold a mapping, got {type(data).__name__}")
        return Cluster.from_dict(data, **overrides)

    # ---- queries ------------------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """Every usable GPU, node by node, GPU ids ascending (the canonical order)."""
        return list(self.device_tuple())

    def device_tuple(self) -> tuple[Device, ...]:
        """:meth:`devices` as a tuple, made once per cluster (the cluster is immutable)."""
        cached = self.__dict__.get("_devices")
        if cached is None:
            # the four fields as flat lists, then one C-level map: a 131,072-GPU cluster makes its
            # devices in a few tens of milliseconds (a generator step per device costs 2-3x that)
            nodes = self.nodes
            sizes = list(map(len, map(_GPUS, nodes)))
            if all(map(operator.eq, map(_GPUS, nodes), map(_IDS.__getitem__, sizes))):  # ids 0..k-1 everywhere
                gpus = list(chain.from_iterable(map(_GPUS, nodes)))
                speeds = list(chain.from_iterable(map(_SPEEDS, nodes)))
            else:
                gpus, speeds = [], []
                for n in nodes:
                    pairs = zip(n.gpus, n.speeds) if n.gpus == _IDS[len(n.gpus)] else sorted(zip(n.gpus, n.speeds))
                    for g, sp in pairs:
                        gpus.append(g)
                        speeds.append(sp)
            index = chain.from_iterable(map(repeat, range(len(nodes)), sizes))
            names = chain.from_iterable(map(repeat, map(_NAME, nodes), sizes))
            with gc_paused():  # 131,072 new tuples: no collection of the young generation between them
                cached = tuple(map(_new_device, repeat(Device), zip(index, names, gpus, speeds)))
            object.__setattr__(self, "_devices", cached)
        return cached

    def node_starts(self) -> list[int]:
        """The position in :meth:`device_tuple` of each node's first device (one past the last
        device for a node without usable GPUs), made once per cluster."""
        cached = self.__dict__.get("_starts")
        if cached is None:
            cached = list(accumulate(map(len, map(_GPUS, self.nodes)), initial=0))[:-1]
            object.__setattr__(self, "_starts", cached)
        return cached

    def node_index(self) -> dict[str, int]:
        """Node name -> index (made once per cluster)."""
        cached = self.__dict__.get("_node_index")
        if cached is None:
            cached = {n.name: i for i, n in enumerate(self.nodes)}
            object.__setattr__(self, "_node_index", cached)
        return cached

    @cached_property
    def num_gpus(self) -> int:
        return sum(map(len, map(_GPUS, self.nodes)))

    @cached_property
    def max_gpus_per_node(self) -> int:
        return max(map(len, map(_GPUS, self.nodes)), default=0)

    def describe(self) -> str:
        """``"131,071 GPUs on 16,384 nodes (16,383 x 8, 1 x 7), 80 GB each"``: per-node counts summarised."""
        counts = [len(n.gpus) for n in self.nodes]
        slow = sum(1 for n in self.nodes for s in n.speeds if s != 1.0)
        return (f"{self.num_gpus:,} GPUs on {len(self.nodes):,} nodes ({run_length(counts)}), "
                f"{self.gpu_memory_gb:g} GB each" + (f", {slow:,} with non-nominal speed" if slow else ""))


_GPUS = operator.attrgetter("gpus")
_SPEEDS = operator.attrgetter("speeds")
_NAME = operator.attrgetter("name")
_new_device = tuple.__new__  # Device's fields without NamedTuple.__new__'s keyword handling
_IDS = {k: tuple(range(k)) for k in range(MAX_GPUS_PER_NODE + 1)}
_ONES = {k: (1.0,) * k for k in range(MAX_GPUS_PER_NODE + 1)}


def run_length(values: list[int], limit: int = 6) -> str:
    """Consecutive repeats folded: ``[8, 8, 8, 7]`` -> ``"8,8,8,7"``; long lists by count, most common
    first: ``"16,383 x 8, 1 x 7"``."""
    if len(values) <= 8:
        return ",".join(map(str, values))
    tally: dict[int, int] = {}
    for v in values:
        tally[v] = tally.get(v, 0) + 1
    items = sorted(tally.items(), key=lambda kv: (-kv[1], -kv[0]))
    text = ", ".join(f"{n:,} x {v}" for v, n in items[:limit])
    return text + (f", {len(items) - limit} other counts" if len(items) > limit else "")
