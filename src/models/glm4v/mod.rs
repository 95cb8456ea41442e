//! GLM-4.1V (`glm4v`) and GLM-4.5V / GLM-4.6V (`glm4v_moe`): a vision tower whose image
//! embeddings replace the prompt's `<|image|>` tokens (the chat template wraps each image in
//! `<|begin_of_image|>` .. `<|end_of_image|>`), and a language model with partial M-RoPE; the
//! same weights serve text-only requests, which skip the vision tower.

pub mod config;
pub mod text;
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

pub type Glm4v = PatchVlm<VisionTower>;

/// Reads `config.json` and `preprocessor_config.json` in `dir` and the tower's weights.
pub fn load(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Glm4v, WeightsError> {
    let cfg = VisionConfig::from_hf_file(&dir.join("config.json"))?;
    let geometry = PatchGeometry {
        image_token_id: cfg.image_token_id,
        patch_size: cfg.patch_size,
        spatial_merge_size: cfg.spatial_merge_size,
        temporal_patch_size: cfg.temporal_patch_size,
        patch_dim: cfg.patch_dim(),
        out_hidden_size: cfg.out_hidden_size,
    };
    PatchVlm::load(dir, ResizeRule::Glm4v, geometry, text, || VisionTower::load(w, cfg))
}

impl PatchTower for VisionTower {
    fn forward(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        VisionTower::forward(self, pixels)
    }
}
