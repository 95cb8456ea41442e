#!/usr/bin/env bash
# Per-kernel GPU time of iris's decode (batch 1) and prefill (one 2048-token prompt) steps with
# Nsight Compute (kernel durations only, clocks and caches as the card has them), kernels
# launched one by one (IRIS_CUDA_GRAPHS=0).
#   scripts/gpu-profile.sh MODEL_DIR LAYERS [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
M=$1 LAYERS=$2 LOG=${3:-/tmp/iris-profile}
mkdir -p "$LOG"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
IRIS=${IRIS_BIN:-/tmp/iris-bench/iris}
[ -x "$IRIS" ] || { xz -dc .gpu/iris.xz > "$IRIS" && chmod +x "$IRIS"; }
run() {  # name, iris bench args...
  local name=$1; shift
  IRIS_CUDA_GRAPHS=0 timeout 200 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --csv --log-file "$LOG/$name.csv" "$IRIS" bench --model "$M" --device cuda --dtype bf16 --json "$@" \
    > "$LOG/$name.out" 2>&1 || tail -5 "$LOG/$name.out"
}
run decode --batch-sizes 1 --prompt-len 128 --gen-len 6 --repeats 1
echo "== decode, batch 1 (3 steps)"; python3 scripts/gpu_profile.py "$LOG/decode.csv" 3 0 "$LAYERS"
run prefill --batch-sizes 1 --prompt-len 2048 --gen-len 2 --repeats 1
echo "== prefill, 2048 tokens"; python3 scripts/gpu_profile.py "$LOG/prefill.csv" 1 1 "$LAYERS"
