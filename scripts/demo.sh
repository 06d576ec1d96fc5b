#!/usr/bin/env bash
# The README's main job, on CPU processes (gloo) by default:
#   train a GPT (megatron-core TP layers in DeepSpeed's pipeline engine) on 4 processes as TP2 x PP2,
#   checkpoint asynchronously, kill one worker as a GPU loss would, ask the planner for the best
#   layout for the 3 processes left, relaunch, resume under that layout and keep training.
# Installs what it needs into .venv first. Outputs go to runs/elastic_demo/ (table, loss.png).
#   ./scripts/demo.sh --gpus      # the same on this node's GPUs (NCCL)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
if [[ " $* " == *" --gpus "* ]]; then unset DS_ACCELERATOR; fi
exec .venv/bin/python examples/megatron_gpt/elastic_demo.py "$@"
