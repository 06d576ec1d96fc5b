"""The rendezvous state is signed: another user who reaches the store cannot run code in the agent.

torch's dynamic rendezvous unpickles the state it reads from the store (``torch.rendezvous.<run
id>``) on every sync, and a c10d ``TCPStore`` takes writes from anyone who reaches its port. The
attack here is the real one: a process of user ``nobody`` connects to a running ``elastor run``'s
store and replaces the state with a pickle that runs a shell command; the agent must not run it.
Before :mod:`elastor_ds.elastic.rdzv_auth` the command ran as the job's user within a second or
two (the first test failed: the marker file existed, owned by root)."""
from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest

from other_user import as_other_user  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
NOBODY = 65534


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"id -u > {self.marker}",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attack_as_nobody(port: int, run_id: str, marker: str) -> None:
    """A forked child, become user nobody, writes the malicious state into the store at ``port``."""
    import datetime

    import torch.distributed as dist
    blob = base64.b64encode(pickle.dumps(_Payload(marker))).decode()

    def attack() -> None:   # another uid, no access to the job's files
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        store.set("torch.rendezvous." + run_id, blob)
    as_other_user((NOBODY, NOBODY), attack)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as user nobody")
def test_another_user_who_reaches_the_store_cannot_run_code_in_the_agent(tmp_path):
    marker = str(tmp_path / "pwned")
    go = tmp_path / "go"
    script = tmp_path / "train.py"
    script.write_text("import os, sys, time\n"
                      "t = time.time()\n"
                      "while not os.path.exists(sys.argv[1]) and time.time() - t < 120:\n"
                      "    time.sleep(0.05)\n")
    port, run_id = _free_port(), "rdzv-auth-test"
    proc = subprocess.Popen([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--nnodes", "1",
                             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-id", run_id, "--monitor-interval", "0.1", "--max-restarts", "0",
                             "--events", str(tmp_path / "ev.jsonl"), str(script), str(go)],
                            cwd=str(tmp_path), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()   # the worker is up once the events file says so: the store is up before it
        ev = tmp_path / "ev.jsonl"
        while not (ev.exists() and '"launch"' in ev.read_text()):
            assert proc.poll() is None and time.time() - t0 < 120, "elastor run did not launch its worker"
            time.sleep(0.1)
        _attack_as_nobody(port, run_id, marker)
        # the agent syncs the state at every monitor tick and keep-alive: a few seconds is many syncs
        time.sleep(8)
        go.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not os.path.exists(marker), f"the agent ran the attacker's pickle as uid {open(marker).read().strip()}"
    # the forged state was refused, and said so (the job may end on it: a store others write to is a
    # denial of service at worst)
    assert "not written by this job" in out and "lost contact" not in out, out[-3000:]
    assert proc.returncode == 1, out[-3000:]


def test_signed_states_round_trip_and_a_forged_or_foreign_one_is_refused_before_unpickling(tmp_path):
    from torch.distributed import FileStore
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from elastor_ds.elastic.rdzv_auth import SignedBackend

    store = FileStore(str(tmp_path / "store"), 1)
    mine = SignedBackend(C10dRendezvousBackend(store, "job"), b"k" * 32, "job")
    assert mine.get_state() is None
    state, token, ok = mine.set_state(b"round 1")
    assert (state, ok) == (b"round 1", True)
    assert mine.get_state()[0] == b"round 1"
    # the bytes in the store are MAGIC + HMAC-SHA256(key, MAGIC + run id + NUL + state) + state
    import hashlib
    import hmac
    raw = base64.b64decode(store.get("torch.rendezvous.job"))
    tag = hmac.new(b"k" * 32, b"ELRDZV1\0" + b"job\0" + b"round 1", hashlib.sha256).digest()
    assert raw == b"ELRDZV1\0" + tag + b"round 1"
    # a second writer with the same key and a stale token loses, and is given the winner's state
    other = SignedBackend(C10dRendezvousBackend(store, "job"), b"k" * 32, "job")
    assert other.set_state(b"round 2", token)[::2] == (b"round 2", True)
    assert mine.set_state(b"round 2b", token)[::2] == (b"round 2", False)
    # another key (another job on the same run id, or a forger), an unsigned pickle, a truncated tag
    for blob in (SignedBackend(None, b"x" * 32, "job")._sign(b"evil"),
                 pickle.dumps({"a": 1}),
                 raw[:20],
                 SignedBackend(None, b"k" * 32, "another-run")._sign(b"evil")):
        store.set("torch.rendezvous.job", base64.b64encode(blob).decode())
        with pytest.raises(RendezvousStateError, match="not written by this job"):
            mine.get_state()


def test_the_key_comes_from_the_secret_file_or_is_random_on_one_node(tmp_path):
    from elastor_ds.elastic.rdzv_auth import rendezvous_key
    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"s" * 32)
    os.close(fd)
    a, b = rendezvous_key(str(secret), True), rendezvous_key(str(secret), False)
    assert a == b and len(a) == 32                       # every node derives the same key from the file
    assert rendezvous_key(None, False) != rendezvous_key(None, False)   # one node: random per job
    assert rendezvous_key(None, True) is None            # many nodes, no shared secret: unsigned (warned)
