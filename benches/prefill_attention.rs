//! The CPU's paged attention for prompt rows that follow a cached context (what a turn of a
//! conversation computes after a prefix-cache hit): `rows` new rows of one sequence over
//! `context` cached positions, per layer, with the head layout of a model. Prints ms per layer
//! and the attention's arithmetic rate (4 * rows * heads * head_dim * keys seen, causal).
//!
//!   cargo bench --bench prefill_attention -- [--rows 144] [--contexts 0,256,1280,4096]
//!       [--heads 9] [--kv-heads 3] [--head-dim 64] [--reps 20] [--cache-dtype f32|bf16|f16]
//!
//! Defaults: SmolLM2-135M's attention (9 query heads, 3 kv heads, head dim 64), f32 cache
//! (`--cache-dtype`: the CPU's cache type; queries stay f32). `--rows 1` is a decode step's
//! attention.
//! `--layers N`: N caches of that size, one per layer, run in turn (as a step runs its
//! layers), so that at long contexts the cache streams from DRAM as in serving rather than
//! from the L3 the single repeated cache fits in.
//! `--cuda` (a build with `--features cuda`): on the GPU with a bf16 cache and queries, the
//! tensor-core prompt-chunk kernel (`ops/cuda/prefill_attention.cu`); `--seqs N` runs N such
//! sequences in one launch (N x rows rows).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use iris::batch::{AttentionMeta, SeqSlice};
use iris::ops::paged_attention::PagedAttention;
use iris::simd::Isa;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_string())
}

fn main() {
    let rows: usize = arg("--rows", "144").parse().expect("--rows");
    let hq: usize = arg("--heads", "9").parse().expect("--heads");
    let hkv: usize = arg("--kv-heads", "3").parse().expect("--kv-heads");
    let d: usize = arg("--head-dim", "64").parse().expect("--head-dim");
    let reps: usize = arg("--reps", "20").parse().expect("--reps");
    let contexts: Vec<usize> =
        arg("--contexts", "0,256,1280,4096").split(',').map(|c| c.parse().expect("--contexts")).collect();
    let nseqs: usize = arg("--seqs", "1").parse().expect("--seqs");
    let layers: usize = arg("--layers", "1").parse().expect("--layers");
    let cuda = std::env::args().any(|a| a == "--cuda");
    // The cache's type and the queries' (the CPU op takes f32 queries).
    let (dev, dt, qt) = match cuda {
        true => (
            Device::new_cuda(0).expect("--cuda: a CUDA device (a build with --features cuda)"),
            DType::BF16,
            DType::BF16,
        ),
        false => {
            let dt = match arg("--cache-dtype", "f32").as_str() {
                "f32" => DType::F32,
                "bf16" => DType::BF16,
                "f16" => DType::F16,
                other => panic!("--cache-dtype {other}: f32, bf16 or f16"),
            };
            (Device::Cpu, dt, DType::F32)
        }
    };
    let bs = 16;
    println!("| cached context | rows | ms per layer | GFLOP/s |");
    println!("|---|---|---|---|");
    for &cached in &contexts {
        let total = cached + rows;
        let blocks = total.div_ceil(bs);
        let cache = || Tensor::randn(0f32, 1.0, (nseqs * blocks * bs, hkv, d), &dev).unwrap().to_dtype(dt).unwrap();
        let kv: Vec<(Tensor, Tensor)> = (0..layers).map(|_| (cache(), cache())).collect();
        let q = Tensor::randn(0f32, 1.0, (nseqs * rows, hq, d), &dev).unwrap().to_dtype(qt).unwrap();
        let seqs = (0..nseqs)
            .map(|i| SeqSlice {
                q_start: i * rows,
                q_len: rows,
                context_len: total,
                block_table: (0..blocks as u32).map(|b| (i * blocks) as u32 + b).collect(),
            })
            .collect();
        let mut meta = AttentionMeta::new(bs, seqs);
        if cuda {
            meta.upload(&dev).unwrap();
        }
        let op = PagedAttention {
            meta: &meta,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            window: None,
            softcap: None,
            isa: Isa::active(),
            bidirectional: false,
        };
        let step = || {
            for (k, v) in &kv {
                op.forward(&q, k, v).unwrap();
            }
            dev.synchronize().unwrap();
        };
        step();
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            step();
            times.push(t.elapsed().as_secs_f64() / layers as f64);
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let median = times[reps / 2];
        // Row i sees cached + i + 1 keys: a score and a value product per key and head.
        let keys: usize = (0..rows).map(|i| cached + i + 1).sum();
        let flops = 4.0 * (nseqs * keys * hq * d) as f64;
        println!("| {cached} | {} | {:.3} | {:.1} |", nseqs * rows, median * 1e3, flops / median / 1e9);
    }
}
