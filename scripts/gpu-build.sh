#!/usr/bin/env bash
# Builds iris and its test binaries with --features cuda on a machine without a GPU (see
# ../shared/cuda/README.md for the toolkit) and packs them into .gpu/ for the GPU machine,
# which may have no Rust toolchain or crates:
#   .gpu/iris.xz          the release binary (scripts/gpu-bench.sh)
#   .gpu/tests.tar.xz     every test binary (scripts/gpu-check.sh)
#   .gpu/paths            the build's repo and binary paths, which the tests have compiled in
#   .gpu/kv_decode.xz     the KV-cache decode bench (scripts/gpu-kv-bench.sh)
#   .gpu/prefill_attention.xz  the prompt-chunk attention bench (`--cuda`, benches/prefill_attention.rs)
#   .gpu/matmul.xz        the dense products: cuBLAS, GEMV and the batch-invariant kernels (benches/matmul.rs)
# Uses $CARGO_TARGET_DIR (default target/). TESTS="cuda_ops model_parity": only those test
# binaries, for a quick check of a change. FEATURES=nccl: with tensor parallelism over NCCL
# (links libnccl.so.2; the GPU machine's PyTorch has one: scripts/gpu-tp.sh finds it).
set -euo pipefail
cd "$(dirname "$0")/.."
TGT=${CARGO_TARGET_DIR:-$PWD/target}
FEATURES=${FEATURES:-cuda}
cargo build --release --features "$FEATURES"
stage=$(mktemp -d)
# At once: another build in the same target dir (a CPU one) would overwrite release/iris.
strip -o "$stage/iris" "$TGT/release/iris"
only=()
for t in ${TESTS:-}; do only+=(--test "$t"); done
cargo test --release --features "$FEATURES" --no-run "${only[@]}" --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        t = m["target"]
        # The library and the binary unit tests are both named after the crate.
        print(t["name"] + ("-" + t["kind"][0] if t["kind"][0] in ("lib", "bin") else ""), m["executable"])
' > /tmp/iris-gpu-tests.txt
# A bench binary's path (built on the way).
bench() {
  cargo build --release --features "$FEATURES" --bench "$1" --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$1"
}
mkdir -p "$stage/tests" .gpu
# Not shipped: tests that download real models or need the Python SDKs (absent there).
while read -r name exe; do
  case " real_models tokenizer_real server_sdk iris-bin " in *" $name "*) continue ;; esac
  cp "$exe" "$stage/tests/$name"
done < /tmp/iris-gpu-tests.txt
strip "$stage"/tests/*
# One archive with a large window: the test binaries share most of their bytes (candle's kernels).
tar -C "$stage" -cf - tests | xz -T1 --lzma2=preset=3,dict=512MiB > .gpu/tests.tar.xz
xz -T2 -9 -c "$stage/iris" > .gpu/iris.xz
for b in kv_decode prefill_attention matmul; do
  strip -o "$stage/$b" "$(bench $b)"
  xz -T2 -9 -c "$stage/$b" > .gpu/$b.xz
done
printf 'MANIFEST_DIR=%s\nBIN_EXE=%s\n' "$PWD" "$TGT/release/iris" > .gpu/paths
rm -rf "$stage"
ls -la .gpu
