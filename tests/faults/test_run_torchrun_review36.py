"""``elastor run`` given a command copied from torchrun (review 36): torchrun's flags that have no
counterpart are refused with one line naming the flag and what to do (exit 2, nothing started);
before, they exited 2 with a bare "unrecognized arguments", and --redirects/--tee/--run-path/
--start-method, which have the same meaning here, were refused too. The controller in a
subprocess, as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def elastor_run(tmp_path, source: str, flags: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(source)
    cmd = [sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--monitor-interval", "0.05",
           "--log-dir", str(tmp_path / "logs"), *flags, str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path), env=ENV)


@pytest.mark.parametrize("flags, says", [
    (["--node-rank", "0"], "--node-rank 0: a torchrun flag elastor run does not take: elastor run ranks the nodes"),
    (["--node_rank", "1"], "--node-rank 1: a torchrun flag"),
    (["--master-addr", "127.0.0.1"], "--master-addr 127.0.0.1: a torchrun flag elastor run does not take: torchrun's "
                                     "static rendezvous is not supported; drop it and give --rdzv-endpoint HOST:PORT"),
    (["--master_port", "29500"], "--master-port 29500: a torchrun flag"),
    (["--role", "trainer"], "--role trainer: a torchrun flag elastor run does not take: elastor run runs one worker "
                            "role, 'default'"),
    (["-m"], "-m/--module: a torchrun flag elastor run does not take: elastor run takes the script's path"),
    (["--module"], "-m/--module: a torchrun flag"),
    (["--no-python"], "--no-python: a torchrun flag elastor run does not take: elastor run starts the script with "
                      "Python"),
    (["--no_python"], "--no-python: a torchrun flag"),
    (["--local-ranks-filter", "0"], "--local-ranks-filter 0: a torchrun flag elastor run does not take"),
    (["--logs-specs", "x"], "--logs-specs x: a torchrun flag"),
    (["--redirects", "1"], "--redirects 1: elastor run takes 0 or 3"),
    (["-t", "0:3,1:0"], "--tee 0:3,1:0: elastor run takes 0 or 3"),
    # torch reads these as whole seconds: 0.5 became 0 and the rendezvous never completed (a hang)
    (["--rdzv-conf", "keep_alive_interval=0.5"],
     "--rdzv-conf keep_alive_interval=0.5: torch's rendezvous takes whole seconds (at least 1); give e.g. "
     "keep_alive_interval=1"),
    (["--rdzv-conf", "join_timeout=10.5"], "--rdzv-conf join_timeout=10.5: torch's rendezvous takes whole seconds"),
    (["--rdzv-conf", "use_libuv=0"], "--rdzv-conf use_libuv=0: has no effect"),
    (["--rdzv-conf", "heartbeat=5"], "--rdzv-conf heartbeat=5: has no effect (torch's key is heartbeat_timeout)"),
    # torch's c10d and etcd-v2 handlers never read "timeout" (only etcd v1's does)
    (["--rdzv-conf", "join_timeout=60,timeout=30"], "--rdzv-conf timeout=30: only --rdzv-backend etcd reads it"),
])
def test_a_torchrun_flag_without_a_counterpart_is_one_line_naming_it(tmp_path, flags, says):
    marker = tmp_path / "ran"
    p = elastor_run(tmp_path, f"open({str(marker)!r}, 'w').close()\n", flags, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastor run: error: ") and says in lines[0], p.stderr[-2000:]
    assert "unrecognized" not in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists() and not (tmp_path / "logs").exists()   # nothing started, no folder made


HELLO = "import os\nprint('hello-from-rank', os.environ['RANK'], flush=True)\n"


def _console_and_logs(tmp_path, flags):
    p = elastor_run(tmp_path, HELLO, ["--nproc-per-node", "2", *flags])
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    console = (p.stdout + p.stderr).count("hello-from-rank")
    logged = 0
    for folder, _dirs, files in os.walk(tmp_path / "logs"):
        for f in files:
            if f == "stdout.log":
                logged += open(os.path.join(folder, f)).read().count("hello-from-rank")
    return console, logged


@pytest.mark.parametrize("flags, on_console", [
    ([], 2),                                   # elastor run's default: console and --log-dir
    (["--tee", "3"], 2),
    (["-r", "3", "-t", "3"], 2),
    (["--redirects", "0"], 2),
    (["--redirects", "3"], 0),                 # torchrun: the workers' output in the log files only
    (["-r", "3", "--start-method", "spawn", "--run-path"], 0),
])
def test_redirects_and_tee_mean_what_they_mean_in_torchrun(tmp_path, flags, on_console):
    console, logged = _console_and_logs(tmp_path, flags)
    assert (console, logged) == (on_console, 2)


@pytest.mark.parametrize("value", ["auto", "cpu"])
def test_nproc_per_node_auto_without_a_gpu_is_one_worker_per_cpu_as_torchrun(tmp_path, value):
    """torchrun's ``--nproc-per-node auto`` without an accelerator, and ``cpu``, start one worker per
    CPU of the launcher's affinity; elastor run started one for ``auto`` and refused ``cpu``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    script = tmp_path / "train.py"
    script.write_text(f"import os\nopen(os.path.join({str(tmp_path)!r}, 'w' + os.environ['RANK']), 'w')"
                      ".write(os.environ['WORLD_SIZE'])\n")
    p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", "--no-standby", "--nproc-per-node", value,
                        "--log-dir", str(tmp_path / "logs"), str(script)], capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path), env=ENV,
                       preexec_fn=lambda: os.sched_setaffinity(0, cpus[:2]))   # two CPUs: two workers
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    written = sorted(f.name for f in tmp_path.iterdir() if f.name.startswith("w"))
    assert written == ["w0", "w1"] and (tmp_path / "w0").read_text() == "2", (written, p.stderr[-2000:])


def test_a_linked_script_imports_the_modules_beside_its_real_file_as_python_does(tmp_path):
    """``python link/train.py`` and torchrun put the folder of the real file first on ``sys.path``;
    elastor run's workers put the link's folder there, and the trainer's own imports failed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "real" / "helper_review36.py").write_text("VALUE = 'beside the real file'\n")
    (tmp_path / "real" / "train.py").write_text(
        f"import helper_review36, sys\nopen({str(tmp_path / 'out')!r}, 'w').write(helper_review36.VALUE)\n")
    os.symlink(os.path.join("..", "real", "train.py"), tmp_path / "run" / "train.py")
    oracle = subprocess.run([sys.executable, str(tmp_path / "run" / "train.py")], env=ENV, capture_output=True,
                            text=True, timeout=60)   # what Python itself does with the link
    assert oracle.returncode == 0, oracle.stderr
    os.remove(tmp_path / "out")
    for standby in ("--no-standby", "--standby"):
        p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", standby, "--max-restarts", "0",
                            "--log-dir", str(tmp_path / "logs"), str(tmp_path / "run" / "train.py")],
                           capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=ENV)
        assert p.returncode == 0, (standby, p.returncode, p.stderr[-3000:])
        assert (tmp_path / "out").read_text() == "beside the real file"
        os.remove(tmp_path / "out")


RAISES = """
def inner():
    try:
        {}['missing']
    except KeyError as e:
        raise ValueError('boom in the trainer') from e

inner()
"""


def test_a_worker_exception_prints_the_traceback_python_prints(tmp_path):
    """A trainer's exception: the worker's stderr holds the traceback ``python SCRIPT`` prints (the
    chained one included), without the launcher's runpy and worker_main frames above the script."""
    script = tmp_path / "train.py"
    script.write_text(RAISES)
    oracle = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=60)
    assert oracle.returncode == 1 and "ValueError: boom in the trainer" in oracle.stderr
    for standby in ("--no-standby", "--standby"):
        logs = tmp_path / f"logs{standby}"
        p = subprocess.run([sys.executable, "-m", "elastor_ds.cli", "run", standby, "--max-restarts", "0",
                            "--log-dir", str(logs), str(script)],
                           capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=ENV)
        assert p.returncode == 1, (standby, p.returncode, p.stderr[-3000:])
        stderr = [os.path.join(d, f) for d, _, fs in os.walk(logs) for f in fs if f == "stderr.log"]
        assert len(stderr) == 1, stderr
        text = open(stderr[0]).read()
        assert text.endswith(oracle.stderr), (standby, text[-3000:], oracle.stderr)
        assert "runpy" not in text and "worker_main" not in text, text[-3000:]


def test_rdzv_conf_takes_torchs_heartbeat_timeout_in_whole_seconds(tmp_path):
    """torch's dynamic rendezvous reads ``heartbeat_timeout`` (elastor run refused it as unknown and
    took ``heartbeat``, which nothing reads) and every time as an integer."""
    from elastor_ds.elastic.rdzv_args import parse_rdzv_conf
    conf = parse_rdzv_conf("heartbeat_timeout=30,join_timeout=60.0,last_call_timeout=0,read_timeout=7")
    assert conf == {"heartbeat_timeout": 30, "join_timeout": 60, "last_call_timeout": 0, "read_timeout": 7}
    assert all(type(v) is int for v in conf.values())
    p = elastor_run(tmp_path, HELLO, ["--rdzv-conf", "heartbeat_timeout=30,join_timeout=60"])
    assert p.returncode == 0 and "hello-from-rank 0" in p.stdout + p.stderr, (p.returncode, p.stderr[-3000:])


ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
DUMP = """
import json, os, sys
keys = {keys!r}
with open(os.path.join({out!r}, os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{"env": {{k: os.environ.get(k) for k in keys}}, "argv": sys.argv[1:], "name": __name__,
               "run_id_is_set": bool(os.environ.get("TORCHELASTIC_RUN_ID")),
               "master_port": os.environ.get("MASTER_PORT", "").isdigit()}}, f, sort_keys=True)
"""


def test_the_workers_environment_is_torchruns(tmp_path):
    """The same trainer under torchrun (torch.distributed.run) and elastor run, three processes, one
    node: the same torchrun variables (ports and run ids aside), the same arguments, OMP_NUM_THREADS=1
    set and said by both."""
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    dumps = {}
    for who in ("torchrun", "elastor"):
        out = tmp_path / who
        out.mkdir()
        script = tmp_path / f"dump_{who}.py"
        script.write_text(DUMP.format(keys=ENV_KEYS, out=str(out)))
        launcher = ([sys.executable, "-m", "torch.distributed.run"] if who == "torchrun" else
                    [sys.executable, "-m", "elastor_ds.cli", "run", "--log-dir", str(tmp_path / "logs")])
        p = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "3", "--max-restarts", "2", str(script),
                            "--max-restarts", "9", "-x"], capture_output=True, text=True, timeout=180,
                           cwd=str(tmp_path), env=env)
        assert p.returncode == 0, (who, p.returncode, p.stderr[-3000:])
        assert "OMP_NUM_THREADS" in p.stderr, (who, p.stderr[-3000:])
        dumps[who] = {f.name: json.loads(f.read_text()) for f in out.iterdir()}
    assert sorted(dumps["torchrun"]) == ["0.json", "1.json", "2.json"]
    assert dumps["elastor"] == dumps["torchrun"]
