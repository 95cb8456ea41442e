#!/usr/bin/env bash
# Runs the test suite on a CUDA GPU: the model tests with IRIS_TEST_DEVICE=cuda (f32, the same
# 1e-4 tolerances against transformers as on the CPU), the CUDA kernels against their CPU
# reference ops (tests/cuda_ops.rs, cuda_quantized.rs, cuda_moe.rs, cuda_tq.rs; bf16 tolerances where the kernel computes in bf16), the CLI
# and server tests with iris picking the GPU (--device auto). A missing GPU fails the run.
#
#   scripts/gpu-check.sh [LOG_DIR]        (ONLY="cuda_tq kv_quant": just those test binaries)
#
# With .gpu/tests.tar.xz (scripts/gpu-build.sh) it runs those prebuilt binaries, so the GPU
# machine needs no Rust toolchain; else `cargo test --release --features cuda`.
# Skipped: tests that download real models (real_models, tokenizer_real: no network there).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-/tmp/iris-gpu-check}}
mkdir -p "$LOG"
export IRIS_TEST_DEVICE=${IRIS_TEST_DEVICE:-cuda} IRIS_REQUIRE_GPU=1
SKIP="real_models tokenizer_real"
if [ ! -f .gpu/tests.tar.xz ]; then
  cargo test --release --features cuda 2>&1 | tee "$LOG/cargo-test.log"
  exit "${PIPESTATUS[0]}"
fi
bin=$(mktemp -d)
tar -C "$bin" -xJf .gpu/tests.tar.xz
# The tests have the build machine's repo and iris paths compiled in (env! at build time).
. .gpu/paths
if [ "$MANIFEST_DIR" != "$PWD" ]; then
  mkdir -p "$(dirname "$MANIFEST_DIR")" && ln -sfn "$PWD" "$MANIFEST_DIR"
fi
mkdir -p "$(dirname "$BIN_EXE")" && xz -dc .gpu/iris.xz > "$BIN_EXE" && chmod +x "$BIN_EXE"
fails=0
printf '| test binary | result | time s |\n|---|---|---|\n' > "$LOG/summary.md"
for t in "$bin"/tests/*; do
  name=$(basename "$t")
  if [[ " $SKIP " == *" $name "* ]]; then
    echo "| $name | skipped (needs network) | |" >> "$LOG/summary.md"
    continue
  fi
  # ONLY="cuda_tq batch_invariance": these binaries alone (a quick re-check).
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
  s=$(date +%s)
  # One test at a time: an engine captures CUDA graphs on its first decode steps, and another
  # test thread's synchronizing call on the same context invalidates a capture in flight (a
  # server runs one engine per process, so this concerns the test harness only).
  if (cd "$PWD" && "$t" --test-threads=1 > "$LOG/$name.log" 2>&1); then r=ok; else r=FAILED; fails=$((fails + 1)); fi
  line=$(grep -E '^test result:' "$LOG/$name.log" | tail -1)
  echo "| $name | $r: ${line#test result: } | $(( $(date +%s) - s )) |" >> "$LOG/summary.md"
  [ "$r" = ok ] || grep -E -A15 '^---- |panicked' "$LOG/$name.log" | head -60
  # Attention on codes once more with each prompt chunk staged alone (the grouping that bounds
  # the prefill scratch, ops/tq_attention/cuda.rs).
  if [ "$name" = cuda_tq ]; then
    s=$(date +%s)
    if IRIS_TQ_STAGE_MIB=0 "$t" --test-threads=1 > "$LOG/$name-staged-alone.log" 2>&1; then r=ok; else r=FAILED; fails=$((fails + 1)); fi
    line=$(grep -E '^test result:' "$LOG/$name-staged-alone.log" | tail -1)
    echo "| $name (IRIS_TQ_STAGE_MIB=0) | $r: ${line#test result: } | $(( $(date +%s) - s )) |" >> "$LOG/summary.md"
    [ "$r" = ok ] || grep -E -A15 '^---- |panicked' "$LOG/$name-staged-alone.log" | head -60
  fi
done
cat "$LOG/summary.md"
exit $((fails > 0))
