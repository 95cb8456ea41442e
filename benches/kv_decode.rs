//! Decode speed by KV cache format and context length: one sequence's decode step through
//! the whole model (all layers, the logits of its row, the greedy token), over a cache already
//! holding `context` tokens. The cache is filled with random keys and values through the same
//! write ops as serving (codes are real codes); decode speed does not depend on their values,
//! and filling this way skips a prefill that would take minutes at 32k tokens on a CPU.
//!
//!   cargo bench --bench kv_decode -- MODEL [--contexts 1024,8192,32768]
//!       [--caches bf16,f32,tq-k4v4,tq-k3v4,tq-k2v3] [--steps 8] [--device cpu|cuda] [--dtype f32|bf16]
//!
//! Steps run as the engine runs them (`ModelRunner`): on a GPU, through the decode step's CUDA
//! graph (IRIS_CUDA_GRAPHS=0: op by op). `--device cuda` defaults to bf16 weights and the
//! caches bf16,tq-k4v4,tq-k3v4; a TurboQuant cache keeps its unused float parts in the
//! weights' type there.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use iris::batch::{Batch, DeviceAttentionMeta, SeqSlice};
use iris::engine::runner::ModelRunner;
use iris::kv::{KvCache, KvCacheDtype, KvCacheSpec, KvDtype, LayerCache, TqSpec};
use iris::models::TextModel;
use iris::ops::kv_write::KvWrite;
use iris::ops::sample::Draw;
use iris::ops::tq_write::TqWrite;

const BLOCK: usize = 16;

fn fill(kv: &KvCache, layers: usize, context: usize, kv_heads: usize, dim: usize, dev: &Device) {
    for l in 0..layers {
        let mut start = 0;
        while start < context {
            let n = (context - start).min(4096);
            let slots: Vec<u32> = (start as u32..(start + n) as u32).collect();
            let dm = (!dev.is_cpu()).then(|| DeviceAttentionMeta::slots(&slots, dev).unwrap());
            let k = Tensor::randn(0f32, 1.0, (n, kv_heads, dim), dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (n, kv_heads, dim), dev).unwrap();
            match kv.layer(l) {
                LayerCache::Dense { k: kc, v: vc } => {
                    let write = KvWrite::to_slots(&slots, dm.as_ref());
                    kc.inplace_op2(&k, &write).unwrap();
                    vc.inplace_op2(&v, &write).unwrap();
                }
                LayerCache::TurboQuant(c) => {
                    c.k.inplace_op2(&k, &TqWrite::keys(c, &slots, dm.as_ref())).unwrap();
                    c.v.inplace_op2(&v, &TqWrite::values(c, &slots, dm.as_ref())).unwrap();
                }
                LayerCache::Calibration(_) => unreachable!("the bench builds no calibration cache"),
                LayerCache::Recurrent(_) => unreachable!("the bench's models have no recurrent layers"),
                LayerCache::Shared { .. } => unreachable!("the bench's models share no KV"),
            }
            start += n;
        }
        // A float window's ring (one sequence's) holds random rows too.
        if let LayerCache::TurboQuant(c) = kv.layer(l) {
            if let Some(w) = &c.window {
                for ring in [&w.k, &w.v] {
                    ring.slice_set(
                        &Tensor::randn(0f32, 1.0, ring.shape(), dev).unwrap().to_dtype(ring.dtype()).unwrap(),
                        0,
                        0,
                    )
                    .unwrap();
                }
            }
        }
    }
}

/// A cache format of the table: a `--kv-cache-dtype` value, for TurboQuant optionally with
/// `/wN` (a float window of N positions, as `--kv-float-window N`).
#[derive(Clone, Copy)]
struct Cache {
    dtype: KvCacheDtype,
    float_window: usize,
}

impl std::fmt::Display for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.float_window {
            0 => write!(f, "{}", self.dtype),
            w => write!(f, "{}/w{w}", self.dtype),
        }
    }
}

fn parse_cache(s: &str) -> Result<Cache, String> {
    let (dtype, window) = s.split_once("/w").map_or((s, None), |(d, w)| (d, Some(w)));
    let dtype: KvCacheDtype = dtype.parse().map_err(|e| format!("cache `{s}`: {e}"))?;
    let float_window = match window {
        None => 0,
        Some(w) => w.parse().map_err(|_| format!("cache `{s}`: /wN takes a number of positions"))?,
    };
    if float_window > 0 && !matches!(dtype, KvCacheDtype::TurboQuant(_)) {
        return Err(format!("cache `{s}`: a float window needs a TurboQuant cache"));
    }
    Ok(Cache { dtype, float_window })
}

/// Bad arguments: one line, exit status 2.
fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("kv_decode: {msg}");
    std::process::exit(2);
}

/// Median seconds of one decode step at `context` tokens.
fn decode_step(model: &dyn TextModel, dev: &Device, float: KvDtype, cache: Cache, context: usize, steps: usize) -> f64 {
    let cfg = model.config();
    let (float, tq) = match cache.dtype {
        KvCacheDtype::Auto => (float, None),
        KvCacheDtype::Float(d) => (d, None),
        // Key scales as calibration sets them by default (their values do not change the speed).
        KvCacheDtype::TurboQuant(bits) => (
            float,
            Some(TqSpec {
                key_scales: vec![vec![1.0; cfg.num_kv_heads * cfg.head_dim]; cfg.num_layers],
                float_window: cache.float_window,
                window_rings: 1,
                ..TqSpec::new(bits)
            }),
        ),
    };
    let spec = KvCacheSpec { block_size: BLOCK, num_blocks: (context + 1).div_ceil(BLOCK), dtype: float };
    let kv = KvCache::build(cfg, spec, tq.as_ref(), 1, dev).unwrap();
    fill(&kv, cfg.num_layers, context, cfg.num_kv_heads, cfg.head_dim, dev);
    let max_positions = cfg.max_position_embeddings.min(iris::layers::rotary::MAX_TABLE_POSITIONS);
    let mut runner = ModelRunner::new(dev.clone(), 1, spec.num_blocks, max_positions, 1);
    let greedy = [Draw::greedy()];
    let mut times = Vec::new();
    for _ in 0..steps + 2 {
        let seq = SeqSlice {
            q_start: 0,
            q_len: 1,
            context_len: context + 1,
            block_table: (0..spec.num_blocks as u32).collect(),
        };
        let mut batch = Batch::from_tokens(&Device::Cpu, BLOCK, vec![seq], &[42]).unwrap();
        if let Some(w) = kv.turboquant().map(|t| t.float_window).filter(|&w| w > 0) {
            batch.attn.set_float_window(w, vec![0]).unwrap();
        }
        let t = Instant::now();
        let draws = (!dev.is_cpu()).then_some(&greedy[..]);
        let _ = runner.run(model, &kv, batch, &[0], draws, false).unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    // Warm-up: the first step (and on a GPU the graph's capture in the second).
    times.drain(..2);
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let Some(model_path) = args.first() else {
        eprintln!(
            "usage: cargo bench --bench kv_decode -- MODEL [--contexts 1024,8192] [--caches bf16,tq-k3v4,tq-k3v4/w128] [--steps 8] [--device cpu|cuda] [--dtype f32|bf16]"
        );
        std::process::exit(2);
    };
    let opt = |name: &str, default: &str| -> String {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or(default.to_string())
    };
    let dev = iris::device::open(&opt("--device", "cpu")).unwrap_or_else(|e| fail(e));
    let on_gpu = !dev.is_cpu();
    let dtype = match opt("--dtype", if on_gpu { "bf16" } else { "f32" }).as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => fail(format!("unknown --dtype {other} (f32, bf16, f16)")),
    };
    let float = KvDtype::from_dtype(dtype).expect("a float type");
    let contexts: Vec<usize> = opt("--contexts", "1024,8192,32768")
        .split(',')
        .map(|s| s.parse().unwrap_or_else(|_| fail(format!("--contexts: `{s}` is not a number of tokens"))))
        .collect();
    let default_caches = if on_gpu { "bf16,tq-k4v4,tq-k3v4" } else { "bf16,f32,tq-k4v4,tq-k3v4,tq-k2v3" };
    let caches: Vec<Cache> =
        opt("--caches", default_caches).split(',').map(|c| parse_cache(c).unwrap_or_else(|e| fail(e))).collect();
    let steps: usize =
        opt("--steps", "8").parse().ok().filter(|&n| n > 0).unwrap_or_else(|| fail("--steps takes a positive number"));
    let loaded = iris::loader::load(std::path::Path::new(model_path), &dev, dtype)
        .unwrap_or_else(|e| fail(format!("loading {model_path}: {e}")));
    let model = loaded.model.as_ref();
    let threads = iris::ops::team::team().threads();
    let graphs = on_gpu && std::env::var("IRIS_CUDA_GRAPHS").map_or(true, |v| v != "0");
    println!(
        "model {model_path}, {dtype:?} on {}, batch 1, median of {steps} steps{}",
        if on_gpu { "cuda" } else { "cpu" },
        if on_gpu {
            format!(", CUDA graphs {}", if graphs { "on" } else { "off" })
        } else {
            format!(", {threads} threads")
        }
    );
    println!("| context | KV cache | decode tok/s | vs bf16 |");
    println!("|---|---|---|---|");
    for &context in &contexts {
        let mut bf16 = None;
        for &cache in &caches {
            let t = decode_step(model, &dev, float, cache, context, steps);
            if cache.dtype == KvCacheDtype::Float(KvDtype::Bf16) {
                bf16 = Some(t);
            }
            let rel = bf16.map_or("-".to_string(), |b| format!("{:.2}x", b / t));
            println!("| {context} | {cache} | {:.1} | {rel} |", 1.0 / t);
        }
    }
}
