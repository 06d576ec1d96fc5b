"""What ``elastor run`` reads that others write: a liveness counter in the store (anyone who reaches
the store writes there) and a failed worker's stderr (the worker's own text).

Before: one non-integer value under a peer's liveness key raised ``ValueError`` in every node's
liveness read, which the controller took for a lost store (every node killed its workers and left
the job); a failed worker's last error line went raw into the stop reason and the terminal
(escape sequences ran), read from the whole stderr log at once."""
from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


def test_a_forged_liveness_value_is_no_beat_not_a_lost_store(caplog):
    import torch.distributed as dist

    from elastor_ds.elastic.liveness import KEY, PeerBook, read_peers

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    store.add(KEY.format(0), 1)
    store.set(KEY.format(1), "\x1b]0;owned\x07 not a number")
    book = PeerBook(timeout=2.0)
    with caplog.at_level(logging.WARNING, logger="elastor.run"):
        assert read_peers(store, book, [0, 1], now=0.0) == []
        store.add(KEY.format(0), 1)   # node 0 beats on; node 1's key stays forged
        assert read_peers(store, book, [0, 1], now=1.5) == []
        # node 1 made no beat for longer than the timeout: lost, as a silent node is
        assert read_peers(store, book, [0, 1], now=2.5) == [1]
    warned = [r.getMessage() for r in caplog.records if "not a beat counter" in r.getMessage()]
    assert len(warned) == 1 and "\x1b" not in warned[0] and KEY.format(1) in warned[0], warned
    # a real counter after the forged value is a beat again
    store.set(KEY.format(1), "7")
    assert read_peers(store, book, [0, 1], now=3.0) == [] and book.seen[1] == (7, 3.0)


WORKER = r"""
import sys
sys.stderr.write("x" * 2_000_000 + "\n")              # a chatty worker: megabytes before its error
sys.stderr.write("\x1b]0;owned\x07\x1b[2Jerror: the real failure\n")
sys.stderr.flush()
sys.exit(2)                                          # a usage error: its line is the reason
"""


def test_a_failed_workers_error_line_is_shown_escaped(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--standalone",
                        "--nproc-per-node", "1", "--max-restarts", "0", "--events", str(tmp_path / "ev.jsonl"),
                        str(script)], capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=ENV)
    assert p.returncode == 1, p.stderr[-3000:]
    final = [ln for ln in p.stderr.splitlines() if ln.startswith("elastor run:")]
    assert final and "error: the real failure" in final[-1], p.stderr[-3000:]
    # the escapes are shown as text in controller lines (the worker's own tee'd output is its own)
    ours = [ln for ln in p.stderr.splitlines() if "the real failure" in ln and not ln.startswith("[default")]
    assert ours and all("\x1b" not in ln and "\\x1b]0;owned\\x07" in ln for ln in ours), ours
