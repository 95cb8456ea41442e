#!/usr/bin/env bash
# Structured outputs' cost: decode tokens/s without a grammar and with every sequence held to
# scripts/bench-schema.json (`iris bench --json-schema`), alternated, two rounds, on the GPU
# (Qwen2.5-7B-shaped) and on the host's CPU (SmolLM2-135M-shaped, CPU=0 skips it). Random
# seeded bf16 weights and a byte-level tokenizer of the real vocabulary size, made by
# scripts/gpu_bench.py (a grammar needs tokens that spell its text). On the GPU machine, from
# the repo root:
#
#   scripts/gpu-json-bench.sh [RESULTS_DIR]
#
# iris: $IRIS_BIN, else .gpu/iris.xz unpacked. Prints one table; JSON per run in RESULTS_DIR
# (default $OUT or /tmp/iris-json/results).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-json/results}}
DIR=${BENCH_DIR:-/tmp/iris-spec}
MODEL=${BENCH_MODEL:-qwen2.5-7b+bytes}
BATCHES=${BATCHES:-1,32}
mkdir -p "$RES" "$DIR"
IRIS=${IRIS_BIN:-}
if [ -z "$IRIS" ]; then
  xz -dc .gpu/iris.xz > "$DIR/iris" && chmod +x "$DIR/iris" && IRIS="$DIR/iris"
fi
model_dir() { # model name -> its directory
  local md="$DIR/$1"
  if [ ! -f "$md/done.json" ]; then
    PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py make "$md" "$1" > "$RES/make.log" 2>&1 || { cat "$RES/make.log" >&2; exit 1; }
    touch "$md/done.json"
  fi
  echo "$md"
}
run() { # name, model dir, device, args...
  local name=$1 md=$2 device=$3 dtype=bf16
  shift 3
  [ "$device" = cpu ] && dtype=f32
  "$IRIS" bench --model "$md" --device "$device" --dtype "$dtype" --json --prompt-len 128 --gen-len 64 --repeats 2 \
    --batch-sizes "$BATCHES" "$@" > "$RES/$name.json" 2> "$RES/$name.err" || { echo "$name failed:"; tail -3 "$RES/$name.err"; }
}
targets="cuda:$MODEL"
[ "${CPU:-1}" = 1 ] && targets="$targets cpu:${CPU_MODEL:-smollm2-135m+bytes}"
for t in $targets; do
  device=${t%%:*} md=$(model_dir "${t#*:}") || exit 1
  for round in 1 2; do
    run "$device-plain-$round" "$md" "$device"
    run "$device-schema-$round" "$md" "$device" --json-schema scripts/bench-schema.json
  done
done
python3 - "$RES" $targets <<'PY'
import json, sys
res = sys.argv[1]
def rows(name):
    try:
        return {r["batch"]: r for r in json.load(open(f"{res}/{name}.json"))["rows"]}
    except Exception:
        return {}
print("| device, model | batch | decode tok/s, plain (round 1 / 2) | with the JSON schema (round 1 / 2) | schema / plain (means) | grammar ms per step |")
print("|---|---|---|---|---|---|")
for t in sys.argv[2:]:
    dev, model = t.split(":", 1)
    runs = {n: rows(f"{dev}-{n}") for n in ["plain-1", "schema-1", "plain-2", "schema-2"]}
    for b in sorted(runs["plain-1"]):
        p = [runs[f"plain-{i}"].get(b, {}).get("decode_tok_s", float("nan")) for i in (1, 2)]
        s = [runs[f"schema-{i}"].get(b, {}).get("decode_tok_s", float("nan")) for i in (1, 2)]
        pm, sm = sum(p) / 2, sum(s) / 2
        step = (b / sm - b / pm) * 1e3
        print(f"| {dev}, {model} | {b} | {p[0]:.1f} / {p[1]:.1f} | {s[0]:.1f} / {s[1]:.1f} | {sm / pm:.2f} | {step:.2f} |")
PY
