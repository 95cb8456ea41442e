//! A hybrid model's two token mixers in one sequence's decode step, on the CPU, per layer: the
//! Gated DeltaNet recurrence (`ops::gated_delta`: the conv, the l2 norms and the delta rule over
//! a fixed state) against paged attention (`ops::paged_attention`) over a cache of `context`
//! tokens. The projections around either mixer are matrix-vector products whose cost does not
//! depend on the context; they are left out. Dims of two Qwen3.5 sizes:
//! - 0.8B: DeltaNet 16 key / 16 value heads of 128; attention 8 heads, 2 KV heads of 256;
//! - 27B-class: DeltaNet 16 key / 48 value heads of 128; attention 24 heads, 4 KV heads of 256.
//!
//!   cargo bench --bench mixer_decode -- [--contexts 1024,32768] [--steps 40]
//!
//! Prints the median microseconds per layer of each mixer and their ratio.

use std::time::Instant;

use candle_core::{Device, Tensor};
use iris::batch::{AttentionMeta, SeqSlice};
use iris::config::LinearAttnConfig;
use iris::ops::gated_delta::{run_sequence, DeltaParams};
use iris::ops::paged_attention::PagedAttention;

const BLOCK: usize = 16;

struct Shape {
    name: &'static str,
    delta: LinearAttnConfig,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Microseconds of one decode row through the DeltaNet recurrence, from a random state.
fn delta_us(d: &LinearAttnConfig, steps: usize) -> f64 {
    let noise = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect() };
    let (c, hv) = (d.conv_dim(), d.num_value_heads);
    let (w, neg_a, dt) = (noise(c * d.conv_kernel), vec![-0.5f32; hv], vec![0.1f32; hv]);
    let p = DeltaParams { conv_weight: &w, neg_a: &neg_a, dt_bias: &dt };
    let (cl, sl) = d.state_len();
    let (mut conv, mut ssm) = (noise(cl), noise(sl));
    let (qkv, a, b) = (noise(c), noise(hv), noise(hv));
    let times = (0..steps + 3)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(run_sequence(d, &p, &mut conv, &mut ssm, &qkv, &a, &b));
            t.elapsed().as_secs_f64() * 1e6
        })
        .skip(3)
        .collect();
    median(times)
}

/// Microseconds of one decode row attending to `context` cached positions (f32 cache, random).
fn attention_us(s: &Shape, context: usize, steps: usize) -> f64 {
    let dev = Device::Cpu;
    let k = Tensor::randn(0f32, 1.0, (context, s.kv_heads, s.head_dim), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (context, s.kv_heads, s.head_dim), &dev).unwrap();
    let q = Tensor::randn(0f32, 1.0, (1, s.heads, s.head_dim), &dev).unwrap();
    let table = (0..context.div_ceil(BLOCK) as u32).collect();
    let meta =
        AttentionMeta::new(BLOCK, vec![SeqSlice { q_start: 0, q_len: 1, context_len: context, block_table: table }]);
    let op = PagedAttention {
        meta: &meta,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        scale: (s.head_dim as f32).powf(-0.5),
        window: None,
        softcap: None,
        isa: iris::simd::Isa::active(),
        bidirectional: false,
    };
    let times = (0..steps + 3)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(op.forward(&q, &k, &v).unwrap());
            t.elapsed().as_secs_f64() * 1e6
        })
        .skip(3)
        .collect();
    median(times)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let contexts: Vec<usize> = flag("--contexts")
        .unwrap_or_else(|| "1024,32768".into())
        .split(',')
        .map(|c| c.trim().parse().unwrap_or_else(|_| panic!("--contexts: `{c}` is not a number")))
        .collect();
    let steps: usize = flag("--steps").map_or(40, |s| s.parse().expect("--steps takes a number"));
    let delta = |hk, hv| LinearAttnConfig {
        num_key_heads: hk,
        num_value_heads: hv,
        key_head_dim: 128,
        value_head_dim: 128,
        conv_kernel: 4,
    };
    let shapes = [
        Shape { name: "Qwen3.5-0.8B", delta: delta(16, 16), heads: 8, kv_heads: 2, head_dim: 256 },
        Shape { name: "Qwen3.5-27B-class", delta: delta(16, 48), heads: 24, kv_heads: 4, head_dim: 256 },
    ];
    println!("| shape | context | DeltaNet us/layer | attention us/layer | attention / DeltaNet |");
    println!("|---|---|---|---|---|");
    for s in &shapes {
        let d = delta_us(&s.delta, steps);
        for &ctx in &contexts {
            let a = attention_us(s, ctx, steps);
            println!("| {} | {ctx} | {d:.1} | {a:.1} | {:.2} |", s.name, a / d);
        }
    }
}
