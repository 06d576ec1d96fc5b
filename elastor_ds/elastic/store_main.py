"""A c10d rendezvous store in a process of its own: ``python -m elastor_ds.elastic.store_main --port P``.

With ``--rdzv-backend c10d`` the store lives in one process; when that process is on a training
node, losing the node ends the rendezvous and the job (torchrun's limit too). Run this on a machine
that is not one of the nodes that can fail (a login or service node) and give every node
``--rdzv-endpoint <that host>:P --rdzv-conf is_host=0``; or use the etcd backend (``etcd-v2``)
against an etcd cluster, which survives losing any one member.

It serves until SIGTERM or SIGINT; the store keeps everything in memory and has no authentication:
bind it to the cluster network only (``--host``).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

log = logging.getLogger("elastor.store")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastor_ds.elastic.store_main",
                                description="host a c10d rendezvous store for `elastor run --rdzv-backend c10d`")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    p.add_argument("--port", type=int, default=29400, help="TCP port (default 29400)")
    a = p.parse_args(argv)
    if not 0 < a.port < 65536:
        print(f"store_main: --port {a.port}: expected 1..65535", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch.distributed as dist
    try:
        store = dist.TCPStore(a.host, a.port, is_master=True, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, ValueError) as e:   # address in use, bad address
        print(f"store_main: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 1
    done = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: done.set())
    log.info("c10d store listening on %s:%d (pid %d)", a.host, a.port, __import__("os").getpid())
    print(f"ready {a.host}:{a.port}", flush=True)
    done.wait()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
