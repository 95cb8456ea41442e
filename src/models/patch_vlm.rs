//! What Qwen2-VL and the GLM-V family share around their vision towers: an image processor
//! whose patches the tower takes, image tokens placed by the M-RoPE rule of `mrope`, and the
//! embeddings of one image per call. Each family brings its tower (`PatchTower`) and its
//! resize rule.

use std::path::Path;

use candle_core::Tensor;

use super::model::VisionModel;
use super::mrope::{self, PositionError, PromptPositions};
use crate::config::TextConfig;
use crate::media::processor::{ImageProcessor, ResizeRule};
use crate::media::{ImageError, PixelValues, RgbImage};
use crate::weights::WeightsError;

/// A vision tower over merged patches.
pub trait PatchTower: Send + Sync {
    /// One image's embeddings, in the order of its image tokens.
    fn forward(&self, pixels: &PixelValues) -> candle_core::Result<Tensor>;
}

/// What `config.json`'s `vision_config` says of the tower that the processor, the prompt and
/// the language model must agree with.
pub struct PatchGeometry {
    pub image_token_id: u32,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    /// Values per patch: channels x temporal patch x patch x patch.
    pub patch_dim: usize,
    pub out_hidden_size: usize,
}

pub struct PatchVlm<T> {
    processor: ImageProcessor,
    geometry: PatchGeometry,
    tower: T,
}

impl<T: PatchTower> PatchVlm<T> {
    /// Reads the image processor's config in `dir` (`ImageProcessor::from_dir`), checks it and
    /// the language model against the tower's `geometry` (from `config.json`), then loads the
    /// tower.
    pub fn load(
        dir: &Path,
        rule: ResizeRule,
        geometry: PatchGeometry,
        text: &TextConfig,
        load_tower: impl FnOnce() -> Result<T, WeightsError>,
    ) -> Result<Self, WeightsError> {
        let g = geometry;
        let processor = ImageProcessor::from_dir(dir, rule)?;
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size)
            != (g.patch_size, g.spatial_merge_size, g.temporal_patch_size)
        {
            let file = ["preprocessor_config.json", "processor_config.json"]
                .into_iter()
                .find(|f| dir.join(f).is_file())
                .unwrap_or("preprocessor_config.json");
            return Err(WeightsError::Config {
                path: dir.join(file),
                msg: format!(
                    "patch {} / merge {} / temporal patch {} differ from config.json's vision_config ({} / {} / {})",
                    processor.patch_size,
                    processor.merge_size,
                    processor.temporal_patch_size,
                    g.patch_size,
                    g.spatial_merge_size,
                    g.temporal_patch_size
                ),
            });
        }
        if g.out_hidden_size != text.hidden_size {
            return Err(WeightsError::Config {
                path: dir.join("config.json"),
                msg: format!(
                    "the vision tower outputs {} values per token, the language model takes {}",
                    g.out_hidden_size, text.hidden_size
                ),
            });
        }
        Ok(PatchVlm { processor, tower: load_tower()?, geometry: g })
    }

    pub fn processor(&self) -> &ImageProcessor {
        &self.processor
    }
}

impl<T: PatchTower> VisionModel for PatchVlm<T> {
    fn image_token_id(&self) -> u32 {
        self.geometry.image_token_id
    }

    fn preprocess(&self, image: &RgbImage) -> Result<PixelValues, ImageError> {
        self.processor.preprocess(image)
    }

    fn num_image_tokens(&self, pixels: &PixelValues) -> usize {
        let m = self.geometry.spatial_merge_size;
        pixels.grid_thw.iter().product::<usize>() / (m * m)
    }

    /// Both families place an image's tokens alike (one temporal position per frame, the
    /// merged grid's rows and columns; the text after continues past the larger side).
    fn prompt_positions(&self, tokens: &[u32], images: &[&PixelValues]) -> Result<PromptPositions, PositionError> {
        let m = self.geometry.spatial_merge_size;
        mrope::check_pixels(images, self.geometry.patch_dim, m)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|p| p.grid_thw).collect();
        mrope::prompt_positions(tokens, self.image_token_id(), &grids, m)
    }

    fn encode(&self, pixels: &PixelValues) -> candle_core::Result<Tensor> {
        self.tower.forward(pixels)
    }
}
