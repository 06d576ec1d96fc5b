#!/usr/bin/env bash
# End to end: Megatron-LM's own pretrain_gpt.py with the elastor patches trains, saves and resumes
# under new layouts (uninterrupted vs resume at the same layout, TP2, uneven PP2 from a plan,
# TP2 x PP2 from a plan, --no-load-optim / --finetune, a stock-checkpoint --load directory, bf16,
# the distributed optimizer) and runs under `elastor run --nproc-per-node 4 --on-failure shrink`
# (a SIGKILLed worker: relaunch on 3, re-plan, restore, losses reproduce; SIGTERM: the current
# iteration saved durably, exit 143). Results: WORKDIR/summary.json and one PASS/FAIL line per check.
#
# usage: scripts/megatron_lm_e2e.sh MEGATRON_LM_DIR [--gpu] [--only LIST] [--workdir DIR]
#   --only LIST      comma-separated cases (default: all): fp32, stock, bf16, distopt, distopt_bf16,
#                    fp16, elastic_kill, elastic_sigterm, elastic_memory (the elastic_* cases: CPU only;
#                    elastic_memory once the hooks have --elastor-memory-snapshot-* flags)
#   MEGATRON_LM_DIR  a Megatron-LM checkout at tag core_v0.16.1 (this script never downloads it);
#                    the patches are applied to it (patches/apply.sh; a no-op when already applied)
#   --gpu            run on GPUs (nccl, --bf16 --use-distributed-optimizer, stock pretrain_gpt.py,
#                    no shims); default: CPU + gloo through examples/megatron_lm/cpu_pretrain_gpt.py
# Needs: the Python that has torch, megatron-core 0.16.1 and elastor_ds' deps (PYTHON, default
# python3). Megatron-LM also imports six, regex, triton and pybind11: missing ones are installed,
# pinned and --no-deps, into a side folder (WORKDIR/site) that only these runs put on PYTHONPATH.
# Exit: 0 all checks passed, 1 a check failed, 2 usage.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
mlm="" ; gpu=() ; only=() ; work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) gpu=(--gpu); shift ;;
    --only) only=(--only "$2"); shift 2 ;;
    --workdir) work=$2; shift 2 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    -*) echo "megatron_lm_e2e.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$mlm" ] || { echo "megatron_lm_e2e.sh: one MEGATRON_LM_DIR only" >&2; exit 2; }; mlm=$1; shift ;;
  esac
done
[ -n "$mlm" ] || { echo "usage: $0 MEGATRON_LM_DIR [--gpu] [--only LIST] [--workdir DIR]" >&2; exit 2; }
[ -f "$mlm/pretrain_gpt.py" ] || { echo "megatron_lm_e2e.sh: $mlm has no pretrain_gpt.py: not a Megatron-LM checkout" >&2; exit 2; }
mlm=$(cd "$mlm" && pwd)
work=${work:-$(mktemp -d "${TMPDIR:-/tmp}/elastor_mlm_e2e.XXXXXX")}
mkdir -p "$work"

"$here/patches/apply.sh" "$mlm"

# Megatron-LM's extra imports, pinned; installed without dependencies into a side folder
site="$work/site"
need=()
for spec in six==1.17.0 regex==2026.9.29 pybind11==3.1.0 triton==3.6.0; do
  mod=${spec%%==*}
  if ! PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "import $mod" >/dev/null 2>&1; then need+=("$spec"); fi
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} into $site (--no-deps)"
  "$py" -m pip install -q --no-deps --target "$site" "${need[@]}"
fi

export PYTHONPATH="$mlm:$here:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYENV_VERSION=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')  # Megatron-LM's .python-version says 3.12
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
[ ${#gpu[@]} -eq 0 ] || unset DS_ACCELERATOR
echo "workdir $work"
exec "$py" "$here/examples/megatron_lm/e2e.py" "$mlm" "$work" "${gpu[@]}" "${only[@]}"
