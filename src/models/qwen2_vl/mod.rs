//! Qwen2-VL, Qwen2.5-VL and Qwen3.5's vision side: a vision tower whose image embeddings
//! replace the prompt's image-pad tokens. The language model is the `llama` module's decoder
//! with M-RoPE (Qwen2-VL, Qwen2.5-VL) or the hybrid `qwen35` one; the same weights serve
//! text-only requests, which skip the vision tower.

pub mod config;
pub mod qwen35_vision;
pub mod vision;

use std::path::Path;

use candle_core::Tensor;

use super::patch_vlm::{PatchGeometry, PatchTower, PatchVlm};
use crate::config::TextConfig;
use crate::media::processor::ResizeRule;
use crate::media::PixelValues;
use crate::weights::{Weights, WeightsError};
use config::{VisionConfig, VisionKind};
use qwen35_vision::Qwen35Tower;
use vision::VisionTower;

/// The towers of the family: Qwen2-VL's and Qwen2.5-VL's blocks, or Qwen3.5's.
pub enum Tower {
    Qwen2(VisionTower),
    Qwen35(Qwen35Tower),
}

pub type Qwen2Vl = PatchVlm<Tower>;

/// The weight every tower of the family has (under any of the layouts `Weights` resolves).
const PATCH_EMBED: &str = "visual.patch_embed.proj.weight";

/// Reads `config.json` and the image processor's config in `dir` and the tower's weights.
pub fn load(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Qwen2Vl, WeightsError> {
    let cfg = VisionConfig::from_hf_file(&dir.join("config.json"), text.arch)?;
    let geometry = PatchGeometry {
        image_token_id: cfg.image_token_id,
        patch_size: cfg.patch_size,
        spatial_merge_size: cfg.spatial_merge_size,
        temporal_patch_size: cfg.temporal_patch_size,
        patch_dim: cfg.patch_dim(),
        out_hidden_size: cfg.out_hidden_size,
    };
    PatchVlm::load(dir, ResizeRule::Qwen2Vl, geometry, text, || {
        Ok(match cfg.kind {
            VisionKind::Qwen35 => Tower::Qwen35(Qwen35Tower::load(w, cfg)?),
            _ => Tower::Qwen2(VisionTower::load(w, cfg)?),
        })
    })
}

/// Qwen3.5's vision side, where the checkpoint has one: the same `qwen3_5` model type names
/// text-only checkpoints too (`Qwen3_5ForCausalLM`, mlx-lm's conversions, which keep an empty
/// or stale `vision_config` but no tower weights); those serve text only.
pub fn load_qwen35(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Option<Qwen2Vl>, WeightsError> {
    let path = dir.join("config.json");
    let raw = std::fs::read_to_string(&path).map_err(|e| WeightsError::io(&path, e))?;
    let json: serde_json::Value = serde_json::from_str(&raw)
        .map_err(|e| WeightsError::Config { path: path.clone(), msg: format!("not valid JSON: {e}") })?;
    let has_config = json.get("vision_config").and_then(|v| v.as_object()).is_some_and(|v| !v.is_empty());
    if !has_config {
        return Ok(None);
    }
    if !w.contains(PATCH_EMBED) {
        tracing::info!("config.json has a vision_config but the weights hold no vision tower: serving text only");
        return Ok(None);
    }
    load(w, dir, text).map(Some)
}

impl PatchTower for Tower {
    fn forward(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        match self {
            Tower::Qwen2(t) => t.forward(pixels),
            Tower::Qwen35(t) => t.forward(pixels),
        }
    }
}
