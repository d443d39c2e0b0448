#!/usr/bin/env bash
# Every CUDA check of dist_optim in one run, for a GPU machine (a few minutes, not yet measured; under 8 by the
# per-step timeouts): the tests in tests/gpu (one process; DDP, FSDP2 and pipeline stages on NCCL, 1 rank per GPU;
# FSDP2 with CPUOffloadPolicy) and the CUDA variants of the benchmarks. Results (logs, JUnit XML, JSON) go to $OUT if set,
# else ./gpu-results. A failing step does not stop the others; the script fails at the end if any step did.
#
#   bash tests/gpu/run.sh                     # from the repository root (or anywhere: it finds the root)
#   OUT=/tmp/r PYTHON=.venv/bin/python bash tests/gpu/run.sh
#
# Exits 3 at once, with what it found, where there is no CUDA device.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python}
RESULTS=${OUT:-$ROOT/gpu-results}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}    # seconds for the whole of tests/gpu
BENCH_TIMEOUT=${BENCH_TIMEOUT:-75}   # seconds per benchmark
mkdir -p "$RESULTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DIST_OPTIM_GPU_RESULTS="$RESULTS"
# the stress tests need kernels queued asynchronously and the caching allocator on
unset CUDA_LAUNCH_BLOCKING PYTORCH_NO_CUDA_MEMORY_CACHING

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    # No torch here: install the project with its test extra. Not with -c constraints.txt: that file pins the
    # CPU-only torch build of the development machines; plain pip picks the CUDA build on Linux. Needs a
    # reachable package index.
    echo "+ $PYTHON -m pip install -e '.[test]'"
    "$PYTHON" -m pip install -e '.[test]'
fi

echo "+ $PYTHON -c 'import torch; ...'  # what this machine has"
GPUS=$("$PYTHON" - <<'EOF'
import torch
import torch.distributed as dist

cuda = torch.cuda.is_available()
n = torch.cuda.device_count() if cuda else 0
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available: {cuda}, devices: {n}, "
      f"NCCL: {dist.is_available() and dist.is_nccl_available()}", file=__import__("sys").stderr)
for i in range(n):
    print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}", file=__import__("sys").stderr)
print(n)
EOF
)
if [ "$GPUS" -eq 0 ]; then
    echo "no CUDA device: nothing to run here (tests/gpu skips on this machine; see docs/cuda.md)" >&2
    exit 3
fi

declare -A CODES=()
step() {  # step NAME TIMEOUT COMMAND...: run, log to $RESULTS/NAME.log, record the exit code, never stop
    local name=$1 limit=$2
    shift 2
    echo
    echo "+ $*"
    set +e
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
    CODES[$name]=${PIPESTATUS[0]}
    set -e
    echo "= $name: exit ${CODES[$name]}"
}

step tests "$TEST_TIMEOUT" "$PYTHON" -m pytest tests/gpu -v -rs -s -p no:xdist \
    --junitxml "$RESULTS/tests-gpu.xml"
step bench_core "$BENCH_TIMEOUT" "$PYTHON" -m benchmarks.bench_core --device cuda --quick \
    --out "$RESULTS/bench_core_cuda.json"
if [ "$GPUS" -ge 2 ]; then
    step bench_distributed "$BENCH_TIMEOUT" "$PYTHON" -m benchmarks.bench_distributed --device cuda --quick \
        --out "$RESULTS/bench_distributed_cuda.json"
else
    echo
    echo "bench_distributed: not run, it needs 2 GPUs (2 NCCL ranks, one per GPU) and this machine has $GPUS"
fi

echo
echo "+ summary of $RESULTS"
"$PYTHON" - "$RESULTS" <<'EOF' || true
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


if m := load("cuda_memory.json"):
    print(f"one process, {m['model']}: peak {m['peak_bytes_standard'] / 2**20:.1f} -> "
          f"{m['peak_bytes_in_backward'] / 2**20:.1f} MiB; saved {m['saved_fraction_of_grad_bytes']:.3f} of gradient "
          f"bytes, {m['saved_fraction_of_theoretical']:.3f} of the theoretical saving")
if r := load("bench_core_cuda.json"):
    for model, res in r["models"].items():
        ratios = ", ".join(f"{k} {v['paired_median']:.3f}" for k, v in res["ratios"].items())
        saving = res["saving"]["inbackward"]["fraction"]
        print(f"bench_core {model}: time ratios {ratios}; peak saving "
              f"{'n/a' if saving is None else f'{saving:.3f}'} of theoretical")
if r := load("bench_distributed_cuda.json"):
    for key, s in r["summary"].items():
        fmt = lambda xs: " ".join("n/a" if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"bench_distributed {key}: time ratio per rank {fmt(s['time_ratio_paired'])}, saved/held "
              f"{fmt(s['saving_fraction_of_held'])}, bitwise {s['params_bitwise_equal']}")
EOF

echo
failed=0
for name in "${!CODES[@]}"; do
    echo "$name: exit ${CODES[$name]}"
    [ "${CODES[$name]}" -eq 0 ] || failed=1
done
echo "results in $RESULTS"
exit $failed
