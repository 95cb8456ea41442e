#!/usr/bin/env bash
# Benchmarks iris on a CUDA GPU against the hardware's bandwidth bound and against
# transformers, in one go (see scripts/README.md). On the GPU machine, from the repo root:
#
#   scripts/gpu-bench.sh [RESULTS_DIR]
#
# - iris: $IRIS_BIN, else .gpu/iris.xz (made by scripts/gpu-build.sh) unpacked, else
#   target/release/iris; it must be built with --features cuda.
# - Models ($BENCH_MODELS, default "smollm2-135m qwen2.5-7b"): random seeded bf16 weights of
#   the real configs, written to $BENCH_DIR (default /tmp/iris-bench) by scripts/gpu_bench.py.
# - iris bench: decode at batch 1, 8, 64, 256 (128-token prompts, $GEN_LEN new tokens, median
#   of 3); prefill and TTFT of one 2048-token prompt. transformers generate: the same batches
#   (32 new tokens), the same prefill. Copy bandwidth measured with torch in the same run.
# - SAMPLED=1 (default): the decode bench again with sampling (temperature 1, top-k 50, top-p 0.9).
# Prints a summary table last; full logs and results.json go to RESULTS_DIR (default $OUT or
# /tmp/iris-bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-bench/results}}
DIR=${BENCH_DIR:-/tmp/iris-bench}
MODELS=${BENCH_MODELS:-"smollm2-135m qwen2.5-7b"}
GEN_LEN=${GEN_LEN:-128}
HF=${HF:-1}
mkdir -p "$RES" "$DIR"
IRIS=${IRIS_BIN:-}
if [ -z "$IRIS" ]; then
  if [ -f .gpu/iris.xz ]; then
    xz -dc .gpu/iris.xz > "$DIR/iris" && chmod +x "$DIR/iris" && IRIS="$DIR/iris"
  else
    IRIS=target/release/iris
  fi
fi
py() { PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py "$@"; }
last_json() { grep '^{' "$1" | tail -1; }

py bandwidth > "$RES/bandwidth.log" 2>&1 || { cat "$RES/bandwidth.log"; exit 1; }
echo "{\"bandwidth\": $(last_json "$RES/bandwidth.log"), \"models\": [" > "$RES/results.json"
first=1
for m in $MODELS; do
  md="$DIR/$m"
  t0=$(date +%s)
  if [ ! -f "$md/done.json" ]; then
    py make "$md" "$m" > "$RES/make-$m.log" 2>&1 || { cat "$RES/make-$m.log"; exit 1; }
    last_json "$RES/make-$m.log" > "$md/done.json"
  fi
  cp "$md/done.json" "$RES/weights-$m.json"
  echo "== $m: checkpoint written in $(( $(date +%s) - t0 )) s"
  common=(--model "$md" --device cuda --dtype bf16 --json)
  "$IRIS" bench "${common[@]}" --batch-sizes 1,8,64,256 --prompt-len 128 --gen-len "$GEN_LEN" --repeats 3 \
    > "$RES/iris-decode-$m.json" 2> "$RES/iris-decode-$m.err" || { echo "iris bench failed:"; tail -5 "$RES/iris-decode-$m.err"; }
  "$IRIS" bench "${common[@]}" --batch-sizes 1 --prompt-len 2048 --gen-len 2 --repeats 3 \
    > "$RES/iris-prefill-$m.json" 2> "$RES/iris-prefill-$m.err" || { echo "iris prefill failed:"; tail -5 "$RES/iris-prefill-$m.err"; }
  # COMPARE_ENV="IRIS_CUDA_GRAPHS=0" (say): the same decode bench once more with that setting.
  if [ -n "${COMPARE_ENV:-}" ]; then
    env $COMPARE_ENV "$IRIS" bench "${common[@]}" --batch-sizes 1,8,64 --prompt-len 128 --gen-len 32 --repeats 1 \
      > "$RES/iris-compare-$m.json" 2> "$RES/iris-compare-$m.err"
    python3 -c 'import json,sys; [print("   %s: batch" % sys.argv[2], r["batch"], "decode %.1f tok/s" % r["decode_tok_s"]) for r in json.load(open(sys.argv[1]))["rows"]]' "$RES/iris-compare-$m.json" "$COMPARE_ENV" || tail -3 "$RES/iris-compare-$m.err"
  fi
  # SAMPLED=1 (default): decode once more drawing tokens (temperature 1, top-k 50, top-p 0.9)
  # instead of greedy: the draw runs on the device, only ids come back.
  if [ "${SAMPLED:-1}" = 1 ]; then
    "$IRIS" bench "${common[@]}" --batch-sizes 1,8,64,256 --prompt-len 128 --gen-len "$GEN_LEN" --repeats 1 \
      --temperature 1 --top-k 50 --top-p 0.9 > "$RES/iris-sampled-$m.json" 2> "$RES/iris-sampled-$m.err"
    python3 -c 'import json,sys; [print("   sampled (t=1, top-k 50, top-p 0.9): batch", r["batch"], "decode %.1f tok/s" % r["decode_tok_s"]) for r in json.load(open(sys.argv[1]))["rows"]]' "$RES/iris-sampled-$m.json" || tail -3 "$RES/iris-sampled-$m.err"
    # The same with the logits copied to the host and drawn there (how it ran before).
    IRIS_DEVICE_SAMPLING=0 "$IRIS" bench "${common[@]}" --batch-sizes 1,8,64,256 --prompt-len 128 --gen-len 32 --repeats 1 \
      --temperature 1 --top-k 50 --top-p 0.9 > "$RES/iris-hostsampled-$m.json" 2> "$RES/iris-hostsampled-$m.err"
    python3 -c 'import json,sys; [print("   sampled on the host: batch", r["batch"], "decode %.1f tok/s" % r["decode_tok_s"]) for r in json.load(open(sys.argv[1]))["rows"]]' "$RES/iris-hostsampled-$m.json" || tail -3 "$RES/iris-hostsampled-$m.err"
  fi
  echo "== $m: iris done at $(( $(date +%s) - t0 )) s"
  if [ "$HF" = 1 ]; then
    py hf "$md" --gen 32 --prefill-len 2048 > "$RES/hf-$m.log" 2>&1 || { echo "transformers failed:"; tail -5 "$RES/hf-$m.log"; }
    echo "== $m: transformers done at $(( $(date +%s) - t0 )) s"
  fi
  python3 - "$m" "$RES" "$(cat "$RES/weights-$m.json")" >> "$RES/results.json" <<PY
import json, sys
m, res, weights = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {"model": m, "weights": weights, "prefill_len": 2048}
try:
    dec = json.load(open(f"{res}/iris-decode-{m}.json"))["rows"]
    pre = json.load(open(f"{res}/iris-prefill-{m}.json"))["rows"][0]
    out["iris"] = {"decode": {str(r["batch"]): r["decode_tok_s"] for r in dec},
                   "prefill_tok_s": pre["prefill_tok_s"], "ttft_ms": pre["ttft_ms"], "rows": dec}
except Exception as e:
    print(f"iris results missing: {e}", file=sys.stderr)
try:
    lines = [l for l in open(f"{res}/hf-{m}.log") if l.startswith("{")]
    out["transformers"] = json.loads(lines[-1])
except Exception:
    pass
print(("" if $first else ",") + json.dumps(out))
PY
  first=0
  [ "${KEEP:-0}" = 1 ] || rm -rf "$md"
done
echo "]}" >> "$RES/results.json"
py table "$RES/results.json" | tee "$RES/summary.md"
