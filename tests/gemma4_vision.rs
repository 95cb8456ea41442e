//! Gemma 4's vision path against transformers 5.24 on the tiny-gemma4 fixture (E2B-like, with a
//! tower of patch 4 and pooling 2; scripts/make_gemma4_fixtures.py): the image processor (PIL
//! backend, pixel values to f32 rounding, <= 1e-6) and patch places, the chat template's ids
//! with each image expanded to `<|image>` + `<|image|>` x n + `<image|>`, the projected image
//! embeddings, every layer's hidden states and the logits with images (f32, relative error
//! <= 1e-4 of the reference's largest magnitude; whole, in chunks that split the images, and
//! token by token), and greedy tokens alone and side by side, for one square image, one
//! non-square image after text, and two images across two turns. And the same checkpoint with
//! `use_bidirectional_attention: "vision"` (the 26B/31B mask: on sliding layers an image's
//! tokens see the whole image), whose references transformers computed from the same weights.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{expand_image_tokens, ImageInput, Request};
use iris::loader::LoadedModel;
use iris::media::{decode_image, DecodeLimits, PixelValues};
use iris::models::VisionModel;

const MODEL: &str = "tiny-gemma4";
const TOL: f32 = 1e-4;
const CASES: [&str; 3] = ["single", "nonsquare", "multi"];

fn load() -> LoadedModel {
    iris::loader::load(&fixture(MODEL), &Device::Cpu, DType::F32).unwrap()
}

/// The fixture with `use_bidirectional_attention: "vision"`, in a temporary directory.
fn bidirectional_copy() -> ScratchDir {
    copy_with_config(&fixture(MODEL), "gemma4-bidirectional", |cfg| {
        cfg["text_config"]["use_bidirectional_attention"] = "vision".into();
    })
}

fn vision(m: &LoadedModel) -> &dyn VisionModel {
    m.vision.as_deref().expect("tiny-gemma4 has a vision tower")
}

fn case_json(case: &str) -> serde_json::Value {
    reference_json(MODEL)["cases"][case].clone()
}

fn pixels(m: &LoadedModel, case: &str) -> Vec<PixelValues> {
    case_json(case)["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let bytes = std::fs::read(fixture(MODEL).join(f.as_str().unwrap())).unwrap();
            vision(m).preprocess(&decode_image(&bytes, &DecodeLimits::default()).unwrap()).unwrap()
        })
        .collect()
}

fn prompt(case: &str) -> Vec<u32> {
    json_ids(&case_json(case)["input_ids"])
}

fn image_embeds(m: &LoadedModel, px: &[PixelValues]) -> Tensor {
    Tensor::cat(&px.iter().map(|p| vision(m).encode(p).unwrap()).collect::<Vec<_>>(), 0).unwrap()
}

#[test]
fn processor_gives_transformers_pixels_and_places() {
    let m = load();
    let r = reference(MODEL);
    for case in CASES {
        let px = pixels(&m, case);
        let data: Vec<f32> = px.iter().flat_map(|p| p.data.iter().copied()).collect();
        let want = &r[&format!("{case}.pixel_values")];
        let got = Tensor::from_vec(data, want.dims(), &Device::Cpu).unwrap();
        let diff = (&got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-6, "{case}: pixel values differ by {diff}");
        // transformers' (x, y) of each patch: iris's rows run row by row over the grid.
        let places: Vec<Vec<i64>> = r[&format!("{case}.image_position_ids")].to_vec2().unwrap();
        let ours: Vec<Vec<i64>> = px
            .iter()
            .flat_map(|p| {
                let gw = p.grid_thw[2];
                (0..p.rows).map(move |i| vec![(i % gw) as i64, (i / gw) as i64])
            })
            .collect();
        assert_eq!(ours, places, "{case}: patch places");
        let counts: Vec<usize> = px.iter().map(|p| vision(&m).num_image_tokens(p)).collect();
        assert_eq!(serde_json::json!(counts), case_json(case)["num_soft_tokens"], "{case}: image tokens");
    }
}

#[test]
fn chat_template_places_each_image_between_its_markers() {
    let m = load();
    for case in CASES {
        let msgs: Vec<iris::tokenizer::ChatMessage> =
            serde_json::from_value(case_json(case)["messages"].clone()).unwrap();
        let rendered = m.tokenizer.encode_chat(&msgs, true).unwrap();
        let counts: Vec<usize> = pixels(&m, case).iter().map(|p| vision(&m).num_image_tokens(p)).collect();
        let got = expand_image_tokens(&rendered, vision(&m), &counts).unwrap();
        assert_eq!(got, prompt(case), "{case}: prompt ids");
    }
}

#[test]
fn image_embeddings_layers_and_logits_match_transformers() {
    let m = load();
    let r = reference(MODEL);
    for case in CASES {
        let tokens = prompt(case);
        let px = pixels(&m, case);
        let embeds = image_embeds(&m, &px);
        let e = rel_err(&embeds, &r[&format!("{case}.image_embeds")]);
        assert!(e <= TOL, "{case} image embeddings: rel err {e}");
        let refs: Vec<&PixelValues> = px.iter().collect();
        let pos = vision(&m).prompt_positions(&tokens, &refs).unwrap();
        assert!(pos.positions.iter().enumerate().all(|(i, p)| *p == [i as u32; 3]) && pos.delta == 0);
        let (hidden, taps) = forward_with_images(&m, &Device::Cpu, &tokens, Some((&pos, &embeds)), usize::MAX);
        for (i, h) in taps.layers.iter().enumerate() {
            let e = rel_err(h, &r[&format!("{case}.layer.{i}")]);
            assert!(e <= TOL, "{case} layer {i}: rel err {e}");
        }
        let want = &r[&format!("{case}.logits")];
        let e = rel_err(&m.model.logits(&hidden).unwrap(), want);
        assert!(e <= TOL, "{case} logits: rel err {e}");
        // In chunks of 5 (image runs split across chunks) and token by token.
        for chunk in [5, 1] {
            let (h, _) = forward_with_images(&m, &Device::Cpu, &tokens, Some((&pos, &embeds)), chunk);
            let e = rel_err(&m.model.logits(&h).unwrap(), want);
            assert!(e <= TOL, "{case} in chunks of {chunk}: rel err {e}");
        }
    }
}

/// Every case's greedy tokens are transformers', each alone and all side by side in one engine
/// with a small step budget (prompts chunked, images split across steps).
#[test]
fn greedy_tokens_with_images_match_transformers() {
    let m = load();
    let r = reference(MODEL);
    for budget in [usize::MAX, 16] {
        let opts =
            EngineOptions { kv_memory: Some(4 << 20), max_num_batched_tokens: budget.min(8192), ..Default::default() };
        let mut engine = engine_with(&fixture(MODEL), opts);
        let mut want = std::collections::HashMap::new();
        for case in CASES {
            let expected = ids(&r[&format!("{case}.generated_ids")]);
            let req = Request { prompt_tokens: prompt(case), params: greedy(expected.len()) };
            let images = pixels(&m, case).into_iter().map(ImageInput::new).collect();
            want.insert(engine.add_request_with_images(req, images).unwrap(), (case, expected));
            if budget == usize::MAX {
                // Alone: run it to the end before the next one comes.
                let got = drain(&mut engine);
                let (case, expected) = &want[&got[0].0];
                assert_eq!(&got[0].1, expected, "{case} alone");
                want.clear();
            }
        }
        for (id, got) in drain(&mut engine) {
            let (case, expected) = &want[&id];
            assert_eq!(&got, expected, "{case} side by side");
        }
    }
}

fn drain(engine: &mut iris::engine::Engine) -> Vec<(iris::engine::SeqId, Vec<u32>)> {
    let mut out: Vec<(iris::engine::SeqId, Vec<u32>)> = Vec::new();
    while engine.has_work() {
        for u in engine.step().unwrap() {
            let Some(t) = u.token else { continue };
            match out.iter_mut().find(|(id, _)| *id == u.id) {
                Some((_, v)) => v.push(t.token),
                None => out.push((u.id, vec![t.token])),
            }
        }
    }
    out
}

/// With `use_bidirectional_attention: "vision"`, the logits of every case are transformers'
/// (their max difference from the causal ones is over 6), and greedy tokens too, alone and
/// side by side with a step budget of 16 (the scheduler then stops a chunk before an image and
/// takes an image whole, past the budget).
#[test]
fn bidirectional_images_match_transformers() {
    let dir = bidirectional_copy();
    let m = iris::loader::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
    assert!(m.config().images_attend_both_ways());
    let r = reference(MODEL);
    for case in CASES {
        let tokens = prompt(case);
        let px = pixels(&m, case);
        let embeds = image_embeds(&m, &px);
        let refs: Vec<&PixelValues> = px.iter().collect();
        let pos = vision(&m).prompt_positions(&tokens, &refs).unwrap();
        let (hidden, _) = forward_with_images(&m, &Device::Cpu, &tokens, Some((&pos, &embeds)), usize::MAX);
        let e = rel_err(&m.model.logits(&hidden).unwrap(), &r[&format!("{case}.bidir.logits")]);
        assert!(e <= TOL, "{case} bidirectional logits: rel err {e}");
    }
    for budget in [8192, 16] {
        let opts = EngineOptions { kv_memory: Some(4 << 20), max_num_batched_tokens: budget, ..Default::default() };
        let mut engine = engine_with(dir.path(), opts);
        let mut want = std::collections::HashMap::new();
        for case in CASES {
            let expected = ids(&r[&format!("{case}.bidir.generated_ids")]);
            let req = Request { prompt_tokens: prompt(case), params: greedy(expected.len()) };
            let images = pixels(&m, case).into_iter().map(ImageInput::new).collect();
            want.insert(engine.add_request_with_images(req, images).unwrap(), (case, expected));
        }
        for (id, got) in drain(&mut engine) {
            let (case, expected) = &want[&id];
            assert_eq!(&got, expected, "{case} bidirectional, budget {budget}");
        }
    }
}
