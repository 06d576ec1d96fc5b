"""Nodes as Linux network namespaces: a test bed for real node losses on one machine (needs root).

Layout (``Testbed.up``)::

    <prefix>sw   one namespace holding a bridge "br0" (no address: it only switches)
    <prefix>N    one namespace per node: "lo" and "eth0" (SUBNET.<i+1>/24), a veth pair whose other
                 end ("p<i>") is a port of br0. No default route: no packet leaves the bed.

Processes started with :meth:`Testbed.popen` run in a node's namespace (same file system, same
pid namespace: the shared disk plays a cluster file system). Faults:

- :meth:`kill_node`: SIGKILL every process whose network namespace is the node's (whole node lost);
- :meth:`cut`: the node's switch port stops forwarding, silently: ``Cut.LINK_DOWN`` sets the port
  down (the node sees no carrier), ``Cut.DROP`` disables the port in the bridge (links stay up,
  every frame to or from the node is dropped: a hung switch port); no reset reaches anyone.
  :meth:`heal` undoes either (a partition that ends);
- :meth:`slow`: a token-bucket rate limit (tbf) on both ends of the node's link, with a short
  queue: large transfers crawl and bursts beyond the queue are dropped (a congested link). netem
  (fixed delay, random loss) is used instead when the kernel has it (``sch_netem``).

:meth:`down` kills every process in every namespace of the bed and deletes the namespaces (their
veth pairs go with them); :func:`leftovers` lists what is left of a prefix. Every name starts with
the bed's prefix: nothing else on the machine is touched. ``python -m elastor_ds.testing.netns``
(``scripts/netns_nodes.sh``) does the same from a shell.
"""
from __future__ import annotations

import argparse
import enum
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

SUBNET = "10.77.0"


class Cut(enum.Enum):
    LINK_DOWN = "link-down"   # the switch port is down: no carrier
    DROP = "drop"             # the bridge port is disabled: links up, nothing is forwarded


@dataclass(frozen=True)
class Node:
    name: str        # the test's name for it ("n0", "store", ...)
    ns: str          # network namespace
    addr: str        # its address on the bed's subnet
    port: str        # its veth end in the switch namespace


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode:
        raise NetnsError(f"ip {' '.join(args)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if check and res.returncode:
        raise NetnsError(f"tc {' '.join(args)} in {ns}: {res.stderr.strip()}")
    return res


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can). Creates and deletes one."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the netns tier as root"
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"'{tool}' is not installed (iproute2)"
    probe = f"elprobe{secrets.token_hex(3)}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode:
        return f"'ip netns add' is not permitted here: {res.stderr.strip()}"
    try:
        if _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1", check=False).returncode:
            return "veth pairs cannot be created in a network namespace here"
        if _tc(probe, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst", "16kb", "latency",
               "50ms", check=False).returncode:
            return "tc tbf is not available (kernel module sch_tbf)"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespaces(prefix: str) -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix))


def ns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return sorted(int(x) for x in res.stdout.split() if x.strip().isdigit())


def leftovers(prefix: str) -> dict[str, list[int]]:
    """Namespaces of ``prefix`` that still exist, each with the pids still in it."""
    return {ns: ns_pids(ns) for ns in namespaces(prefix)}


def kill_namespace_processes(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left; returns the pids killed."""
    killed: list[int] = []
    t_end = time.monotonic() + timeout
    while True:
        pids = [p for p in ns_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except ProcessLookupError:
                pass
        if time.monotonic() > t_end:
            raise NetnsError(f"processes {pids} in {ns} survive SIGKILL")
        time.sleep(0.05)


class Testbed:
    """N nodes on one bridge. Use as a context manager, or call :meth:`up` and :meth:`down`."""

    def __init__(self, names: Sequence[str], prefix: str | None = None, subnet: str = SUBNET):
        if len(names) > 250 or len(set(names)) != len(names):
            raise ValueError(f"node names must be unique and at most 250: {names}")
        self.prefix = prefix or f"eln{secrets.token_hex(2)}"
        if len(self.prefix) > 10:
            raise ValueError(f"prefix {self.prefix!r}: at most 10 characters (interface names are 15)")
        self.switch = f"{self.prefix}sw"
        self.nodes = {n: Node(n, f"{self.prefix}{i}", f"{subnet}.{i + 1}", f"p{i}") for i, n in enumerate(names)}
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Testbed":
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, node in enumerate(self.nodes.values()):
                _ip("netns", "add", node.ns)
                _ip("-n", node.ns, "link", "set", "lo", "up")
                _ip("-n", node.ns, "link", "add", "eth0", "type", "veth", "peer", "name", node.port)
                _ip("-n", node.ns, "link", "set", node.port, "netns", self.switch)
                _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
                _ip("-n", node.ns, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", node.port, "master", "br0")
                _ip("-n", self.switch, "link", "set", node.port, "up")
        except Exception:
            self.down()
            raise
        return self

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[name].ns, *argv]

    def popen(self, name: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in node ``name`` (its own session, so a test can signal its group)."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.argv(name, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, name: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(name, argv), **kw)

    def pids(self, name: str) -> list[int]:
        return ns_pids(self.nodes[name].ns)

    # ------------------------------------------------------------------ faults
    def kill_node(self, name: str) -> list[int]:
        """Whole node lost: SIGKILL every process in its namespace (until none is left)."""
        return kill_namespace_processes(self.nodes[name].ns)

    def cut(self, name: str, how: Cut = Cut.DROP) -> None:
        node = self.nodes[name]
        if how is Cut.LINK_DOWN:
            _ip("-n", self.switch, "link", "set", node.port, "down")
        else:   # bridge port state 0: disabled
            self._port_state(node, 0)

    def heal(self, name: str) -> None:
        node = self.nodes[name]
        _tc(self.switch, "qdisc", "del", "dev", node.port, "root", check=False)
        _tc(node.ns, "qdisc", "del", "dev", "eth0", "root", check=False)
        _ip("-n", self.switch, "link", "set", node.port, "up")
        self._port_state(node, 3)   # forwarding

    def _port_state(self, node: Node, state: int) -> None:
        res = subprocess.run(["ip", "netns", "exec", self.switch, "bridge", "link", "set", "dev", node.port, "state",
                              str(state)], capture_output=True, text=True)
        if res.returncode:
            raise NetnsError(f"bridge link set dev {node.port} state {state}: {res.stderr.strip()}")

    def slow(self, name: str, rate_kbit: int, queue_ms: float = 20.0, delay_ms: float = 0.0,
             loss_pct: float = 0.0) -> str:
        """Slow the node's link in both directions; returns the qdisc used. With netem in the
        kernel: ``delay_ms`` per direction, ``loss_pct`` random loss, ``rate_kbit``. Without it: a
        token bucket of ``rate_kbit`` whose queue holds ``queue_ms`` of traffic (what does not fit
        is dropped)."""
        node = self.nodes[name]
        spec = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%", "rate", f"{rate_kbit}kbit"]
        if _tc(self.switch, "qdisc", "replace", "dev", node.port, "root", *spec, check=False).returncode:
            burst = max(1600, rate_kbit * 1000 // 8 // 100)   # 10 ms of traffic, at least one frame
            spec = ["tbf", "rate", f"{rate_kbit}kbit", "burst", str(burst), "latency", f"{queue_ms}ms"]
            _tc(self.switch, "qdisc", "replace", "dev", node.port, "root", *spec)
        _tc(node.ns, "qdisc", "replace", "dev", "eth0", "root", *spec)
        return spec[0]

    # ------------------------------------------------------------------ teardown
    def down(self) -> dict[str, list[int]]:
        """Kill every process of the bed, delete its namespaces; returns what is left (empty: all gone)."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in namespaces(self.prefix):
            try:
                kill_namespace_processes(ns)
            except NetnsError:
                pass
            _ip("netns", "del", ns, check=False)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return leftovers(self.prefix)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="netns_nodes", description="nodes as network namespaces (root)")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create nodes n0..nN-1 on one bridge; prints their namespaces and addresses")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--prefix", required=True)
    for name in ("down", "list"):
        sub.add_parser(name, help=f"{name} the bed of a prefix").add_argument("--prefix", required=True)
    for name in ("cut", "heal", "kill", "slow"):
        sp = sub.add_parser(name, help=f"{name} one node")
        sp.add_argument("--prefix", required=True)
        sp.add_argument("--node", type=int, required=True)
        if name == "cut":
            sp.add_argument("--how", choices=[c.value for c in Cut], default=Cut.DROP.value)
        if name == "slow":
            sp.add_argument("--rate-kbit", type=int, required=True)
            sp.add_argument("--delay-ms", type=float, default=0.0)
            sp.add_argument("--loss-pct", type=float, default=0.0)
    a = p.parse_args(argv)
    if a.cmd == "up":
        why = unavailable()
        if why:
            print(f"netns_nodes: {why}", file=sys.stderr)
            return 2
        bed = Testbed([f"n{i}" for i in range(a.nodes)], prefix=a.prefix).up()
        for n in bed.nodes.values():
            print(f"{n.name} {n.ns} {n.addr}")
        return 0
    if a.cmd == "list":
        for ns, pids in leftovers(a.prefix).items():
            print(ns, *pids)
        return 0
    nodes = [n for n in namespaces(a.prefix) if n != f"{a.prefix}sw"]
    bed = Testbed([f"n{i}" for i in range(len(nodes))], prefix=a.prefix)
    if a.cmd == "down":
        left = bed.down()
        return 1 if left else 0
    name = f"n{a.node}"
    if name not in bed.nodes:
        print(f"netns_nodes: no node {a.node} under prefix {a.prefix!r} ({len(nodes)} nodes)", file=sys.stderr)
        return 2
    if a.cmd == "cut":
        bed.cut(name, Cut(a.how))
    elif a.cmd == "heal":
        bed.heal(name)
    elif a.cmd == "kill":
        print(*bed.kill_node(name))
    else:
        print(bed.slow(name, a.rate_kbit, delay_ms=a.delay_ms, loss_pct=a.loss_pct))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
