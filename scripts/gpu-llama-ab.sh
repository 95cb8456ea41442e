#!/usr/bin/env bash
# On the GPU machine: llama.cpp against iris on the same GGUF files (quantized weights kept
# quantized, IRIS_CUDA_QUANT=1), in one run. Stages (STAGE, default all):
#   build  llama.cpp from .gpu/llama-src.tar.xz (the llama-cpp-python 0.3.36 sdist's llama.cpp,
#          without other backends' sources and the web UI; made by `scripts/gpu-llama-ab.sh pack`
#          here) with CUDA for sm_90, into /tmp/llama: llama-bench, llama-batched-bench and
#          llama-quantize. A build cut by the time limit goes on where it stopped when run
#          again on the same (warm) machine. Where .gpu/llama-bin.tar.xz is carried instead
#          (`scripts/gpu-llama-ab.sh pack-bin` here, after a build with the toolkit of
#          ../shared/cuda: about 40 minutes on 2 cores), its binaries, libraries and gguf-py are
#          used and nothing is built.
#   model  a random Qwen2.5-7B-shaped F16 GGUF (scripts/gpu_bench.py gguf, gguf-py from the
#          same sources), quantized by llama.cpp's own tool to each of TYPES (default
#          "Q4_K_M Q8_0"), under /tmp/llama-models.
#   bench  per type: llama-bench (pp2048, tg128 at batch 1), llama-batched-bench (128-token
#          prompts, 64 new tokens, 1/8/64 sequences), iris bench (decode at 1/8/64, 2048-token
#          prefill), alternated, ROUNDS times (default 1).
# Needs .gpu/iris.xz and .gpu/llama-src.tar.xz or .gpu/llama-bin.tar.xz (carry them; the
# prebuilt archive is about 23 MB, which with iris.xz fits the carry's 64 MiB once the large
# fixtures are aside, as for other runs). Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pack ]; then
  # Here: the llama.cpp sources the build stage needs (about 4.4 MB).
  src=${LLAMA_SRC:-/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp}
  mkdir -p .gpu
  tar -C "$src" -cf - --exclude='ggml/src/ggml-et' --exclude='ggml/src/ggml-metal' --exclude='ggml/src/ggml-hexagon' \
    --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-opencl' --exclude='tools/ui' \
    CMakeLists.txt cmake ggml src include common tools vendor gguf-py licenses LICENSE app | xz -T2 -6 > .gpu/llama-src.tar.xz
  ls -la .gpu/llama-src.tar.xz
  exit 0
fi
if [ "${1:-}" = pack-bin ]; then
  # Here: a build made from those sources (LLAMA_BUILD, default /tmp/lb/build; configured as the
  # build stage below does, but with -DCMAKE_CUDA_COMPILER and -DCUDAToolkit_ROOT pointing at the
  # toolkit, -DGGML_NATIVE=OFF and -DCMAKE_CUDA_ARCHITECTURES=90-real (machine code only, no
  # PTX: half the size), and linked with LD_LIBRARY_PATH=$CUDA_HOME/lib so that ld finds cuBLAS
  # behind libggml-cuda), with the C++ and OpenMP runtimes it was linked against and gguf-py,
  # for a GPU machine whose image may hold older ones.
  b=${LLAMA_BUILD:-/tmp/lb/build}; st=$(mktemp -d)
  mkdir -p "$st/bin"
  cp -a "$b"/bin/llama-bench "$b"/bin/llama-batched-bench "$b"/bin/llama-quantize "$b"/bin/*.so* "$st/bin/"
  strip "$st"/bin/llama-* 2>/dev/null || true
  strip --strip-unneeded "$st"/bin/lib*.so.* 2>/dev/null || true
  for l in libstdc++.so.6 libgomp.so.1 libgcc_s.so.1; do cp -L "$(gcc -print-file-name=$l)" "$st/bin/" 2>/dev/null || true; done
  cp -a "$(dirname "$b")/gguf-py" "$st/"
  tar -C "$st" -cf - bin gguf-py | xz -T2 -9e > .gpu/llama-bin.tar.xz
  rm -rf "$st"; ls -la .gpu/llama-bin.tar.xz
  exit 0
fi
OUT=${OUT:-/tmp/iris-llama-ab}; mkdir -p "$OUT"
# The toolkit's nvcc where it is not on PATH.
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
L=/tmp/llama; M=/tmp/llama-models; STAGE=${STAGE:-all}; LLAMA_LD=${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader; date -u
if [ -f .gpu/llama-bin.tar.xz ]; then
  # Prebuilt: its libraries first, then the CUDA runtime and cuBLAS of the toolkit or of
  # PyTorch's wheels.
  if [ ! -x "$L/build/bin/llama-bench" ]; then
    mkdir -p "$L/build" "$L/src" && tar -C "$L/build" -xJf .gpu/llama-bin.tar.xz bin \
      && tar -C "$L/src" -xJf .gpu/llama-bin.tar.xz gguf-py
  fi
  wheels=$(python3 -c 'import glob, site; print(":".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages() for p in glob.glob(s + "/nvidia/**/libcublas.so*", recursive=True)})))' 2>/dev/null)
  # For llama.cpp's binaries only (the C++ runtime it brings is not PyTorch's nor iris's).
  LLAMA_LD=$L/build/bin:/usr/local/cuda/lib64:${wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  LD_LIBRARY_PATH=$LLAMA_LD "$L/build/bin/llama-bench" --help > /dev/null 2>&1 \
    || { echo "the prebuilt llama.cpp does not start:"; LD_LIBRARY_PATH=$LLAMA_LD ldd "$L/build/bin/llama-bench" | grep -i "not found"; }
elif [ "$STAGE" = all ] || [ "$STAGE" = build ]; then
  if [ ! -d "$L/src" ]; then mkdir -p "$L/src" && tar -C "$L/src" -xJf .gpu/llama-src.tar.xz; fi
  if [ ! -f "$L/build/build.ninja" ]; then
    cmake -S "$L/src" -B "$L/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_APP=OFF -DGGML_CCACHE=OFF > "$OUT/cmake.log" 2>&1 || { tail -20 "$OUT/cmake.log"; exit 1; }
  fi
  t0=$(date +%s)
  ninja -C "$L/build" -j "$(nproc)" llama-bench llama-batched-bench llama-quantize > "$OUT/build.log" 2>&1 \
    || { tail -20 "$OUT/build.log"; exit 1; }
  echo "llama.cpp built in $(( $(date +%s) - t0 )) s"
fi
bin=$L/build/bin
if [ "$STAGE" = all ] || [ "$STAGE" = model ]; then
  mkdir -p "$M"
  [ -f "$M/f16.gguf" ] || GGUF_PY="$L/src/gguf-py" python3 scripts/gpu_bench.py gguf "$M/f16.gguf" qwen2.5-7b > "$OUT/gguf.log" 2>&1 \
    || { tail -5 "$OUT/gguf.log"; exit 1; }
  tail -1 "$OUT/gguf.log"
  for t in ${TYPES:-Q4_K_M Q8_0}; do
    [ -f "$M/$t.gguf" ] || LD_LIBRARY_PATH=$LLAMA_LD "$bin/llama-quantize" "$M/f16.gguf" "$M/$t.gguf" "$t" "$(nproc)" > "$OUT/quantize-$t.log" 2>&1 \
      || { tail -5 "$OUT/quantize-$t.log"; exit 1; }
    ls -la "$M/$t.gguf"
  done
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  B=$(mktemp -d); xz -dc .gpu/iris.xz > "$B/iris"; chmod +x "$B/iris"
  python3 scripts/gpu_bench.py bandwidth 2>&1 | tail -1
  decode() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" ".join("b%d %.1f" % (r["batch"], r["decode_tok_s"]) for r in d["rows"]))' "$1" 2>/dev/null || tail -3 "${1%.json}.err"; }
  prefill() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" ".join("prefill %.0f tok/s" % r["prefill_tok_s"] for r in d["rows"]))' "$1" 2>/dev/null || tail -3 "${1%.json}.err"; }
  for t in ${TYPES:-Q4_K_M Q8_0}; do
    f=$M/$t.gguf
    for r in $(seq "${ROUNDS:-1}"); do
      echo "== $t round $r"
      LD_LIBRARY_PATH=$LLAMA_LD timeout 300 "$bin/llama-bench" -m "$f" -ngl 99 -fa 1 -p 2048 -n 128 -r 3 -o md > "$OUT/llama-bench-$t-$r.md" 2> "$OUT/llama-bench-$t-$r.err"
      grep -E "pp2048|tg128" "$OUT/llama-bench-$t-$r.md" | sed 's/^/llama-bench /'
      LD_LIBRARY_PATH=$LLAMA_LD timeout 300 "$bin/llama-batched-bench" -m "$f" -ngl 99 -fa on -c 20480 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 1,8,64 \
        > "$OUT/llama-batched-$t-$r.log" 2>&1
      grep -E "^\|\s+128 \|" "$OUT/llama-batched-$t-$r.log" | sed 's/^/llama-batched-bench /'
      IRIS_CUDA_QUANT=1 timeout 300 "$B/iris" bench --model "$f" --device cuda --dtype bf16 --batch-sizes 1,8,64 \
        --prompt-len 128 --gen-len 64 --repeats 1 --json > "$OUT/iris-$t-$r.json" 2> "$OUT/iris-$t-$r.err"
      echo "iris decode: $(decode "$OUT/iris-$t-$r.json")"
      IRIS_CUDA_QUANT=1 timeout 300 "$B/iris" bench --model "$f" --device cuda --dtype bf16 --batch-sizes 1 \
        --prompt-len 2048 --gen-len 2 --repeats 1 --json > "$OUT/iris-prefill-$t-$r.json" 2> "$OUT/iris-prefill-$t-$r.err"
      echo "iris: $(prefill "$OUT/iris-prefill-$t-$r.json")"
    done
  done
fi
date -u
