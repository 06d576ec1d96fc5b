"""The ``elastor`` command line: thin subcommands over library functions.

Each subcommand lives in its own module exposing ``register(subparsers)``; that function adds a
parser whose ``func`` attribute takes the parsed args and returns the exit code. Exit codes: 0 ok,
1 the operation found a problem (e.g. a corrupt checkpoint, an infeasible plan), 2 usage errors.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import ConfigError, ElastorError

_SUBCOMMAND_MODULES = (
    "elastor_ds.checkpoint.cli",   # inspect, verify, convert
    "elastor_ds.plan.cli",         # plan
    "elastor_ds.integrations.deepspeed.cli",  # convert --from deepspeed[-universal]
    "elastor_ds.integrations.megatron.cli",   # convert --from/--to megatron
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastor", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod_name in _SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:  # a subcommand module not built yet
            if e.name != mod_name:
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except ElastorError as e:
        logging.getLogger("elastor").error("%s", e)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
