"""The ``etcd-v2`` rendezvous against every member of an etcd cluster (``--rdzv-endpoint a:2379,b:2379,c:2379``).

torch's own ``etcd-v2`` handler takes one ``HOST:PORT``: the client starts at that member and
learns the others from it. When that member is down (its node was the one lost), a controller that
starts then cannot join at all. This module builds the same handler (torch's
``EtcdRendezvousBackend`` for the rendezvous state, ``EtcdStore`` for the round's keys, the dynamic
rendezvous on top) with a ``python-etcd`` client given the whole member list, so any one member
may be gone at start and later (the client moves to the next member on a connection error).

A node that runs a member of the cluster (its address is ``--local-addr``) talks to its own member
first: it then needs no other node to reach the store, and a node cut off from the others finds
its member without a quorum (a write times out), misses its beats and fences itself.

Every etcd call is bounded by ``read_timeout`` (``--rdzv-conf``, default 60 s): a member that
vanished silently costs at most that much before the client tries the next one.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError

STATE_PREFIX = "/torch/elastic/rendezvous"   # torch's own etcd-v2 key layout, kept so tools find it
STORE_PREFIX = "/torch/elastic/store"
CLIENT_HINT = "pip install python-etcd==0.4.5 (requirements-dev.txt pins it)"


def member_order(members: Sequence[tuple[str, int]], local_addr: str | None) -> tuple[tuple[str, int], ...]:
    """The members in the order the client tries them: this node's own member first (if it runs one)."""
    mine = [m for m in members if local_addr and m[0] == local_addr]
    return tuple(mine + [m for m in members if m not in mine])


def create_handler(params, members: Sequence[tuple[str, int]], local_addr: str | None = None,
                   key: bytes | None = None):
    """A ``DynamicRendezvousHandler`` whose state and store live in the etcd cluster of ``members``;
    its state signed with ``key`` (:mod:`.rdzv_auth`; None: unsigned)."""
    try:
        import etcd
    except ModuleNotFoundError:
        raise ConfigError(f"--rdzv-backend etcd-v2 needs the etcd client library: {CLIENT_HINT}") from None
    import urllib3.exceptions
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    protocol = str(params.get("protocol", "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol={protocol}: expected http or https")
    cert = params.get("cert")
    if cert and params.get("key"):
        cert = (cert, params.get("key"))
    try:
        client = etcd.Client(host=member_order(members, local_addr), protocol=protocol, allow_reconnect=True,
                             read_timeout=int(params.get_as_int("read_timeout", 60)), cert=cert,
                             ca_cert=params.get("cacert"))
    except (etcd.EtcdException, urllib3.exceptions.HTTPError) as e:
        raise RendezvousConnectionError(f"no member of the etcd cluster answered "
                                        f"({', '.join(f'{h}:{p}' for h, p in members)}): {e}") from e
    backend = EtcdRendezvousBackend(client, params.run_id, key_prefix=STATE_PREFIX)
    if key is None:
        return dynamic_handler(EtcdStore(client, STORE_PREFIX), backend, params)
    from .rdzv_auth import signed_handler
    return signed_handler(params, key, store=EtcdStore(client, STORE_PREFIX), backend=backend)
