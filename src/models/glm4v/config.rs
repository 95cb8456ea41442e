//! The vision half of a GLM-4.1V / GLM-4.5V / GLM-4.6V `config.json` (`vision_config` and the
//! top-level image token id).

use std::path::Path;

use serde_json::Value;

use crate::config::{positive_int, Activation};
use crate::weights::WeightsError;

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    /// Width of the vision blocks.
    pub hidden_size: usize,
    pub num_heads: usize,
    /// Width of the merger's gated MLP.
    pub intermediate_size: usize,
    /// The language model's hidden size: the downsample convolution's output, and the width
    /// of the blocks' MLP.
    pub out_hidden_size: usize,
    pub activation: Activation,
    pub attention_bias: bool,
    pub rms_norm_eps: f64,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// Side in pixels of the images the learned position table was trained for.
    pub image_size: usize,
    pub rope_theta: f64,
    pub image_token_id: u32,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values per patch: channels x temporal patch x patch x patch.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Side of the learned position table, in patches.
    pub fn position_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    pub fn from_hf_file(path: &Path) -> Result<Self, WeightsError> {
        let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::Config { path: path.to_path_buf(), msg: format!("not valid JSON: {e}") })?;
        Self::from_hf_json(&json).map_err(|msg| WeightsError::Config { path: path.to_path_buf(), msg })
    }

    /// Defaults are transformers' `Glm4vVisionConfig`'s.
    pub fn from_hf_json(root: &Value) -> Result<Self, String> {
        let v = root.get("vision_config").filter(|v| v.is_object()).ok_or("missing object `vision_config`")?;
        let int = |key: &str, default| positive_int(v.get(key), default, format_args!("vision_config.{key}"));
        let act_name = v.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        let activation =
            Activation::from_hf(act_name).ok_or_else(|| format!("unsupported vision activation `{act_name}`"))?;
        let cfg = VisionConfig {
            depth: int("depth", 24)?,
            hidden_size: int("hidden_size", 1536)?,
            num_heads: int("num_heads", 12)?,
            intermediate_size: int("intermediate_size", 13696)?,
            out_hidden_size: int("out_hidden_size", 4096)?,
            activation,
            attention_bias: v.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-5),
            in_channels: int("in_channels", 3)?,
            patch_size: int("patch_size", 14)?,
            temporal_patch_size: int("temporal_patch_size", 2)?,
            spatial_merge_size: int("spatial_merge_size", 2)?,
            image_size: int("image_size", 336)?,
            rope_theta: v
                .get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
            image_token_id: root
                .get("image_token_id")
                .and_then(Value::as_u64)
                .map(|n| n as u32)
                .ok_or("missing `image_token_id`")?,
        };
        if !cfg.hidden_size.is_multiple_of(cfg.num_heads) || !cfg.head_dim().is_multiple_of(4) {
            return Err(format!(
                "vision width {} does not split into {} heads of a multiple of 4",
                cfg.hidden_size, cfg.num_heads
            ));
        }
        if cfg.position_side() == 0 {
            return Err(format!("`image_size` {} is smaller than a patch", cfg.image_size));
        }
        Ok(cfg)
    }
}
