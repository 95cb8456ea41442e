#!/usr/bin/env bash
# n-gram speculation on a real model on a CUDA GPU: the quick start's SmolLM2-135M-Instruct
# (its Q4_1 GGUF, dequantized to bf16 at load), on the input-grounded task of the CPU
# benchmark (benches/prompts/edit_code.txt through the chat template, 200 tokens). On the GPU
# machine, from the repo root:
#
#   scripts/gpu-ngram-bench.sh MODEL.gguf [RESULTS_DIR]
#
# - iris: $IRIS_BIN, else .gpu/iris.xz unpacked.
# - Greedy, plain and n-gram K=4, batch 1, 8, 32 (every sequence has the same prompt, so its
#   steps verify the same number of drafts in each sequence); then sampled (temperature 0.7,
#   top-k 40, a seed per sequence), where sequences part ways and a step's sequences verify
#   different numbers of drafts: padded into graphs (the default) and op by op
#   (IRIS_CUDA_PAD_ROWS=0; UNPADDED=0 leaves it out). $ROUNDS rounds (default 2), alternated.
# - Greedy text with and without speculation, compared (`iris generate`), with the default
#   GEMV threshold and with IRIS_CUDA_GEMV=8.
# Prints tables; JSON per run in RESULTS_DIR (default $OUT or /tmp/iris-ngram/results).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: scripts/gpu-ngram-bench.sh MODEL.gguf [RESULTS_DIR]}
RES=${2:-${OUT:-/tmp/iris-ngram/results}}
DIR=/tmp/iris-ngram
mkdir -p "$RES" "$DIR"
IRIS=${IRIS_BIN:-}
if [ -z "$IRIS" ]; then
  xz -dc .gpu/iris.xz > "$DIR/iris" && chmod +x "$DIR/iris" && IRIS="$DIR/iris"
fi
SPEC='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
common=(--model "$MODEL" --device cuda --dtype bf16 --json --prompt-file benches/prompts/edit_code.txt --chat
  --gen-len 200 --repeats 3 --batch-sizes 1,8,32)
sampled=(--temperature 0.7 --top-k 40)
run() { # name, args...
  local name=$1
  shift
  "$IRIS" bench "${common[@]}" "$@" > "$RES/$name.json" 2> "$RES/$name.err" || { echo "$name failed:"; tail -3 "$RES/$name.err"; }
}
for round in $(seq "${ROUNDS:-2}"); do
  run "greedy-plain-$round"
  run "greedy-ngram-$round" --speculative-config "$SPEC"
  run "sampled-plain-$round" "${sampled[@]}"
  run "sampled-ngram-$round" "${sampled[@]}" --speculative-config "$SPEC"
  [ "${UNPADDED:-1}" = 0 ] || IRIS_CUDA_PAD_ROWS=0 run "sampled-ngram-unpadded-$round" "${sampled[@]}" --speculative-config "$SPEC"
done
prompt=$(cat benches/prompts/edit_code.txt)
gen=(--model "$MODEL" --device cuda --dtype bf16 --max-tokens 200 --prompt "$prompt")
# Then with every product of up to 8 rows on the GEMV kernel (a verify pass's 5 rows too, as a
# decode's one row), whose rows do not depend on how many there are.
for gemv in default 8; do
  env=(); [ "$gemv" = default ] || env=(IRIS_CUDA_GEMV="$gemv")
  env "${env[@]}" "$IRIS" generate "${gen[@]}" > "$RES/text-plain-$gemv.txt" 2> "$RES/text-plain-$gemv.err"
  env "${env[@]}" "$IRIS" generate "${gen[@]}" --speculative-config "$SPEC" > "$RES/text-ngram-$gemv.txt" 2> "$RES/text-ngram-$gemv.err"
  if cmp -s "$RES/text-plain-$gemv.txt" "$RES/text-ngram-$gemv.txt"; then
    echo "greedy text, GEMV rows $gemv: the same with and without speculation ($(wc -c < "$RES/text-plain-$gemv.txt") bytes)"
  else
    echo "greedy text, GEMV rows $gemv: DIFFERS with speculation"
    diff "$RES/text-plain-$gemv.txt" "$RES/text-ngram-$gemv.txt" | head -6
  fi
done
python3 - "$RES" <<'PY'
import json, sys
res = sys.argv[1]
def rows(name):
    try:
        return {r["batch"]: r for r in json.load(open(f"{res}/{name}.json"))["rows"]}
    except Exception:
        return {}
print("| run | batch | decode tok/s (round 1 / 2) | acceptance | tokens/verify | x plain |")
print("|---|---|---|---|---|---|")
for mode in ["greedy", "sampled"]:
    plain = {b: (rows(f"{mode}-plain-1").get(b, {}).get("decode_tok_s", 0) + rows(f"{mode}-plain-2").get(b, {}).get("decode_tok_s", 0)) / 2
             for b in [1, 8, 32]}
    for kind in ["plain", "ngram", "ngram-unpadded"]:
        r1, r2 = rows(f"{mode}-{kind}-1"), rows(f"{mode}-{kind}-2")
        for b in sorted(r1):
            a, v = r1[b].get("acceptance_rate"), r1[b].get("tokens_per_verify")
            t1, t2 = r1[b]["decode_tok_s"], r2.get(b, {}).get("decode_tok_s", float("nan"))
            acc = f"{100 * a:.1f}%" if a is not None else "-"
            tpv = f"{v:.2f}" if v is not None else "-"
            x = (t1 + t2) / 2 / plain[b] if plain.get(b) else float("nan")
            print(f"| {mode} {kind} | {b} | {t1:.0f} / {t2:.0f} | {acc} | {tpv} | {x:.2f} |")
PY
