//! Qwen2-VL and Qwen2.5-VL: a vision tower whose image embeddings replace the prompt's
//! image-pad tokens, and a Qwen2 language model with M-RoPE (the `llama` module's decoder;
//! the same weights serve text-only requests, which skip the vision tower).

pub mod config;
pub mod mrope;
pub mod processor;
pub mod vision;

use std::path::Path;

use candle_core::Tensor;

use super::config::TextConfig;
use super::VisionModel;
use crate::media::{ImageError, PixelValues, RgbImage};
use crate::weights::{Weights, WeightsError};
use config::VisionConfig;
use mrope::{PositionError, PromptPositions};
use processor::ImageProcessor;
use vision::VisionTower;

pub struct Qwen2Vl {
    processor: ImageProcessor,
    tower: VisionTower,
}

impl Qwen2Vl {
    /// Reads `config.json` and `preprocessor_config.json` in `dir` and the tower's weights.
    pub fn load(w: &Weights, dir: &Path, text: &TextConfig) -> Result<Self, WeightsError> {
        let cfg_path = dir.join("config.json");
        let cfg = VisionConfig::from_hf_file(&cfg_path, text.arch)?;
        let processor = ImageProcessor::from_dir(dir)?;
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
                    "the vision merger outputs {} values per token, the language model takes {}",
                    cfg.out_hidden_size, text.hidden_size
                ),
            });
        }
        Ok(Qwen2Vl { processor, tower: VisionTower::load(w, cfg)? })
    }

    pub fn processor(&self) -> &ImageProcessor {
        &self.processor
    }
}

impl VisionModel for Qwen2Vl {
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

    fn prompt_positions(&self, tokens: &[u32], images: &[&PixelValues]) -> Result<PromptPositions, PositionError> {
        let cfg = self.tower.config();
        for (index, p) in images.iter().enumerate() {
            let [t, h, w] = p.grid_thw;
            let m = cfg.spatial_merge_size;
            if p.cols != cfg.patch_dim() || p.rows != t * h * w || p.rows == 0 || h % m != 0 || w % m != 0 {
                return Err(PositionError::BadPixels {
                    index,
                    reason: format!(
                        "[{}, {}] pixel values with grid {:?} do not fit this model's patches",
                        p.rows, p.cols, p.grid_thw
                    ),
                });
            }
            if p.data.len() != p.rows * p.cols {
                return Err(PositionError::BadPixels { index, reason: "pixel data has the wrong length".into() });
            }
        }
        let grids: Vec<[usize; 3]> = images.iter().map(|p| p.grid_thw).collect();
        mrope::prompt_positions(tokens, self.image_token_id(), &grids, self.tower.config().spatial_merge_size)
    }

    fn encode(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        self.tower.forward(pixels)
    }
}
