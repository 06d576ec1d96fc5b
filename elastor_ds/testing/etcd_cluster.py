"""An etcd cluster for tests: one ``etcd`` member (Debian's ``etcd-server``, 3.4) per named node of
a :class:`~elastor_ds.testing.netns.Testbed`, on the node's address, with the v2 API on (torch's
``etcd``/``etcd-v2`` rendezvous backends speak v2).

Each member keeps its data in a private folder under the test's own directory; the member
processes belong to the bed (``Testbed.popen``), so ``Testbed.down`` and a node loss
(``kill_node``) end them like any other process of that node. :meth:`EtcdCluster.stop` ends them
earlier. :func:`etcd_unavailable` says why no cluster can run here (no ``etcd`` binary).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import sys
from typing import Sequence

from .netns import Testbed

CLIENT_PORT = 2379
PEER_PORT = 2380


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def etcd_unavailable() -> str | None:
    """Why no etcd cluster can be started here (None: it can)."""
    if etcd_binary() is None:
        return ("no 'etcd' binary: install Debian's etcd-server (scripts/setup_env.sh does as root: "
                "apt-get install -y etcd-server)")
    return None


class EtcdCluster:
    """Members on ``names`` of ``bed``; :attr:`endpoint` is the ``--rdzv-endpoint`` list of them all."""

    def __init__(self, bed: Testbed, names: Sequence[str], folder: str, token: str = "elastor-test"):
        self.bed, self.names, self.folder = bed, list(names), folder
        self.addrs = {n: bed.node(n).addr for n in self.names}
        self.procs: dict[str, subprocess.Popen] = {}
        os.makedirs(folder, mode=0o700, exist_ok=True)
        cluster = ",".join(f"{n}=http://{a}:{PEER_PORT}" for n, a in self.addrs.items())
        for n, a in self.addrs.items():
            data = os.path.join(folder, f"{n}.etcd")
            log = open(os.path.join(folder, f"{n}.log"), "w")
            argv = [etcd_binary() or "etcd", "--name", n, "--data-dir", data, "--enable-v2",
                    "--listen-client-urls", f"http://{a}:{CLIENT_PORT}", "--advertise-client-urls",
                    f"http://{a}:{CLIENT_PORT}", "--listen-peer-urls", f"http://{a}:{PEER_PORT}",
                    "--initial-advertise-peer-urls", f"http://{a}:{PEER_PORT}", "--initial-cluster", cluster,
                    "--initial-cluster-token", token, "--initial-cluster-state", "new",
                    "--heartbeat-interval", "100", "--election-timeout", "1000"]
            self.procs[n] = bed.popen(n, argv, stdout=log, stderr=subprocess.STDOUT)
            log.close()

    @property
    def endpoint(self) -> str:
        return ",".join(f"{a}:{CLIENT_PORT}" for a in self.addrs.values())

    def _http(self, name: str, path: str, body: dict | None = None, timeout: float = 2.0) -> dict:
        """GET (POST with a JSON ``body``) ``path`` of the member on ``name``, from its own node;
        {} when it does not answer."""
        url = f"http://{self.addrs[name]}:{CLIENT_PORT}{path}"
        data = None if body is None else json.dumps(body).encode()
        code = (f"import urllib.request as u; r = u.Request({url!r}, data={data!r}); "
                f"print(u.urlopen(r, timeout={timeout}).read().decode())")
        res = self.bed.run(name, [sys.executable, "-c", code])
        try:
            return json.loads(res.stdout or "{}")
        except ValueError:
            return {}

    def health(self, name: str) -> bool:
        """The member on ``name`` answers ``/health`` with a quorum behind it."""
        return self._http(name, "/health").get("health") == "true"

    def leader(self) -> str | None:
        """The node whose member leads the cluster now (None: no member says it leads)."""
        return next((n for n in self.names if self._http(n, "/v2/stats/self").get("state") == "StateLeader"), None)

    def move_leader(self, to: str, timeout: float = 30.0) -> None:
        """Make the member on ``to`` the leader (etcd's leadership transfer, asked of the leader)."""
        ids = {m["name"]: m["ID"] for m in self._http(to, "/v3/cluster/member/list", {}).get("members", [])}
        t_end = time.monotonic() + timeout
        while (now := self.leader()) != to:
            if time.monotonic() > t_end:
                raise RuntimeError(f"etcd leadership did not move to {to} in {timeout:.0f} s (leader: {now})")
            if now is not None:
                self._http(now, "/v3/maintenance/transfer-leadership", {"targetID": ids[to]})
            time.sleep(0.2)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        t_end = time.monotonic() + timeout
        while True:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"etcd member(s) exited: {dead}; logs in {self.folder}")
            if all(self.health(n) for n in self.names):
                return
            if time.monotonic() > t_end:
                raise RuntimeError(f"etcd cluster not healthy in {timeout:.0f} s; logs in {self.folder}")
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


__all__ = ["CLIENT_PORT", "EtcdCluster", "etcd_unavailable"]
