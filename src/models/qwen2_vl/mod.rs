//! Qwen2-VL and Qwen2.5-VL: a vision tower whose image embeddings replace the prompt's
//! image-pad tokens, and a Qwen2 language model with M-RoPE (the `llama` module's decoder;
//! the same weights serve text-only requests, which skip the vision tower).

pub mod config;
pub mod vision;

use std::path::Path;

use candle_core::Tensor;

use super::patch_vlm::{PatchGeometry, PatchTower, PatchVlm};
use crate::config::TextConfig;
use crate::media::processor::ResizeRule;
use crate::media::PixelValues;
use crate::weights::{Weights, WeightsError};
use config::VisionConfig;
use vision::VisionTower;

pub type Qwen2Vl = PatchVlm<VisionTower>;

/// Reads `config.json` and `preprocessor_config.json` in `dir` and the tower's weights.
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
    PatchVlm::load(dir, ResizeRule::Qwen2Vl, geometry, text, || VisionTower::load(w, cfg))
}

impl PatchTower for VisionTower {
    fn forward(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        VisionTower::forward(self, pixels)
    }
}
