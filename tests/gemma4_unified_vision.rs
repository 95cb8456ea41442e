//! The unified Gemma 4 family's (`gemma4_unified`) vision path against transformers 5.24 on the
//! tiny-gemma4-unified-vlm fixture (scripts/make_gemma4_fixtures.py: the encoder-free embedder,
//! patch 4 merged 2 x 2): the merged patches iris builds from its processor's patches, the
//! image embeddings, the logits with images (f32, relative error <= 1e-4; the checkpoint's
//! images attend both ways, as the family does by default, and a copy set causal, with every
//! layer's hidden states) and greedy tokens, alone and side by side with a small step budget,
//! for one square image, one non-square image after text and two images across two turns.
//!
//! The references with images attending both ways are transformers' with Gemma 4's masks (both
//! ways on sliding layers only), which its generate() builds; its forward() alone builds Gemma 3's
//! for this family, and its generate() over the cache parts from its own whole-sequence forwards
//! after a few tokens, so greedy tokens are the argmax loop over whole-sequence forwards
//! (scripts/make_gemma4_fixtures.py says so beside them).
//!
//! transformers has no PIL backend for this processor (its torchvision resize differs from
//! Pillow's by about 1/255 in a few values), so the model tests take transformers' pixel values,
//! cut back into the processor's patches, and the processor test bounds the difference.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{ImageInput, Request};
use iris::loader::LoadedModel;
use iris::media::{decode_image, DecodeLimits, PixelValues};
use iris::models::gemma4::unified_vision::merge_patches;
use iris::models::VisionModel;

const MODEL: &str = "tiny-gemma4-unified-vlm";
const TOL: f32 = 1e-4;
const CASES: [&str; 3] = ["single", "nonsquare", "multi"];
/// The fixture's patch side and merge.
const P: usize = 4;
const K: usize = 2;

fn vision(m: &LoadedModel) -> &dyn VisionModel {
    m.vision.as_deref().expect("the fixture has a vision embedder")
}

fn case_json(case: &str) -> serde_json::Value {
    reference_json(MODEL)["cases"][case].clone()
}

fn prompt(case: &str) -> Vec<u32> {
    json_ids(&case_json(case)["input_ids"])
}

/// transformers' merged patches of each image of a case, as the processor's patches of P.
fn reference_pixels(case: &str) -> Vec<PixelValues> {
    let r = reference(MODEL);
    let merged: Vec<Vec<f32>> = r[&format!("{case}.pixel_values")].to_vec2().unwrap();
    let places: Vec<Vec<i64>> = r[&format!("{case}.image_position_ids")].to_vec2().unwrap();
    let counts: Vec<usize> = serde_json::from_value(case_json(case)["num_soft_tokens"].clone()).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    for n in counts {
        let (mw, mh) = (places[at + n - 1][0] as usize + 1, places[at + n - 1][1] as usize + 1);
        assert_eq!(mw * mh, n, "merged patches run row by row over the grid");
        let (gh, gw) = (mh * K, mw * K);
        let mut data = vec![0.0; gh * gw * 3 * P * P];
        for (i, patch) in merged[at..at + n].iter().enumerate() {
            let (my, mx) = (i / mw, i % mw);
            for r in 0..K * P {
                for b in 0..K {
                    let teacher = (my * K + r / P) * gw + mx * K + b;
                    let dst = teacher * 3 * P * P + (r % P) * 3 * P;
                    let src = (r * K + b) * 3 * P;
                    data[dst..dst + 3 * P].copy_from_slice(&patch[src..src + 3 * P]);
                }
            }
        }
        out.push(PixelValues { data, rows: gh * gw, cols: 3 * P * P, grid_thw: [1, gh, gw] });
        at += n;
    }
    out
}

fn embeds(m: &LoadedModel, px: &[PixelValues]) -> Tensor {
    Tensor::cat(&px.iter().map(|p| vision(m).encode(p).unwrap()).collect::<Vec<_>>(), 0).unwrap()
}

#[test]
fn merged_patches_match_transformers() {
    let m = iris::loader::load(&fixture(MODEL), &Device::Cpu, DType::F32).unwrap();
    let r = reference(MODEL);
    for case in CASES {
        let mut ours = Vec::new();
        let mut counts = Vec::new();
        for f in case_json(case)["images"].as_array().unwrap() {
            let bytes = std::fs::read(fixture(MODEL).join(f.as_str().unwrap())).unwrap();
            let px = vision(&m).preprocess(&decode_image(&bytes, &DecodeLimits::default()).unwrap()).unwrap();
            counts.push(vision(&m).num_image_tokens(&px));
            let [_, gh, gw] = px.grid_thw;
            ours.extend(merge_patches(&px.data, (gh, gw), P, K));
        }
        assert_eq!(serde_json::json!(counts), case_json(case)["num_soft_tokens"], "{case}: image tokens");
        // The merge itself is exact: transformers' patches cut and merged back are its own.
        let back: Vec<f32> = reference_pixels(case)
            .iter()
            .flat_map(|p| merge_patches(&p.data, (p.grid_thw[1], p.grid_thw[2]), P, K))
            .collect();
        let want = &r[&format!("{case}.pixel_values")];
        assert_eq!(back, want.flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{case}: merge");
        // Pillow's bicubic against torchvision's: a few values a step of 1/255 apart.
        let got = Tensor::from_vec(ours, want.dims(), &Device::Cpu).unwrap();
        let diff = (&got - want).unwrap().abs().unwrap();
        let max = diff.max_all().unwrap().to_scalar::<f32>().unwrap();
        let mean = diff.mean_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(max <= 2.5 / 255.0 && mean <= 0.1 / 255.0, "{case}: pixel values differ by {max} (mean {mean})");
    }
}

/// Image embeddings and logits with images, both ways (the checkpoint) and causal (a copy),
/// with each layer's hidden states there.
#[test]
fn image_embeddings_layers_and_logits_match_transformers() {
    let causal = copy_with_config(&fixture(MODEL), "gemma4-unified-causal", |cfg| {
        cfg["text_config"]["use_bidirectional_attention"] = serde_json::Value::Null;
    });
    let r = reference(MODEL);
    for (dir, key) in [(causal.path().to_path_buf(), ""), (fixture(MODEL), ".bidir")] {
        let m = iris::loader::load(&dir, &Device::Cpu, DType::F32).unwrap();
        assert_eq!(m.config().images_attend_both_ways(), !key.is_empty());
        for case in CASES {
            let tokens = prompt(case);
            let px = reference_pixels(case);
            let e_img = embeds(&m, &px);
            let e = rel_err(&e_img, &r[&format!("{case}.image_embeds")]);
            assert!(e <= TOL, "{case} image embeddings: rel err {e}");
            let refs: Vec<&PixelValues> = px.iter().collect();
            let pos = vision(&m).prompt_positions(&tokens, &refs).unwrap();
            let (hidden, taps) = forward_with_images(&m, &Device::Cpu, &tokens, Some((&pos, &e_img)), usize::MAX);
            if key.is_empty() {
                for (i, h) in taps.layers.iter().enumerate() {
                    let e = rel_err(h, &r[&format!("{case}.layer.{i}")]);
                    assert!(e <= TOL, "{case} layer {i}: rel err {e}");
                }
            }
            let e = rel_err(&m.model.logits(&hidden).unwrap(), &r[&format!("{case}{key}.logits")]);
            assert!(e <= TOL, "{case}{key} logits: rel err {e}");
        }
    }
}

/// Greedy tokens with images are transformers', all cases side by side, whole and with a step
/// budget of 16 (prompts chunked; an image taken whole).
#[test]
fn greedy_tokens_with_images_match_transformers() {
    let r = reference(MODEL);
    for budget in [8192, 16] {
        let opts = EngineOptions { kv_memory: Some(4 << 20), max_num_batched_tokens: budget, ..Default::default() };
        let mut engine = engine_with(&fixture(MODEL), opts);
        let mut want = std::collections::HashMap::new();
        for case in CASES {
            let expected = ids(&r[&format!("{case}.bidir.generated_ids")]);
            let req = Request { prompt_tokens: prompt(case), params: greedy(expected.len()) };
            let images = reference_pixels(case).into_iter().map(ImageInput::new).collect();
            want.insert(engine.add_request_with_images(req, images).unwrap(), (case, expected));
        }
        let mut got: std::collections::HashMap<_, Vec<u32>> = Default::default();
        while engine.has_work() {
            for u in engine.step().unwrap() {
                if let Some(t) = u.token {
                    got.entry(u.id).or_default().push(t.token);
                }
            }
        }
        for (id, (case, expected)) in want {
            assert_eq!(got[&id], expected, "{case}, budget {budget}");
        }
    }
}
