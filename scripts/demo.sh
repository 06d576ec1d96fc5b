#!/usr/bin/env bash
# The README's main job: a real multi-process save -> resharding load on CPU processes (gloo).
#   4 processes save a GPT-like state (weights + Adam moments) under TP2 x PP2 asynchronously,
#   then 3 processes (one "GPU" lost) load it under a heterogeneous layout and check every byte.
# Installs what it needs into .venv first. Output and checkpoints go to runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export OMP_NUM_THREADS=1
OUT=${OUT:-runs/demo}
rm -rf "$OUT" && mkdir -p "$OUT"
TORCHRUN=".venv/bin/torchrun --standalone"
echo "== phase 1: train-time save, 4 processes, TP2 x PP2 =="
$TORCHRUN --nproc-per-node 4 -m elastor_ds.demo --phase save --ckpt "$OUT/ckpt" --layout tp=2,pp=2,dp=1
echo "== phase 2: one process lost; resume on 3 processes, heterogeneous layout =="
PLAN='{"version":1,"replicas":[{"micro_batches":5,"stages":[{"tp":1,"layers":[0,3]},{"tp":1,"layers":[3,8]}]},{"micro_batches":3,"stages":[{"tp":1,"layers":[0,8]}]}]}'
$TORCHRUN --nproc-per-node 3 -m elastor_ds.demo --phase load --ckpt "$OUT/ckpt" --layout "$PLAN"
echo "== phase 3: and back to 2 processes, TP2 (checkpoint written by 4, read by 2) =="
$TORCHRUN --nproc-per-node 2 -m elastor_ds.demo --phase load --ckpt "$OUT/ckpt" --layout tp=2,pp=1,dp=1
.venv/bin/elastor inspect "$OUT/ckpt" | head -20 || true
