#!/usr/bin/env bash
# Prefix caching on the GPU (issue: prefix caching): a 10-turn conversation, each turn resending
# the growing conversation, with the cache on and off and against the prefill of each turn's new
# tokens alone (`iris bench --conversation-turns`), on a Qwen2.5-7B-shaped text model and on a
# Qwen2.5-VL-7B-shaped model whose conversations open with a 448x448 image. Random bf16 weights
# made here by scripts/gpu_bench.py. On the GPU machine, from the repo root:
#
#   scripts/gpu-conversation-bench.sh [RESULTS_DIR]
#
# iris: $IRIS_BIN, else .gpu/iris.xz (scripts/gpu-build.sh). Prints the tables last.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-bench/results}}
DIR=${BENCH_DIR:-/tmp/iris-bench}
mkdir -p "$RES" "$DIR"
IRIS=${IRIS_BIN:-}
if [ -z "$IRIS" ]; then
  xz -dc .gpu/iris.xz > "$DIR/iris" && chmod +x "$DIR/iris" && IRIS="$DIR/iris"
fi
py() { PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py "$@"; }
[ -f "$DIR/qwen2.5-7b/done.json" ] || { py make "$DIR/qwen2.5-7b" qwen2.5-7b > "$RES/make-text.log" 2>&1 && touch "$DIR/qwen2.5-7b/done.json"; } || { tail -5 "$RES/make-text.log"; exit 1; }
[ -f "$DIR/qwen2.5-vl-7b/done.json" ] || { py make-vl "$DIR/qwen2.5-vl-7b" > "$RES/make-vl.log" 2>&1 && touch "$DIR/qwen2.5-vl-7b/done.json"; } || { tail -5 "$RES/make-vl.log"; exit 1; }
common=(--device cuda --dtype bf16 --conversation-turns 10 --prompt-len 128 --gen-len 16 --repeats ${REPEATS:-3})
"$IRIS" bench --model "$DIR/qwen2.5-7b" "${common[@]}" > "$RES/conversation-text.md" 2> "$RES/conversation-text.err" \
  || tail -5 "$RES/conversation-text.err"
"$IRIS" bench --model "$DIR/qwen2.5-vl-7b" "${common[@]}" --conversation-image --image-size 448x448 \
  > "$RES/conversation-image.md" 2> "$RES/conversation-image.err" || tail -5 "$RES/conversation-image.err"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u
echo "== Qwen2.5-7B-shaped, text"; cat "$RES/conversation-text.md"
echo "== Qwen2.5-VL-7B-shaped, a 448x448 image in the first turn"; cat "$RES/conversation-image.md"
