//! The CPU's paged attention for prompt rows that follow a cached context (what a turn of a
//! conversation computes after a prefix-cache hit): `rows` new rows of one sequence over
//! `context` cached positions, per layer, with the head layout of a model. Prints ms per layer
//! and the attention's arithmetic rate (4 * rows * heads * head_dim * keys seen, causal).
//!
//!   cargo bench --bench prefill_attention -- [--rows 144] [--contexts 0,256,1280,4096]
//!       [--heads 9] [--kv-heads 3] [--head-dim 64] [--reps 20]
//!
//! Defaults: SmolLM2-135M's attention (9 query heads, 3 kv heads, head dim 64), f32 cache.

use std::time::Instant;

use candle_core::{Device, Tensor};
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
    let bs = 16;
    println!("| cached context | rows | ms per layer | GFLOP/s |");
    println!("|---|---|---|---|");
    for &cached in &contexts {
        let total = cached + rows;
        let blocks = total.div_ceil(bs);
        let dev = Device::Cpu;
        let k = Tensor::randn(0f32, 1.0, (blocks * bs, hkv, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (blocks * bs, hkv, d), &dev).unwrap();
        let q = Tensor::randn(0f32, 1.0, (rows, hq, d), &dev).unwrap();
        let seq = SeqSlice { q_start: 0, q_len: rows, context_len: total, block_table: (0..blocks as u32).collect() };
        let meta = AttentionMeta::new(bs, vec![seq]);
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
        op.forward(&q, &k, &v).unwrap();
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            op.forward(&q, &k, &v).unwrap();
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let median = times[reps / 2];
        // Row i sees cached + i + 1 keys: a score and a value product per key and head.
        let keys: usize = (0..rows).map(|i| cached + i + 1).sum();
        let flops = 4.0 * (keys * hq * d) as f64;
        println!("| {cached} | {rows} | {:.2} | {:.1} |", median * 1e3, flops / median / 1e9);
    }
}
