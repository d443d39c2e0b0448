#!/usr/bin/env bash
# Two (or NNODES) machines: run this on every machine with the same MASTER=host:port (the first machine's address
# and a free port) and JOB_ID. Extra arguments go to launch.train.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-2}
NPROC=${NPROC:-2}
MASTER=${MASTER:?set MASTER=host:port of the first machine}
JOB_ID=${JOB_ID:-gpt}
STEPS=${STEPS:-200}
# restarts (--max-restarts) need a fresh rendezvous store per round (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
cmd=(torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint "$MASTER"
     --rdzv-id "$JOB_ID" -m launch.train --steps "$STEPS" "$@")
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
