#!/usr/bin/env bash
# The GPU check: everything a CUDA machine runs, in one call, within 8 minutes (docs/development.md).
#
# Where there is network:  bash scripts/fetch_gpu_wheels.sh   (peer wheels into .whl/, ~6 MB)
# Then, on the GPU machine with .whl/ alongside:  bash scripts/gpu_check.sh
#
# It builds the package against the machine's own torch, runs the test suite with the
# Triton kernels compiled for the GPU (CUDA tensors, checked against the fp64 reference),
# `rlvr-kernels check` and `rlvr-kernels bench` on CUDA. $OUT receives at most seven
# files: logs.tar.gz (every log and plot), and the three bench runs' .json/.md (commit them
# as benchmarks/results/<date>-h200*.*). The tarball is written on any exit, a timeout
# included.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlvr-gpu-out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
trap 'cp "$LOGS"/results/*.{json,md} "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tar.gz" -C "$LOGS" .' EXIT
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/wheels.log" 2>&1 || { stamp "wheel install failed"; tail -20 "$LOGS/wheels.log"; }
  # ray (imported by verl at module level, never used by the functions we call) is stubbed.
  export PYTHONPATH=/tmp/site:$PWD/scripts/gpu_stubs${PYTHONPATH:+:$PYTHONPATH}
  # ninja's binary (from its wheel), which compiles the C++ kernels.
  export PATH=/tmp/site/bin:$PATH
fi

stamp "build"
# The package is pure Python; `build` compiles the C++ kernels against the machine's torch.
if ! { $PY -m pip install -q --no-build-isolation --no-deps -e . && $PY -m rlvr_kernels build; } > "$LOGS/build.log" 2>&1; then
  tail -40 "$LOGS/build.log"; exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$LOGS/gpu.txt" 2>&1
$PY -m rlvr_kernels info | tee "$LOGS/info.txt"
$PY -c "import verl.trainer.ppo.core_algos, trl" > "$LOGS/peers.txt" 2>&1 && echo "peers importable" || { echo "peers NOT importable:"; tail -3 "$LOGS/peers.txt"; }

stamp "tests on CUDA"
# The CLI tests re-run check and a quick bench, both done below on the real workload.
timeout 160 $PY -m pytest -q -p no:cacheprovider --ignore=tests/common/test_cli.py tests 2>&1 | tee "$LOGS/tests.log" | tail -12

stamp "check"
timeout 40 $PY -m rlvr_kernels check > "$LOGS/check.txt" 2>&1; echo "check exit code $?"; tail -3 "$LOGS/check.txt"

stamp "bench"
# Two runs, so a packing workload that overruns (a 0.5B model over 49k tokens, FlexAttention
# compiles) cannot take the op tables with it: each run writes its files only at its end.
timeout 130 $PY -m rlvr_kernels bench --op group_advantages --op policy_loss --op linear_logprobs \
  --out "$LOGS/results" 2>&1 | tee "$LOGS/bench.log" | grep -v "^bench" | tail -40
stamp "bench packing"
timeout 75 $PY -m rlvr_kernels bench --op packing --out "$LOGS/results" 2>&1 | tee "$LOGS/bench-packing.log" \
  | grep -v "^bench" | tail -25
stamp "bench trainer"
# One TRL GRPOTrainer step and one verl engine step, stock vs apply(): last, as the least
# essential (it needs TRL's and verl's dependencies on the machine).
timeout 55 $PY -m rlvr_kernels bench --op trainer --out "$LOGS/results" 2>&1 | tee "$LOGS/bench-trainer.log" \
  | grep -v "^bench" | tail -25
stamp "done"
