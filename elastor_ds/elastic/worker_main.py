"""Worker entry point of ``elastor run``: ``python -m elastor_ds.elastic.worker_main SCRIPT ARGS...``.

Records the process start time, installs the stop-signal handlers and the parent-death signal
before anything slow is imported, then runs SCRIPT as ``__main__`` (its exit code is the worker's).
After a stop the ranks agreed on (the checkpoint is durable by then), the process exits at once
instead of running the interpreter's teardown (seconds with torch, DeepSpeed and gloo loaded): the
relaunch starts sooner.
"""
from __future__ import annotations

import os
import sys
import time

os.environ["ELASTOR_T_PROCESS_START"] = repr(time.time())


def main() -> None:
    import runpy

    from elastor_ds.elastic import worker
    worker.install_signal_handlers()
    worker.set_parent_death_signal()
    if len(sys.argv) < 2:
        print("usage: python -m elastor_ds.elastic.worker_main SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if worker.agreed():
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise


if __name__ == "__main__":
    main()
