#!/usr/bin/env bash
# GPU time per kernel of a command, on the GPU machine (no Nsight there): builds
# scripts/kernel_times.c against the CUPTI that PyTorch's wheels bring, preloads it, runs the
# command, and prints the table (largest total first). E.g. the decode steps of the KV bench:
#
#   scripts/gpu-kernel-times.sh OUT.md /tmp/iris-bench/kv_decode MODEL --device cuda --contexts 1024 --caches tq-k3v4
set -euo pipefail
out=$1; shift
# Where pip put CUPTI (the nvidia-cuda-cupti wheel, a dependency of torch), else the toolkit's.
roots="$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true) /usr/local/cuda /opt"
hdr=$(find $roots -name cupti.h 2>/dev/null | head -1 || true)
lib=$(find $roots -name 'libcupti.so*' 2>/dev/null | head -1 || true)
[ -n "$hdr" ] && [ -n "$lib" ] || { echo "no CUPTI headers or library found under $roots"; exit 1; }
inc=$(dirname "$hdr")
krec=$(grep -ho 'CUpti_ActivityKernel[0-9]*' "$inc"/cupti_activity*.h | sort -V | tail -1 || true)
echo "CUPTI: $hdr, $lib, $krec"
so=/tmp/libkernel_times.so
gcc -O2 -shared -fPIC -DKREC="$krec" -I "$inc" -I /usr/local/cuda/include "$(dirname "$0")/kernel_times.c" \
  -o "$so" "$lib" -Wl,-rpath,"$(dirname "$lib")"
KERNEL_TIMES_OUT="$out" LD_PRELOAD="$so" "$@"
cat "$out"
