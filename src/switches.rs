//! Settings read from the environment once, to compare code paths on one machine (the A/B
//! runs of `scripts/gpu-variants.sh`, docs/benchmarks.md). Not configuration: the defaults are
//! what serves.
//!
//! Every `IRIS_*` variable iris reads, in one place:
//!
//! | variable | read in | effect |
//! |---|---|---|
//! | `IRIS_MODEL` | cli/args.rs | the model when `--model` is not given |
//! | `IRIS_CACHE` | fetch | where fetched models live (default `~/.cache/iris`) |
//! | `IRIS_API_KEY` | cli/serve.rs | `--api-key` |
//! | `IRIS_THREADS` | ops/team.rs | CPU threads of the kernels' team (default: one per core) |
//! | `IRIS_CPU_ISA` | simd/isa.rs | the CPU kernels' instruction set: `avx512`, `avx2`, `neon` or `portable` (default: the best this CPU has; one it lacks is refused at start) |
//! | `IRIS_DEVICE_SAMPLING=0` | engine/runner.rs | sample on the host instead of the GPU |
//! | `IRIS_CUDA_GRAPHS=0` | engine/cuda_graph.rs | no CUDA graphs (op by op) |
//! | `IRIS_CUDA_PAD_ROWS=N` | engine/cuda_graph.rs | most rows a verify step with mixed draft counts is padded to for a graph (64; beyond, while it at most doubles the rows; 0: never) |
//! | `IRIS_CUDA_STEP_TIMING=1` | engine/cuda_graph.rs | log the replayed graphs' GPU time per step |
//! | `IRIS_CUDA_PDL=0` | ops/cuda | no programmatic dependent launches |
//! | `IRIS_CUDA_FUSED_KV_WRITE=0` | ops/qkv_rope.rs | the KV write apart from q/k/v + rotary |
//! | `IRIS_CUDA_FUSED_MERGE=0` | ops/paged_attention | the decode attention's merge as its own kernel |
//! | `IRIS_CUDA_PAGED_DECODE=0` | ops/paged_attention | no lane-split decode attention kernel |
//! | `IRIS_CUDA_DECODE_CHUNK=N` | ops/paged_attention | positions per decode attention chunk (64) |
//! | `IRIS_CUDA_GQA_DECODE=0` | ops/paged_attention | 16-bit decode attention per query head, not per KV head on tensor cores |
//! | `IRIS_CUDA_DECODE_SPLITS=N` | ops/paged_attention | most blocks a decode row's keys split over on tensor cores (32, at most 64) |
//! | `IRIS_CUDA_DECODE_SPLIT_TILES=N` | ops/paged_attention | key tiles of 64 per such block, at least (2) |
//! | `IRIS_CUDA_GATED_GEMV=0` | layers/linear.rs | the gated MLP's GEMV without the fused activation |
//! | `IRIS_CUDA_GEMV=N` | ops/gemv.rs | most rows a step takes the GEMV path for |
//! | `IRIS_CUDA_MMA_ROWS=N` | ops/invariant_matmul.rs | most rows a step takes the batch-invariant tensor-core products for without `--batch-invariant` (0) |
//! | `IRIS_CUDA_QUANT=1` | layers/linear.rs | keep GGUF / MLX quantized matrices quantized on CUDA (default: dequantized at load: past 32 rows a step the kept ones are dequantized for cuBLAS every step, and 5-, 6- and 8-bit codes take the slower block kernel; docs/benchmarks.md) |
//! | `IRIS_TQ_MIN_CHUNK=N` | ops/tq_attention/cuda.rs | smallest prompt chunk the TurboQuant staging kernel takes (32) |
//! | `IRIS_TQ_STAGE_MIB=N` | ops/tq_attention/cuda.rs | staging buffer of the TurboQuant prefill (256 MiB; 0: none) |
//!
//! Tests and scripts read more (`IRIS_TEST_DEVICE`, `IRIS_TEST_PYTHON`, `IRIS_REQUIRE_GPU`,
//! `IRIS_REAL_FIXTURES_DIR`, ...): tests/common and scripts/README.md name them. The Hugging
//! Face variables (`HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_ENDPOINT`, ...)
//! are huggingface_hub's, read as it reads them in hub/settings.rs.

/// Whether a path is taken: yes, unless the environment sets `$name=0`.
macro_rules! switched_on {
    ($name:literal) => {{
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var($name).map_or(true, |v| v != "0"))
    }};
}

/// A number the environment may set (`$name=N`, parsed as `$ty`), else `$default`.
macro_rules! tuned {
    ($name:literal, $ty:ty, $default:expr) => {{
        static VALUE: std::sync::OnceLock<$ty> = std::sync::OnceLock::new();
        *VALUE.get_or_init(|| std::env::var($name).ok().and_then(|v| v.parse::<$ty>().ok()).unwrap_or($default))
    }};
}

#[allow(unused_imports)] // only CUDA builds use some of them
pub(crate) use {switched_on, tuned};
