#!/usr/bin/env bash
# Decode speed by KV cache format on a CUDA GPU (benches/kv_decode.rs): one sequence, random
# Qwen2.5-7B-shaped bf16 weights (scripts/gpu_bench.py make), a cache filled to 1k / 8k / 32k
# tokens through the serving write ops, decode steps as the engine runs them (CUDA graphs).
# On the GPU machine, from the repo root:
#
#   scripts/gpu-kv-bench.sh [RESULTS_DIR]
#
# - The bench binary: $KV_BENCH_BIN, else .gpu/kv_decode.xz (scripts/gpu-build.sh) unpacked,
#   else `cargo bench` (needs a toolchain there).
# - KV_MODEL (default qwen2.5-7b; or smollm2-135m), KV_CONTEXTS (default 1024,8192,32768),
#   KV_CACHES (default bf16,tq-k3v4,tq-k4v4; tq-kXvY/wN: with a float window of N), KV_STEPS (default 20). The checkpoint goes to
#   $BENCH_DIR (default /tmp/iris-bench, shared with gpu-bench.sh) and is made once; its
#   config's max_position_embeddings is raised to 65536 in a copy, so that 32k tokens of
#   context (past Qwen2.5-7B's 32768) still use the device rotary table and CUDA graphs
#   (random weights: the model's own context limit means nothing here).
# - COMPARE_GRAPHS=1: the same once more with IRIS_CUDA_GRAPHS=0 (op by op).
# Prints the table; the log goes to RESULTS_DIR (default $OUT or /tmp/iris-bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-bench/results}}
DIR=${BENCH_DIR:-/tmp/iris-bench}
MODEL=${KV_MODEL:-qwen2.5-7b}
mkdir -p "$RES" "$DIR"
BIN=${KV_BENCH_BIN:-}
if [ -z "$BIN" ] && [ -f .gpu/kv_decode.xz ]; then
  xz -dc .gpu/kv_decode.xz > "$DIR/kv_decode" && chmod +x "$DIR/kv_decode" && BIN="$DIR/kv_decode"
fi
md="$DIR/$MODEL"
t0=$(date +%s)
if [ ! -f "$md/done.json" ]; then
  PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py make "$md" "$MODEL" > "$RES/make-$MODEL.log" 2>&1 \
    || { cat "$RES/make-$MODEL.log"; exit 1; }
  grep '^{' "$RES/make-$MODEL.log" | tail -1 > "$md/done.json"
fi
long="$DIR/$MODEL-long"
mkdir -p "$long"
for f in "$md"/*; do [ "$(basename "$f")" = config.json ] || ln -sfn "$f" "$long/$(basename "$f")"; done
python3 - "$md/config.json" "$long/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["max_position_embeddings"] = max(c.get("max_position_embeddings", 0), 65536)
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
echo "== $MODEL: checkpoint ready in $(( $(date +%s) - t0 )) s"
args=("$long" --device cuda --dtype bf16 --contexts "${KV_CONTEXTS:-1024,8192,32768}"
      --caches "${KV_CACHES:-bf16,tq-k3v4,tq-k4v4}" --steps "${KV_STEPS:-20}")
run() {
  if [ -n "$BIN" ]; then "$BIN" "${args[@]}"; else cargo bench --features cuda --bench kv_decode -- "${args[@]}"; fi
}
run 2>&1 | tee "$RES/kv-decode-$MODEL.log"
rc=${PIPESTATUS[0]}
if [ "${COMPARE_GRAPHS:-0}" = 1 ]; then
  IRIS_CUDA_GRAPHS=0 run 2>&1 | tee "$RES/kv-decode-$MODEL-nographs.log"
fi
# E2E=1: end to end through the engine too (iris bench: a 1,024-token prompt, batch 1 and 8),
# per cache format; iris from $IRIS_BIN or .gpu/iris.xz.
if [ "${E2E:-0}" = 1 ]; then
  IRIS=${IRIS_BIN:-}
  if [ -z "$IRIS" ] && [ -f .gpu/iris.xz ]; then xz -dc .gpu/iris.xz > "$DIR/iris" && chmod +x "$DIR/iris" && IRIS="$DIR/iris"; fi
  for c in $(echo "${KV_CACHES:-bf16,tq-k3v4,tq-k4v4}" | tr , ' '); do
    # tq-kXvY/wN: with a float window of N positions.
    win=0; case "$c" in */w*) win=${c##*/w} ;; esac
    "$IRIS" bench --model "$md" --device cuda --dtype bf16 --kv-cache-dtype "${c%%/*}" --kv-float-window "$win" \
      --batch-sizes 1,8 --prompt-len 1024 --gen-len 64 --repeats 3 > "$RES/e2e-$MODEL-${c//\//-}.txt" 2>&1 \
      || tail -3 "$RES/e2e-$MODEL-${c//\//-}.txt"
    echo "-- iris bench, KV cache $c:"; grep -E '^\|' "$RES/e2e-$MODEL-${c//\//-}.txt" || tail -5 "$RES/e2e-$MODEL-${c//\//-}.txt"
  done
fi
echo "== done in $(( $(date +%s) - t0 )) s"
exit "$rc"
