//! GLM-4.1V (`glm4v`) and GLM-4.5V / GLM-4.6V (`glm4v_moe`): a vision tower whose image
//! embeddings replace the prompt's `<|image|>` tokens (the chat template wraps each image in
//! `<|begin_of_image|>` .. `<|end_of_image|>`), and a language model with partial M-RoPE; the
//! same weights serve text-only requests, which skip the vision tower.

pub mod config;
pub mod text;
pub mod vision;

use std::path::Path;

use candle_core::Tensor;

use super::config::TextConfig;
use super::mrope::{self, PositionError, PromptPositions};
use super::VisionModel;
use crate::media::processor::{ImageProcessor, ResizeRule};
use crate::media::{ImageError, PixelValues, RgbImage};
use crate::weights::{Weights, WeightsError};
use config::VisionConfig;
use vision::VisionTower;

pub struct Glm4v {
    processor: ImageProcessor,
    tower: VisionTower,
}

impl Glm4v {
    /// Reads `config.json` and `preprocessor_config.json` in `dir` and the tower's weights.
    pub fn load(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Self, WeightsError> {
        let cfg_path = dir.join("config.json");
        let cfg = VisionConfig::from_hf_file(&cfg_path)?;
        let processor = ImageProcessor::from_dir(dir, ResizeRule::Glm4v)?;
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size)
            != (cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size)
        {
            return Err(WeightsError::Config {
                path: dir.join("preprocessor_config.json"),
                msg: format!(
                    "patch {} / merge {} / temporal patch {} differ from config.json's vision_config ({} / {} / {})",
                    processor.patch_size,
                    processor.merge_size,
                    processor.temporal_patch_size,
                    cfg.patch_size,
                    cfg.spatial_merge_size,
                    cfg.temporal_patch_size
                ),
            });
        }
        if cfg.out_hidden_size != text.hidden_size {
            return Err(WeightsError::Config {
                path: cfg_path,
                msg: format!(
                    "the vision tower outputs {} values per token, the language model takes {}",
                    cfg.out_hidden_size, text.hidden_size
                ),
            });
        }
        Ok(Glm4v { processor, tower: VisionTower::load(w, cfg)? })
    }

    pub fn processor(&self) -> &ImageProcessor {
        &self.processor
    }
}

impl VisionModel for Glm4v {
    fn image_token_id(&self) -> u32 {
        self.tower.config().image_token_id
    }

    fn preprocess(&self, image: &RgbImage) -> Result<PixelValues, ImageError> {
        self.processor.preprocess(image)
    }

    fn num_image_tokens(&self, pixels: &PixelValues) -> usize {
        let m = self.tower.config().spatial_merge_size;
        pixels.grid_thw.iter().product::<usize>() / (m * m)
    }

    /// GLM's `get_rope_index` places an image's tokens as Qwen2-VL's does (one temporal
    /// position per frame, the merged grid's rows and columns; the text after continues past
    /// the larger side), so the shared rule applies.
    fn prompt_positions(&self, tokens: &[u32], images: &[&PixelValues]) -> Result<PromptPositions, PositionError> {
        let cfg = self.tower.config();
        mrope::check_pixels(images, cfg.patch_dim(), cfg.spatial_merge_size)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|p| p.grid_thw).collect();
        mrope::prompt_positions(tokens, self.image_token_id(), &grids, cfg.spatial_merge_size)
    }

    fn encode(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        self.tower.forward(pixels)
    }
}
