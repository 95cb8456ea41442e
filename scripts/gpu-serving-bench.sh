#!/usr/bin/env bash
# Serving under load on the GPU, random bf16 weights made here by scripts/gpu_bench.py:
# - prefix caching: a 10-turn conversation, each turn resending the growing conversation, with
#   the cache on and off and against the prefill of each turn's new tokens alone
#   (`iris bench --conversation-turns`), on a Qwen2.5-7B-shaped text model and on a
#   Qwen2.5-VL-7B-shaped model whose conversations open with a 448x448 image;
# - long prompts beside decodes: 8 streams decode while a 32,000-token prompt is admitted
#   (`iris bench --admit-prompt-len`), whole in one step, in the default 2,048-token steps, and
#   with --long-prefill-token-threshold 512.
# On the GPU machine, from the repo root:
#
#   scripts/gpu-serving-bench.sh [RESULTS_DIR]
#
# PARTS="text image admission" (the default) picks what runs; the checkpoints are made once.
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
PARTS=${PARTS:-text image admission}
has() { [[ " $PARTS " == *" $1 "* ]]; }
has image && { [ -f "$DIR/qwen2.5-vl-7b/done.json" ] || { py make-vl "$DIR/qwen2.5-vl-7b" > "$RES/make-vl.log" 2>&1 && touch "$DIR/qwen2.5-vl-7b/done.json"; } || { tail -5 "$RES/make-vl.log"; exit 1; }; }
# Two engines at once (cache on and off), so each gets a pool of its own size.
common=(--device cuda --dtype bf16 --kv-cache-memory 24GiB --conversation-turns 10 --prompt-len 128 --gen-len 16 --repeats ${REPEATS:-3})
has text && { "$IRIS" bench --model "$DIR/qwen2.5-7b" "${common[@]}" > "$RES/conversation-text.md" \
  2> "$RES/conversation-text.err" || tail -5 "$RES/conversation-text.err"; }
has image && { "$IRIS" bench --model "$DIR/qwen2.5-vl-7b" "${common[@]}" --conversation-image --image-size 448x448 \
  > "$RES/conversation-image.md" 2> "$RES/conversation-image.err" || tail -5 "$RES/conversation-image.err"; }
adm=(--model "$DIR/qwen2.5-7b" --device cuda --dtype bf16 --admit-prompt-len 32000 --streams 8 --prompt-len 128 --gen-len 32)
has admission && for policy in "--max-num-batched-tokens 32768" "--max-num-batched-tokens 2048" "--max-num-batched-tokens 2048 --long-prefill-token-threshold 512"; do
  "$IRIS" bench "${adm[@]}" $policy >> "$RES/admission.md" 2>> "$RES/admission.err" || tail -5 "$RES/admission.err"
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u
has text && { echo "== Qwen2.5-7B-shaped, text"; cat "$RES/conversation-text.md"; }
has image && { echo "== Qwen2.5-VL-7B-shaped, a 448x448 image in the first turn"; cat "$RES/conversation-image.md"; }
has admission && { echo "== Qwen2.5-7B-shaped: 8 streams while a 32,000-token prompt is admitted"; cat "$RES/admission.md"; }
