//! The vision half of a Gemma 4 `config.json` (`vision_config` and the image token ids): a
//! tower's (`gemma4`) or the unified family's embedder's (`gemma4_unified`).

use std::path::Path;

use serde_json::Value;

use super::unified_vision::UnifiedVisionConfig;
use crate::config::{positive_int, Activation};
use crate::weights::WeightsError;

/// The tokens of an image in a prompt: `<|image>`, as many `<|image|>` as it has cells, `<image|>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageTokens {
    pub image: u32,
    pub boi: u32,
    pub eoi: u32,
}

/// What turns an image into its tokens' embeddings.
#[derive(Debug, Clone, PartialEq)]
pub enum Vision {
    Tower(VisionConfig),
    Unified(UnifiedVisionConfig),
}

impl Vision {
    /// None when the checkpoint has no vision half (`gemma4_text`, or `vision_config` null).
    pub fn from_hf_file(path: &Path) -> Result<Option<(ImageTokens, Self)>, WeightsError> {
        let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::Config { path: path.to_path_buf(), msg: format!("not valid JSON: {e}") })?;
        Self::from_hf_json(&json).map_err(|msg| WeightsError::Config { path: path.to_path_buf(), msg })
    }

    /// Token id defaults are transformers 5.24's `Gemma4Config`'s (and `Gemma4UnifiedConfig`'s).
    pub fn from_hf_json(root: &Value) -> Result<Option<(ImageTokens, Self)>, String> {
        let Some(v) = root.get("vision_config").filter(|v| v.is_object()) else { return Ok(None) };
        let id = |key: &str, default: u32| -> Result<u32, String> {
            match root.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_u64().map(|n| n as u32).ok_or_else(|| format!("`{key}` must be a token id")),
            }
        };
        let tokens = ImageTokens {
            image: id("image_token_id", 258_880)?,
            boi: id("boi_token_id", 255_999)?,
            eoi: id("eoi_token_id", 258_882)?,
        };
        let vision = match root.get("model_type").and_then(Value::as_str) {
            Some("gemma4_unified") => Vision::Unified(UnifiedVisionConfig::from_hf_json(v)?),
            _ => Vision::Tower(VisionConfig::from_vision_json(v)?),
        };
        Ok(Some((tokens, vision)))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub activation: Activation,
    pub rms_norm_eps: f64,
    pub patch_size: usize,
    /// Side of the k x k patch cells averaged into one image token.
    pub pooling_kernel_size: usize,
    /// Rows of each axis' learned position table: the largest patch row or column.
    pub position_embedding_size: usize,
    pub rope_theta: f64,
    /// Projections clamp their inputs and outputs to stored bounds (E2B, E4B).
    pub use_clipped_linears: bool,
    /// The pooled output is standardized by stored `std_bias` / `std_scale` (26B, 31B).
    pub standardize: bool,
}

impl VisionConfig {
    /// Values per patch: 3 channels x patch x patch.
    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// Defaults are transformers 5.24's `Gemma4VisionConfig`'s.
    fn from_vision_json(v: &Value) -> Result<Self, String> {
        let int = |key: &str, default| positive_int(v.get(key), default, format_args!("vision_config.{key}"));
        let act_name = v.get("hidden_activation").and_then(Value::as_str).unwrap_or("gelu_pytorch_tanh");
        let activation =
            Activation::from_hf(act_name).ok_or_else(|| format!("unsupported vision activation `{act_name}`"))?;
        let rope = v.get("rope_parameters");
        match rope.and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
            None | Some("default" | "axial") => {}
            Some(other) => return Err(format!("unsupported vision rope type `{other}` (axial is)")),
        }
        let num_heads = int("num_attention_heads", 12)?;
        let cfg = VisionConfig {
            hidden_size: int("hidden_size", 768)?,
            intermediate_size: int("intermediate_size", 3072)?,
            num_layers: int("num_hidden_layers", 16)?,
            num_heads,
            num_kv_heads: int("num_key_value_heads", num_heads)?,
            head_dim: int("head_dim", 64)?,
            activation,
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            patch_size: int("patch_size", 16)?,
            pooling_kernel_size: int("pooling_kernel_size", 3)?,
            position_embedding_size: int("position_embedding_size", 10240)?,
            rope_theta: rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(100.0),
            use_clipped_linears: v.get("use_clipped_linears").and_then(Value::as_bool).unwrap_or(false),
            standardize: v.get("standardize").and_then(Value::as_bool).unwrap_or(false),
        };
        // The 2-D rotary turns each half of a head by one axis, in pairs.
        if cfg.head_dim % 4 != 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            return Err(format!(
                "vision heads: {} query and {} key/value heads of {} do not fit the 2-D rotary",
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            ));
        }
        if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err("`vision_config.attention_bias` is not supported (Gemma 4's projections have no bias)".into());
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gemma4_unified config names the encoder-free embedder, the same `vision_config` under
    /// `gemma4` a tower; both take the image ids from the top level.
    #[test]
    fn unified_checkpoints_name_the_embedder() {
        let cfg = serde_json::json!({
            "model_type": "gemma4_unified", "image_token_id": 9, "boi_token_id": 7, "eoi_token_id": 8,
            "vision_config": { "patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": 32, "output_proj_dims": 32 }
        });
        let (tokens, vision) = Vision::from_hf_json(&cfg).unwrap().unwrap();
        assert_eq!(tokens, ImageTokens { image: 9, boi: 7, eoi: 8 });
        assert!(matches!(vision, Vision::Unified(UnifiedVisionConfig { patch_size: 4, mm_embed_dim: 32, .. })));
        let mut bad = cfg.clone();
        bad["vision_config"]["output_proj_dims"] = 16.into();
        assert!(Vision::from_hf_json(&bad).unwrap_err().contains("output_proj_dims"));
        let mut g4 = cfg.clone();
        g4["model_type"] = "gemma4".into();
        assert!(matches!(Vision::from_hf_json(&g4), Ok(Some((_, Vision::Tower(_))))));
    }
}
