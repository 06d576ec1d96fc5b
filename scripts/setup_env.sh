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
# etcd (Debian's etcd-server) for the netns tier's etcd rendezvous test: installed as root only, when
# absent. The tier needs root anyway; as root a missing etcd fails that test with this reason.
if [ "$(id -u)" = 0 ] && ! command -v etcd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q etcd-server >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q etcd-server >/dev/null 2>&1; } ||
      echo "setup_env: apt-get install etcd-server failed: the netns etcd test will fail" >&2
  else
    echo "setup_env: no apt-get here to install etcd-server: the netns etcd test will fail (install etcd 3.4+)" >&2
  fi
fi
