//! Gemma 4 (`gemma4`, `gemma4_text`, `gemma4_unified`): the language model (text.rs) and, in a
//! vision-language checkpoint, its vision tower (vision.rs) or, in the unified family, its
//! encoder-free embedder (unified_vision.rs): each image's pooled patch cells (merged patches)
//! replace a run of `<|image|>` tokens between `<|image>` and `<image|>`; positions stay 1-D.
//! Text-only requests skip the vision half; the same weights serve both.

pub mod assistant;
pub mod assistant_config;
pub mod config;
pub mod text;
pub mod unified_vision;
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
use config::ImageTokens;
use unified_vision::UnifiedEmbedder;
use vision::VisionTower;

pub struct Gemma4Vision {
    processor: Gemma4ImageProcessor,
    tokens: ImageTokens,
    /// Values per patch of the processor's and the side of the cells one image token stands for.
    patch_dim: usize,
    pooling_kernel_size: usize,
    encoder: Encoder,
}

enum Encoder {
    Tower(VisionTower),
    Unified(UnifiedEmbedder),
}

/// The vision half of the checkpoint in `dir`, None when it has none.
pub fn load(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Option<Gemma4Vision>, WeightsError> {
    let path = dir.join("config.json");
    let Some((tokens, vision)) = config::Vision::from_hf_file(&path)? else { return Ok(None) };
    let (patch_size, k, encoder) = match vision {
        config::Vision::Tower(cfg) => {
            (cfg.patch_size, cfg.pooling_kernel_size, Encoder::Tower(VisionTower::load(w, cfg, text.hidden_size)?))
        }
        config::Vision::Unified(cfg) => (
            cfg.patch_size,
            cfg.pooling_kernel_size,
            Encoder::Unified(UnifiedEmbedder::load(w, cfg, text.hidden_size)?),
        ),
    };
    let processor = Gemma4ImageProcessor::from_dir(dir)?;
    if (processor.patch_size, processor.pooling_kernel_size) != (patch_size, k) {
        return Err(WeightsError::Config {
            path: dir.join("processor_config.json"),
            msg: format!(
                "patch {} / pooling {} differ from config.json's vision_config ({} / {})",
                processor.patch_size, processor.pooling_kernel_size, patch_size, k
            ),
        });
    }
    let patch_dim = 3 * patch_size * patch_size;
    Ok(Some(Gemma4Vision { processor, tokens, patch_dim, pooling_kernel_size: k, encoder }))
}

impl VisionModel for Gemma4Vision {
    fn image_token_id(&self) -> u32 {
        self.tokens.image
    }

    fn preprocess(&self, image: &RgbImage) -> Result<PixelValues, ImageError> {
        self.processor.preprocess(image)
    }

    fn num_image_tokens(&self, pixels: &PixelValues) -> usize {
        let k = self.pooling_kernel_size;
        pixels.grid_thw.iter().product::<usize>() / (k * k)
    }

    fn placeholder(&self, n: usize) -> Vec<u32> {
        let body = std::iter::repeat_n(self.tokens.image, n);
        std::iter::once(self.tokens.boi).chain(body).chain([self.tokens.eoi]).collect()
    }

    fn prompt_positions(&self, tokens: &[u32], images: &[&PixelValues]) -> Result<PromptPositions, PositionError> {
        mrope::check_pixels(images, self.patch_dim, self.pooling_kernel_size)?;
        let counts: Vec<usize> = images.iter().map(|p| self.num_image_tokens(p)).collect();
        mrope::flat_prompt_positions(tokens, self.tokens.image, &counts)
    }

    fn encode(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        match &self.encoder {
            Encoder::Tower(t) => t.forward(pixels),
            Encoder::Unified(u) => u.forward(pixels),
        }
    }
}
