#!/usr/bin/env bash
# The main job on one machine: torchrun with NPROC processes (FSDP2 by default; PARALLEL=ddp for DDP).
# Extra arguments go to launch.train, e.g. `launch/run.sh --resume latest`.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
STEPS=${STEPS:-200}
PARALLEL=${PARALLEL:-auto}
MODE=${MODE:-in_backward}
RUN_DIR=${RUN_DIR:-runs/gpt}
cmd=(torchrun --standalone --nproc-per-node "$NPROC" -m launch.train --steps "$STEPS" --parallel "$PARALLEL"
     --optimizer-mode "$MODE" --run-dir "$RUN_DIR" "$@")
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
