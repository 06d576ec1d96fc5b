"""The row type of the overrides tables, and the few helpers every overrides module shares.

Each host framework has one overrides module that lists every private (or internal) symbol
elastor_ds patches or reads, pinned to the host versions we support:

* :mod:`elastor_ds.integrations.deepspeed.overrides` (DeepSpeed, and the torch internals the
  DeepSpeed adapter touches);
* :mod:`elastor_ds.integrations.megatron.overrides` (megatron-core, the Megatron-LM patch points, and
  the torch functions the Megatron CPU shims replace);
* :mod:`elastor_ds.elastic.overrides` (torch.distributed.elastic, and the c10d privates of ``comm/``).

A row says what the symbol is (``path``: ``"module:Attr.chain"``), what we do to it (:class:`Kind`),
where we use it (repository-relative files; ``direct``: those that touch it themselves instead of
through the module's accessors), and for a callable we call, wrap or override, the parameter names
we rely on. ``tests/unit/test_overrides.py`` imports every row, compares the
parameter names with ``inspect.signature``, fails when an installed host version differs from the
pin, and fails when a private framework symbol is touched at a place no row names.

Patches go through :func:`patch` / :func:`patched`, which refuse a path that no table lists.
Pure: imports hosts only when a helper resolves a path.
"""
from __future__ import annotations

import contextlib
import enum
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from ..errors import ConfigError

__all__ = ["Kind", "Override", "Pin", "resolve", "patch", "patched", "parameter_names", "release"]


class Kind(str, enum.Enum):
    """What elastor_ds does to a host symbol."""

    READ = "read"                    # reads the value (attribute, module global, instance field)
    CALL = "call"                    # calls it (a private function or method)
    PATCH = "patch"                  # assigns it (module global, class or instance attribute)
    WRAP = "wrap"                    # replaces it with a function that calls the original
    REPLACE_CLASS = "replace class"  # an instance's ``__class__`` becomes a subclass of this class
    OVERRIDE = "override"            # a subclass of ours redefines this private method


@dataclass(frozen=True)
class Pin:
    """One supported host release: the distribution's name and its exact version."""

    dist: str          # the pip distribution ("deepspeed", "megatron-core", "torch", "megatron-lm")
    version: str       # "0.19.8"; torch's local tag (+cpu) is not part of it
    module: str        # the import name whose ``__version__`` is compared ("deepspeed")


@dataclass(frozen=True)
class Override:
    """One host symbol elastor_ds reaches into."""

    path: str                          # "package.module:Attr.chain"
    kind: Kind
    where: tuple[str, ...]             # repository-relative files that touch it
    why: str
    params: Optional[str] = None       # a callable's parameter names we rely on, "a, b, c" (self omitted)
    instance: bool = False             # an instance attribute: checked in the class's source (self.<name>)
    host: str = ""                     # the Pin.dist that pins it
    # files (a subset of ``where``) that touch the symbol themselves rather than through the overrides
    # module's accessors: a subclass overriding or using it, code the layering keeps below that module,
    # or a file not routed yet. The guard test allows a direct touch only there.
    direct: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def attrs(self) -> tuple[str, ...]:
        return tuple(self.path.split(":", 1)[1].split("."))

    @property
    def name(self) -> str:
        return self.attrs[-1]


def release(version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13.0"`` (the local build tag is not a different release)."""
    return str(version).split("+", 1)[0]


def resolve(path: str) -> Any:
    """The object at ``"module:Attr.chain"`` (imports the module). Raises ConfigError naming the
    missing piece, so a host upgrade that moved a symbol says which."""
    mod_name, _, chain = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{path}: cannot import {mod_name} ({e}); the overrides table names a module this "
                          f"host version does not have: re-check the table against the installed version") from None
    for a in chain.split(".") if chain else ():
        if not hasattr(obj, a):
            raise ConfigError(f"{path}: {type(obj).__name__} {getattr(obj, '__name__', obj)!s} has no attribute {a!r}; "
                              f"the host changed: re-check the overrides table against the installed version")
        obj = getattr(obj, a)
    return obj


def parameter_names(fn: Any) -> str:
    """``"a, b, c"``: the parameter names of ``fn`` without ``self``/``cls`` (no defaults, no types)."""
    names = [p.name for p in inspect.signature(fn).parameters.values()]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return ", ".join(names)


def _row(table: Iterable[Override], path: str, kinds: tuple[Kind, ...]) -> Override:
    for r in table:
        if r.path == path and r.kind in kinds:
            return r
    raise ConfigError(f"{path} is not listed as {'/'.join(k.value for k in kinds)} in the overrides table: add a row "
                      f"(what, where, why) before patching it")


def patch(table: Iterable[Override], path: str, value: Any) -> Any:
    """Set the module global or class attribute at ``path`` (listed as patch or wrap in ``table``)
    to ``value``; returns the previous value."""
    row = _row(table, path, (Kind.PATCH, Kind.WRAP))
    owner = resolve(f"{row.module}:{'.'.join(row.attrs[:-1])}" if len(row.attrs) > 1 else row.module)
    old = getattr(owner, row.name)
    setattr(owner, row.name, value)
    return old


@contextlib.contextmanager
def patched(table: Iterable[Override], path: str, value: Any) -> Iterator[Any]:
    """:func:`patch` for the duration of a ``with`` block (the original is back afterwards, also on
    an error); yields the original."""
    old = patch(table, path, value)
    try:
        yield old
    finally:
        patch(table, path, old)
