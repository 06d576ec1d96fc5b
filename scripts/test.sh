#!/usr/bin/env bash
# Run the whole test suite (installs the pinned stack into .venv first).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q "$@"
