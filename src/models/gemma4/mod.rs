//! Gemma 4 (`gemma4`, `gemma4_text`): the language model (text.rs) and, in a vision-language
//! checkpoint, its vision tower (vision.rs): each image's pooled patch cells replace a run of
//! `<|image|>` tokens between `<|image>` and `<image|>`; positions stay 1-D. Text-only requests
//! skip the tower; the same weights serve both.

pub mod assistant;
pub mod assistant_config;
pub mod config;
pub mod text;
pub mod vision;

use std::path::Path;

use candle_core::Tensor;

pub use assistant::{DraftStep, Gemma4Assistant};
pub use assistant_config::{AssistantConfig, AssistantError};
pub use text::Gemma4;

use super::model::VisionModel;
use super::mrope::{self, PositionError, PromptPositions};
use crate::config::TextConfig;
use crate::media::gemma4_processor::Gemma4ImageProcessor;
use crate::media::{ImageError, PixelValues, RgbImage};
use crate::weights::{Weights, WeightsError};
use config::VisionConfig;
use vision::VisionTower;

pub struct Gemma4Vision {
    processor: Gemma4ImageProcessor,
    cfg: VisionConfig,
    tower: VisionTower,
}

/// The vision half of the checkpoint in `dir`, None when it has none.
pub fn load(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Option<Gemma4Vision>, WeightsError> {
    let Some(cfg) = VisionConfig::from_hf_file(&dir.join("config.json"))? else { return Ok(None) };
    let processor = Gemma4ImageProcessor::from_dir(dir)?;
    if (processor.patch_size, processor.pooling_kernel_size) != (cfg.patch_size, cfg.pooling_kernel_size) {
        return Err(WeightsError::Config {
            path: dir.join("processor_config.json"),
            msg: format!(
                "patch {} / pooling {} differ from config.json's vision_config ({} / {})",
                processor.patch_size, processor.pooling_kernel_size, cfg.patch_size, cfg.pooling_kernel_size
            ),
        });
    }
    let tower = VisionTower::load(w, cfg.clone(), text.hidden_size)?;
    Ok(Some(Gemma4Vision { processor, cfg, tower }))
}

impl VisionModel for Gemma4Vision {
    fn image_token_id(&self) -> u32 {
        self.cfg.image_token_id
    }

    fn preprocess(&self, image: &RgbImage) -> Result<PixelValues, ImageError> {
        self.processor.preprocess(image)
    }

    fn num_image_tokens(&self, pixels: &PixelValues) -> usize {
        let k = self.cfg.pooling_kernel_size;
        pixels.grid_thw.iter().product::<usize>() / (k * k)
    }

    fn placeholder(&self, n: usize) -> Vec<u32> {
        let body = std::iter::repeat_n(self.cfg.image_token_id, n);
        std::iter::once(self.cfg.boi_token_id).chain(body).chain([self.cfg.eoi_token_id]).collect()
    }

    fn prompt_positions(&self, tokens: &[u32], images: &[&PixelValues]) -> Result<PromptPositions, PositionError> {
        mrope::check_pixels(images, self.cfg.patch_dim(), self.cfg.pooling_kernel_size)?;
        let counts: Vec<usize> = images.iter().map(|p| self.num_image_tokens(p)).collect();
        mrope::flat_prompt_positions(tokens, self.cfg.image_token_id, &counts)
    }

    fn encode(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        self.tower.forward(pixels)
    }
}
