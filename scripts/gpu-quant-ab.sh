#!/usr/bin/env bash
# On the GPU machine: quantized products kept quantized (IRIS_CUDA_QUANT=1), a change against a
# base, in one run. First the quantized-matrix test (tests/cuda_quantized.rs), then a random
# Qwen2.5-7B-shaped checkpoint (KIND: mlx4, the default, or mlx8; scripts/gpu_bench.py) decoded
# by both binaries, alternated, ROUNDS times (default 2), at BS (default 1,8,32,64). MODEL=PATH:
# that model instead (a GGUF from scripts/gpu-llama-ab.sh, say).
# Needs .gpu/ from scripts/gpu-build.sh (iris.xz, tests.tar.xz, paths) and the base's binary as
# .gpu/iris-base.xz (the iris.xz of a build of the base). Carry: .gpu/iris.xz,
# .gpu/iris-base.xz, .gpu/tests.tar.xz, .gpu/paths. Results under $OUT. KERNEL_TIMES=1: then
# GPU time per kernel of a batch-1 decode by each binary (scripts/gpu-kernel-times.sh), under
# $OUT/kernels-{base,new}.md, per kernel and grid (so per matrix shape).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/iris-quant-ab}; mkdir -p "$OUT"
B=$(mktemp -d)
xz -dc .gpu/iris.xz > "$B/new"; xz -dc .gpu/iris-base.xz > "$B/base"; chmod +x "$B/new" "$B/base"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader; date -u
python3 scripts/gpu_bench.py bandwidth 2>&1 | tail -1
T=$(mktemp -d); tar -C "$T" -xJf .gpu/tests.tar.xz; . .gpu/paths
if [ "$MANIFEST_DIR" != "$PWD" ]; then mkdir -p "$(dirname "$MANIFEST_DIR")" && ln -sfn "$PWD" "$MANIFEST_DIR"; fi
IRIS_TEST_DEVICE=cuda IRIS_REQUIRE_GPU=1 timeout 180 "$T/tests/cuda_quantized" --test-threads=1 > "$OUT/test.log" 2>&1
grep -E "test result|panicked|rel err|changed at" "$OUT/test.log" | head -5
if [ -n "${MODEL:-}" ]; then
  M=$MODEL  # e.g. a GGUF that scripts/gpu-llama-ab.sh made (STAGE=model)
else
  M=$(mktemp -d)/model
  python3 scripts/gpu_bench.py make "$M" "qwen2.5-7b+${KIND:-mlx4}" > "$OUT/make.log" 2>&1; tail -1 "$OUT/make.log"
fi
row() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], " ".join("b%d %.1f" % (r["batch"], r["decode_tok_s"]) for r in d["rows"]))' "$1" "$2" 2>/dev/null || tail -3 "${1%.json}.err"; }
for r in $(seq "${ROUNDS:-2}"); do
  for v in base new; do
    IRIS_CUDA_QUANT=1 timeout 200 "$B/$v" bench --model "$M" --device cuda --dtype bf16 --batch-sizes "${BS:-1,8,32,64}" \
      --prompt-len 128 --gen-len 64 --repeats 1 --json > "$OUT/$v-$r.json" 2> "$OUT/$v-$r.err"
    row "$OUT/$v-$r.json" "$v round $r:"
  done
done
if [ -n "${KERNEL_TIMES:-}" ]; then
  for v in base new; do
    KERNEL_TIMES_GRID=1 IRIS_CUDA_QUANT=1 timeout 200 scripts/gpu-kernel-times.sh "$OUT/kernels-$v.md" "$B/$v" bench --model "$M" --device cuda \
      --dtype bf16 --batch-sizes 1 --prompt-len 128 --gen-len 64 --repeats 1 > "$OUT/kernels-$v.log" 2>&1
    echo "$v kernels:"; head -14 "$OUT/kernels-$v.md"
  done
fi
date -u
