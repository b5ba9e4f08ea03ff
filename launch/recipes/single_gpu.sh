#!/usr/bin/env bash
# One GPU (or one single-host TPU VM): memory plan, then the study (SFT base, RL runs, evaluation
# and the comparison report) in one workdir; rerunning the same command resumes.
#
#   MODEL=/models/Qwen2.5-1.5B-Instruct WORKDIR=/data/study_q15 \
#     launch/recipes/single_gpu.sh [--config.k=v ...]
#   CONFIG=configs/default.py STEP=train ... launch/recipes/single_gpu.sh   # training only
#
# CONFIG defaults to configs/hf.py:qwen2.5-1.5b (bfloat16, 128 episodes per RL step in 32
# minibatches, sized for one 80 GB GPU). The plan uses the memory the device reports (or
# DEVICE_MEMORY_GB) and stops here, naming the change to make, if the run would not fit.
# STEP: study (default) or train. DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail

cd "$(dirname "$0")/../.."
: "${MODEL:?set MODEL (a local Hugging Face directory)}" "${WORKDIR:?set WORKDIR}"
CONFIG=${CONFIG:-configs/hf.py:qwen2.5-1.5b}
STEP=${STEP:-study}
PYTHON=${PYTHON:-.venv/bin/python}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}

run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

MEM=()
if [[ -n "${DEVICE_MEMORY_GB:-}" ]]; then MEM=(--device_memory_gb="$DEVICE_MEMORY_GB"); fi
run "$PYTHON" -m launch.plan --config="$CONFIG" --config.model.path="$MODEL" --num_devices=1 \
  ${MEM[@]+"${MEM[@]}"} "$@"
case "$STEP" in
  study|train)
    run "$PYTHON" -m "launch.$STEP" --config="$CONFIG" --workdir="$WORKDIR" \
      --config.model.path="$MODEL" --config.num_devices=1 "$@"
    ;;
  *)
    echo "unknown STEP=$STEP; use study or train" >&2
    exit 2
    ;;
esac
