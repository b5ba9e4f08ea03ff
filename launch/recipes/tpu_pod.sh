#!/usr/bin/env bash
# Multi-host Cloud TPU slice (v4-16, v5p-16, v5e-32, ...): one training process per TPU VM host,
# all started at once with `gcloud compute tpus tpu-vm ssh --worker=all`.
#
#   export TPU_NAME=my-v5p-16 ZONE=us-east5-a PROJECT=my-project NUM_DEVICES=8 \
#          MODEL=/mnt/shared/models/Qwen2.5-7B-Instruct WORKDIR=/mnt/shared/runs/q25
#   launch/recipes/tpu_pod.sh setup                  # copy this checkout + venv to every worker
#   launch/recipes/tpu_pod.sh plan                   # memory plan for the slice (worker 0)
#   launch/recipes/tpu_pod.sh train [--config.k=v ...]
#
# MODEL and WORKDIR must be the same path on every worker (a shared filesystem: Filestore/NFS or
# a gcsfuse mount): each host reads only its own shards of the checkpoint, and checkpoints are
# written by all hosts. NUM_DEVICES: the slice's JAX devices (chips; `jax.device_count()` after
# initialisation). CONFIG (default configs/hf.py:qwen2.5-7b) takes --config.* overrides after
# `train`. The processes join one JAX runtime through jax.distributed (JAXAGENT_DISTRIBUTED=auto:
# JAX reads the slice layout from the TPU metadata). DRY_RUN=1 prints the commands instead.
set -euo pipefail

STEP=${1:?"usage: $0 setup|plan|train [--config.k=v ...]"}
shift
: "${TPU_NAME:?set TPU_NAME (the TPU VM slice)}" "${ZONE:?set ZONE}" "${PROJECT:?set PROJECT}"
CONFIG=${CONFIG:-configs/hf.py:qwen2.5-7b}
REMOTE_DIR=${REMOTE_DIR:-jaxagent}             # relative to each worker's home directory
REPO=$(cd "$(dirname "$0")/../.." && pwd)

run() {                                        # run, or print with DRY_RUN=1
  if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

on_workers() {                                 # on_workers WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
    --worker="$1" --command="$2"
}

EXTRA=""
if (( $# )); then EXTRA=$(printf '%q ' "$@"); fi
Q_MODEL=$(printf '%q' "${MODEL:-}")
Q_WORKDIR=$(printf '%q' "${WORKDIR:-}")
case "$STEP" in
  setup)
    run tar czf /tmp/jaxagent.tgz --exclude=.venv --exclude=.git --exclude=workdirs -C "$REPO" .
    run gcloud compute tpus tpu-vm scp /tmp/jaxagent.tgz "$TPU_NAME":jaxagent.tgz \
      --zone="$ZONE" --project="$PROJECT" --worker=all
    on_workers all "mkdir -p $REMOTE_DIR && tar xzf jaxagent.tgz -C $REMOTE_DIR && cd $REMOTE_DIR \
&& python3 -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e . 'jax[tpu]'"
    ;;
  plan)
    : "${MODEL:?set MODEL}" "${NUM_DEVICES:?set NUM_DEVICES (chips in the slice)}"
    # One process, no distributed runtime: the plan for NUM_DEVICES devices, checked against the
    # HBM that worker 0's chip reports. Exits nonzero (naming the fix) if it does not fit.
    on_workers 0 "cd $REMOTE_DIR && .venv/bin/python -m launch.plan --config=$CONFIG \
--config.model.path=$Q_MODEL --num_devices=$NUM_DEVICES $EXTRA"
    ;;
  train)
    : "${MODEL:?set MODEL}" "${WORKDIR:?set WORKDIR (shared by all workers)}"
    on_workers all "set -o pipefail; cd $REMOTE_DIR && JAXAGENT_DISTRIBUTED=auto .venv/bin/python \
-m launch.train --config=$CONFIG --workdir=$Q_WORKDIR --config.model.path=$Q_MODEL $EXTRA 2>&1 \
| tee -a \$HOME/jaxagent_train.log"
    ;;
  *)
    echo "unknown step $STEP; use setup, plan or train" >&2
    exit 2
    ;;
esac
