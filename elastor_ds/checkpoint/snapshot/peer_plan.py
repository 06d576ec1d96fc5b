"""Who sends its memory snapshot to whom: the peer-copy ring (pure; no torch, no I/O).

Global ranks are numbered node after node (node-rank order, ``ELASTOR_PROCS_PER_NODE``). For copy
``k`` (1 <= k <= peer_copies), every rank of node ``n`` sends its chunk files to a rank of node
``(n + k) mod N``: sender local rank ``i`` -> receiver local rank ``i mod m`` (``m`` ranks on the
receiving node), so receivers on a smaller node take several senders and local rank 0 of every node
receives from every origin node. One node, or ``peer_copies == 0``: no transfers.

Also here: how many bytes each node holds as peer copies (the start-up budget check adds it to
the local snapshot's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ...errors import ConfigError

__all__ = ["PeerTransfer", "node_of_rank", "plan_peer_copies", "peer_bytes_by_node", "node_starts", "node_memory_need"]


@dataclass(frozen=True)
class PeerTransfer:
    src: int        # global rank that sends its files
    dst: int        # global rank that receives them
    src_node: int
    dst_node: int
    copy: int = 1   # which of the peer copies (1 = the next node)


def node_starts(procs_per_node: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for n in procs_per_node:
        out.append(acc)
        acc += n
    return out


def node_of_rank(procs_per_node: Sequence[int], rank: int) -> int:
    acc = 0
    for node, n in enumerate(procs_per_node):
        if rank < acc + n:
            return node
        acc += n
    raise ValueError(f"rank {rank} is outside a world of {acc} ranks ({list(procs_per_node)} per node)")


def plan_peer_copies(procs_per_node: Sequence[int], peer_copies: int = 1) -> tuple[PeerTransfer, ...]:
    """Every transfer of one snapshot, ordered by (copy, src). Raises ConfigError when more copies
    are asked for than there are other nodes."""
    ppn = [int(n) for n in procs_per_node]
    if any(n < 1 for n in ppn):
        raise ValueError(f"processes per node {ppn}: every node needs at least one process")
    if peer_copies < 0:
        raise ConfigError(f"peer_copies={peer_copies}: must be >= 0")
    nodes = len(ppn)
    if nodes < 2 or peer_copies == 0:
        return ()
    if peer_copies > nodes - 1:
        raise ConfigError(f"peer_copies={peer_copies} but the job has {nodes} nodes: at most {nodes - 1} copies fit "
                          f"on other nodes; set memory_snapshot.peer_copies <= {nodes - 1}")
    starts = node_starts(ppn)
    out = []
    for k in range(1, peer_copies + 1):
        for n in range(nodes):
            d = (n + k) % nodes
            for i in range(ppn[n]):
                out.append(PeerTransfer(src=starts[n] + i, dst=starts[d] + i % ppn[d], src_node=n, dst_node=d, copy=k))
    return tuple(out)


def peer_bytes_by_node(plan: Sequence[PeerTransfer], bytes_by_rank: Mapping[int, int], nodes: int) -> list[int]:
    """Bytes of peer copies each node holds for one snapshot (what its ranks receive)."""
    out = [0] * nodes
    for t in plan:
        out[t.dst_node] += int(bytes_by_rank.get(t.src, 0))
    return out


def node_memory_need(procs_per_node: Sequence[int], bytes_by_rank: Mapping[int, int], keep: int,
                     peer_copies: int) -> list[dict]:
    """Bytes each node's snapshot directory must hold at once: its own ranks' snapshots x (``keep``
    committed + 1 being written), plus the peer copies it receives x 2 (the held copy stays until
    the next one is complete, so a node lost during a copy still leaves a complete one)."""
    plan = plan_peer_copies(procs_per_node, peer_copies)
    peer = peer_bytes_by_node(plan, bytes_by_rank, len(procs_per_node))
    out = []
    for n, start in enumerate(node_starts(procs_per_node)):
        own = sum(int(bytes_by_rank.get(r, 0)) for r in range(start, start + procs_per_node[n]))
        out.append({"own": own, "peer": peer[n], "need": own * (keep + 1) + 2 * peer[n]})
    return out
