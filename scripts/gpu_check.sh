#!/usr/bin/env bash
# GPU checks (issue 13's GPU path): the gpu test tier and the GPU benchmark rows.
#   ./scripts/gpu_check.sh            (PYTHON=... to use another interpreter with a CUDA build of torch)
# Runs: pytest -m gpu (tests/gpu/test_gpu_snapshot.py: pinned staging, side-stream device-to-host copy,
# CUDA snapshot restored bit for bit under a reshard from a memory root, plus every other gpu-marked
# test), then bench/gpu_snapshot_bench.py (stall vs the D2H floor; save and load vs PyTorch DCP on
# the GPU). Results: bench/results/gpu_snapshot_bench.json; record the ratios in bench/README.md.
# Exits 2 when torch sees no CUDA device (the shared .venv holds a CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch ($("$PY" -c 'import torch; print(torch.__version__)')) sees no CUDA device; nothing run." >&2
  echo "gpu_check: run it on a GPU machine with a CUDA build of torch (PYTHON=/path/to/python)." >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
unset DS_ACCELERATOR
mkdir -p bench/results
echo "== gpu tests"
"$PY" -m pytest -q -m gpu tests/ -p no:cacheprovider
echo "== gpu bench rows"
"$PY" bench/gpu_snapshot_bench.py --mib "${GPU_BENCH_MIB:-1024}" --json bench/results/gpu_snapshot_bench.json
