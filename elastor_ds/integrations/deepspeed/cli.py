"""CLI glue: plugs the DeepSpeed importers into ``elastor convert`` (``--from deepspeed``,
``--from deepspeed-universal``). Registered through ``_SUBCOMMAND_MODULES`` in :mod:`elastor_ds.cli`;
adds no subcommand of its own."""
from __future__ import annotations


def _importer(source: str):
    def run(src: str, dst: str, args) -> str:
        from .convert import convert
        return convert(src, dst, source=source, weights_only=bool(getattr(args, "weights_only", False)))
    return run


def register(subparsers) -> None:
    from ...checkpoint.cli import IMPORTERS
    IMPORTERS["deepspeed"] = _importer("deepspeed")
    IMPORTERS["deepspeed-universal"] = _importer("deepspeed-universal")
