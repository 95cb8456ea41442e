//! The `quantization` block that mlx-lm and mlx-vlm write into config.json (copied to
//! `quantization_config`): global `group_size`, `bits` and `mode`, then per-module overrides
//! keyed by MLX module paths, each a dict of its own parameters, `true` (the global ones) or
//! `false` (left in float). Whether a module is quantized is decided by its `.scales` tensor,
//! as mlx-lm decides; this block says with which parameters, and the loader checks the two
//! agree.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::error::WeightsError;
use crate::ops::qmatmul::AffineParams;

/// What the config says of one module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleQuant {
    Affine(AffineParams),
    /// Listed as `false`: kept in float.
    Float,
}

#[derive(Debug, Clone)]
pub struct MlxQuantization {
    global: AffineParams,
    /// Keyed by module path, and again by the path without a wrapper prefix.
    overrides: HashMap<String, ModuleQuant>,
}

/// Module-path prefixes that wrap a text model inside a VLM (or a text model kept in its
/// VLM's layout): overrides match with or without them.
const WRAPPERS: [&str; 2] = ["language_model.", "model.language_model."];

fn unwrapped(path: &str) -> &str {
    WRAPPERS.iter().find_map(|w| path.strip_prefix(w)).unwrap_or(path)
}

impl MlxQuantization {
    /// The block of `config` (config.json's JSON), if it has one. HF-style quantization
    /// configs of other tools (`quant_method`: gptq, awq, fp8, ...) and MLX's FP modes are
    /// refused here, at load, naming what was found.
    pub fn from_config(config: &Value, path: &Path) -> Result<Option<Self>, WeightsError> {
        let text = config.get("text_config");
        let block = ["quantization", "quantization_config"]
            .iter()
            .find_map(|k| config.get(k).or_else(|| text.and_then(|t| t.get(k))));
        let Some(block) = block else { return Ok(None) };
        let bad = |msg: String| WeightsError::Config { path: path.to_path_buf(), msg };
        let Some(obj) = block.as_object() else {
            return Err(bad("`quantization` must be an object".into()));
        };
        if let Some(method) = obj.get("quant_method").and_then(Value::as_str) {
            return Err(bad(format!(
                "quantization method `{method}` is not supported; iris reads MLX affine and GGUF quantization"
            )));
        }
        let global = params(obj, None).map_err(|m| bad(format!("`quantization`: {m}")))?;
        let mut overrides = HashMap::new();
        for (key, v) in obj {
            if matches!(key.as_str(), "group_size" | "bits" | "mode") {
                continue;
            }
            let q = match v {
                Value::Bool(true) => ModuleQuant::Affine(global),
                Value::Bool(false) => ModuleQuant::Float,
                Value::Object(o) => {
                    ModuleQuant::Affine(params(o, Some(global)).map_err(|m| bad(format!("`quantization.{key}`: {m}")))?)
                }
                _ => return Err(bad(format!("`quantization.{key}` must be an object or a boolean"))),
            };
            overrides.insert(key.clone(), q);
            overrides.entry(unwrapped(key).to_string()).or_insert(q);
        }
        Ok(Some(MlxQuantization { global, overrides }))
    }

    /// The parameters of the module stored at `path`: its override (by exact path, then
    /// without a wrapper prefix), else the global ones.
    pub fn module(&self, path: &str) -> ModuleQuant {
        self.overrides
            .get(path)
            .or_else(|| self.overrides.get(unwrapped(path)))
            .copied()
            .unwrap_or(ModuleQuant::Affine(self.global))
    }
}

/// `group_size`, `bits` and `mode` of one dict, missing ones taken from `global`.
fn params(o: &serde_json::Map<String, Value>, global: Option<AffineParams>) -> Result<AffineParams, String> {
    if let Some(mode) = o.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            return Err(format!(
                "MLX quantization mode `{mode}` is not supported (iris reads mode `affine`: bits 2, 3, 4, 5, 6, 8)"
            ));
        }
    }
    let int = |k: &str| o.get(k).and_then(Value::as_u64);
    let p = match (int("bits"), int("group_size"), global) {
        (Some(b), Some(g), _) => AffineParams { bits: b as u32, group: g as usize },
        (b, g, Some(gl)) => {
            AffineParams { bits: b.map_or(gl.bits, |b| b as u32), group: g.map_or(gl.group, |g| g as usize) }
        }
        _ => return Err("needs `bits` and `group_size`".into()),
    };
    if !p.is_valid() {
        return Err(format!(
            "bits {} group_size {} is not an MLX affine format (bits 2, 3, 4, 5, 6, 8; groups 32, 64, 128)",
            p.bits, p.group
        ));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<Option<MlxQuantization>, WeightsError> {
        MlxQuantization::from_config(&v, Path::new("config.json"))
    }

    #[test]
    fn overrides_match_by_path_then_without_the_wrapper() {
        let q = parse(serde_json::json!({
            "quantization": {
                "group_size": 64, "bits": 4, "mode": "affine",
                "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                "model.layers.1.self_attn.v_proj": {"bits": 6},
                "model.layers.1.mlp.down_proj": false,
                "lm_head": true
            }
        }))
        .unwrap()
        .unwrap();
        let a = |bits, group| ModuleQuant::Affine(AffineParams { bits, group });
        assert_eq!(q.module("language_model.model.layers.0.mlp.gate"), a(8, 64));
        assert_eq!(q.module("model.layers.0.mlp.gate"), a(8, 64));
        assert_eq!(q.module("language_model.model.layers.1.self_attn.v_proj"), a(6, 64));
        assert_eq!(q.module("model.layers.1.mlp.down_proj"), ModuleQuant::Float);
        assert_eq!(q.module("lm_head"), a(4, 64));
        assert_eq!(q.module("model.layers.5.mlp.up_proj"), a(4, 64));
    }

    #[test]
    fn fp_modes_and_other_methods_are_refused_naming_them() {
        let e = parse(serde_json::json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}})).unwrap_err();
        assert!(e.to_string().contains("mode `mxfp4` is not supported"), "{e}");
        let e = parse(serde_json::json!({"quantization": {"group_size": 64, "bits": 4,
            "model.layers.0.mlp.gate": {"group_size": 16, "bits": 4, "mode": "nvfp4"}}}))
        .unwrap_err();
        assert!(e.to_string().contains("`nvfp4`"), "{e}");
        let e = parse(serde_json::json!({"quantization_config": {"quant_method": "awq", "bits": 4}})).unwrap_err();
        assert!(e.to_string().contains("`awq` is not supported"), "{e}");
        let e = parse(serde_json::json!({"quantization": {"group_size": 64, "bits": 7}})).unwrap_err();
        assert!(e.to_string().contains("bits 7"), "{e}");
        assert!(parse(serde_json::json!({"hidden_size": 8})).unwrap().is_none());
    }

    #[test]
    fn a_vlm_keeps_its_block_in_text_config_too() {
        let q = parse(serde_json::json!({"text_config": {"quantization": {"group_size": 32, "bits": 3}}})).unwrap();
        assert_eq!(q.unwrap().module("x"), ModuleQuant::Affine(AffineParams { bits: 3, group: 32 }));
    }
}
