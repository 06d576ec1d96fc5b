#!/usr/bin/env bash
# Run the test suite (installs the pinned stack into .venv first).
#   ./scripts/test.sh            every tier: unit, dist, e2e, faults, netns, gpu (skipped without CUDA)
#   ./scripts/test.sh --quick    the unit tier only (pure code, one process: well under a minute)
#   ./scripts/test.sh ARGS...    anything else goes to pytest, e.g. tests/dist or -k name
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -q tests/unit "$@"
fi
exec .venv/bin/python -m pytest -q --durations=30 "$@"
