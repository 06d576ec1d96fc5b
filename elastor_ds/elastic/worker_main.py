"""Worker entry point of ``elastor run``: ``python -m elastor_ds.elastic.worker_main SCRIPT ARGS...``.

Records the process start time, installs the stop-signal handlers and the parent-death signal
before anything slow is imported, then runs SCRIPT as ``__main__`` (its exit code is the worker's).
After a stop the ranks agreed on (the checkpoint is durable by then), the process exits at once
instead of running the interpreter's teardown (seconds with torch, DeepSpeed and gloo loaded): the
relaunch starts sooner. A failure (an exception, a non-zero exit) exits at once too, with its code:
a teardown with gloo threads still running can abort the process (SIGABRT), which reads as a device
fault. An elastor ``ConfigError`` escaping the script (a misspelt ``"elastor"`` config key, say) is
exit 2, which ``elastor run`` does not retry: every relaunch would fail the same way. A standby worker (:mod:`standby_main`) ends in :func:`run_script` too. A script that ends
with 0 ignores SIGTERM and SIGINT during the teardown (:func:`_ignore_stop_signals`).
"""
from __future__ import annotations

import os
import sys
import time
import traceback

if __name__ == "__main__":   # a standby worker sets its own (the time it was assigned)
    _T_START = time.time()   # before the (small) import below
    from elastor_ds.elastic.protocol import ENV_T_START
    os.environ[ENV_T_START] = repr(_T_START)


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` (a script path) with ``argv[1:]`` as this worker's ``__main__``."""
    import runpy

    from elastor_ds.elastic import worker
    worker.install_signal_handlers()
    worker.set_parent_death_signal()
    if not argv:
        print("usage: python -m elastor_ds.elastic.worker_main SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    script = argv[0]
    if not os.path.isfile(script):   # deleted or moved since the launch: no relaunch can help (exit 2)
        print(f"elastor worker: the training script {script} no longer exists (deleted or moved after elastor run "
              f"started); restore it and start the job again", file=sys.stderr)
        _exit_now(2)
    sys.argv = list(argv)
    # as `python SCRIPT` (and torchrun): the folder of the script's real file, its links resolved, so that a
    # trainer linked into a run folder imports the modules beside its real file (was: the link's folder)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:   # sys.exit("message"): as Python does, the message goes to stderr and the code is 1
            print(e.code, file=sys.stderr)
            code = 1
        if worker.agreed() or code != 0:
            _exit_now(code)
        _ignore_stop_signals()
        raise
    except BaseException as e:   # noqa: BLE001 - the worker failed: report it, exit 1, skip the teardown
        from elastor_ds.errors import USER_ERRORS, ConfigError
        if isinstance(e, USER_ERRORS):   # the user's to fix (its message names what and how): one line
            from elastor_ds.checkpoint.paths import printable
            text = " | ".join(x.strip() for x in str(e).splitlines() if x.strip())
            print(f"elastor worker: {type(e).__name__}: {printable(text)}", file=sys.stderr)
            # a bad key, flag or value: the same on every relaunch, so exit 2 (not retried); a checkpoint
            # that cannot be used: a failure (1)
            _exit_now(2 if isinstance(e, ConfigError) else 1)
        traceback.print_exception(type(e), e, _from_the_script(e.__traceback__))
        _exit_now(1)
    _ignore_stop_signals()


def _from_the_script(tb):
    """The traceback from the script's first frame on, as ``python SCRIPT`` prints it: this module's
    and runpy's frames above it are the launcher's, not the user's (all of it if none is the script's)."""
    import runpy
    ours = {os.path.realpath(__file__), os.path.realpath(runpy.__file__), "<frozen runpy>"}
    first = tb
    while first is not None and (first.tb_frame.f_code.co_filename in ours
                                 or os.path.realpath(first.tb_frame.f_code.co_filename) in ours):
        first = first.tb_next
    return first if first is not None else tb


def _ignore_stop_signals() -> None:
    """The script ended with 0 (its own final save and ``finalize`` done): nothing is left for a stop
    signal to stop. The interpreter's teardown resets Python's handlers to the default, so a SIGTERM
    from a preemption that lands there ended a rank as killed by it (QA round 6, Q6-9: a Megatron-LM
    rank that had saved the last iteration, read as "ended on the stop signal without a
    checkpoint"). Ignored from here, the process exits with its own 0; a teardown that hangs still
    meets the controller's SIGKILL after ``--shutdown-timeout``."""
    import signal
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def _exit_now(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown. After a failure the teardown is where
    a worker whose peer vanished turned its exit 1 into SIGABRT ("terminate called without an active
    exception": a C++ thread still joinable at exit), which the controller reads as this worker's
    own device failing (shrink dropped it). After an agreed stop it only costs seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    run_script(sys.argv[1:])


if __name__ == "__main__":
    main()
