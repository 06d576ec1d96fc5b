"""``elastor inspect | verify | convert``: checkpoint subcommands over library functions."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import sys

from ..cli_types import positive_int
from ..errors import (CheckpointError, CheckpointNotFoundError, ConfigError, UnreadableCheckpointError,
                      UnsafeCheckpointError)
from . import commit as commit_mod
from .paths import printable

log = logging.getLogger("elastor")

# format name -> (importer(src, dst, args), exporter(src, dst, args)); integrations add theirs
IMPORTERS: dict = {}
EXPORTERS: dict = {}
# the names --help lists (the integrations register theirs after this parser is built; a test checks
# these lists against IMPORTERS and EXPORTERS)
SOURCE_FORMATS = ("elastor", "consolidated", "deepspeed", "deepspeed-universal", "megatron")
TARGET_FORMATS = ("elastor", "consolidated", "deepspeed-universal", "megatron")
# the top module of an optional package a format may need -> (its pip name, the extra of elastor_ds
# that installs it: setup.py's extras_require)
EXTRAS = {"deepspeed": ("deepspeed", "deepspeed"), "megatron": ("megatron-core", "megatron")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a checkpoint's step, layout, tensors and files")
    p.add_argument("ckpt", help="checkpoint root (uses 'latest') or a step directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check completeness and checksums (exit 0 good, 1 corrupt, 2 usage)")
    p.add_argument("ckpt", help="checkpoint root (uses 'latest') or a step directory")
    p.add_argument("--no-checksums", action="store_true", help="sizes and headers only (fast)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("convert", help="convert between elastor and other checkpoint formats")
    p.add_argument("src", help="the checkpoint to read (an elastor root or step directory, a consolidated directory, "
                               "a DeepSpeed or Megatron checkpoint: see --from)")
    p.add_argument("dst", help="where to write it: absent or empty (an import with --force: an elastor root)")
    p.add_argument("--from", dest="src_format", default="elastor", metavar="FORMAT",
                   help=f"source format: {', '.join(SOURCE_FORMATS)}; all but elastor import into an elastor "
                        f"checkpoint (default elastor)")
    p.add_argument("--to", dest="dst_format", default="elastor", metavar="FORMAT",
                   help=f"target format: {', '.join(TARGET_FORMATS)}; all but elastor export an elastor checkpoint "
                        f"(default elastor)")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, help="--to megatron: TP of the export")
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1, help="--to megatron: PP of the export")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true",
                   help="import into a non-empty elastor checkpoint root: adds the imported step next to the "
                        "others; never replaces a step, never moves 'latest' to an older step, runs no retention "
                        "(exports always need an absent or empty destination)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="DeepSpeed/Megatron sources: allow full unpickling (runs code stored in the checkpoint); "
                        "only for checkpoints you made yourself. Default: torch.load(weights_only=True) with an "
                        "allow-list of the types these formats need")
    p.set_defaults(func=cmd_convert)


def cmd_inspect(args) -> int:
    try:
        step_dir = commit_mod.resolve(args.ckpt)
        man = commit_mod.read_manifest(step_dir)
    except CheckpointError as e:
        print(f"elastor inspect: error: {_line(e)}", file=sys.stderr)   # a typo or not a checkpoint: a usage error
        return 2 if not os.path.exists(args.ckpt) or isinstance(e, CheckpointNotFoundError) else 1
    if args.json:
        d = man.to_json()
        d["step_dir"] = step_dir
        d["total_bytes"] = man.total_bytes
        json.dump(d, sys.stdout, indent=1)
        print()
        return 0
    from ..layout import Layout
    layout = "unknown"
    if man.layout:
        try:
            layout = Layout.from_json(man.layout).describe()
        except Exception:  # noqa: BLE001 - informational only
            layout = "unreadable"
    print(f"checkpoint  {printable(step_dir)}")
    print(f"step        {man.step}")
    print(f"format      elastor v{man.format_version}")
    print(f"written by  {_n(man.world_size, 'rank')}, layout {layout}")
    print(f"files       {len(man.files)}, {man.total_bytes / 2**20:.2f} MiB")
    if man.extra:
        print(f"extra       {_clip(json.dumps(man.extra), 200)}")
    print(f"tensors     {len(man.tensors)}")
    width = max((len(n) for n in man.tensors), default=4)
    for n, t in sorted(man.tensors.items()):
        print(f"  {n:<{width}}  {str(list(t.shape)):>16}  {t.dtype:<9} {len(t.chunks):>3} chunks  {t.nbytes:>12,} B")
    return 0


def _line(e: object) -> str:
    """A message on one line, non-printable characters escaped (names from disk are anyone's)."""
    return printable(" | ".join(x.strip() for x in str(e).splitlines() if x.strip()))


def _clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters after a comma, with " ... (--json shows all)"."""
    if len(text) <= limit:
        return text
    cut = text.rfind(", ", 0, limit)
    return text[:cut if cut > 0 else limit] + ", ... (--json shows all)"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def cmd_verify(args) -> int:
    try:
        step_dir = commit_mod.resolve(args.ckpt)
        man = commit_mod.read_manifest(step_dir)  # a malformed manifest: one line, exit 1
    except CheckpointError as e:
        if not os.path.exists(args.ckpt) or isinstance(e, CheckpointNotFoundError):   # a typo, or not a checkpoint
            print(f"elastor verify: error: {_line(e)}", file=sys.stderr)
            return 2
        if isinstance(e, UnreadableCheckpointError):   # nothing known to be wrong with the checkpoint
            print(f"elastor verify: error: {_line(e)}", file=sys.stderr)
            return 1
        print(f"CORRUPT/INCOMPLETE: {_line(e)}", file=sys.stderr)
        return 1
    from .verify import verify  # torch-free CLI start: heavy modules load on use
    problems = verify(step_dir, checksums=not args.no_checksums, manifest=man,
                      progress=sys.stderr is not None and sys.stderr.isatty())
    if problems:
        for p in problems:
            print(f"CORRUPT: {_line(_problem_text(p))}", file=sys.stderr)
        print(f"{printable(step_dir)}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"OK {printable(step_dir)}: step {man.step}, {_n(len(man.files), 'file')}, {_n(len(man.tensors), 'tensor')}, "
          f"{man.total_bytes / 2**20:.2f} MiB, checksums {'skipped' if args.no_checksums else 'match'}")
    extra = _unlisted(step_dir, man)
    if extra:   # never read by a load; worth a look (a merged or hand-edited folder)
        print(f"note: {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} in {printable(step_dir)} the manifest "
              f"does not list (never read): "
              f"{', '.join(n if n.isprintable() else ascii(n) for n in extra[:5])}{' ...' if len(extra) > 5 else ''}",
              file=sys.stderr)   # names on disk are anyone's: a terminal escape in one is shown escaped
    return 0


def _problem_text(p) -> str:
    """A verify problem as ``FILE: what``; the file named once (a header error's own message starts
    with the file's path too)."""
    where, what = getattr(p, "where", None), getattr(p, "what", None)
    if isinstance(where, str) and isinstance(what, str) and what.startswith(f"{where}: "):
        return f"{where}: {what[len(where) + 2:]}"
    return str(p)


def _unlisted(step_dir: str, man) -> list[str]:
    """Entries of ``step_dir`` that are neither the manifest nor a file it lists (QA round 8, F8.7)."""
    listed = {n.split("/", 1)[0] for n in man.files} | {commit_mod.MANIFEST_NAME}
    try:
        return sorted(n for n in os.listdir(step_dir) if n not in listed)
    except OSError:
        return []


def _check_export_source(src: str) -> None:
    """Every exporter allocates whole tensors of the manifest's shapes: check, from the manifest
    alone, that the chunks cover them before any is allocated (a crafted shape of 10^18 elements
    must not claim the node's memory)."""
    from .verify import require_coverage
    step_dir = commit_mod.resolve(src)
    require_coverage(commit_mod.read_manifest(step_dir), step_dir)


# flag dest -> (flag, default, where it applies, test on (--from, --to)); a flag given where it does
# not apply was ignored without a word (``--to consolidated --weights-only`` wrote the optimizer too)
_CONVERT_SCOPES = {
    "tensor_model_parallel_size": ("--tensor-model-parallel-size", 1, "--to megatron", lambda f, t: t == "megatron"),
    "pipeline_model_parallel_size": ("--pipeline-model-parallel-size", 1, "--to megatron",
                                     lambda f, t: t == "megatron"),
    "megatron_format": ("--megatron-format", "legacy", "--to megatron", lambda f, t: t == "megatron"),
    "megatron_weights_only": ("--megatron-weights-only", False, "--to megatron", lambda f, t: t == "megatron"),
    "model_config": ("--model-config", None, "--from megatron and --to megatron", lambda f, t: "megatron" in (f, t)),
    "weights_only": ("--weights-only", False, "--from deepspeed", lambda f, t: f == "deepspeed"),
    "trust_checkpoint": ("--trust-checkpoint", False, "--from deepspeed, deepspeed-universal or megatron",
                         lambda f, t: f in ("deepspeed", "deepspeed-universal", "megatron")),
    "force": ("--force", False, "imports (--to elastor)", lambda f, t: t == "elastor"),
}


def _check_convert_flags(args, src_f: str, dst_f: str) -> None:
    for dest, (flag, default, where, applies) in _CONVERT_SCOPES.items():
        if getattr(args, dest, default) != default and not applies(src_f, dst_f):
            raise ConfigError(f"{flag} applies to {where} only, not to --from {src_f} --to {dst_f}; drop it")
    if getattr(args, "megatron_format", None) == "torch":   # Megatron-LM's name (--ckpt-format torch) of legacy
        args.megatron_format = "legacy"
    if getattr(args, "megatron_format", "legacy") == "torch_dist" and \
            getattr(args, "pipeline_model_parallel_size", 1) != 1:
        # a torch_dist checkpoint has no pipeline stages of its own (Megatron loads it at any PP)
        raise ConfigError("--pipeline-model-parallel-size applies to --megatron-format legacy only: a torch_dist "
                          "checkpoint loads at any pipeline parallel size; drop it")


def cmd_convert(args) -> int:
    src_f, dst_f = args.src_format, args.dst_format
    progress = not args.no_progress
    if not os.path.exists(args.src):
        print(f"elastor convert: error: source {printable(args.src)} does not exist", file=sys.stderr)
        return 2
    importing = dst_f == "elastor" and (src_f == "consolidated" or src_f in IMPORTERS)
    exporting = src_f == "elastor" and (dst_f == "consolidated" or dst_f in EXPORTERS)
    if not (importing or exporting):
        known_from = ", ".join(["consolidated", *IMPORTERS])
        known_to = ", ".join(["consolidated", *EXPORTERS])
        raise ConfigError(f"cannot convert --from {src_f} --to {dst_f}; supported: --from one of {known_from} "
                          f"--to elastor (an import), or --from elastor --to one of {known_to} (an export)")
    _check_convert_flags(args, src_f, dst_f)
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise ConfigError(f"source and destination are both {args.src}; choose a new destination")
    commit_mod.check_outside_checkpoints(args.dst, args.src)
    parent = os.path.dirname(os.path.abspath(args.dst))
    if not os.path.isdir(parent):   # like cp: a typo in the destination does not create a tree
        raise ConfigError(f"the destination's parent directory {parent} does not exist; create it first "
                          f"(mkdir -p {parent}) or fix the path {args.dst}")
    # refuse a non-empty destination before any work (the writers check again when they commit)
    if importing:
        commit_mod.check_import_destination(args.dst, None, args.force)
    else:
        commit_mod.check_empty_destination(os.path.abspath(args.dst))
        _check_export_source(args.src)
    from .convert import from_consolidated, to_consolidated
    if src_f == "elastor" and dst_f == "consolidated":
        out = to_consolidated(args.src, args.dst, progress=progress)
    elif src_f == "consolidated" and dst_f == "elastor":
        out = from_consolidated(args.src, args.dst, progress=progress, force=args.force)
    elif importing:
        with _optional_package(f"--from {src_f}"):
            out = IMPORTERS[src_f](args.src, args.dst, args)
    else:
        try:
            with _optional_package(f"--to {dst_f}"):
                out = EXPORTERS[dst_f](args.src, args.dst, args)
        except OSError as e:   # a full disk, a permission: name the destination (the file may be a temp one)
            raise OSError(e.errno, f"{e.strerror or e} (exporting {args.src} to {args.dst})") from e
    print(f"wrote {printable(out)}")
    return 0


def missing_extra_error(what: str, module: str, detail: str, hint: str = "") -> ConfigError:
    """A usage error for a conversion that needs the optional package of ``module`` (``deepspeed``,
    ``megatron``), which is not installed: names the extra of elastor_ds that installs it."""
    package, extra = EXTRAS.get(module, (module, module))
    return ConfigError(f"{what} needs {package}, which is not installed here ({detail}); install it with "
                       f"pip install 'elastor_ds[{extra}]'{hint}")


@contextlib.contextmanager
def _optional_package(what: str):
    """A converter that reached for an optional package (deepspeed, megatron-core) that is not
    installed: a one-line usage error naming the extra, not "unexpected ModuleNotFoundError".
    The converters read and check their sources before they write, and remove what they wrote on
    failure, so nothing is left behind."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        raise missing_extra_error(what, top, f"No module named {e.name!r}") from None
    except UnsafeCheckpointError as e:   # a pickled type of a package that is not installed (never unpickled)
        m = re.search(r"GLOBAL ((\w+)\.[\w.]+)", str(e))
        if m is None or m.group(2) not in EXTRAS or importlib.util.find_spec(m.group(2)) is not None:
            raise
        raise missing_extra_error(what, m.group(2), f"{_line(e).split(' needs a type', 1)[0]} holds a "
                                                    f"{m.group(1)}") from None
