"""Cross-node side of the memory tier in the DeepSpeed runtime: peer copies and remote restore.

:func:`attach` (collective; called by :class:`~.runtime.ElastorCheckpointer` right after its
:class:`~.memory.MemoryTier`, on every rank at the same point):

- restores: adds the cross-node sources (:func:`~elastor_ds.checkpoint.snapshot.peer_sources.node_sources`:
  peer copies held on this node, then the other live nodes' snapshot servers from
  ``ELASTOR_SNAPSHOT_PEERS``) between this node's memory and storage;
- peer copies: with ``peer_copies >= 1`` and more than one node (``ELASTOR_PROCS_PER_NODE``),
  creates the :class:`~elastor_ds.checkpoint.snapshot.peer_copy.PeerCopier` (one transport, every rank) and
  hooks it to the memory engine's commits: after each snapshot commits, this rank's files go to
  its ring partner in the background.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ...elastic.protocol import ENV_PROCS_PER_NODE, launch_context
from ...comm.groups import world_rank, world_size
from .peer_sources import node_sources
from .peer_copy import PeerCopier, PeerFile

log = logging.getLogger(__name__)

__all__ = ["attach", "procs_per_node"]


def procs_per_node(world: int) -> list[int]:
    """The launched processes per node (``elastor run`` exports them), else one node."""
    ppn = launch_context().procs_per_node
    if ppn is None or sum(ppn) != world:
        if ppn is not None:
            log.warning("%s=%s does not describe a world of %d: treating it as one node", ENV_PROCS_PER_NODE,
                        ",".join(map(str, ppn)), world)
        return [world]
    return list(ppn)


def _cross_node_sources(step_dir: str, _manifest: Any) -> list:
    return node_sources(os.path.basename(os.path.normpath(step_dir)))


def attach(checkpointer: Any, timeout_s: float = 600.0) -> Optional[PeerCopier]:
    """Collective. Returns the copier (None without peer copies)."""
    mem = checkpointer.memory
    if mem is None:
        return None
    if _cross_node_sources not in checkpointer.extra_memory_sources:
        checkpointer.extra_memory_sources.append(_cross_node_sources)
    ppn = procs_per_node(world_size())
    copier = PeerCopier.create(ppn, mem.dir, int(mem.cfg.peer_copies), timeout_s)
    if copier is None:
        return None

    def peer_copy(info) -> None:
        if not mem.cfg.copies_step(int(info.step)):   # a peer-copy interval longer than the snapshots'
            return
        files = [PeerFile(rel, int(size), int(crc)) for rel, (size, crc) in sorted(info.files.items())]
        copier.submit(info.step_dir, files, search_dirs=[info.tmp_dir], mapped=info.mapped)

    mem.ckpt.after_commit.append(peer_copy)
    mem.peer_copier = copier
    if world_rank() == 0:
        log.info("memory snapshots: peer copies to the next node in the ring (%d node(s): %s processes)", len(ppn), ppn)
    return copier
