#!/usr/bin/env bash
# Decode speed of iris under several settings, measured alternately on one checkpoint (the GPU
# is shared by nothing else, but clocks and caches drift: rounds interleave the settings and
# the medians are reported). On the GPU machine, from the repo root:
#
#   VARIANTS="base;IRIS_CUDA_FUSED_MERGE=0;IRIS_CUDA_GEMV_UNROLL=16" scripts/gpu-variants.sh [RESULTS_DIR]
#
# - VARIANTS: settings separated by ';', each "base" or space-separated VAR=VALUE pairs.
# - MODEL (default qwen2.5-7b), BATCHES (default 1), PROMPT_LEN (default 128), GEN_LEN (default 64),
#   ROUNDS (default 3).
# - iris: $IRIS_BIN, else .gpu/iris.xz unpacked (scripts/gpu-build.sh).
# Each run also logs the decode graphs' GPU time per step against its wall time
# (IRIS_CUDA_STEP_TIMING=1), in RESULTS_DIR/<round>-<variant>.err.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-bench/variants}}
DIR=${BENCH_DIR:-/tmp/iris-bench}
MODEL=${MODEL:-qwen2.5-7b} BATCHES=${BATCHES:-1} PROMPT_LEN=${PROMPT_LEN:-128} GEN_LEN=${GEN_LEN:-64} ROUNDS=${ROUNDS:-3}
mkdir -p "$RES" "$DIR"
IRIS=${IRIS_BIN:-$DIR/iris}
[ -x "$IRIS" ] || { xz -dc .gpu/iris.xz > "$IRIS" && chmod +x "$IRIS"; }
md="$DIR/$MODEL"
if [ ! -f "$md/done.json" ]; then
  python3 scripts/gpu_bench.py make "$md" "$MODEL" > "$RES/make.log" 2>&1 || { tail -5 "$RES/make.log"; exit 1; }
  grep '^{' "$RES/make.log" | tail -1 > "$md/done.json"
fi
IFS=';' read -ra VARS <<< "${VARIANTS:-base}"
for r in $(seq 1 "$ROUNDS"); do
  for i in "${!VARS[@]}"; do
    v=${VARS[$i]}; envs=(); [ "$v" = base ] || read -ra envs <<< "$v"
    env IRIS_CUDA_STEP_TIMING=1 "${envs[@]}" "$IRIS" bench --model "$md" --device cuda --dtype bf16 --json \
      --batch-sizes "$BATCHES" --prompt-len "$PROMPT_LEN" --gen-len "$GEN_LEN" --repeats 1 \
      > "$RES/$r-$i.json" 2> "$RES/$r-$i.err" || { echo "variant '$v' failed:"; tail -3 "$RES/$r-$i.err"; }
  done
done
python3 - "$RES" "$ROUNDS" "${VARS[@]}" <<'PY'
import json, re, statistics, sys
res, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for i, v in enumerate(variants):
    by_batch, timing = {}, []
    for r in range(1, rounds + 1):
        try:
            for row in json.load(open(f"{res}/{r}-{i}.json"))["rows"]:
                by_batch.setdefault(row["batch"], []).append(row["decode_tok_s"])
        except (OSError, ValueError, KeyError):
            pass
        try:
            timing += re.findall(r"decode graphs: .*", open(f"{res}/{r}-{i}.err").read())
        except OSError:
            pass
    cells = "  ".join(f"b{b}: {statistics.median(x):.1f} tok/s ({', '.join(f'{y:.1f}' for y in x)})" for b, x in sorted(by_batch.items()))
    print(f"{v:60s} {cells}")
    if timing:
        print(f"{'':60s} {timing[-1]}")
PY
