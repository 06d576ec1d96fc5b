"""Review 36 (a DeepSpeed user's findings about the checkpoint storage set-up):

- an error about the checkpoint folder (a file, under a file, a link to nothing, not creatable)
  named "checkpoint directory <path>", never the setting the user wrote: now it starts with the
  setting (``elastor.checkpoint.dir`` from DeepSpeed, ``--save``/``--load`` from Megatron-LM, the
  session API's ``checkpoint.dir``) and the value, and says what to set;
- a folder at the same path on node-local storage of each node (``/tmp/ckpt``) was accepted and the
  first save failed as another writer's interference: set-up now refuses it on every rank. Two
  nodes are two mount namespaces here, each with its own folder bind-mounted at the same path (the
  code under test sees one path, one host name, one file system);
- a fresh run (load "none") in a folder with an earlier run's higher steps: retention counted those
  as the newest ``keep`` and deleted this run's own previous step (keep 2 kept one); set-up says
  that the run starts over beside them;
- ``Layout.from_json`` took ``micro_batches`` of 10**30 (the planner's bound is 2**22 per step).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import free_port

from elastor_ds.checkpoint.settings import parse_checkpoint
from elastor_ds.errors import ConfigError, LayoutError

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


class _State:
    """The smallest TrainerState: one tensor, no optimizer."""

    def __init__(self, value: float = 1.0, step: int = 1):
        from elastor_ds.checkpoint.shards import full_shard
        self.t = torch.full((4,), float(value))
        self.it = step
        self.shards = [full_shard("w", self.t)]

    def step(self):
        return self.it

    def layout(self):
        from elastor_ds.layout import Layout
        return Layout.uniform(1, 1, 1, 1)

    def collect(self):
        from elastor_ds.checkpoint.session import Collected
        return Collected(self.shards, {})

    def shards_for(self, manifest):
        return self.shards

    def restore(self, result, same_layout):
        pass

    def snapshot_bytes(self, comm):
        return 16

    def fence_optimizer(self):
        return None


def _session(path, setting=None, **kw):
    from elastor_ds.checkpoint.session import CheckpointSession
    from elastor_ds.comm.collectives import LocalComm
    extra = {} if setting is None else {"dir_setting": setting}
    cfg = parse_checkpoint({"dir": str(path), "interval_steps": 5, "async": False, **kw})
    return CheckpointSession(_State(), cfg, comm=LocalComm(), policy_comm=LocalComm(), **extra)


# ------------------------------------------------------------------------------------------------ 1
@pytest.mark.parametrize("setting", [None, "elastor.checkpoint.dir", "--save"])
@pytest.mark.parametrize("case", ["file", "under-file", "dangling-link", "not-creatable"])
def test_a_folder_set_up_error_names_the_setting_its_value_and_the_fix(tmp_path, setting, case):
    (tmp_path / "afile").write_text("x")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    path, want = {
        "file": (tmp_path / "afile", "is a file, not a directory"),
        "under-file": (tmp_path / "afile" / "ck", f"a component of the path is a file, not a directory "
                                                  f"({tmp_path / 'afile'})"),
        "dangling-link": (tmp_path / "dangling", f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"),
        "not-creatable": (Path("/proc/elastor-review36/ck"), "cannot create it (No such file or directory in /proc)"),
    }[case]
    label = setting or "checkpoint.dir"   # the session API's own name by default
    with pytest.raises(ConfigError) as e:
        _session(path, setting)
    msg = str(e.value)
    assert msg.startswith(f"{label} {path}: the checkpoint directory {path}"), msg
    assert want in msg and f"set {label} to " in msg, msg
    assert (tmp_path / "afile").read_text() == "x" and not os.path.lexists(tmp_path / "gone")


def test_a_relative_folder_is_named_as_written_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").write_text("x")
    with pytest.raises(ConfigError, match=r"^--save ck: the checkpoint directory " + str(tmp_path / "ck") +
                       " is a file"):
        _session("ck", "--save")


def test_deepspeed_and_megatron_pass_their_setting_names(monkeypatch, tmp_path):
    """The one line at each call site: DeepSpeed's config key, Megatron-LM's flag (--save, or --load
    for the session of a --load folder)."""
    from types import SimpleNamespace

    from elastor_ds.integrations.deepspeed import runtime
    from elastor_ds.integrations.megatron import training_hooks as th
    seen = []

    class Capture:
        def __init__(self, *a, **kw):
            seen.append(kw.get("dir_setting"))
            self.policy_comm = None
    monkeypatch.setattr(runtime, "CheckpointSession", Capture)
    monkeypatch.setattr(runtime, "DeepSpeedState", lambda engine: SimpleNamespace())
    runtime.ElastorCheckpointer(object(), parse_checkpoint({"dir": str(tmp_path / "ck")}))
    monkeypatch.setattr(th, "CheckpointSession", Capture)
    monkeypatch.setattr(th, "MegatronState", lambda args, comm: SimpleNamespace())
    monkeypatch.setattr(th, "_comm", lambda args: None)
    monkeypatch.setattr(th, "memory_config", lambda args: None)
    monkeypatch.setattr(th, "_distributed", lambda: False)
    monkeypatch.setattr(th._S, "sessions", {})
    args = SimpleNamespace(save=str(tmp_path / "save"), load=str(tmp_path / "load"))
    th.session(args, args.save)
    th.session(args, args.load)
    assert seen == ["elastor.checkpoint.dir", "--save", "--load"]


# ------------------------------------------------------------------------------------------------ 2
DRIVER = r'''
import json, os, sys
import torch.distributed as dist
rank, world, port, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sys.path.insert(0, sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
from test_storage_review36 import _State
from elastor_ds.checkpoint.session import CheckpointSession
from elastor_ds.checkpoint.settings import parse_checkpoint
from elastor_ds.errors import ConfigError
try:
    s = CheckpointSession(_State(), parse_checkpoint({"dir": path, "interval_steps": 1, "async": False}),
                          dir_setting="elastor.checkpoint.dir", cross_node=False)
    s.save()
    s.finalize()
    res = {"ok": True}
except Exception as e:
    res = {"ok": False, "config": isinstance(e, ConfigError), "msg": f"{type(e).__name__}: {e}"}
with open(out, "w") as f:
    json.dump(res, f)
dist.destroy_process_group()
'''


def _can_bind_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "--bind", d, d],
                              capture_output=True, timeout=30).returncode == 0


def _two_nodes(tmp_path, own: "list[Path | None]", mount: Path, path: Path) -> list:
    """Two ranks; rank r runs with ``own[r]`` bind-mounted at ``mount`` in a mount namespace of its
    own (None: no namespace, ``mount`` as it is). Returns each rank's outcome."""
    (tmp_path / "driver.py").write_text(DRIVER)
    port = free_port()
    procs = []
    for r in range(2):
        cmd = [sys.executable, str(tmp_path / "driver.py"), str(r), "2", str(port), str(path),
               str(tmp_path / f"out{r}.json"), os.path.dirname(os.path.abspath(__file__))]
        if own[r] is not None:
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && '
                   'exec "$@"', "sh", str(own[r]), str(mount)] + cmd
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "helpers")]))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]


needs_mounts = pytest.mark.skipif(not _can_bind_mount(), reason="needs root and unshare -m (mount namespaces)")


@needs_mounts
@pytest.mark.parametrize("sub", ["", "ck"], ids=["folder-on-both", "made-by-rank-0"])
def test_a_folder_each_node_has_its_own_copy_of_is_refused_at_set_up_on_every_rank(tmp_path, sub):
    a, b, mount = tmp_path / "node_a", tmp_path / "node_b", tmp_path / "ckpt"
    for d in (a, b, mount):
        d.mkdir()
    path = mount / sub if sub else mount
    got = _two_nodes(tmp_path, [a, b], mount, path)
    seen = "does not exist on this rank's node" if sub else "exists on this rank's node, but without the file"
    for res in got:
        assert not res["ok"] and res["config"], got
        assert f"failed on 1 of 2 ranks: rank 1: ConfigError: elastor.checkpoint.dir {path}: the folder {path} " \
               f"{seen}" in res["msg"], res["msg"]
        assert "storage every node shares" in res["msg"], res["msg"]
    # nothing left behind: rank 0's folder (made by its set-up), its probe, rank 1's mkdir
    assert os.listdir(a) == [] and os.listdir(b) == [] and os.listdir(mount) == []


@needs_mounts
def test_the_same_folder_seen_through_a_mount_on_each_node_is_accepted(tmp_path):
    """The control: both namespaces bind the same folder (shared storage), set-up passes, a save
    commits, no probe is left."""
    shared, mount = tmp_path / "shared", tmp_path / "ckpt"
    shared.mkdir()
    mount.mkdir()
    got = _two_nodes(tmp_path, [shared, shared], mount, mount / "ck")
    assert all(r["ok"] for r in got), got
    assert sorted(os.listdir(shared / "ck")) == ["latest", "step_000000001"]


# ------------------------------------------------------------------------------------------------ 4
def test_a_fresh_run_in_a_used_folder_keeps_its_own_steps_and_is_told(tmp_path, caplog):
    from elastor_ds.checkpoint import commit as commit_mod
    old = _session(tmp_path, keep=2)
    for s in (100, 200):
        old.state.it = s
        old.save()
    old.finalize()
    caplog.set_level(logging.WARNING)
    new = _session(tmp_path, "elastor.checkpoint.dir", keep=2, load="none")
    said = [r.getMessage() for r in caplog.records if "starts over" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"elastor.checkpoint.dir {tmp_path} holds committed steps of an "
                                                  f"earlier run (100, 200)"), said
    assert new.load() is None
    for s, v in ((5, 5.0), (10, 10.0)):
        new.state.it = s
        new.state.t.fill_(v)
        new.save()
    new.finalize()
    # keep 2: this run's two newest (5 was deleted: the old run's 100 and 200 counted as the newest two)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000000005", "step_000000010", "step_000000100",
                                            "step_000000200"]
    assert commit_mod.read_latest(str(tmp_path)) == str(tmp_path / "step_000000010")
    resumed = _session(tmp_path, keep=2)
    resumed.state.t.zero_()
    assert resumed.load().step == 10 and torch.equal(resumed.state.t, torch.full((4,), 10.0))
    resumed.finalize()


# ------------------------------------------------------------------------------------------------ 3
def _plan(mbs):
    return {"replicas": [{"micro_batches": m, "stages": [{"tp": 1, "layers": [0, 2]}]} for m in mbs]}


def test_plan_micro_batches_are_bounded_as_the_planner_bounds_them():
    from elastor_ds.layout import Layout
    from elastor_ds.layout.compact_plan import MAX_MICRO_BATCHES
    from elastor_ds.plan.cli import MAX_MICRO_BATCHES as PLANNER
    assert MAX_MICRO_BATCHES == PLANNER == 1 << 22
    assert Layout.from_json(_plan([1 << 22])).replicas[0].micro_batches == 1 << 22
    with pytest.raises(LayoutError, match=r"^plan document: replicas\[0\]\.micro_batches must be at most 4,194,304, "
                                          r"got 1,000,000,000,000,000,000,000,000,000,000"):
        Layout.from_json(_plan([10 ** 30]))
    with pytest.raises(LayoutError, match=r"replicas\[1\]\.micro_batches 2,097,153 brings the plan to 4,194,305 "
                                          r"micro-batches per optimizer step"):
        Layout.from_json(_plan([1 << 21, (1 << 21) + 1]))
    compact = {"version": 2, "num_layers": 2, "nodes": [["n0", 1]],
               "replica_groups": [{"count": 1, "micro_batches": 1 << 23, "stages": [{"tp": 1, "layers": 2}]}]}
    with pytest.raises(LayoutError, match=r"micro_batches=8388608: must be in \[1, 4194304\]"):
        Layout.from_json(compact)
