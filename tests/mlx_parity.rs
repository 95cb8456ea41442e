//! MLX conversions (tests/fixtures/mlx, made by scripts/make_mlx_fixtures.py with mlx-lm and
//! mlx-vlm) against mlx's own forward pass: unpacking of every bits/group pair against
//! `mx.dequantize`, and for every family iris runs, the logits of its MLX conversion and the
//! greedy tokens. The fixtures' scales are f32 (one is bf16), and iris computes in f32 as mlx
//! did, so the logits agree to f32 rounding: the same 1e-4 relative tolerance as against
//! transformers.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{ImageInput, Request};
use iris::media::{decode_image, DecodeLimits};
use iris::ops::qmatmul::QMatrix;
use iris::weights::{AffineMatrix, AffineParams};

const TOL: f32 = 1e-4;

fn mlx(name: &str) -> PathBuf {
    fixture("mlx").join(name)
}

fn mlx_reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(mlx(name).join("reference.safetensors"), &Device::Cpu).unwrap()
}

fn vec_u32(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<u32>().unwrap()
}

fn vec_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `mx.quantize`'s codes, scales and biases of every bits/group pair, three groups per row
/// (3-, 5- and 6-bit codes straddling words) and one: dequantized by iris, directly and
/// through the repacked fused-kernel rows, they give `mx.dequantize`'s values.
#[test]
fn unpacking_matches_mlx_dequantize_for_every_bits_and_group() {
    let v = candle_core::safetensors::load(fixture("mlx").join("quant_vectors.safetensors"), &Device::Cpu).unwrap();
    let mut prefixes: Vec<&str> = v.keys().filter_map(|k| k.strip_suffix(".w_q")).collect();
    prefixes.sort();
    let mut seen = std::collections::HashSet::new();
    for p in &prefixes {
        let head = p.split('.').next().unwrap();
        let (bits, group) = head.trim_start_matches('b').split_once("_g").unwrap();
        let group: usize = group.trim_end_matches("_bf16").parse().unwrap();
        let params = AffineParams { bits: bits.parse().unwrap(), group };
        let (rows, cols) = v[&format!("{p}.dequant")].dims2().unwrap();
        let a = AffineMatrix {
            rows,
            cols,
            params,
            codes: vec_u32(&v[&format!("{p}.w_q")]),
            scales: vec_f32(&v[&format!("{p}.scales")]),
            biases: vec_f32(&v[&format!("{p}.biases")]),
        };
        assert_eq!(a.codes.len(), rows * params.packed_words(cols), "{p}");
        let want = vec_f32(&v[&format!("{p}.dequant")]);
        // mlx dequantizes in the scales' dtype: bf16 for the bf16 case.
        let tol = if p.ends_with("bf16") { 8e-3 } else { 1e-6 };
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let direct = vec_f32(&a.dequantize(&Device::Cpu).unwrap());
        let fused = QMatrix::from_affine(&a).unwrap().dequantize_rows(&(0..rows as u32).collect::<Vec<_>>()).unwrap();
        for (how, got) in [("direct", &direct), ("fused", &fused)] {
            let err = got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(err <= tol * scale, "{p} {how}: max error {err} (scale {scale})");
        }
        seen.insert((params.bits, params.group));
    }
    assert_eq!(seen.len(), AffineParams::BITS.len() * AffineParams::GROUPS.len(), "every bits/group pair");
}

/// The text fixtures: logits of the whole prompt and token by token, and greedy tokens.
fn check_text(name: &str, logits_key: &str, ids_key: &str) {
    let _gpu = gpu_lock();
    let r = mlx_reference(name);
    let tokens = ids(&r["input_ids"]);
    for chunk in [usize::MAX, 1] {
        let (_, logits, _) = forward_in_chunks(&mlx(name), &tokens, chunk);
        let e = rel_err(&logits, &r[logits_key]);
        assert!(e <= TOL, "{name} logits (chunks of {chunk}): rel err {e} against mlx");
    }
    let mut engine = engine_with(&mlx(name), EngineOptions { kv_memory: Some(8 << 20), ..Default::default() });
    let want = ids(&r[ids_key]);
    let got = run_requests(&mut engine, &[(tokens, greedy(want.len()))], &[0]);
    assert_eq!(got[0], want, "{name}: greedy tokens differ from mlx's");
}

/// The image case of a VLM conversion: the source fixture's image of `case` through iris's
/// processor and the MLX checkpoint's vision tower, greedy tokens as mlx-vlm's.
fn check_image(name: &str, source: &str, case: &str) {
    let _gpu = gpu_lock();
    let r = mlx_reference(name);
    let m = iris::loader::load(&mlx(name), &Device::Cpu, DType::F32).unwrap();
    let file = reference_json(source)["cases"][case]["images"][0].as_str().unwrap().to_string();
    let img = decode_image(&std::fs::read(fixture(source).join(file)).unwrap(), &DecodeLimits::default()).unwrap();
    let px = m.vision.as_deref().expect("a vision tower").preprocess(&img).unwrap();
    let mut engine = engine_with(&mlx(name), EngineOptions { kv_memory: Some(1 << 20), ..Default::default() });
    let want = ids(&r["image.generated_ids"]);
    let req = Request { prompt_tokens: ids(&r["image.input_ids"]), params: greedy(want.len()) };
    engine.add_request_with_images(req, vec![ImageInput::new(px)]).unwrap();
    let mut got = Vec::new();
    while engine.has_work() {
        got.extend(engine.step().unwrap().into_iter().filter_map(|u| u.token.map(|t| t.token)));
    }
    assert_eq!(got, want, "{name}: greedy tokens with an image differ from mlx-vlm's");
}

macro_rules! text_tests {
    ($($m:ident => $name:literal),*) => {$(
        #[test]
        fn $m() {
            check_text($name, "logits", "generated_ids");
        }
    )*};
}

text_tests!(
    llama_4bit_g32 => "llama-4bit-g32",
    llama_8bit_g64 => "llama-8bit-g64",
    llama_3bit_g32 => "llama-3bit-g32",
    llama_6bit_g64 => "llama-6bit-g64",
    llama_2bit_g32 => "llama-2bit-g32",
    llama_5bit_g32 => "llama-5bit-g32",
    llama_mixed_overrides => "llama-mixed",
    llama_mixed_3_6_recipe => "llama-mixed_3_6",
    qwen2_4bit => "qwen2-4bit-g64",
    qwen3_4bit_sharded => "qwen3-4bit-g64",
    gemma3_4bit => "gemma3-4bit-g64",
    qwen2_vl_text => "qwen2-vl-4bit",
    qwen25_vl_text => "qwen2.5-vl-4bit",
    glm4v_text => "glm4v-4bit",
    glm4v_moe_text => "glm4v-moe-4bit",
    qwen35_4bit => "qwen3.5-4bit",
    qwen35_moe_4bit => "qwen3.5-moe-4bit",
    gemma4_text_4bit => "gemma4-text-4bit",
    gemma4_moe_4bit => "gemma4-moe-4bit",
    gemma4_vlm_text => "gemma4-4bit"
);

/// bf16 scales and biases (the real-world case), computed in f32: against mlx's f32 forward
/// of the same checkpoint widened (mlx's own bf16 forward rounds every product to bf16).
#[test]
fn llama_4bit_g64_bf16_scales() {
    check_text("llama-4bit-g64-bf16", "logits_f32", "generated_ids_f32");
}

#[test]
fn qwen2_vl_image() {
    check_image("qwen2-vl-4bit", "tiny-qwen2-vl", "single");
}

#[test]
fn qwen25_vl_image() {
    check_image("qwen2.5-vl-4bit", "tiny-qwen2.5-vl", "single");
}

/// Gemma 4's tower with clippable linears (bounds bound) and images seen whole.
#[test]
fn gemma4_image() {
    check_image("gemma4-4bit", "tiny-gemma4", "nonsquare");
}

/// A copy of an MLX fixture with its config.json's `quantization` block replaced.
fn with_quantization(name: &str, block: serde_json::Value) -> ScratchDir {
    copy_with_config(&mlx(name), &format!("mlx-{name}"), |cfg| {
        cfg["quantization"] = block.clone();
        cfg["quantization_config"] = block;
    })
}

fn load_error(dir: &std::path::Path) -> String {
    match iris::loader::load(dir, &Device::Cpu, DType::F32) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Checkpoints iris cannot read as they say are refused at load with one line naming what is
/// wrong: an FP mode, and a config whose bits disagree with the tensors.
#[test]
fn unsupported_modes_and_inconsistent_configs_are_refused_at_load() {
    let fp = with_quantization("llama-4bit-g32", serde_json::json!({"group_size": 32, "bits": 4, "mode": "mxfp4"}));
    let e = load_error(fp.path());
    assert!(e.contains("mode `mxfp4` is not supported") && !e.contains('\n'), "{e}");
    let wrong = with_quantization(
        "llama-4bit-g32",
        serde_json::json!({"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 8}}),
    );
    let e = load_error(wrong.path());
    assert!(e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("8 bits") && !e.contains('\n'), "{e}");
    let float = with_quantization(
        "llama-4bit-g32",
        serde_json::json!({"group_size": 32, "bits": 4, "model.layers.1.self_attn.o_proj": false}),
    );
    let e = load_error(float.path());
    assert!(e.contains("not quantized, yet it has .scales"), "{e}");
}
