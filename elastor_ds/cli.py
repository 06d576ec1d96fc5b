"""The ``elastor`` command line: thin subcommands over library functions.

Each subcommand lives in its own module exposing ``register(subparsers)``; that function adds a
parser whose ``func`` attribute takes the parsed args and returns the exit code. Exit codes: 0 ok,
1 the operation found a problem (e.g. a corrupt checkpoint, an infeasible plan), 2 usage errors.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import warnings
import os
import sys

from .errors import CheckpointNotFoundError, ConfigError, ElastorError, PlanningError, StoppedEarly

_SUBCOMMAND_MODULES = (
    "elastor_ds.checkpoint.cli",   # inspect, verify, convert
    "elastor_ds.plan.cli",         # plan
    "elastor_ds.integrations.deepspeed.cli",  # convert --from deepspeed[-universal]
    "elastor_ds.integrations.megatron.cli",   # convert --from/--to megatron
    "elastor_ds.elastic.cli",      # run
)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (subcommand parsers inherit this class). Flags are
    never abbreviated: ``elastor plan --gpus 8`` is an error, not ``--gpus-per-node 8``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        from .checkpoint.paths import printable   # a value given on the command line may hold escapes
        self.exit(2, f"{self.prog}: error: {printable(self._without_remainders(message))} (see {self.prog} --help)\n")

    def _without_remainders(self, message: str) -> str:
        """argparse lists a trailing ``nargs=REMAINDER`` positional (``elastor run``'s script_args) as
        required when nothing is given; it may be empty: name only the positionals that are needed."""
        head = "the following arguments are required: "
        if not message.startswith(head):
            return message
        optional = {a.dest for a in self._actions if a.nargs == argparse.REMAINDER}
        names = [n for n in message[len(head):].split(", ") if n not in optional]
        return head + ", ".join(names) if names else message


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("elastor_ds")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elastor", description="The elastor command line: checkpoints (inspect, verify, convert), "
                     "layouts (plan) and elastic runs (run).")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"elastor {_version()}",
                        help="print the installed elastor_ds version and exit")
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


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (a scheduler, ``timeout``, a closed terminal): raised where the command is,
    so that it cleans up as for Ctrl-C (a convert removes its half-written temp folder)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_terminate(signum: int, _frame) -> None:
    raise _Terminated(signum)


def _catch_termination() -> None:
    """SIGTERM and SIGHUP end a command like Ctrl-C does, cleaning up, with exit 128 + the signal.
    A signal the caller set to be ignored (``nohup``: SIGHUP) stays ignored. ``elastor run``
    installs its own handlers over these."""
    import signal
    for s in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):   # not the main thread: leave them
            if signal.getsignal(s) is signal.SIG_DFL:
                signal.signal(s, _on_terminate)


def _stop_early(signum: int, _frame) -> None:
    raise StoppedEarly(signum)


def _reopen_closed_std_streams() -> None:
    """A standard stream the caller closed (``elastor convert ... >&-``, ``2>&-``) is opened on
    /dev/null, as ``>/dev/null`` would be: Python leaves ``sys.stdout`` None there, and the next
    file a command opens would get descriptor 1 or 2 (a stray write to it would land in that file)."""
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                nfd = os.open(os.devnull, flags)
                if nfd != fd:
                    os.dup2(nfd, fd)
                    os.close(nfd)
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError):
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False, encoding="utf-8",
                                        errors="backslashreplace"))


class _EscapeFilter(logging.Filter):
    """Log lines with non-printable characters escaped, as the error lines are: a path or name in a
    message (``converted SRC -> DST``) is anyone's and may hold terminal escapes."""

    def filter(self, record: logging.LogRecord) -> bool:
        from .checkpoint.paths import printable
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed call: logging reports it as it would have
            return True
        if not msg.isprintable():
            record.msg, record.args = printable(msg), None
        return True


def main(argv: list[str] | None = None) -> int:
    import signal
    _reopen_closed_std_streams()
    words = sys.argv[1:] if argv is None else list(argv)
    if next((a for a in words if not a.startswith("-")), None) == "run":
        # elastor run's stop handling from the first line on (its own handlers replace these once
        # its module is imported): a SIGTERM or SIGINT while the parser's modules import is a clean
        # stop too (it was lost, or exit 143, in the first ~0.4 s; QA round 9, N2)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, _stop_early)
    _catch_termination()
    try:
        return _main(argv)
    except _Terminated as e:   # (a command's own handler below reports it; this is for the set-up)
        logging.getLogger("elastor").error("terminated by %s", signal.Signals(e.signum).name)
        return 128 + e.signum
    except StoppedEarly as e:
        logging.getLogger("elastor.run").warning("stopped by %s before any worker started: nothing to checkpoint",
                                                 signal.Signals(e.signum).name)
        return 128 + e.signum   # stopped, not finished: as a preemption of a running job (and torchrun)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # named by the subcommand's parser (its --help), as the other usage errors are
        subs = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
        hint = ("; -v/--verbose is elastor's own option: it goes before the command (elastor -v "
                f"{args.command} ...)") if set(extra) & {"-v", "--verbose"} and getattr(args, "command", None) else ""
        subs.get(getattr(args, "command", None) or "", parser).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command != "run":   # (the controller relays its workers' lines as they are)
        for h in logging.getLogger().handlers:
            if not any(isinstance(f, _EscapeFilter) for f in h.filters):   # main() may run again in-process
                h.addFilter(_EscapeFilter())
    if not args.verbose:   # megatron-core's import-time notes (no Transformer Engine / Apex on this host) are not ours
        logging.getLogger("megatron").setLevel(logging.WARNING)
        logging.getLogger("torch").setLevel(logging.WARNING)   # e.g. "FakeTensor cache stats" at exit
        warnings.filterwarnings("ignore", message=r"Transformer Engine and Apex are not installed", category=UserWarning)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    log = logging.getLogger("elastor")
    try:
        code = int(args.func(args) or 0)
        if sys.stdout is not None:
            sys.stdout.flush()   # a reader that left shows here (BrokenPipeError), not in the exit's flush
        return code
    except ElastorError as e:
        if isinstance(e, (ConfigError, CheckpointNotFoundError)):   # usage: a wrong path or value
            sys.stderr.write(f"elastor {args.command}: error: {_one_line(e)}\n")   # as the parser's own errors
            return 2
        if isinstance(e, PlanningError) and args.command == "plan":   # no layout fits: says why and what would
            sys.stderr.write(f"elastor plan: infeasible: {_one_line(e)}\n")
            return 1
        log.error("%s", _one_line(e))
        return 1
    except BrokenPipeError:  # `elastor plan ... | head`: the reader left; stop quietly, as a shell tool does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's flush finds no pipe
        return 141
    except OSError as e:  # a full disk, a permission, a vanished file: a runtime failure, not a bug
        log.error("%s: %s", type(e).__name__, _one_line(e))
        return 1
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except _Terminated as e:
        import signal
        log.error("terminated by %s", signal.Signals(e.signum).name)
        return 128 + e.signum
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked (-v)
        sig = getattr(e, "sigval", None)
        if type(e).__name__ == "SignalException" and sig is not None:   # torch elastic's, while workers start
            # a stop before any trainer could checkpoint: exit 1, as for a stop of a script without hooks
            # (docs/elastic.md); 130 stays "interrupted twice"
            log.error("stopped by %s while the workers were starting (no checkpoint was taken)",
                      getattr(sig, "name", sig))
            return 1
        log.error("unexpected %s: %s (rerun with -v for the traceback)", type(e).__name__, _one_line(e),
                  exc_info=args.verbose)
        return 1
    except BaseException as e:   # torch.distributed.checkpoint's CheckpointException is a BaseException
        if type(e).__name__ != "CheckpointException":
            raise
        inner = next(iter((getattr(e, "failures", None) or {}).values()), None)
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        log.error("a torch.distributed.checkpoint read or write failed: %s (rerun with -v for the traceback)",
                  f"{type(inner).__name__}: {_one_line(inner)}" if isinstance(inner, BaseException) else "no detail",
                  exc_info=args.verbose)
        return 1


def console_main() -> None:
    """The ``elastor`` command. ``elastor run`` leaves without the interpreter's teardown once its
    work is done (logs flushed): torch's c10d store client keeps a C++ thread that, after the store's
    host is gone, can abort the process during teardown ("terminate called without an active
    exception", SIGABRT) in place of the exit code the run chose."""
    code = main()
    if next((a for a in sys.argv[1:] if not a.startswith("-")), None) == "run":
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line, non-printable characters escaped (a name from a checkpoint
    or the file system in it may carry terminal escapes)."""
    from .checkpoint.paths import printable
    return printable(" | ".join(x.strip() for x in str(e).splitlines() if x.strip()) or type(e).__name__)


if __name__ == "__main__":
    console_main()
