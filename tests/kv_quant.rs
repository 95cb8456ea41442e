//! The TurboQuant KV cache inside whole models: byte accounting, prefill against token by
//! token, closeness to the float cache, and the engine's settings.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use iris::batch::{Batch, SeqSlice};
use iris::engine::build::{build_engine, EngineOptions};
use iris::kv::{KvCache, KvCacheSpec, KvDtype, TqBits, TqSpec};

fn tq(key: u8, value: u8, float_window: usize, skip_layers: Vec<usize>) -> TqSpec {
    TqSpec { skip_layers, float_window, window_rings: 3, ..TqSpec::new(TqBits { key, value }) }
}

/// Bytes per token follow from the layout, and the pool allocates exactly blocks x tokens x
/// that, plus the float-window rings.
#[test]
fn byte_accounting_equals_allocation() {
    // tiny-llama: 2 layers, 2 kv heads, head dim 16. k3v4: keys 16 x 3 bits = 6 bytes + a
    // 4-byte norm, values 8 + 4: (10 + 12) x 2 heads x 2 layers.
    let cfg = iris::loader::read_config(&fixture("tiny-llama")).unwrap().1;
    assert_eq!(tq(3, 4, 0, vec![]).bytes_per_token(&cfg, KvDtype::F32), 88);
    // Layer 1 dense in bf16 instead: 44 + 2 x 2 heads x 16 x 2 bytes.
    assert_eq!(tq(3, 4, 0, vec![1]).bytes_per_token(&cfg, KvDtype::Bf16), 44 + 128);
    for name in TINY_MODELS {
        let cfg = iris::loader::read_config(&fixture(name)).unwrap().1;
        for (spec, float) in [
            (tq(3, 4, 0, vec![]), KvDtype::F32),
            (tq(2, 3, 5, vec![0]), KvDtype::Bf16),
            (tq(4, 4, 3, vec![]), KvDtype::F32),
            (tq(2, 2, 0, vec![cfg.num_layers - 1]), KvDtype::F16),
        ] {
            let kv_spec = KvCacheSpec { block_size: 4, num_blocks: 7, dtype: float };
            let kv = KvCache::build(&cfg, kv_spec, Some(&spec), 1, &Device::Cpu).unwrap();
            let want = 7 * 4 * spec.bytes_per_token(&cfg, float) + spec.window_bytes(&cfg, float);
            assert_eq!(kv.allocated_bytes(), want, "{name} {spec:?}");
        }
    }
    // The engine sizes the pool from the budget and reports what it allocated.
    let budget = 200_000u64;
    let opts = EngineOptions {
        kv_memory: Some(budget),
        kv_quant: Some(TqBits { key: 3, value: 4 }),
        kv_float_window: 4,
        max_num_seqs: 8,
        ..Default::default()
    };
    let (engine, report) = build_engine(&fixture("tiny-llama"), &Device::Cpu, &opts).unwrap();
    let spec = engine.kv().turboquant().unwrap();
    let window = spec.window_bytes(&cfg, KvDtype::F32);
    assert_eq!(window, 2 * 2 * 8 * 4 * 2 * 16 * 4, "rings: layers x (k, v) x seqs x window x heads x dim x f32");
    assert_eq!(report.kv_allocated_bytes, report.kv_capacity_tokens * 88 + window);
    assert!(report.kv_allocated_bytes as u64 <= budget);
    assert!(report.kv_allocated_bytes as u64 + 88 * 16 > budget, "the budget is used up to a block");
    let bf16 = KvCacheSpec::bytes_per_token(&cfg, KvDtype::Bf16);
    assert_eq!(report.kv_bf16_capacity_tokens, budget as usize / (bf16 * 16) * 16);
    assert!(report.kv_summary().contains("tq-k3v4"), "{}", report.kv_summary());
}

/// Hidden states of one prompt run through the model in chunks of `chunk` tokens.
fn forward_chunked(name: &str, tokens: &[u32], chunk: usize, spec: Option<&TqSpec>) -> Tensor {
    let dev = device();
    let loaded = iris::loader::load(&fixture(name), &dev, DType::F32).unwrap();
    let cfg = loaded.config().clone();
    let bs = 4;
    let kv_spec = KvCacheSpec { block_size: bs, num_blocks: tokens.len().div_ceil(bs) + 2, dtype: KvDtype::F32 };
    let kv = KvCache::build(&cfg, kv_spec, spec, 1, &dev).unwrap();
    let table: Vec<u32> = (0..kv_spec.num_blocks as u32).rev().collect();
    let mut hidden = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let n = chunk.min(tokens.len() - start);
        let seq = SeqSlice { q_start: 0, q_len: n, context_len: start + n, block_table: table.clone() };
        let mut batch = Batch::from_tokens(&dev, bs, vec![seq], &tokens[start..start + n]).unwrap();
        if let Some(w) = spec.map(|s| s.float_window).filter(|&w| w > 0) {
            batch.attn.set_float_window(w, vec![2]).unwrap();
        }
        hidden.push(loaded.model.forward(&batch, &kv, None).unwrap());
        start += n;
    }
    Tensor::cat(&hidden, 0).unwrap()
}

/// Prefill in one step, in chunks and token by token give the same hidden states with a
/// quantized cache, up to the odd code flipped by the matmuls' last-bit differences between
/// row counts (the attention op alone is bit-identical: `ops::tq_attention` tests). A float
/// window covering the whole prompt reproduces the float cache; codes perturb it.
#[test]
fn prefill_equals_token_by_token_and_a_full_window_equals_the_float_cache() {
    for name in TINY_MODELS {
        let r = reference(name);
        let tokens = ids(&r["text.input_ids"]);
        let dense = forward_chunked(name, &tokens, usize::MAX, None);
        let scaled = TqSpec { key_scales: key_scales(name), ..tq(3, 4, 2, vec![]) };
        for spec in [tq(4, 4, 0, vec![]), tq(3, 4, 3, vec![]), tq(2, 3, 0, vec![0]), scaled] {
            let whole = forward_chunked(name, &tokens, usize::MAX, Some(&spec));
            for chunk in [1, 5] {
                let e = rel_err(&forward_chunked(name, &tokens, chunk, Some(&spec)), &whole);
                assert!(e <= 1e-2, "{name} {spec:?}: chunks of {chunk} differ from one prefill by {e}");
            }
            let e = rel_err(&whole, &dense);
            assert!(e > 1e-3, "{name} {spec:?}: codes changed nothing ({e})");
        }
        let all_float = TqSpec { key_scales: key_scales(name), ..tq(2, 2, tokens.len(), vec![]) };
        for chunk in [usize::MAX, 1, 7] {
            let e = rel_err(&forward_chunked(name, &tokens, chunk, Some(&all_float)), &dense);
            assert!(e <= 1e-5, "{name}: a full float window in chunks of {chunk} is {e} from the float cache");
        }
    }
}

fn key_scales(name: &str) -> Vec<Vec<f32>> {
    let dev = device();
    let loaded = iris::loader::load(&fixture(name), &dev, DType::F32).unwrap();
    iris::engine::calibrate::key_scales(loaded.model.as_ref(), &loaded.tokenizer, &dev).unwrap()
}

/// Calibration gives every layer one positive scale per kv head and channel, the same for
/// the two channels rotary turns together, a mean square of 1 per head, and not all equal.
#[test]
fn calibrated_key_scales_have_the_cache_shape() {
    for name in TINY_MODELS {
        let cfg = iris::loader::read_config(&fixture(name)).unwrap().1;
        let scales = key_scales(name);
        assert_eq!(scales.len(), cfg.num_layers, "{name}");
        let d = cfg.head_dim;
        for s in &scales {
            assert_eq!(s.len(), cfg.num_kv_heads * d, "{name}");
            assert!(s.iter().all(|x| x.is_finite() && *x > 0.0), "{name}: {s:?}");
            for head in s.chunks_exact(d) {
                let ms = head.iter().map(|x| x * x).sum::<f32>() / d as f32;
                assert!((ms - 1.0).abs() < 1e-4, "{name}: mean square {ms}");
                let partner = |c: usize| match cfg.rope_layout {
                    iris::config::RopeLayout::Half => (c + d / 2) % d,
                    iris::config::RopeLayout::Interleaved => c ^ 1,
                };
                assert!((0..d).all(|c| head[c] == head[partner(c)]), "{name}: rotary pairs differ");
                assert!(head.iter().any(|x| (x - head[0]).abs() > 1e-3), "{name}: all scales equal");
            }
        }
        // The same model gives the same scales.
        assert_eq!(scales, key_scales(name), "{name}: calibration is not deterministic");
    }
}

/// Settings that do not fit are errors, not panics.
#[test]
fn bad_settings_are_errors() {
    let path = fixture("tiny-llama");
    let build = |opts: EngineOptions| build_engine(&path, &Device::Cpu, &opts).err().map(|e| e.to_string());
    let bits = Some(TqBits { key: 3, value: 4 });
    let e = build(EngineOptions { kv_float_window: 8, ..Default::default() }).unwrap();
    assert!(e.contains("--kv-float-window"), "{e}");
    let e = build(EngineOptions { kv_skip_layers: vec![0], ..Default::default() }).unwrap();
    assert!(e.contains("--kv-skip-layers"), "{e}");
    let e = build(EngineOptions { kv_quant: bits, kv_skip_layers: vec![2], ..Default::default() }).unwrap();
    assert!(e.contains("layer 2") && e.contains("2 layers"), "{e}");
    let e =
        build(EngineOptions { kv_quant: bits, kv_float_window: 1000, kv_memory: Some(1 << 20), ..Default::default() })
            .unwrap();
    assert!(e.contains("float window"), "{e}");
    assert!(build(EngineOptions { kv_quant: bits, kv_skip_layers: vec![-2, 1], ..Default::default() }).is_none());
}
