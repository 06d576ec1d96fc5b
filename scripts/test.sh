#!/usr/bin/env bash
# Run the test suite (installs the pinned stack into .venv first).
#   ./scripts/test.sh            every tier: unit, dist, e2e, faults, netns, gpu (skipped without CUDA)
#   ./scripts/test.sh --quick    the unit tier only (pure code, on 2 pytest-xdist workers: well under a minute)
#   ./scripts/test.sh ARGS...    anything else goes to pytest, e.g. tests/dist or -k name
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -q -n 2 tests/unit "$@"
fi
exec .venv/bin/python -m pytest -q --durations=30 "$@"
