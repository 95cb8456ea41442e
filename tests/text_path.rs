//! One weight store, two paths: a vision-language checkpoint loaded with its tower and with
//! `--limit-mm-per-prompt '{"image": 0}'` (no tower) holds the same text model, byte for byte,
//! and gives the same greedy tokens for a text-only request; a text-only checkpoint of the
//! same family loads through the same code into the same bytes.

mod common;

use candle_core::{DType, Device};
use common::{engine_with, fixture, greedy, run_requests};
use iris::engine::build::EngineOptions;
use iris::loader::load_model_parts;

const VLMS: [&str; 2] = ["tiny-qwen2-vl", "tiny-qwen3.5-vl"];

#[test]
fn the_text_model_holds_the_same_bytes_with_and_without_the_tower() {
    for name in VLMS {
        let load = |vision| load_model_parts(&fixture(name), None, &Device::Cpu, DType::F32, None, vision).unwrap();
        let (both, text) = (load(true), load(false));
        assert!(both.vision.is_some() && text.vision.is_none(), "{name}");
        assert!(both.held.vision > 0, "{name}: {:?}", both.held);
        assert_eq!(text.held.vision, 0, "{name}");
        // A second copy of the backbone for the text path would show here.
        assert_eq!(both.held.text, text.held.text, "{name}");
        assert_eq!(both.held.total(), both.held.text + both.held.vision, "{name}");
        // The figure is what the layers keep: every text weight of this f32 fixture, 4 bytes each.
        let cfg = both.config();
        assert!(both.held.text >= 4 * cfg.vocab_size as u64 * cfg.hidden_size as u64, "{name}: {:?}", both.held);
    }
    // Qwen3.5: the text-only checkpoint of the family (same text config as the VLM fixture).
    let plain = load_model_parts(&fixture("tiny-qwen3.5"), None, &Device::Cpu, DType::F32, None, true).unwrap();
    let vl = load_model_parts(&fixture("tiny-qwen3.5-vl"), None, &Device::Cpu, DType::F32, None, false).unwrap();
    assert_eq!(plain.held, vl.held);
    // bf16 holds half of f32's dense bytes: the figure is what is held, not the files' size.
    let half = load_model_parts(&fixture("tiny-qwen2-vl"), None, &Device::Cpu, DType::BF16, None, false).unwrap();
    let full = load_model_parts(&fixture("tiny-qwen2-vl"), None, &Device::Cpu, DType::F32, None, false).unwrap();
    assert!(half.held.text < full.held.text, "{:?} vs {:?}", half.held, full.held);
}

#[test]
fn a_text_request_gives_the_same_tokens_without_the_tower() {
    for name in VLMS {
        let opts = |image_limit| EngineOptions {
            kv_memory: Some(1 << 20),
            max_num_seqs: 4,
            image_limit,
            ..Default::default()
        };
        let mut both = engine_with(&fixture(name), opts(None));
        let mut text = engine_with(&fixture(name), opts(Some(0)));
        assert!(both.vision().is_some() && text.vision().is_none(), "{name}");
        let reqs: Vec<_> =
            [vec![1u32, 5, 9, 14, 3, 27], vec![40, 2, 2, 7]].into_iter().map(|p| (p, greedy(12))).collect();
        let want = run_requests(&mut both, &reqs, &[0, 1]);
        assert!(want.iter().all(|o| o.len() == 12), "{name}");
        assert_eq!(run_requests(&mut text, &reqs, &[0, 1]), want, "{name}");
    }
}
