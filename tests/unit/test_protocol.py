"""elastic/protocol.py owns every ``ELASTOR_*`` name, and a worker's launch context is parsed and
checked in one place.

* no module of the package other than elastic/protocol.py spells an ``ELASTOR_*`` name (a string
  literal, or a keyword argument such as ``dict(env, ELASTOR_X=...)``): a new variable must be a
  constant there, with who sets it and who reads it;
* protocol.py's list of names (``ENV_NAMES``) is complete (docs/elastic.md documents that list:
  tests/unit/test_docs.py);
* ``LaunchContext.from_env`` on hand-written environments: a full one, an empty one (the defaults),
  bad values (a ConfigError naming the variable and the value);
* the readers of the package (snapshot tier, peer sources, peer copies, the job key, the worker
  hooks) see the environment through the context, including after it changes.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

from elastor_ds.elastic import protocol
from elastor_ds.elastic.protocol import LaunchContext, LaunchedWorld, LaunchMode, launch_context
from elastor_ds.errors import ConfigError

pytestmark = pytest.mark.unit

PKG = pathlib.Path(__file__).resolve().parents[2] / "elastor_ds"
PROTOCOL = PKG / "elastic" / "protocol.py"


# ------------------------------------------------------------------ one owner of the names
def elastor_names_in(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal starting with ``ELASTOR_`` and every keyword argument
    named ``ELASTOR_*`` in ``source`` (f-string pieces included; prose that mentions a name in the
    middle of a docstring is not a literal that starts with it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ELASTOR_"):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("ELASTOR_"):
            found.append((node.value.lineno, f"{node.arg}="))
    return found


def test_the_finder_sees_literals_keywords_and_fstrings_not_prose():
    src = ('"""Reads ``ELASTOR_X`` (prose)."""\n'
           'import os\n'
           'A = os.environ.get("ELASTOR_A")\n'
           'B = dict(os.environ, ELASTOR_B="1")\n'
           'C = f"ELASTOR_C_{A}"\n'
           'D = "not ELASTOR_D"\n')
    assert sorted(elastor_names_in(src)) == [(3, "ELASTOR_A"), (4, "ELASTOR_B="), (5, "ELASTOR_C_")]


def test_no_module_but_protocol_spells_an_elastor_name():
    bad = []
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 50 and PROTOCOL in files
    for f in files:
        if f == PROTOCOL:
            continue
        for line, text in elastor_names_in(f.read_text(encoding="utf-8")):
            bad.append(f"{f.relative_to(PKG.parent)}:{line}: {text!r}")
    assert not bad, ("ELASTOR_* names outside elastor_ds/elastic/protocol.py (add a constant there, with "
                     "who sets it and who reads it, and import it):\n" + "\n".join(bad))


def test_protocol_lists_every_name_it_defines_once_each_with_who_sets_and_reads_it():
    src = PROTOCOL.read_text(encoding="utf-8")
    literals = {text for _, text in elastor_names_in(src)}
    constants = {k: v for k, v in vars(protocol).items() if k.startswith("ENV_") and isinstance(v, str)}
    assert len(set(constants.values())) == len(constants)   # no name under two constants
    assert set(constants.values()) == set(protocol.ENV_NAMES) == literals
    assert set(protocol.WORKER_ENV) <= set(protocol.ENV_NAMES)
    assert {"ELASTOR_SNAPSHOT_DIR", "ELASTOR_JOB_SECRET_FILE", "ELASTOR_PROCS_PER_NODE", "ELASTOR_ROUND",
            "ELASTOR_COLLECTIVE_TIMEOUT_S", "ELASTOR_STANDBY_READY_FD", "ELASTOR_PYTHON"} <= literals
    # each definition line carries its comment: who sets it -> who reads it
    defs = [line for line in src.splitlines() if re.match(r"^ENV_\w+ = \"ELASTOR_", line)]
    assert len(defs) == len(constants)
    assert [d for d in defs if not re.search(r"#.*->", d)] == []


# ------------------------------------------------------------------ LaunchContext.from_env
FULL = {
    "ELASTOR_ROUND": "3",
    "ELASTOR_PROCS_PER_NODE": "2,1",
    "ELASTOR_INITIAL_WORLD_SIZE": "4",
    "ELASTOR_DEVICES": "0,2",
    "ELASTOR_GPU_MEMORY_GB": "80",
    "ELASTOR_COLLECTIVE_TIMEOUT_S": "600",
    "ELASTOR_HEARTBEAT_DIR": "/logs/heartbeat/round3",
    "ELASTOR_EVENTS_FILE": "/logs/events.jsonl",
    "ELASTOR_SNAPSHOT_DIR": "/dev/shm/elastor-job",
    "ELASTOR_SNAPSHOT_PEERS": "10.0.0.1:4001,10.0.0.2:4002",
    "ELASTOR_SNAPSHOT_SELF": "10.0.0.2:4002",
    "ELASTOR_SNAPSHOT_SERVER_HOST": "10.0.0.2",
    "ELASTOR_JOB_SECRET_FILE": "/home/me/.job-secret",
    "ELASTOR_STANDBY_DIR": "/logs/standby",
    "ELASTOR_LAUNCH_MODE": "standby-warm",
    "ELASTOR_T_PROCESS_START": "1700000000.5",
    "ELASTOR_T_STANDBY_SPAWN": "1699999990.25",
    "ELASTOR_T_STANDBY_READY": "1699999995",
    "RANK": "1", "WORLD_SIZE": "3",   # torchrun's: not the context's
}


def test_a_full_environment():
    ctx = LaunchContext.from_env(FULL)
    assert ctx == LaunchContext(
        round=3, procs_per_node=(2, 1), initial_world_size=4, devices=(0, 2), gpu_memory_gb=80.0,
        collective_timeout_s=600.0, heartbeat_dir="/logs/heartbeat/round3", events_file="/logs/events.jsonl",
        snapshot_dir="/dev/shm/elastor-job", snapshot_peers=("10.0.0.1:4001", "10.0.0.2:4002"),
        snapshot_self="10.0.0.2:4002", snapshot_server_host="10.0.0.2", job_secret_file="/home/me/.job-secret",
        standby_dir="/logs/standby", launch_mode=LaunchMode.WARM, t_process_start=1700000000.5,
        t_standby_spawn=1699999990.25, t_standby_ready=1699999995.0)
    assert ctx.under_elastor_run
    assert ctx.launched_world == LaunchedWorld((2, 1), 80.0, 4) and ctx.launched_world.world_size == 3
    assert ctx.start_marks() == {"t_process_start": 1700000000.5, "t_standby_spawn": 1699999990.25,
                                 "t_standby_ready": 1699999995.0}
    with pytest.raises(AttributeError):   # frozen
        ctx.round = 4


def test_an_empty_environment_gives_the_defaults():
    ctx = LaunchContext.from_env({})
    assert (ctx.round, ctx.procs_per_node, ctx.initial_world_size, ctx.devices) == (0, None, None, None)
    assert (ctx.gpu_memory_gb, ctx.collective_timeout_s, ctx.heartbeat_dir, ctx.events_file) == (None,) * 4
    assert (ctx.snapshot_dir, ctx.snapshot_peers, ctx.snapshot_self, ctx.job_secret_file) == (None, (), None, None)
    assert (ctx.snapshot_server_host, ctx.standby_dir) == (None, None)
    assert ctx.launch_mode is LaunchMode.SPAWN and ctx.start_marks() == {}
    assert not ctx.under_elastor_run and ctx.launched_world is None
    # an empty value is an unset one (the controller exports "" for a node without a snapshot server)
    assert LaunchContext.from_env({n: "" for n in protocol.WORKER_ENV}) == ctx
    assert LaunchContext.from_env({"ELASTOR_SNAPSHOT_SELF": "", "ELASTOR_ROUND": " 0 "}) == ctx


def test_only_an_events_file_is_enough_to_be_watched():
    assert LaunchContext.from_env({"ELASTOR_EVENTS_FILE": "/e.jsonl"}).under_elastor_run
    assert LaunchContext.from_env({"ELASTOR_HEARTBEAT_DIR": "/hb"}).under_elastor_run
    assert not LaunchContext.from_env({"ELASTOR_SNAPSHOT_DIR": "/dev/shm/x"}).under_elastor_run


@pytest.mark.parametrize("name,value", [
    ("ELASTOR_ROUND", "x"),
    ("ELASTOR_ROUND", "1.5"),
    ("ELASTOR_ROUND", "-1"),
    ("ELASTOR_PROCS_PER_NODE", "-2"),
    ("ELASTOR_PROCS_PER_NODE", "2,0"),
    ("ELASTOR_PROCS_PER_NODE", "2,x"),
    ("ELASTOR_PROCS_PER_NODE", "2,,1"),
    ("ELASTOR_INITIAL_WORLD_SIZE", "0"),
    ("ELASTOR_INITIAL_WORLD_SIZE", "four"),
    ("ELASTOR_DEVICES", "0,-1"),
    ("ELASTOR_DEVICES", "cuda:0"),
    ("ELASTOR_GPU_MEMORY_GB", "-40"),
    ("ELASTOR_GPU_MEMORY_GB", "80GB"),
    ("ELASTOR_COLLECTIVE_TIMEOUT_S", "0"),
    ("ELASTOR_COLLECTIVE_TIMEOUT_S", "nan"),
    ("ELASTOR_COLLECTIVE_TIMEOUT_S", "inf"),
    ("ELASTOR_SNAPSHOT_PEERS", "10.0.0.1"),
    ("ELASTOR_SNAPSHOT_PEERS", "10.0.0.1:4001,10.0.0.2:99999"),
    ("ELASTOR_SNAPSHOT_PEERS", ":4001"),
    ("ELASTOR_LAUNCH_MODE", "warm"),
    ("ELASTOR_T_PROCESS_START", "yesterday"),
    ("ELASTOR_T_STANDBY_READY", "-5"),
])
def test_a_bad_value_is_a_config_error_naming_the_variable_and_the_value(name, value):
    env = dict(FULL, **{name: value})
    with pytest.raises(ConfigError) as e:
        LaunchContext.from_env(env)
    msg = str(e.value)
    assert name in msg and repr(value) in msg, msg
    assert "expected" in msg   # and what it should be
    with pytest.raises(ConfigError, match=name):   # alone, too
        LaunchContext.from_env({name: value})


def test_a_bad_launch_mode_lists_the_good_ones():
    with pytest.raises(ConfigError, match="spawn, standby-warm, standby-cold"):
        LaunchContext.from_env({"ELASTOR_LAUNCH_MODE": "hot"})


# ------------------------------------------------------------------ the process's context
def _clear(monkeypatch):
    for n in protocol.WORKER_ENV:
        monkeypatch.delenv(n, raising=False)


def test_launch_context_is_parsed_once_and_again_only_when_a_variable_changes(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("ELASTOR_ROUND", "2")
    first = launch_context()
    assert first.round == 2 and launch_context() is first
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    assert launch_context() is first
    monkeypatch.setenv("ELASTOR_ROUND", "5")
    assert launch_context().round == 5
    monkeypatch.setenv("ELASTOR_ROUND", "five")
    with pytest.raises(ConfigError, match=r"ELASTOR_ROUND='five'"):
        launch_context()
    monkeypatch.delenv("ELASTOR_ROUND")
    assert launch_context() == LaunchContext()


def test_the_older_accessors_read_the_context():
    assert protocol.launched_world({"ELASTOR_PROCS_PER_NODE": "1,3"}) == LaunchedWorld((1, 3))
    assert protocol.collective_timeout_s({"ELASTOR_COLLECTIVE_TIMEOUT_S": "12.5"}) == 12.5
    assert protocol.procs_per_node({"WORLD_SIZE": "4", "ELASTOR_PROCS_PER_NODE": "1,3"}) == [1, 3]
    with pytest.raises(ConfigError, match="ELASTOR_PROCS_PER_NODE"):
        protocol.procs_per_node({"WORLD_SIZE": "4", "ELASTOR_PROCS_PER_NODE": "1,three"})


def test_the_package_readers_see_the_environment_through_the_context(monkeypatch, tmp_path):
    from elastor_ds.checkpoint.auth import job_key
    from elastor_ds.checkpoint.settings import MemorySnapshotConfig
    from elastor_ds.checkpoint.snapshot import peer, peer_sources, tier
    from elastor_ds.elastic.worker import ElasticWorker

    _clear(monkeypatch)
    assert ElasticWorker.from_env() is None and job_key() is None
    assert peer.procs_per_node(3) == [3]
    with pytest.raises(ConfigError, match="ELASTOR_SNAPSHOT_DIR"):
        tier.node_dir(MemorySnapshotConfig())

    snap = tmp_path / "node"
    monkeypatch.setenv("ELASTOR_SNAPSHOT_DIR", str(snap))
    monkeypatch.setenv("ELASTOR_PROCS_PER_NODE", "2,1")
    monkeypatch.setenv("ELASTOR_SNAPSHOT_PEERS", "10.0.0.1:4001,10.0.0.2:4002")
    monkeypatch.setenv("ELASTOR_SNAPSHOT_SELF", "10.0.0.1:4001")
    monkeypatch.setenv("ELASTOR_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTOR_ROUND", "1")
    monkeypatch.setenv("ELASTOR_T_PROCESS_START", "100.5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert tier.node_dir(MemorySnapshotConfig()) == str(snap)
    assert tier.node_dir(MemorySnapshotConfig(dir=str(tmp_path / "mine"))) == str(tmp_path / "mine")
    assert peer.procs_per_node(3) == [2, 1]
    assert peer.procs_per_node(4) == [4]       # not this world's list: one node (logged)
    key = b"k" * 32
    sources = peer_sources.node_sources("step_000000007", key=key)
    assert [s.name for s in sources][1:] == ["remote:10.0.0.2:4002"]   # own server left out
    w = ElasticWorker.from_env()
    assert w is not None and w.round == 1 and w.marks == {"t_process_start": 100.5}
    assert w.world == LaunchedWorld((2, 1)) and w.launch_mode == "spawn"
    assert w.heartbeat_file == os.path.join(str(tmp_path), "heartbeat_1")

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    monkeypatch.setenv("ELASTOR_JOB_SECRET_FILE", str(secret))
    assert len(job_key()) == 32 and job_key({}) is None
    monkeypatch.setenv("ELASTOR_PROCS_PER_NODE", "2,zero")
    with pytest.raises(ConfigError, match=r"ELASTOR_PROCS_PER_NODE='2,zero'"):
        peer.procs_per_node(3)
