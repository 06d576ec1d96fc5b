"""The overrides tables (one per host framework) against the installed hosts, and the rule that no
other code in ``elastor_ds/`` touches a private framework symbol.

1. Pins: each installed host's version equals its pin (and the pins equal requirements-dev.txt and
   scripts/setup_env.sh).
2. Rows: every listed symbol of an installed host exists; an instance attribute appears as
   ``self.<name>`` in its class's source; a callable's parameter names equal the recorded ones.
   Megatron-LM rows are checked against the source of a checkout in ``MEGATRON_LM_DIR`` (skipped
   without one: the package is not installable).
3. Guard (AST walk of ``elastor_ds/``, overrides modules excepted): no ``__class__`` assignment, no
   assignment or ``setattr`` on a framework module or class, no ``from <framework> import _x``, no
   private attribute of a framework object (read, call, ``getattr(x, "_y")``, ``super()._y``, a
   private method or ``self._y`` of a framework base class in a subclass) unless a table row lists
   that symbol with this file in its ``direct`` (the files allowed to touch it without the accessors).
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import pathlib
import re
from typing import Any, Iterable, Optional

import pytest

from elastor_ds.integrations.override_table import Kind, Override, Pin, parameter_names, release, resolve

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ("elastor_ds.integrations.deepspeed.overrides", "elastor_ds.integrations.megatron.overrides",
           "elastor_ds.elastic.overrides")
OVERRIDES_FILES = {"elastor_ds/integrations/deepspeed/overrides.py", "elastor_ds/integrations/megatron/overrides.py",
                   "elastor_ds/elastic/overrides.py", "elastor_ds/integrations/override_table.py"}
FRAMEWORKS = ("torch", "deepspeed", "megatron")
# privates of standard-library objects held in variables (argparse keeps its actions there)
STDLIB_PRIVATE = {"_actions"}


def _tables() -> list[tuple[str, tuple[Pin, ...], tuple[Override, ...]]]:
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        out.append((name, mod.PINS, mod.TABLE))
    return out


ALL_ROWS: list[Override] = [r for _, _, t in _tables() for r in t]
ALL_PINS: list[tuple[str, Pin]] = [(m, p) for m, pins, _ in _tables() for p in pins]


# ------------------------------------------------------------------ 1. pins
@pytest.mark.parametrize("owner,pin", ALL_PINS, ids=[f"{m.split('.')[-2]}-{p.dist}" for m, p in ALL_PINS])
def test_installed_version_is_the_pinned_one(owner, pin):
    if pin.dist == "megatron-lm":
        pytest.skip("Megatron-LM is checked from MEGATRON_LM_DIR (test_megatron_lm_rows)")
    mod = pytest.importorskip(pin.module)
    have = release(getattr(mod, "__version__", "?"))
    assert have == pin.version, (
        f"{pin.dist} {have} is installed but {owner} is pinned to {pin.dist}=={pin.version}: a new version. "
        f"Re-check every row of {owner}.TABLE against {pin.dist} {have}'s source (paths, instance attributes, "
        f"parameter names), then bump the pin (and requirements-dev.txt / scripts/setup_env.sh)")


def test_pins_agree_with_the_install_scripts():
    reqs = (ROOT / "requirements-dev.txt").read_text()
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    for owner, pin in ALL_PINS:
        if pin.dist == "megatron-lm":
            continue
        text = setup if pin.dist == "torch" else reqs
        where = "scripts/setup_env.sh" if pin.dist == "torch" else "requirements-dev.txt"
        found = re.findall(rf"(?m)\b{re.escape(pin.dist)}==([0-9][^\s\"']*)", text)
        assert found == [pin.version], f"{owner} pins {pin.dist}=={pin.version} but {where} says {found}"


def test_every_row_names_a_pinned_host_and_existing_files():
    for owner, pins, table in _tables():
        dists = {p.dist for p in pins}
        for r in table:
            assert ":" in r.path and r.attrs and all(r.attrs), f"{owner}: bad path {r.path!r} (want module:Attr)"
            assert r.host in dists, f"{owner}: {r.path} has host {r.host!r}, not one of its pins {sorted(dists)}"
            assert isinstance(r.kind, Kind) and r.why and r.where, f"{owner}: {r.path} lacks kind, why or where"
            for w in r.where:
                assert (ROOT / w).is_file(), f"{owner}: {r.path} names {w}, which does not exist"
            assert set(r.direct) <= set(r.where), f"{owner}: {r.path}: direct {r.direct} not within where {r.where}"
        paths = [(r.path, r.kind) for r in table]
        assert len(paths) == len(set(paths)), f"{owner}: a row is listed twice"


# ------------------------------------------------------------------ 2. rows
def _host_module(row: Override) -> str:
    return {"deepspeed": "deepspeed", "torch": "torch", "megatron-core": "megatron.core"}[row.host]


def _class_sources(cls: type) -> str:
    out = []
    for c in cls.__mro__:
        if c.__module__.split(".")[0] in FRAMEWORKS:
            try:
                out.append(inspect.getsource(c))
            except (OSError, TypeError):
                pass
    return "\n".join(out)


HOST_ROWS = [r for r in ALL_ROWS if r.host != "megatron-lm"]


@pytest.mark.parametrize("row", HOST_ROWS, ids=[f"{r.path}[{r.kind.value}]" for r in HOST_ROWS])
def test_listed_symbol_exists_with_recorded_parameters(row):
    pytest.importorskip(_host_module(row))
    if row.instance:
        owner = resolve(f"{row.module}:{'.'.join(row.attrs[:-1])}")
        assert isinstance(owner, type), f"{row.path}: an instance attribute needs a class before it"
        assert re.search(rf"self\.{re.escape(row.name)}\b", _class_sources(owner)), (
            f"{row.path}: no `self.{row.name}` in {owner.__qualname__}'s source any more: the host changed; re-check "
            f"the row and the code at {', '.join(row.where)}")
        return
    obj = resolve(row.path)
    if row.kind in (Kind.CALL, Kind.WRAP, Kind.OVERRIDE) and callable(obj) and _has_signature(obj):
        assert row.params is not None, f"{row.path} ({row.kind.value}) records no parameter names"
    if row.params is not None:
        got = parameter_names(obj)
        assert got == row.params, (f"{row.path}: parameters are ({got}), the overrides table records ({row.params}); "
                                   f"re-check the code at {', '.join(row.where)} against the new signature, then "
                                   f"update the row")


def _has_signature(obj: Any) -> bool:
    """False for C functions without a Python signature (e.g. ``torch.Tensor.type``)."""
    try:
        inspect.signature(obj)
        return True
    except (TypeError, ValueError):
        return False


def _def_params(fn: ast.FunctionDef) -> str:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return ", ".join(n for n in names if n not in ("self", "cls"))


MLM_ROWS = [r for r in ALL_ROWS if r.host == "megatron-lm"]


@pytest.mark.parametrize("row", MLM_ROWS, ids=[r.path for r in MLM_ROWS])
def test_megatron_lm_rows(row):
    mlm = os.environ.get("MEGATRON_LM_DIR")
    if not mlm:
        pytest.skip("MEGATRON_LM_DIR is not set: no Megatron-LM checkout to check the patch points against")
    info = (pathlib.Path(mlm) / "megatron" / "core" / "package_info.py").read_text()
    version = ".".join(re.search(rf"(?m)^{k}\s*=\s*(\d+)", info).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    pin = next(p for _, p in ALL_PINS if p.dist == "megatron-lm")
    assert version == pin.version, (f"Megatron-LM in {mlm} is {version}, the pin is {pin.version}: a new version. "
                                    f"Re-check the Megatron-LM rows and patches/megatron-lm/, then bump the pin")
    src = pathlib.Path(mlm, *row.module.split(".")).with_suffix(".py")
    tree = ast.parse(src.read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == row.name]
    if row.params is None:   # a module global: bound at the top level (def, class, import or assignment)
        assert row.name in _top_level_names(tree), f"{row.path}: {row.name} is not bound at the top of {src}"
        return
    assert defs, f"{row.path}: no top-level def {row.name} in {src}: the patch point moved"
    assert _def_params(defs[0]) == row.params, (f"{row.path}: parameters are ({_def_params(defs[0])}) in {src}, the "
                                                f"table records ({row.params}); re-check {', '.join(row.where)}")


def _top_level_names(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Try):   # try: import x / except ImportError: x = None
            out |= _top_level_names(ast.Module(body=n.body + [h for e in n.handlers for h in e.body], type_ignores=[]))
    return out


def test_cpu_runner_patches_only_listed_modules():
    """The Megatron-LM CPU runner's TORCH_PROXY_MODULES are the table's CPU_RUNNER_TORCH_MODULES."""
    from elastor_ds.integrations.megatron.overrides import CPU_RUNNER_TORCH_MODULES
    tree = ast.parse((ROOT / "examples" / "megatron_lm" / "cpu_pretrain_gpt.py").read_text())
    got = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and
               any(isinstance(t, ast.Name) and t.id == "TORCH_PROXY_MODULES" for t in n.targets))
    assert tuple(got) == CPU_RUNNER_TORCH_MODULES, ("examples/megatron_lm/cpu_pretrain_gpt.py patches `torch` in "
                                                    f"{sorted(set(got) ^ set(CPU_RUNNER_TORCH_MODULES))} unlike the "
                                                    "Megatron overrides table: update one of them")


# ------------------------------------------------------------------ 3. the guard
def _framework(mod: str) -> bool:
    return mod.split(".")[0] in FRAMEWORKS


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST) -> Optional[ast.AST]:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


class _FileScan:
    """The import bindings of one file: framework objects (name -> dotted path) and other imports."""

    def __init__(self, tree: ast.AST):
        self.framework: dict[str, str] = {}
        self.other: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    bound = a.asname or a.name.split(".")[0]
                    (self.framework.__setitem__(bound, a.name if a.asname else bound) if _framework(a.name)
                     else self.other.add(bound))
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                for a in n.names:
                    bound = a.asname or a.name
                    if _framework(n.module):
                        self.framework[bound] = f"{n.module}.{a.name}"
                    elif not n.module.startswith("elastor_ds"):
                        self.other.add(bound)
            elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _is_import_module(n.value):
                arg = n.value.args[0] if n.value.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _framework(arg.value):
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            self.framework[t.id] = arg.value


def _is_import_module(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (isinstance(f, ast.Name) and
                                                                           f.id == "import_module")


def _elastor_files(root: pathlib.Path) -> list[tuple[str, ast.AST]]:
    out = []
    for f in sorted((root / "elastor_ds").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel not in OVERRIDES_FILES:
            out.append((rel, ast.parse(f.read_text(), filename=rel)))
    return out


def _defined_names(files: Iterable[tuple[str, ast.AST]]) -> set[str]:
    """Private names elastor_ds defines itself (functions, classes, globals, self./cls. attributes,
    names given to setattr)."""
    out: set[str] = set()
    for _, tree in files:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                    and n.value.id in ("self", "cls"):
                out.add(n.attr)
            elif isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and \
                    isinstance(n.args[1].value, str) and ((isinstance(n.func, ast.Name) and n.func.id == "setattr")
                                                          or (isinstance(n.func, ast.Attribute) and
                                                              n.func.attr == "__setattr__")):
                out.add(n.args[1].value)
    return {n for n in out if n.startswith("_")}


def _listed(rows: Iterable[Override], rel: str, name: str) -> bool:
    """A row lists symbol ``name`` as touched directly in file ``rel``."""
    return any(name in r.attrs and rel in r.direct for r in rows)


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _attr_string_call(n: ast.Call) -> Optional[tuple[ast.AST, str]]:
    if isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
            len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
        return n.args[0], n.args[1].value
    return None


def guard_violations(root: pathlib.Path, rows: list[Override]) -> list[str]:
    """Every place under ``root/elastor_ds`` (overrides modules excepted) that touches a private
    framework symbol without a row listing it there, or patches a framework object at all."""
    files = _elastor_files(root)
    known = {a for r in rows for a in r.attrs if _private(a)}
    ours = _defined_names(files) - known
    bad: list[str] = []
    for rel, tree in files:
        scan = _FileScan(tree)

        def root_kind(node: ast.AST) -> str:
            r = _root(node)
            if _is_super_call(r):
                return "super"
            if isinstance(r, ast.Name):
                if r.id in ("self", "cls"):
                    return "self"
                if r.id in scan.framework:
                    return "framework"
                if r.id in scan.other:
                    return "stdlib"
            return "value"

        def check_private(node: ast.AST, obj: ast.AST, name: str, how: str) -> None:
            kind = root_kind(obj) if not isinstance(obj, ast.Name) or obj.id not in ("self", "cls") else "self"
            if not _private(name) or kind in ("self", "stdlib") or name.startswith("_elastor"):
                return
            if _listed(rows, rel, name):
                return
            if kind == "value" and (name in ours or name in STDLIB_PRIVATE):
                return
            bad.append(f"{rel}:{node.lineno}: {how} {name} ({kind}) is not listed for this file in an overrides table")

        for n in ast.walk(tree):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign,
                                                                                                 ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr == "__class__":
                        bad.append(f"{rel}:{n.lineno}: __class__ assignment (use an overrides module's reclass)")
                    elif isinstance(el, ast.Attribute) and root_kind(el) == "framework":
                        bad.append(f"{rel}:{n.lineno}: assigns {ast.unparse(el)} on a framework object (patch it "
                                   f"through an overrides module)")
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and _framework(n.module):
                for a in n.names:
                    if _private(a.name) and not _listed(rows, rel, a.name):
                        bad.append(f"{rel}:{n.lineno}: from {n.module} import {a.name} is not listed for this file")
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                check_private(n, n.value, n.attr, "reads")
            if isinstance(n, ast.Call):
                got = _attr_string_call(n)
                if got is not None:
                    obj, name = got
                    if name == "__class__" and n.func.id == "setattr":
                        bad.append(f"{rel}:{n.lineno}: setattr(..., '__class__')")
                    elif n.func.id in ("setattr", "delattr") and root_kind(obj) == "framework":
                        bad.append(f"{rel}:{n.lineno}: {n.func.id} on framework object {ast.unparse(obj)}")
                    else:
                        check_private(n, obj, name, f"{n.func.id}(..., {name!r})")
        bad += _subclass_violations(rel, tree, scan, rows)
    return bad


@functools.lru_cache(maxsize=None)
def _framework_privates(cls: type) -> frozenset:
    names = {n for c in cls.__mro__ if c.__module__.split(".")[0] in FRAMEWORKS for n in vars(c) if _private(n)}
    names |= set(re.findall(r"self\.(_[A-Za-z]\w*)", _class_sources(cls)))
    return frozenset(names)


def _subclass_violations(rel: str, tree: ast.AST, scan: _FileScan, rows: list[Override]) -> list[str]:
    """Private methods and ``self._x`` of a framework base class used in a subclass of it, unlisted."""
    local = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}

    def framework_bases(cd: ast.ClassDef, seen: frozenset = frozenset()) -> list[type]:
        out: list[type] = []
        for b in cd.bases:
            if isinstance(b, ast.Name) and b.id in local and b.id not in seen:
                out += framework_bases(local[b.id], seen | {b.id})
                continue
            r = _root(b)
            if isinstance(r, ast.Name) and r.id in scan.framework:
                dotted = scan.framework[r.id] + ast.unparse(b)[len(r.id):]
                mod, _, attr = dotted.rpartition(".")
                try:
                    obj = getattr(importlib.import_module(mod), attr)
                except (ImportError, AttributeError):
                    try:
                        obj = importlib.import_module(dotted)
                    except ImportError:
                        continue
                if isinstance(obj, type):
                    out.append(obj)
        return out

    bad = []
    for cd in local.values():
        bases = framework_bases(cd)
        if not bases:
            continue
        fw = frozenset().union(*(_framework_privates(b) for b in bases))
        used: dict[str, int] = {}
        for n in cd.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign)) and _private(getattr(n, "name", "")):
                used.setdefault(n.name, n.lineno)
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name) and _private(t.id):
                        used.setdefault(t.id, n.lineno)
        for n in ast.walk(cd):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and \
                    _private(n.attr):
                used.setdefault(n.attr, n.lineno)
        for name, line in sorted(used.items(), key=lambda kv: kv[1]):
            if name in fw and not _listed(rows, rel, name):
                bad.append(f"{rel}:{line}: {cd.name} uses {name} of its framework base "
                           f"{'/'.join(b.__name__ for b in bases)}, not listed for this file in an overrides table")
    return bad


def test_no_private_framework_symbol_outside_the_overrides_tables():
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    bad = guard_violations(ROOT, ALL_ROWS)
    assert not bad, ("private framework symbols touched where no overrides table lists them (route the code "
                     "through elastor_ds/{integrations/deepspeed,integrations/megatron,elastic}/overrides.py, or "
                     "add a row naming this file):\n" + "\n".join(bad))


def test_guard_catches_each_kind_of_touch(tmp_path):
    """The guard itself: each pattern it exists for, planted in a scratch tree, is reported."""
    pkg = tmp_path / "elastor_ds"
    pkg.mkdir()
    (pkg / "planted.py").write_text(
        "import torch.distributed as dist\n"
        "from deepspeed.runtime.pipe import p2p\n"
        "from deepspeed.runtime.pipe import module as ds_module\n"
        "from torch.distributed.elastic.agent.server.api import _RoleInstanceInfo\n"
        "from deepspeed.runtime.pipe.engine import PipelineEngine\n"
        "def f(engine, cls, opt):\n"
        "    engine.__class__ = cls\n"
        "    ds_module.PipelineParallelGrid = None\n"
        "    setattr(p2p, 'send', None)\n"
        "    g = p2p._grid\n"
        "    dist.distributed_c10d._get_default_store()\n"
        "    getattr(opt, '_get_model_param_range_map')\n"
        "class E(PipelineEngine):\n"
        "    def _exec_reduce_grads(self):\n"
        "        return super()._exec_reduce_grads()\n")
    bad = guard_violations(tmp_path, [])
    text = "\n".join(bad)
    for expect in ("__class__ assignment", "assigns ds_module.PipelineParallelGrid", "setattr on framework object p2p",
                   "reads _grid", "reads _get_default_store", "import _RoleInstanceInfo",
                   "'_get_model_param_range_map'", "uses _exec_reduce_grads"):
        assert expect in text, f"the guard missed {expect!r}:\n{text}"
    routed = Override("deepspeed.runtime.pipe.p2p:_grid", Kind.READ, ("elastor_ds/planted.py",), "test")
    assert any("reads _grid" in b for b in guard_violations(tmp_path, [routed])), "a routed row allows no direct read"
    direct = Override("deepspeed.runtime.pipe.p2p:_grid", Kind.READ, ("elastor_ds/planted.py",), "test",
                      direct=("elastor_ds/planted.py",))
    assert not any("reads _grid" in b for b in guard_violations(tmp_path, [direct]))
