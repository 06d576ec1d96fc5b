"""The pure core stays pure: layout and plan code imports neither torch.distributed, deepspeed nor
megatron (nor torch at all); checkpoint planning modules (checkpoint/planning/) import no torch,
neither directly (AST check) nor indirectly (each imported in a fresh interpreter). Only comm/,
integrations/, testing/ and the listed elastic modules import torch.distributed; no floor imports one
above it, and comm/ loads nothing of checkpoint/, runtime/ or integrations/, even indirectly."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PKG = pathlib.Path(__file__).resolve().parents[2] / "elastor_ds"
FORBIDDEN_EVERYWHERE_PURE = ("torch", "deepspeed", "megatron")
PURE_FILES = sorted(PKG.glob("layout/*.py")) + sorted(PKG.glob("plan/*.py")) + sorted(PKG.glob("data/*.py")) + sorted(
    p for p in PKG.glob("runtime/*.py") if p.name != "hetero_comm.py") + [
    *sorted(PKG.glob("checkpoint/planning/*.py")), PKG / "checkpoint" / "commit.py", PKG / "errors.py",
    PKG / "checkpoint" / "settings.py", PKG / "checkpoint" / "snapshot" / "peer_plan.py",
    # the elastic controller's decision logic and records
    PKG / "elastic" / "protocol.py", PKG / "elastic" / "policy.py", PKG / "elastic" / "events.py"]
# files allowed to use torch for measurement, but never torch.distributed / deepspeed / megatron
TORCH_OK = {PKG / "plan" / "profile.py"}


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_pure_modules_import_no_framework():
    bad = []
    for f in PURE_FILES:
        for mod in imports(f):
            top = mod.split(".")[0]
            if f in TORCH_OK:
                if mod.startswith("torch.distributed") or top in ("deepspeed", "megatron"):
                    bad.append(f"{f.relative_to(PKG)} imports {mod}")
            elif top in FORBIDDEN_EVERYWHERE_PURE:
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, bad
    assert len(PURE_FILES) >= 8


def test_only_comm_and_integrations_touch_distributed():
    bad = []
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).as_posix()
        # elastic/: the controller is built on torch.distributed.elastic (agent.py) and the workers'
        # stop agreement is one all-reduce (worker.py); standby.py plugs standby workers into its
        # agent's process start; store_main.py hosts the c10d rendezvous store (a TCPStore); etcd_rdzv.py
        # builds torch elastic's etcd-v2 rendezvous handler over every etcd member; rdzv_auth.py wraps its
    # rendezvous backends (the state signed); overrides.py lists (and
        # patches) the torch elastic internals; its pure modules are checked above
        if rel.startswith(("comm/", "integrations/", "testing/")) or rel in ("demo.py", "deepspeed.py",
                                                                              "elastic/agent.py", "elastic/worker.py",
                                                                              "elastic/standby.py",
                                                                              "elastic/overrides.py",
                                                                              "elastic/store_main.py",
                                                                              "elastic/etcd_rdzv.py",
                                                                              "elastic/rdzv_auth.py"):
            continue
        for mod in imports(f):
            if mod.startswith("torch.distributed") or mod.split(".")[0] in ("deepspeed", "megatron"):
                bad.append(f"{rel} imports {mod}")
    assert not bad, bad


PLANNING = sorted(p.stem for p in PKG.glob("checkpoint/planning/*.py") if p.stem != "__init__")


@pytest.mark.parametrize("mod", PLANNING + ["__init__"])
def test_planning_modules_pull_in_no_torch_indirectly(mod):
    """Import a planning module in a fresh interpreter: torch (and torch.distributed) must not be loaded
    by anything it imports, directly or through a package ``__init__``."""
    name = "elastor_ds.checkpoint.planning" + ("" if mod == "__init__" else f".{mod}")
    code = (f"import sys, importlib; importlib.import_module({name!r}); "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'deepspeed', 'megatron')));"
            "print(bad[:5]); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(PKG.parent), env={**__import__("os").environ, "PYTHONPATH": str(PKG.parent)})
    assert p.returncode == 0, f"importing {name} loaded {p.stdout.strip()} {p.stderr[-500:]}"
    assert set(PLANNING) >= {"manifest", "save_plan", "load_plan"}


# The floors, lowest first. A module may import its own floor and the floors below it, never one
# above ("an arrow back up"). elastic/protocol.py and elastic/events.py are the shared vocabulary
# (environment names, event kinds): pure, importable from every floor.
FLOORS = [("errors", "cli_types", "user_json", "threads"), ("layout",), ("plan", "data"), ("comm",), ("runtime",), ("checkpoint",),
          ("integrations", "testing"), ("elastic", "demo", "deepspeed", "cli", "__init__")]
SHARED = {"elastor_ds.elastic.protocol", "elastor_ds.elastic.events", "elastor_ds.errors"}


def _floor(top: str) -> int:
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"package elastor_ds.{top} has no floor in test_layering.FLOORS: add it")


def _absolute_imports(path: pathlib.Path) -> set[str]:
    """elastor_ds modules imported by ``path`` (relative imports resolved; ``from . import x`` as x)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("elastor_ds"):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("elastor_ds")}
    return out


def test_no_arrow_back_up():
    """comm/ imports neither checkpoint/ nor runtime/; checkpoint/ imports no integration nor the
    elastic controller; nothing imports a floor above its own (the shared vocabulary excepted)."""
    bad = []
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG)
        own = _floor(rel.parts[0] if len(rel.parts) > 1 else rel.stem)
        for mod in _absolute_imports(f):
            parts = mod.split(".")
            if len(parts) < 2 or any(mod == s or mod.startswith(s + ".") for s in SHARED):
                continue
            if not (PKG / parts[1]).exists() and not (PKG / f"{parts[1]}.py").exists():
                continue
            if _floor(parts[1]) > own:
                bad.append(f"{rel.as_posix()} imports {mod}")
    assert not bad, "arrows back up:\n" + "\n".join(sorted(bad))


COMM = sorted(p.stem for p in PKG.glob("comm/*.py"))


@pytest.mark.parametrize("mod", COMM)
def test_comm_pulls_in_no_upper_floor_indirectly(mod):
    """Import a comm/ module in a fresh interpreter: no module of checkpoint/, runtime/, integrations/,
    testing/ or the elastic controller gets loaded (the AST check above sees direct imports only; this
    one also sees chains through package ``__init__`` files)."""
    name = "elastor_ds.comm" + ("" if mod == "__init__" else f".{mod}")
    code = (f"import sys, importlib; importlib.import_module({name!r}); "
            "up = ('elastor_ds.checkpoint', 'elastor_ds.runtime', 'elastor_ds.integrations', 'elastor_ds.testing', "
            "'elastor_ds.elastic.agent', 'elastor_ds.elastic.worker');"
            "bad = sorted(m for m in sys.modules if m.startswith(up)); print(bad[:5]); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(PKG.parent), env={**__import__("os").environ, "PYTHONPATH": str(PKG.parent)})
    assert p.returncode == 0, f"importing {name} loaded {p.stdout.strip()} {p.stderr[-500:]}"
    assert {"collectives", "groups", "transport"} <= set(COMM)
