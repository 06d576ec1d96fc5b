#!/usr/bin/env bash
# Run the test suite (installs the pinned stack into .venv first).
#   ./scripts/test.sh            every tier: unit, dist, e2e, faults, netns, gpu (skipped without CUDA),
#                                on 2 pytest-xdist workers (ELASTOR_TEST_WORKERS=N to change, 0 for one
#                                process): most multi-process tests wait on timers, so two run side by side
#   ./scripts/test.sh --quick    the unit tier only (pure code, on 2 workers: well under a minute)
#   ./scripts/test.sh ARGS...    anything else goes to pytest in one process, e.g. tests/dist or -k name
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -q -n 2 tests/unit "$@"
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=30 "$@"
fi
workers="${ELASTOR_TEST_WORKERS:-2}"
# loadgroup: the netns tier and each file with a module-scoped fixture stay on one worker
# (tests/conftest.py marks them); no reorder: conftest puts the longest waits first
exec .venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadgroup --no-loadscope-reorder
