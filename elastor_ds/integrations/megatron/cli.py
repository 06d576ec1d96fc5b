"""CLI glue: plugs ``--from megatron`` / ``--to megatron`` into ``elastor convert`` and adds the
options they need (``--model-config``, ``--megatron-format``). Adds no subcommand of its own."""
from __future__ import annotations


def register(subparsers) -> None:
    from ...checkpoint.cli import EXPORTERS, IMPORTERS

    def cli_import(src, dst, args):  # the converter (torch, megatron) loads on use
        from .convert import cli_import as run
        return run(src, dst, args)

    def cli_export(src, dst, args):
        from .convert import cli_export as run
        return run(src, dst, args)

    IMPORTERS["megatron"] = cli_import
    EXPORTERS["megatron"] = cli_export
    conv = subparsers.choices.get("convert")
    if conv is not None:
        known = {a.dest for a in conv._actions}
        if "model_config" not in known:
            conv.add_argument("--model-config", default=None,
                              help="megatron: GPT config JSON (GPTSpecConfig fields) when the checkpoint has no args")
        if "megatron_format" not in known:
            conv.add_argument("--megatron-format", "--ckpt-format", dest="megatron_format",
                              choices=("legacy", "torch", "torch_dist"), default="legacy",
                              help="--to megatron: legacy mp_rank_* files (default; Megatron-LM's "
                                   "--ckpt-format torch, so 'torch' is accepted too) or torch_dist; "
                                   "--ckpt-format is Megatron-LM's name of this flag")
        if "megatron_weights_only" not in known:
            conv.add_argument("--megatron-weights-only", action="store_true",
                              help="--to megatron: leave the optimizer state out of a legacy export")
