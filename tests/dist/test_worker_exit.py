"""A failed worker exits with its own code, without the interpreter's teardown.

Found between network-namespace nodes (tests/netns, whole node lost): a survivor's worker raised
gloo's "Connection closed by peer", then aborted in the teardown ("terminate called without an
active exception": a C++ thread still joinable at exit), so it died of SIGABRT. The controller reads
a signal death as the worker's own device failing, and shrink dropped a healthy device: the job
resumed at world 1 instead of 2. Here the teardown that aborts is an atexit handler."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import atexit, os, signal, sys
atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))   # a teardown that aborts
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("Connection closed by peer")
if how == "exit3":
    sys.exit(3)
print("done")
"""


@pytest.mark.parametrize("how, code", [("raise", 1), ("exit3", 3)])
def test_a_failed_worker_exits_with_its_code_not_an_abort(tmp_path, how, code):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, "-m", "elastor_ds.elastic.worker_main", str(script), how],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    if how == "raise":   # the traceback is still reported (the controller shows its last error line)
        assert "RuntimeError: Connection closed by peer" in p.stderr


def test_a_worker_that_finishes_runs_the_normal_teardown(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, "-m", "elastor_ds.elastic.worker_main", str(script), "finish"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.stdout.strip() == "done" and p.returncode == -signal.SIGABRT   # atexit ran: teardown kept


FINISHING = """
import sys
import torch   # a real teardown (hundreds of ms)
from elastor_ds.elastic.protocol import expect_worker_hooks
expect_worker_hooks()   # a trainer with elastor's hooks: a stop signal is a request, read each iteration
open(sys.argv[1], "w").close()   # its last iteration and final save are done; the script ends with 0
"""


def test_a_stop_signal_during_the_teardown_of_a_finished_worker_is_not_its_death(tmp_path):
    """QA round 6, Q6-9: a preemption's SIGTERM that reached a Megatron-LM rank after its final save,
    while the interpreter tore down (which resets Python's handlers to the default), ended the rank
    as killed by SIGTERM, and ``elastor run`` said the job stopped without a checkpoint. Here SIGTERM
    is sent every millisecond from the script's end until the process is gone: the code before died
    of it in 5 of 5 tries (after 17-38 signals)."""
    import time
    script = tmp_path / "train.py"
    script.write_text(FINISHING)
    for i in range(2):
        marker = tmp_path / f"done{i}"
        p = subprocess.Popen([sys.executable, "-m", "elastor_ds.elastic.worker_main", str(script), str(marker)],
                             env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE)
        t_end = time.time() + 120
        while not marker.exists() and p.poll() is None and time.time() < t_end:
            time.sleep(0.001)
        assert marker.exists(), p.stderr.read()[-2000:] if p.poll() is not None else "no marker in 120 s"
        sent = 0
        while p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
                sent += 1
            except ProcessLookupError:
                break
            time.sleep(0.001)
        assert p.wait(timeout=60) == 0, (p.returncode, sent, p.stderr.read()[-2000:])
        assert sent > 0
        p.stderr.close()


@pytest.mark.parametrize("err, code", [("CorruptCheckpointError", 1), ("IncompleteCheckpointError", 1),
                                       ("ConfigError", 2)])
def test_a_checkpoint_the_user_must_replace_is_one_line_not_a_traceback(tmp_path, err, code):
    """A corrupt newest checkpoint under --no-elastor-fallback (a trainer under elastor run) printed a
    traceback through the trainer's frames; its message already names the file and the fix. One line
    now (control characters escaped), the exit code unchanged: 1 (a failure), 2 for a ConfigError."""
    script = tmp_path / "train.py"
    script.write_text(f"from elastor_ds.errors import {err}\n"
                      f"raise {err}('ck/step_3/data_00001.safetensors: block 2 fails its CRC\\x1b[2J\\nuse an older step')\n")
    p = subprocess.run([sys.executable, "-m", "elastor_ds.elastic.worker_main", str(script)],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and len(lines) == 1 and lines[0].startswith(f"elastor worker: {err}: ck/step_3"), \
        p.stderr[-2000:]
    assert "\x1b" not in p.stderr and "use an older step" in lines[0]
