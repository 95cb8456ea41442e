//! Qwen2-VL, Qwen2.5-VL, GLM-4.5V/4.6V (`glm4v_moe`), GLM-4.1V (`glm4v`) and Qwen3.5 /
//! Qwen3.5-MoE with images (`qwen3_5`, `qwen3_5_moe`) against transformers, on tiny random
//! checkpoints: the image processor (PIL backend: the resize is
//! Pillow's bicubic, bit for bit, so pixel values agree to f32 rounding, <= 1e-6),
//! image_grid_thw, M-RoPE positions and delta (exact), image embeddings, every layer's hidden
//! states and logits (f32, relative error <= 1e-4 of the reference's largest magnitude), the
//! experts every MoE layer chooses for every token (exact), greedy tokens, and the chat
//! template's ids, for one square image, one non-square image, two images across two turns,
//! and text only.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{expand_image_tokens, ImageInput, Request};
use iris::loader::LoadedModel;
use iris::media::{decode_image, DecodeLimits, PixelValues};
use iris::models::{PromptPositions, Taps, VisionModel};

const TOL: f32 = 1e-4;
const IMAGE_CASES: [&str; 3] = ["single", "nonsquare", "multi"];

fn load(name: &str) -> LoadedModel {
    iris::loader::load(&fixture(name), &Device::Cpu, DType::F32).unwrap()
}

fn vision(m: &LoadedModel) -> &dyn VisionModel {
    m.vision.as_deref().expect("a vision-language model has a vision tower")
}

/// The case's images, decoded from the fixture's PNG files and preprocessed.
fn pixels(name: &str, m: &LoadedModel, case: &str) -> Vec<PixelValues> {
    let j = reference_json(name);
    j["cases"][case]["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let bytes = std::fs::read(fixture(name).join(f.as_str().unwrap())).unwrap();
            let img = decode_image(&bytes, &DecodeLimits::default()).unwrap();
            vision(m).preprocess(&img).unwrap()
        })
        .collect()
}

fn check_processor(name: &str) {
    let m = load(name);
    let r = reference(name);
    for case in IMAGE_CASES {
        let px = pixels(name, &m, case);
        let grids: Vec<i64> = px.iter().flat_map(|p| p.grid_thw.map(|v| v as i64)).collect();
        let want: Vec<i64> = r[&format!("{case}.image_grid_thw")].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(grids, want, "{name} {case}: image_grid_thw");
        // Rows are [C, T=2, 14, 14]; the reference keeps T=0, and T=1 must repeat it.
        let mut t0 = Vec::new();
        for p in &px {
            for row in p.data.chunks(p.cols) {
                for c in row.chunks(p.cols / 3) {
                    let (a, b) = c.split_at(c.len() / 2);
                    assert_eq!(a, b, "{name} {case}: the temporal patch repeats the frame");
                    t0.extend_from_slice(a);
                }
            }
        }
        let want = &r[&format!("{case}.pixel_values_t0")];
        let got = Tensor::from_vec(t0, want.dims(), &Device::Cpu).unwrap();
        let diff = (&got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-6, "{name} {case}: pixel values differ by {diff}");
    }
}

fn positions_of(r: &std::collections::HashMap<String, Tensor>, case: &str) -> (Vec<[u32; 3]>, i64) {
    let p: Vec<Vec<i64>> = r[&format!("{case}.position_ids")].to_vec2().unwrap();
    let delta = r[&format!("{case}.rope_delta")].to_vec1::<i64>().unwrap()[0];
    ((0..p[0].len()).map(|i| [p[0][i] as u32, p[1][i] as u32, p[2][i] as u32]).collect(), delta)
}

fn check_positions(name: &str) {
    let m = load(name);
    let r = reference(name);
    for case in IMAGE_CASES {
        let px = pixels(name, &m, case);
        let refs: Vec<&PixelValues> = px.iter().collect();
        let got = vision(&m).prompt_positions(&ids(&r[&format!("{case}.input_ids")]), &refs).unwrap();
        let (want, delta) = positions_of(&r, case);
        assert_eq!(got.positions, want, "{name} {case}: M-RoPE positions");
        assert_eq!(got.delta, delta, "{name} {case}: M-RoPE delta");
    }
}

fn image_embeds(m: &LoadedModel, px: &[PixelValues]) -> Tensor {
    let parts: Vec<Tensor> = px.iter().map(|p| vision(m).encode(p).unwrap()).collect();
    Tensor::cat(&parts, 0).unwrap()
}

fn check_image_embeds(name: &str) {
    let m = load(name);
    let r = reference(name);
    for case in IMAGE_CASES {
        let px = pixels(name, &m, case);
        let e = rel_err(&image_embeds(&m, &px), &r[&format!("{case}.image_embeds")]);
        eprintln!("{name} {case}: image embeddings, relative error {e:.2e}");
        assert!(e <= TOL, "{name} {case} image embeddings: rel err {e}");
    }
}

fn forward_chunked(
    m: &LoadedModel,
    tokens: &[u32],
    mm: Option<(&PromptPositions, &Tensor)>,
    chunk: usize,
) -> (Tensor, Taps) {
    forward_with_images(m, &Device::Cpu, tokens, mm, chunk)
}

fn check_layers(name: &str) {
    let m = load(name);
    let r = reference(name);
    let n_layers = reference_json(name)["num_layers"].as_u64().unwrap() as usize;
    for case in IMAGE_CASES.iter().copied().chain(["text"]) {
        let mut worst = 0f32;
        let tokens = ids(&r[&format!("{case}.input_ids")]);
        let px = if case == "text" { vec![] } else { pixels(name, &m, case) };
        let refs: Vec<&PixelValues> = px.iter().collect();
        let embeds = (!px.is_empty()).then(|| image_embeds(&m, &px));
        let pos = (!px.is_empty()).then(|| vision(&m).prompt_positions(&tokens, &refs).unwrap());
        let mm = pos.as_ref().zip(embeds.as_ref());
        let (hidden, taps) = forward_chunked(&m, &tokens, mm, usize::MAX);
        let e = rel_err(taps.embed.as_ref().unwrap(), &r[&format!("{case}.embed")]);
        worst = worst.max(e);
        assert!(e <= TOL, "{name} {case} embeddings: rel err {e}");
        assert_eq!(taps.layers.len(), n_layers);
        for (i, h) in taps.layers.iter().enumerate() {
            let e = rel_err(h, &r[&format!("{case}.layer.{i}")]);
            worst = worst.max(e);
            assert!(e <= TOL, "{name} {case} layer {i}: rel err {e}");
        }
        // Router choices: one reference per MoE layer, each matched exactly.
        let want_router = r.keys().filter(|k| k.starts_with(&format!("{case}.router."))).count();
        assert_eq!(taps.router.len(), want_router, "{name} {case}: MoE layers");
        for (layer, got) in &taps.router {
            let want = &r[&format!("{case}.router.{layer}")];
            let got: Vec<Vec<u32>> = got.to_vec2().unwrap();
            let want: Vec<Vec<u32>> = want
                .to_dtype(DType::I64)
                .unwrap()
                .to_vec2::<i64>()
                .unwrap()
                .iter()
                .map(|r| r.iter().map(|&v| v as u32).collect())
                .collect();
            assert_eq!(got, want, "{name} {case} layer {layer}: chosen experts");
        }
        let e = rel_err(&hidden, &r[&format!("{case}.final_norm")]);
        worst = worst.max(e);
        assert!(e <= TOL, "{name} {case} final norm: rel err {e}");
        let tail = r[&format!("{case}.logits_tail")].dim(0).unwrap();
        let logits = m.model.logits(&hidden.narrow(0, tokens.len() - tail, tail).unwrap()).unwrap();
        let e = rel_err(&logits, &r[&format!("{case}.logits_tail")]);
        let logits_err = e;
        worst = worst.max(e);
        assert!(e <= TOL, "{name} {case} logits: rel err {e}");
        // Prefilled in chunks of 5 (image runs split across chunks) and token by token.
        for chunk in [5, 1] {
            let (h, _) = forward_chunked(&m, &tokens, mm, chunk);
            let e = rel_err(&h, &r[&format!("{case}.final_norm")]);
            worst = worst.max(e);
            assert!(e <= TOL, "{name} {case} in chunks of {chunk}: rel err {e}");
        }
        // The measured error, shown with --nocapture.
        eprintln!("{name} {case}: logits {logits_err:.2e}, largest over layers, logits and chunkings {worst:.2e}");
    }
}

fn check_greedy(name: &str) {
    // Few sequences: a hybrid model's per-sequence state comes out of the same budget.
    let opts = EngineOptions { kv_memory: Some(1 << 20), max_num_seqs: 4, ..Default::default() };
    let got = greedy_outputs(name, opts);
    for (case, got, want) in got {
        assert_eq!(got, want, "{name} {case}: greedy tokens differ from transformers");
    }
}

/// A TurboQuant cache whose float window covers every sequence reads only floats: the
/// greedy tokens are transformers' again, images and M-RoPE included. Without the window
/// (codes everywhere) every case still generates to the end.
fn check_greedy_turboquant(name: &str) {
    let bits = Some(iris::kv::TqBits { key: 3, value: 4 });
    let base = EngineOptions { kv_memory: Some(64 << 20), kv_quant: bits, max_num_seqs: 4, ..Default::default() };
    for (case, got, want) in greedy_outputs(name, EngineOptions { kv_float_window: 1024, ..base.clone() }) {
        assert_eq!(got, want, "{name} {case}: a full float window changed the greedy tokens");
    }
    for (case, got, want) in greedy_outputs(name, base) {
        assert_eq!(got.len(), want.len(), "{name} {case}: generation with codes stopped early");
    }
}

/// Speculation with n-gram drafts leaves the greedy tokens transformers', images and M-RoPE
/// positions of the draft rows included.
fn check_greedy_speculative(name: &str) {
    let spec = Some(iris::engine::SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    let opts = EngineOptions { kv_memory: Some(1 << 20), max_num_seqs: 4, speculative: spec, ..Default::default() };
    let (got, stats) = greedy_outputs_and_stats(name, opts, false);
    assert!(stats.spec.num_draft_tokens > 0, "{name}: no draft was verified");
    for (case, got, want) in got {
        assert_eq!(got, want, "{name} {case}: speculation changed the greedy tokens");
    }
}

/// A hybrid model speculates on the CPU (its recurrent state rolled back to the checkpoint of
/// the last accepted row) with the same greedy tokens; on a GPU, which keeps no checkpoints
/// yet, speculation is refused at start, saying why and what to do.
fn check_hybrid_speculative(name: &str) {
    if on_gpu() {
        return check_speculation_refused(name);
    }
    check_greedy_speculative(name);
    // Drafts that are transformers' tokens with every fifth changed: accepted up to the
    // changed one, rejected there (n-gram drafts are rarely accepted on these random models).
    let spec = Some(iris::engine::SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    let opts = EngineOptions { kv_memory: Some(1 << 20), max_num_seqs: 4, speculative: spec, ..Default::default() };
    let (got, stats) = greedy_outputs_and_stats(name, opts, true);
    let s = &stats.spec;
    assert!(s.num_accepted_tokens > 0 && s.num_accepted_tokens < s.num_draft_tokens, "{name}: {s:?}");
    for (case, got, want) in got {
        assert_eq!(got, want, "{name} {case}: rolled-back drafts changed the greedy tokens");
    }
}

fn check_speculation_refused(name: &str) {
    let spec = Some(iris::engine::SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    let opts = EngineOptions { kv_memory: Some(1 << 20), speculative: spec, ..Default::default() };
    let err = match iris::engine::build::build_engine(&fixture(name), &device(), &opts) {
        Ok(_) => panic!("{name}: speculation was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("--speculative-config is not supported") && err.contains("run without it"), "{err}");
}

/// (case, generated tokens, transformers' tokens) for every image case and text.
fn greedy_outputs(name: &str, opts: EngineOptions) -> Vec<(&'static str, Vec<u32>, Vec<u32>)> {
    greedy_outputs_and_stats(name, opts, false).0
}

/// With `replay`, the engine (which speculates) drafts transformers' tokens of each case with
/// every fifth one changed.
fn greedy_outputs_and_stats(
    name: &str,
    opts: EngineOptions,
    replay: bool,
) -> (Vec<(&'static str, Vec<u32>, Vec<u32>)>, iris::engine::EngineStats) {
    let r = reference(name);
    let k = opts.speculative.map_or(0, |s| s.num_tokens);
    let mut engine = engine_with(&fixture(name), opts);
    if replay {
        let recorded = IMAGE_CASES
            .iter()
            .copied()
            .chain(["text"])
            .map(|case| {
                let prompt = ids(&r[&format!("{case}.input_ids")]);
                let want = ids(&r[&format!("{case}.generated_ids")]);
                let changed = want.iter().enumerate().map(|(i, &t)| if i % 5 == 3 { t ^ 1 } else { t });
                (prompt.len(), prompt.iter().copied().chain(changed).collect())
            })
            .collect();
        let replay = iris::engine::ReplayDrafter::new(k, recorded);
        engine.set_drafter(iris::engine::Drafter::Replay(replay)).expect("speculating");
    }
    let m = load(name);
    let mut out = Vec::new();
    for case in IMAGE_CASES.iter().copied().chain(["text"]) {
        let prompt = ids(&r[&format!("{case}.input_ids")]);
        let want = ids(&r[&format!("{case}.generated_ids")]);
        let images = if case == "text" { vec![] } else { pixels(name, &m, case) };
        let req = Request { prompt_tokens: prompt, params: greedy(want.len()) };
        let id = engine.add_request_with_images(req, images.into_iter().map(ImageInput::new).collect()).unwrap();
        let mut got = Vec::new();
        while engine.has_work() {
            for u in engine.step().unwrap() {
                assert_eq!(u.id, id);
                got.extend(u.token.map(|t| t.token));
            }
        }
        out.push((case, got, want));
    }
    (out, engine.stats.clone())
}

fn check_chat_template(name: &str) {
    let m = load(name);
    let r = reference(name);
    let j = reference_json(name);
    for case in IMAGE_CASES {
        let msgs: Vec<iris::tokenizer::ChatMessage> =
            serde_json::from_value(j["cases"][case]["messages"].clone()).unwrap();
        let rendered = m.tokenizer.encode_chat(&msgs, true).unwrap();
        let counts: Vec<usize> = pixels(name, &m, case).iter().map(|p| vision(&m).num_image_tokens(p)).collect();
        let got = expand_image_tokens(&rendered, vision(&m), &counts).unwrap();
        assert_eq!(got, ids(&r[&format!("{case}.input_ids")]), "{name} {case}: chat template ids");
    }
}

macro_rules! parity_tests {
    ($($m:ident => $name:literal),*) => {$(
        mod $m {
            #[test]
            fn processor_matches_transformers() {
                super::check_processor($name);
            }
            #[test]
            fn mrope_positions_match_transformers() {
                super::check_positions($name);
            }
            #[test]
            fn image_embeddings_match_transformers() {
                super::check_image_embeds($name);
            }
            #[test]
            fn hidden_states_and_logits_match_transformers() {
                super::check_layers($name);
            }
            #[test]
            fn greedy_tokens_match_transformers() {
                super::check_greedy($name);
            }
            #[test]
            fn greedy_tokens_with_a_turboquant_cache() {
                super::check_greedy_turboquant($name);
            }
            #[test]
            fn greedy_tokens_with_speculation() {
                super::check_greedy_speculative($name);
            }
            #[test]
            fn chat_template_ids_match_transformers() {
                super::check_chat_template($name);
            }
        }
    )*};
}

parity_tests!(
    qwen2_vl => "tiny-qwen2-vl",
    qwen2_5_vl => "tiny-qwen2.5-vl",
    glm4v_moe => "tiny-glm4v-moe",
    glm4v => "tiny-glm4v"
);

/// The hybrid Qwen3.5 family: every check above (speculation on the CPU only).
macro_rules! hybrid_parity_tests {
    ($($m:ident => $name:literal),*) => {$(
        mod $m {
            #[test]
            fn processor_matches_transformers() {
                super::check_processor($name);
            }
            #[test]
            fn mrope_positions_match_transformers() {
                super::check_positions($name);
            }
            #[test]
            fn image_embeddings_match_transformers() {
                super::check_image_embeds($name);
            }
            #[test]
            fn hidden_states_and_logits_match_transformers() {
                super::check_layers($name);
            }
            #[test]
            fn greedy_tokens_match_transformers() {
                super::check_greedy($name);
            }
            #[test]
            fn greedy_tokens_with_a_turboquant_cache() {
                super::check_greedy_turboquant($name);
            }
            #[test]
            fn greedy_tokens_with_speculation() {
                super::check_hybrid_speculative($name);
            }
            #[test]
            fn chat_template_ids_match_transformers() {
                super::check_chat_template($name);
            }
        }
    )*};
}

hybrid_parity_tests!(
    qwen35_vl => "tiny-qwen3.5-vl",
    qwen35_moe_vl => "tiny-qwen3.5-moe-vl"
);
