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

Every field is checked, and a bad one refused naming it (:class:`~elastor_ds.errors.ConfigError`,
exit 2): node names are non-empty strings without control or invisible formatting characters (they
are printed), GPU ids and counts whole numbers (not ``1.9``, ``true`` or ``"2"``), speed keys a GPU id
of that node in ASCII digits (``"5"`` or ``5``, not ``"05"``), speeds numbers from
:data:`SPEED_RANGE` (relative to a nominal GPU's 1.0), no unknown keys. A YAML file is at most
:data:`CLUSTER_YAML_MAX` bytes and may not use anchors or aliases (``&a`` / ``*a``: a few lines that
expand to a large cluster); a JSON file at most :data:`CLUSTER_FILE_MAX` bytes, strict JSON.

Pure: no torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import argparse
import math
import operator
import re
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain, repeat
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..cli_types import ascii_int, has_control_chars
from ..errors import ConfigError
from .gcpause import gc_paused

# Sizes the planner accepts (its time and memory grow with them; beyond these a typo, not a cluster).
MAX_GPUS_PER_NODE = 64
MAX_NODES = 1 << 18        # 262,144
MAX_GPUS = 1 << 18         # 262,144 usable GPUs in all
CLUSTER_FILE_MAX = 128 * 1024 * 1024   # bytes of a JSON cluster file (262,144 nodes with GPU speeds fit)
CLUSTER_YAML_MAX = 8 * 1024 * 1024     # bytes of a YAML one (262,144 GPUs on 32,768 nodes with speeds: 2.3 MB)
# a GPU's speed relative to a nominal one: beyond this the cost model's arithmetic leaves a float's
# precision (a speed of 1e308 or 1e-200 made the micro-batch assignment loop for ever)
SPEED_RANGE = (1e-3, 1e3)
_GPU_KEY = re.compile(r"0|[1-9][0-9]{0,6}")  # a speed map's key: a GPU id as str(id) writes it


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
        lo, hi = SPEED_RANGE
        if not all(lo <= s <= hi for s in self.speeds):   # NaN fails the comparison too
            g, s = next((g, s) for g, s in zip(gpus, self.speeds) if not lo <= s <= hi)
            raise ConfigError(f"node {self.name}: GPU {g} has speed {s!r}; a relative speed (1.0 = nominal) must be "
                              f"{lo:g} to {hi:g}")


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
                # ASCII digits only: int() also takes "1_6", fullwidth and Arabic-Indic digits; an
                # empty field ("8,,8") is a typo, not a node dropped
                counts = [ascii_int(x) for x in fields]
            except argparse.ArgumentTypeError:
                raise ConfigError(f"--gpus-per-node {spec!r}: expected comma-separated integers in ASCII digits "
                                  f"like 8,8,8,7") from None
            if not counts:
                raise ConfigError(f"--gpus-per-node {spec!r}: expected comma-separated integers like 8,8,8,7")
        else:
            counts = [_whole(x, "gpus per node", f"entry {i}") for i, x in enumerate(spec)]
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
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed cluster description ({type(e).__name__}: {e}); see "
                              f"elastor_ds.plan.cluster for the format") from None

    @staticmethod
    def _from_dict(d: Mapping[str, Any], **overrides: Any) -> "Cluster":
        if not isinstance(d, Mapping):
            raise ConfigError(f"a cluster description is a mapping, got {type(d).__name__}")
        unknown = set(d) - {"gpu_memory_gb", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs",
                            "gpus_per_node", "nodes"}
        if unknown:
            raise ConfigError(f"cluster file has unknown keys {_show_keys(unknown)}; it has gpus_per_node or nodes, and "
                              f"optionally gpu_memory_gb, intra_node_bandwidth_gbs, inter_node_bandwidth_gbs")
        kw: dict[str, Any] = {k: _number(d[k], k) for k in ("gpu_memory_gb", "intra_node_bandwidth_gbs",
                                                             "inter_node_bandwidth_gbs") if k in d}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        if ("nodes" in d) == ("gpus_per_node" in d):
            raise ConfigError("cluster file needs exactly one of 'nodes' or 'gpus_per_node'")
        if "gpus_per_node" in d:
            counts = _list(d["gpus_per_node"], "gpus_per_node", MAX_NODES)
            return Cluster.from_gpus_per_node(counts, **kw)
        nodes = []
        for i, nd in enumerate(_list(d["nodes"], "nodes", MAX_NODES)):
            if not isinstance(nd, Mapping):
                raise ConfigError(f"cluster file nodes[{i}]: expected a mapping with name, gpus and speed, got "
                                  f"{type(nd).__name__}")
            extra = set(nd) - {"name", "gpus", "speed"}
            if extra:
                raise ConfigError(f"cluster file nodes[{i}]: unknown keys {_show_keys(extra)}; a node has "
                                  f"name, gpus and speed")
            name = _node_name(nd.get("name", f"node{i}"), i)
            where = f"node {name}"
            gpus = tuple(_whole(g, where, "each GPU id")
                         for g in _list(nd.get("gpus", []), f"{where}: gpus", MAX_GPUS_PER_NODE))
            sp = nd.get("speed", {})
            if isinstance(sp, Mapping):
                have = set(gpus)
                if len(sp) > len(gpus):
                    raise ConfigError(f"{where}: {len(sp):,} speeds for {len(gpus)} GPUs; give at most one per GPU")
                by_gpu: dict[int, float] = {}
                for k, v in sp.items():
                    g = _gpu_key(k, where)
                    if g not in have:
                        raise ConfigError(f"{where}: speed given for GPU {g}, which is not among its usable GPUs "
                                          f"{list(gpus)}")
                    if g in by_gpu:
                        raise ConfigError(f"{where}: speed of GPU {g} given twice")
                    by_gpu[g] = _number(v, f"{where}: speed of GPU {g}")
                speeds = tuple(by_gpu.get(g, 1.0) for g in gpus)
            else:
                speeds = tuple(_number(s, f"{where}: speed[{j}]")
                               for j, s in enumerate(_list(sp, f"{where}: speed", MAX_GPUS_PER_NODE)))
            nodes.append(Node(name, gpus, speeds))
        return Cluster(tuple(nodes), **kw)

    @staticmethod
    def from_file(path: str | Path, **overrides: Any) -> "Cluster":
        p = Path(path)
        from ..user_json import read_user_file, strict_json
        is_json = p.suffix.lower() == ".json"
        limit = CLUSTER_FILE_MAX if is_json else CLUSTER_YAML_MAX
        raw = read_user_file(str(p), "cluster file", limit, "a JSON cluster file" if is_json else
                             "a YAML cluster file (a larger cluster: write it as .json)",
                             "name a JSON or YAML file of nodes and their GPUs")
        try:
            text = raw.decode("utf-8")
            data = strict_json(text) if is_json else load_yaml(text)
        except ConfigError as e:
            raise ConfigError(f"cluster file {p}: {e}") from None
        except RecursionError:
            raise ConfigError(f"cannot parse cluster file {p}: nested too deeply") from None
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


def _show(v: Any) -> str:
    """A value from a user's file as an error message shows it: repr, at most 40 characters."""
    try:
        text = repr(v)
    except ValueError:   # an int of more than 4,300 digits
        return f"<an integer of {v.bit_length():,} bits>"
    return text if len(text) <= 40 else text[:37] + "..."


def _show_keys(keys: Any, most: int = 5) -> str:
    """Unknown keys of a user's file as an error shows them: the first ``most`` (sorted, each by
    :func:`_show`) and how many more, so a wrong file named by mistake is not echoed whole."""
    shown = sorted(map(_show, keys))
    more = len(shown) - most
    return ", ".join(shown[:most]) + (f" and {more:,} more" if more > 0 else "")


def _whole(v: Any, where: str, what: str) -> int:
    """``v`` when it is an integer (not a bool, a float or a string: ``1.9`` and ``true`` are typos
    that ``int()`` would turn into 1); numpy's integers too."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if not isinstance(v, (bool, str, bytes, float)):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise ConfigError(f"{where}: {what} must be a whole number, got {_show(v)} ({type(v).__name__})")


def _number(v: Any, what: str) -> float:
    """A number of a cluster file as a float: an int or a float, not a bool or a string; one too
    large for a float (``10**400``) refused."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{what}={_show(v)}: expected a number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:
        raise ConfigError(f"{what}={_show(v)}: too large a number") from None


def _list(v: Any, what: str, most: int) -> list:
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"{what}: expected a list, got {type(v).__name__}")
    if len(v) > most:
        raise ConfigError(f"{what}: {len(v):,} entries; at most {most:,} are supported")
    return list(v)


def _node_name(v: Any, i: int) -> str:
    """A node name of a cluster file: a non-empty string the CLI can print (no control or invisible
    formatting characters: an escape sequence would act on the user's terminal)."""
    if not isinstance(v, str):
        raise ConfigError(f"cluster file nodes[{i}]: name {_show(v)} is not a string; give a name like node{i}")
    why = ("is empty" if not v else f"is {len(v):,} characters long (at most 255)" if len(v) > 255 else
           "has control or invisible formatting characters (printed, they would act on the terminal)"
           if has_control_chars(v) else None)
    if why:
        raise ConfigError(f"cluster file nodes[{i}]: name {_show(v)} {why}; give a name like node{i}")
    return v


def _gpu_key(k: Any, where: str) -> int:
    """A speed map's key: a GPU id, as an integer or in ASCII digits as ``str(id)`` writes it (the
    map is read by ``str(id)``: ``"01"`` or ``"1_0"`` would never be found)."""
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    if isinstance(k, str) and _GPU_KEY.fullmatch(k):
        return int(k)
    raise ConfigError(f"{where}: speed key {_show(k)} is not a GPU id; write the id in ASCII digits without "
                      f"leading zeros, e.g. \"5\"")


# ---- YAML without anchors and aliases, through libyaml's event parser ---------------------------------
_YAML_SCALARS = {"tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                 "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null"}
_YAML_CONTAINERS = {None, "!", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` for a cluster file, refusing anchors and aliases (``&a`` / ``*a``:
    a few lines that name one large map on every node, which every reader then walks once per node),
    tags other than plain scalars, maps and lists (timestamps, sets, merge keys ``<<``), keys that are
    not scalars or that repeat, and more than one document: a ConfigError naming the line.

    The events come from libyaml's parser when PyYAML has it (``yaml.CSafeLoader``), and the
    values are built from them here: safe_load's node graph and constructor cost ~7x more
    (2.3 MB, 262,144 GPUs: 5.2 s CPU with the C loader, 16 s without; here 0.7 s)."""
    import yaml
    from yaml.events import (AliasEvent, DocumentStartEvent, MappingEndEvent, MappingStartEvent, ScalarEvent,
                             SequenceEndEvent, SequenceStartEvent)
    from yaml.nodes import ScalarNode

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    resolver = yaml.resolver.Resolver()
    constructor = yaml.constructor.SafeConstructor()
    cache: dict[tuple, Any] = {}  # scalar (text, implicit, tag) -> value: GPU ids and speeds repeat
    stack: list[list] = []        # per open container: [container, key, key seen]
    root: Any = None
    docs = 0

    def refuse(ev: Any, what: str) -> ConfigError:
        m = ev.start_mark
        return ConfigError(f"line {m.line + 1}, column {m.column + 1}: {what}" if m is not None else what)

    for ev in yaml.parse(text, Loader=loader):
        t = type(ev)
        if t is ScalarEvent:
            if ev.anchor is not None:
                raise refuse(ev, f"YAML anchor &{ev.anchor}: anchors and aliases are not accepted in a cluster "
                                 f"file; write each node out")
            key = (ev.value, ev.implicit, ev.tag)
            v = cache.get(key, cache)
            if v is cache:
                tag = ev.tag if ev.tag not in (None, "!") else resolver.resolve(ScalarNode, ev.value, ev.implicit)
                if tag not in _YAML_SCALARS:
                    raise refuse(ev, f"YAML value {_show(ev.value)} has tag {tag}; a cluster file holds strings, "
                                     f"numbers, maps and lists (quote a string)")
                v = constructor.construct_object(ScalarNode(tag, ev.value), deep=True)
                if len(cache) < 4096:
                    cache[key] = v
        elif t is MappingStartEvent or t is SequenceStartEvent:
            if ev.anchor is not None:
                raise refuse(ev, f"YAML anchor &{ev.anchor}: anchors and aliases are not accepted in a cluster "
                                 f"file; write each node out")
            if ev.tag not in _YAML_CONTAINERS:
                raise refuse(ev, f"YAML tag {ev.tag} is not accepted in a cluster file (plain maps and lists only)")
            if stack and isinstance(stack[-1][0], dict) and not stack[-1][2]:
                raise refuse(ev, "a YAML map or list as a key is not accepted in a cluster file")
            stack.append([{} if t is MappingStartEvent else [], None, False])
            continue
        elif t is MappingEndEvent or t is SequenceEndEvent:
            v = stack.pop()[0]
        elif t is AliasEvent:
            raise refuse(ev, f"YAML alias *{ev.anchor}: anchors and aliases are not accepted in a cluster file; "
                             f"write each node out")
        elif t is DocumentStartEvent:
            docs += 1
            if docs > 1:
                raise refuse(ev, "a cluster file holds one YAML document")
            continue
        else:
            continue
        if not stack:
            root = v
            continue
        top = stack[-1]
        c = top[0]
        if type(c) is list:
            c.append(v)
        elif not top[2]:
            top[1], top[2] = v, True
        else:
            if top[1] in c:
                raise refuse(ev, f"key {_show(top[1])} is given twice in one YAML map")
            c[top[1]] = v
            top[2] = False
    return root


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
