//! Real models from PyPI packages against transformers on the same GGUF (dequantized, f32):
//! teacher-forced top-1 agreement over a 300+ token English text, and SmolLM2's chat answer.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use iris::batch::{Batch, SeqSlice};
use iris::engine::build::EngineOptions;
use iris::fetch::{PypiGguf, GEMMA3_270M, SMOLLM2};
use iris::kv::{KvCache, KvCacheSpec, KvDtype};

/// Share of positions where iris's argmax equals transformers'.
fn top1_agreement(m: &PypiGguf, name: &str) -> Option<f64> {
    let path = real_gguf(m)?;
    let r = real_reference(name);
    let ids = json_ids(&r["text_ids"]);
    let want = json_ids(&r["top1"]);
    assert!(ids.len() >= 200, "the reference text must be 200+ tokens");
    let loaded = iris::loader::load(&path, &Device::Cpu, DType::F32).unwrap();
    let cfg = loaded.config().clone();
    let bs = 16;
    let spec = KvCacheSpec { block_size: bs, num_blocks: ids.len().div_ceil(bs), dtype: KvDtype::F32 };
    let kv = KvCache::new(&cfg, spec, &Device::Cpu).unwrap();
    let seq = SeqSlice {
        q_start: 0,
        q_len: ids.len(),
        context_len: ids.len(),
        block_table: (0..spec.num_blocks as u32).collect(),
    };
    let batch = Batch::from_tokens(&Device::Cpu, bs, vec![seq], &ids).unwrap();
    let hidden = loaded.model.forward(&batch, &kv, None).unwrap();
    let logits: Tensor = loaded.model.logits(&hidden).unwrap();
    let got: Vec<u32> = logits.argmax(1).unwrap().to_vec1().unwrap();
    let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
    let agreement = same as f64 / want.len() as f64;
    eprintln!("{name}: top-1 agreement with transformers {same}/{} = {:.2}%", want.len(), agreement * 100.0);
    Some(agreement)
}

#[test]
fn smollm2_top1_agrees_with_transformers() {
    if let Some(a) = top1_agreement(&SMOLLM2, "smollm2") {
        assert!(a >= 0.95, "smollm2 top-1 agreement {a:.3} < 0.95");
    }
}

#[test]
fn gemma3_top1_agrees_with_transformers() {
    if let Some(a) = top1_agreement(&GEMMA3_270M, "gemma3") {
        assert!(a >= 0.95, "gemma3 top-1 agreement {a:.3} < 0.95");
    }
}

#[test]
fn smollm2_knows_the_capital_of_france() {
    let Some(path) = real_gguf(&SMOLLM2) else { return };
    let r = real_reference("smollm2");
    let mut engine = engine_with(&path, EngineOptions { kv_memory: Some(64 << 20), ..Default::default() });
    let tok = engine.tokenizer().clone();
    let msgs = [iris::tokenizer::ChatMessage::text("user", "What is the capital of France?")];
    let prompt = tok.encode_chat(&msgs, true).unwrap();
    assert_eq!(prompt, json_ids(&r["chat"]["prompt_ids"]), "chat prompt ids differ from transformers");
    let params = iris::engine::SamplingParams { max_tokens: 24, ..Default::default() };
    let out = run_requests(&mut engine, &[(prompt, params)], &[0]).remove(0);
    let text = tok.decode(&out, true).unwrap();
    assert!(text.contains("Paris"), "answer was {text:?}");
    // Greedy tokens equal transformers' up to and including the end of the answer.
    let want = json_ids(&r["chat"]["greedy_ids"]);
    let n = r["chat"]["first_eos_index"].as_u64().unwrap() as usize + 1;
    assert_eq!(out, want[..n], "greedy answer differs from transformers");
}
