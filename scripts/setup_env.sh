#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned development stack. Idempotent.
# torch goes first so pip takes the local CPU wheel (see README "Install").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.elastor_deps
WANT=$(cat requirements-dev.txt setup.py | sha1sum | cut -c1-16)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  echo "$WANT" > "$STAMP"
fi
