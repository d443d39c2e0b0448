#!/usr/bin/env bash
# The standard loop against in-backward on the same job: writes RUN_DIR/compare/report.md and compare.png.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
STEPS=${STEPS:-30}
PARALLEL=${PARALLEL:-auto}
RUN_DIR=${RUN_DIR:-runs/compare}
cmd=(torchrun --standalone --nproc-per-node "$NPROC" -m launch.train --compare --steps "$STEPS"
     --parallel "$PARALLEL" --run-dir "$RUN_DIR" "$@")
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
