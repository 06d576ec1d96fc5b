"""CLI glue: plugs the DeepSpeed importers into ``elastor convert`` (``--from deepspeed``,
``--from deepspeed-universal``, ``--to deepspeed-universal``). Registered through ``_SUBCOMMAND_MODULES`` in :mod:`elastor_ds.cli`;
adds no subcommand of its own."""
from __future__ import annotations


def _importer(source: str):
    def run(src: str, dst: str, args) -> str:
        from .convert import convert
        return convert(src, dst, source=source, weights_only=bool(getattr(args, "weights_only", False)),
                       force=bool(getattr(args, "force", False)), trust=bool(getattr(args, "trust_checkpoint", False)),
                       progress=not getattr(args, "no_progress", False))
    return run


def _to_universal(src: str, dst: str, args) -> str:
    from .convert import to_universal
    return to_universal(src, dst, progress=not getattr(args, "no_progress", False))


def register(subparsers) -> None:
    from ...checkpoint.cli import EXPORTERS, IMPORTERS
    EXPORTERS["deepspeed-universal"] = _to_universal
    IMPORTERS["deepspeed"] = _importer("deepspeed")
    IMPORTERS["deepspeed-universal"] = _importer("deepspeed-universal")
    conv = subparsers.choices.get("convert")
    if conv is not None and "weights_only" not in {a.dest for a in conv._actions}:
        conv.add_argument("--weights-only", action="store_true",
                          help="--from deepspeed: import weights only (a ZeRO-0 checkpoint's optimizer state is "
                               "keyed by position and cannot be carried)")
