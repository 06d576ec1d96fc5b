#!/usr/bin/env bash
# The README's main job, on CPU processes (gloo) by default, run by the elastic controller:
#   `elastor run` trains a GPT (megatron-core TP layers in DeepSpeed's pipeline engine) on 4 processes
#   as TP2 x PP2 with asynchronous storage checkpoints and a memory snapshot every iteration (node tmpfs,
#   `elastor run --snapshot-dir`); the demo kills one worker as a GPU loss would; the controller shrinks
#   to 3 processes under the planner's layout and resumes from the snapshot in memory (<= 1 iteration
#   lost; --snapshot-interval 0: storage only, --measure-overhead: snapshot step overhead); the device "returns"
#   (operator scale-up signal) and the job scales back to 4 and finishes. Summary table, recovery
#   time breakdown and timeline plot at the end.
# Installs what it needs into .venv first. Outputs go to runs/elastic_demo/ (events, timeline.png).
#   ./scripts/demo.sh --gpus      # the same on this node's GPUs (NCCL)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
if [[ " $* " == *" --gpus "* ]]; then unset DS_ACCELERATOR; fi
exec .venv/bin/python examples/megatron_gpt/elastic_demo.py "$@"
