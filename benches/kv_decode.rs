//! Decode speed by KV cache format and context length: one sequence's decode step through
//! the whole model (all layers, the logits of its row), over a cache already holding
//! `context` tokens. The cache is filled with random keys and values through the same write
//! ops as serving (codes are real codes); decode speed does not depend on their values, and
//! filling this way skips a prefill that would take minutes at 32k tokens on a CPU.
//!
//!   cargo bench --bench kv_decode -- MODEL.gguf [--contexts 1024,8192,32768]
//!       [--caches bf16,f32,tq-k4v4,tq-k3v4,tq-k2v3] [--steps 8]

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use iris::batch::{Batch, SeqSlice};
use iris::kv::{KvCache, KvCacheDtype, KvCacheSpec, KvDtype, LayerCache, TqSpec};
use iris::models::TextModel;
use iris::ops::kv_write::KvWrite;
use iris::ops::tq_write::TqWrite;

const BLOCK: usize = 16;

fn fill(kv: &KvCache, layers: usize, context: usize, kv_heads: usize, dim: usize) {
    let dev = Device::Cpu;
    for l in 0..layers {
        let mut start = 0;
        while start < context {
            let n = (context - start).min(4096);
            let slots: Vec<u32> = (start as u32..(start + n) as u32).collect();
            let k = Tensor::randn(0f32, 1.0, (n, kv_heads, dim), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (n, kv_heads, dim), &dev).unwrap();
            match kv.layer(l) {
                LayerCache::Dense { k: kc, v: vc } => {
                    kc.inplace_op2(&k, &KvWrite::to_slots(&slots)).unwrap();
                    vc.inplace_op2(&v, &KvWrite::to_slots(&slots)).unwrap();
                }
                LayerCache::TurboQuant(c) => {
                    let scale = c.codecs.key_scale.as_deref();
                    c.k.inplace_op2(&k, &TqWrite { slot_mapping: &slots, codec: &c.codecs.key, scale }).unwrap();
                    c.v.inplace_op2(&v, &TqWrite { slot_mapping: &slots, codec: &c.codecs.value, scale: None })
                        .unwrap();
                }
                LayerCache::Calibration(_) => unreachable!("the bench builds no calibration cache"),
            }
            start += n;
        }
    }
}

/// Median seconds of one decode step at `context` tokens.
fn decode_step(model: &dyn TextModel, cache: KvCacheDtype, context: usize, steps: usize) -> f64 {
    let cfg = model.config();
    let (float, tq) = match cache {
        KvCacheDtype::Auto => (KvDtype::F32, None),
        KvCacheDtype::Float(d) => (d, None),
        // Key scales as calibration sets them by default (their values do not change the speed).
        KvCacheDtype::TurboQuant(bits) => (
            KvDtype::F32,
            Some(TqSpec {
                key_scales: vec![vec![1.0; cfg.num_kv_heads * cfg.head_dim]; cfg.num_layers],
                ..TqSpec::new(bits)
            }),
        ),
    };
    let spec = KvCacheSpec { block_size: BLOCK, num_blocks: (context + 1).div_ceil(BLOCK), dtype: float };
    let kv = KvCache::build(cfg, spec, tq.as_ref(), &Device::Cpu).unwrap();
    fill(&kv, cfg.num_layers, context, cfg.num_kv_heads, cfg.head_dim);
    let seq =
        SeqSlice { q_start: 0, q_len: 1, context_len: context + 1, block_table: (0..spec.num_blocks as u32).collect() };
    let mut batch = Batch::from_tokens(&Device::Cpu, BLOCK, vec![seq], &[42]).unwrap();
    batch.attn.window_rings = vec![0];
    let mut times = Vec::new();
    for _ in 0..steps + 1 {
        let t = Instant::now();
        let h = model.forward(&batch, &kv, None).unwrap();
        let _ = model.logits(&h).unwrap().argmax(1).unwrap().to_vec1::<u32>().unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    times.remove(0); // warm-up
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let Some(model_path) = args.first() else {
        eprintln!(
            "usage: cargo bench --bench kv_decode -- MODEL [--contexts 1024,8192] [--caches bf16,tq-k3v4] [--steps 8]"
        );
        std::process::exit(2);
    };
    let opt = |name: &str, default: &str| -> String {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or(default.to_string())
    };
    let contexts: Vec<usize> =
        opt("--contexts", "1024,8192,32768").split(',').map(|s| s.parse().expect("a context length")).collect();
    let caches: Vec<KvCacheDtype> = opt("--caches", "bf16,f32,tq-k4v4,tq-k3v4,tq-k2v3")
        .split(',')
        .map(|s| s.parse().expect("a cache dtype"))
        .collect();
    let steps: usize = opt("--steps", "8").parse().expect("a step count");
    let loaded = iris::loader::load(std::path::Path::new(model_path), &Device::Cpu, DType::F32).expect("model loads");
    let model = loaded.model.as_ref();
    println!("model {model_path}, {} threads, batch 1, median of {steps} steps", iris::ops::team::team().threads());
    println!("| context | KV cache | decode tok/s | vs bf16 |");
    println!("|---|---|---|---|");
    for &context in &contexts {
        let mut bf16 = None;
        for &cache in &caches {
            let t = decode_step(model, cache, context, steps);
            if cache == KvCacheDtype::Float(KvDtype::Bf16) {
                bf16 = Some(t);
            }
            let rel = bf16.map_or("-".to_string(), |b| format!("{:.2}x", b / t));
            println!("| {context} | {cache} | {:.1} | {rel} |", 1.0 / t);
        }
    }
}
