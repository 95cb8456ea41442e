#!/usr/bin/env bash
# Speculative decoding on a CUDA GPU, Qwen2.5-7B-shaped (random seeded bf16 weights, made by
# scripts/gpu_bench.py). On the GPU machine, from the repo root:
#
#   scripts/gpu-spec-bench.sh [RESULTS_DIR]
#
# - iris: $IRIS_BIN, else .gpu/iris.xz unpacked; $IRIS_OLD (optional): an older build whose
#   plain decode is measured alternately with this one (decode must not regress).
# - Plain decode at batch 1, 8, 64, 256; then every draft accepted (`iris bench --all-accepted`:
#   the drafter proposes the model's own greedy continuation) for K = 1, 2, 4 at batch 1, 8, 64:
#   tokens/s against plain decode, and a verify step's time against a decode step's
#   (step time = batch x tokens per verify / tokens per second).
# Prints one table; JSON per run in RESULTS_DIR (default $OUT or /tmp/iris-spec/results).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-spec/results}}
DIR=${BENCH_DIR:-/tmp/iris-spec}
MODEL=${BENCH_MODEL:-qwen2.5-7b}
GEN_LEN=${GEN_LEN:-64}
REPEATS=${REPEATS:-3}
mkdir -p "$RES" "$DIR"
IRIS=${IRIS_BIN:-}
if [ -z "$IRIS" ]; then
  xz -dc .gpu/iris.xz > "$DIR/iris" && chmod +x "$DIR/iris" && IRIS="$DIR/iris"
fi
md="$DIR/$MODEL"
if [ ! -f "$md/done.json" ]; then
  PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py make "$md" "$MODEL" > "$RES/make.log" 2>&1 || { cat "$RES/make.log"; exit 1; }
  touch "$md/done.json"
fi
common=(--model "$md" --device cuda --dtype bf16 --json --prompt-len 128 --gen-len "$GEN_LEN")
run() { # name, binary, args...
  local name=$1 bin=$2
  shift 2
  "$bin" bench "${common[@]}" "$@" > "$RES/$name.json" 2> "$RES/$name.err" || { echo "$name failed:"; tail -3 "$RES/$name.err"; }
}
for round in 1 2; do
  run "plain-new-$round" "$IRIS" --batch-sizes 1,8,64,256 --repeats "$REPEATS"
  [ -n "${IRIS_OLD:-}" ] && run "plain-old-$round" "$IRIS_OLD" --batch-sizes 1,8,64,256 --repeats "$REPEATS"
done
for k in 1 2 4; do
  run "accepted-k$k" "$IRIS" --batch-sizes 1,8,64 --repeats "$REPEATS" --all-accepted \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $k}"
done
python3 - "$RES" <<'PY'
import json, os, sys
res = sys.argv[1]
def rows(name):
    try:
        return {r["batch"]: r for r in json.load(open(f"{res}/{name}.json"))["rows"]}
    except Exception:
        return {}
print("| build | batch | plain decode tok/s (round 1 / 2) |")
print("|---|---|---|")
for build in ["new", "old"]:
    r1, r2 = rows(f"plain-{build}-1"), rows(f"plain-{build}-2")
    for b in sorted(r1):
        print(f"| {build} | {b} | {r1[b]['decode_tok_s']:.1f} / {r2.get(b, {}).get('decode_tok_s', float('nan')):.1f} |")
plain = {b: (rows("plain-new-1").get(b, {}).get("decode_tok_s", 0) + rows("plain-new-2").get(b, {}).get("decode_tok_s", 0)) / 2 for b in [1, 8, 64]}
print()
print("| K | batch | acceptance | tokens/verify | decode tok/s | x plain | verify step ms | x decode step |")
print("|---|---|---|---|---|---|---|---|")
for k in [1, 2, 4]:
    for b, r in sorted(rows(f"accepted-k{k}").items()):
        tps = r["decode_tok_s"]
        tpv = r.get("tokens_per_verify") or 1.0
        step = b * tpv / tps * 1e3
        plain_step = b / plain[b] * 1e3 if plain.get(b) else float("nan")
        print(f"| {k} | {b} | {100 * (r.get('acceptance_rate') or 0):.1f}% | {tpv:.2f} | {tps:.1f} | "
              f"{tps / plain[b] if plain.get(b) else float('nan'):.2f} | {step:.2f} | {step / plain_step:.2f} |")
PY
