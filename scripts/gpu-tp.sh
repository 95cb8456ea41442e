#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 or more GPUs (device kind nvidia-h200-x2 or larger),
# from a build with FEATURES=nccl (scripts/gpu-build.sh): the tensor_parallel tests over NCCL
# (f32 fixtures, every rank count the GPUs allow), then Qwen2.5-7B-shaped bf16 random weights
# (scripts/gpu_bench.py make) at --tensor-parallel-size 1 and 2, decode at batch 1 / 64 / 256,
# alternated, two rounds; TP=1 also without CUDA graphs (TP>1 runs op by op so far).
#
#   scripts/gpu-tp.sh [RESULTS_DIR]
#
# NVLink multicast stays off (the shared host's rule): NCCL_NVLS_ENABLE=0 and the others below.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-/tmp/iris-tp}}
DIR=${BENCH_DIR:-/tmp/iris-tp-model}
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The runtime's own kernels (cuBLAS) loaded at start, not while an NCCL kernel waits (iris preloads its own).
export CUDA_MODULE_LOADING=EAGER
# iris links libnccl.so.2; PyTorch's wheel carries one.
nccl=$(python3 -c 'import torch, os, glob; print(next(iter(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl*", "lib")))))' 2>/dev/null)
[ -n "$nccl" ] || nccl=$(dirname "$(find / -name libnccl.so.2 -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$nccl:${LD_LIBRARY_PATH:-}"
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -5
ONLY="${ONLY:-tensor_parallel cuda_ops cuda_quantized}" bash scripts/gpu-check.sh "$RES/check" | tail -5
[ "${BENCH:-1}" = 1 ] || exit 0
xz -dc .gpu/iris.xz > /tmp/iris-tp-bin && chmod +x /tmp/iris-tp-bin
if [ ! -f "$DIR/done" ]; then
  python3 scripts/gpu_bench.py make "$DIR" qwen2.5-7b > "$RES/make.log" 2>&1 || { tail -3 "$RES/make.log"; exit 1; }
  touch "$DIR/done"
fi
run() { # name, env..., -- iris args
  local name=$1; shift
  env "$@" /tmp/iris-tp-bin bench --model "$DIR" --dtype bf16 --json --prompt-len 128 --gen-len 32 --repeats 1 \
    --batch-sizes "${BATCHES:-1,64,256}" --no-enable-prefix-caching "${TPARGS[@]}" > "$RES/$name.json" 2> "$RES/$name.err" \
    || { echo "$name failed:"; tail -3 "$RES/$name.err"; }
}
for round in 1 2; do
  TPARGS=(--tensor-parallel-size 1); run "tp1-$round" IRIS_CUDA_GRAPHS=1
  TPARGS=(--tensor-parallel-size 2); run "tp2-$round" IRIS_CUDA_GRAPHS=1
  TPARGS=(--tensor-parallel-size 1); run "tp1-nographs-$round" IRIS_CUDA_GRAPHS=0
done
python3 - "$RES" <<'PY'
import json, sys
res = sys.argv[1]
def rows(name):
    try:
        return {r["batch"]: r for r in json.load(open(f"{res}/{name}.json"))["rows"]}
    except Exception:
        return {}
names = ["tp1", "tp1-nographs", "tp2"]
runs = {n: [rows(f"{n}-{i}") for i in (1, 2)] for n in names}
print("| batch | " + " | ".join(f"{n} decode tok/s (round 1 / 2)" for n in names) + " | tp2 / tp1 | tp2 / tp1 op by op | prefill tok/s tp1 / tp2 |")
print("|---|" + "---|" * (len(names) + 3))
for b in sorted(runs["tp1"][0]):
    d = {n: [r.get(b, {}).get("decode_tok_s", float("nan")) for r in runs[n]] for n in names}
    p = {n: runs[n][0].get(b, {}).get("prefill_tok_s", float("nan")) for n in names}
    mean = {n: sum(v) / 2 for n, v in d.items()}
    cells = " | ".join(f"{v[0]:.1f} / {v[1]:.1f}" for v in d.values())
    print(f"| {b} | {cells} | {mean['tp2'] / mean['tp1']:.2f} | {mean['tp2'] / mean['tp1-nographs']:.2f} | {p['tp1']:.0f} / {p['tp2']:.0f} |")
PY
