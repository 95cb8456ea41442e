//! Model families. A model is a pure function of (batch, kv cache) -> hidden states; it owns
//! no per-sequence state.

pub mod gemma3;
pub mod glm4v;
pub mod llama;
pub mod mrope;
pub mod patch_vlm;
pub mod qwen2_vl;

use std::path::Path;
use std::sync::Arc;

use candle_core::{Result, Tensor};

pub use mrope::{PositionError, PromptPositions};

use crate::batch::Batch;
use crate::config::{Arch, TextConfig};
use crate::kv::KvCache;
use crate::media::{ImageError, PixelValues, RgbImage};
use crate::weights::{Weights, WeightsError};

/// Hidden states captured during a forward pass (tests compare them with transformers).
#[derive(Default)]
pub struct Taps {
    /// Input of the first decoder layer.
    pub embed: Option<Tensor>,
    /// Output of each decoder layer.
    pub layers: Vec<Tensor>,
    /// Mixture-of-experts layers' choices: (layer, `[T, top_k]` u32 experts, ascending).
    pub router: Vec<(usize, Tensor)>,
}

pub trait TextModel: Send {
    fn config(&self) -> &TextConfig;

    /// Runs every scheduled row through the decoder; returns the final-norm hidden states
    /// `[T, hidden]`. Writes the rows' keys and values into `kv`.
    fn forward(&self, batch: &Batch, kv: &KvCache, taps: Option<&mut Taps>) -> Result<Tensor>;

    /// Next-token logits `[N, vocab]` (f32) for rows of final hidden states.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor>;
}

pub fn load_text_model(w: &Weights, cfg: &TextConfig) -> std::result::Result<Box<dyn TextModel>, WeightsError> {
    Ok(match cfg.arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Vl | Arch::Qwen25Vl => {
            Box::new(llama::Llama::load(w, cfg.clone())?)
        }
        Arch::Gemma3 => Box::new(gemma3::Gemma3::load(w, cfg.clone())?),
        Arch::Glm4v | Arch::Glm4vMoe => Box::new(glm4v::text::GlmText::load(w, cfg.clone())?),
    })
}

/// The image side of a vision-language model: preprocessing, the prompt's M-RoPE positions,
/// and the vision tower. Its embeddings go in place of the prompt's image tokens.
pub trait VisionModel: Send + Sync {
    /// The token standing for one image embedding in a prompt.
    fn image_token_id(&self) -> u32;

    /// Decoded image -> patches (resized and normalized as the model's processor does).
    fn preprocess(&self, image: &RgbImage) -> std::result::Result<PixelValues, ImageError>;

    /// Image tokens (and embeddings) this image takes in a prompt.
    fn num_image_tokens(&self, pixels: &PixelValues) -> usize;

    /// Positions of every prompt token; `images` in prompt order.
    fn prompt_positions(
        &self,
        tokens: &[u32],
        images: &[&PixelValues],
    ) -> std::result::Result<PromptPositions, PositionError>;

    /// The image's embeddings, `[num_image_tokens, hidden]`.
    fn encode(&self, pixels: &PixelValues) -> Result<Tensor>;
}

/// The vision half of a vision-language checkpoint in `dir` (None for text-only models).
pub fn load_vision_model(
    w: &Weights,
    dir: &Path,
    cfg: &TextConfig,
) -> std::result::Result<Option<Arc<dyn VisionModel>>, WeightsError> {
    Ok(match cfg.arch {
        Arch::Qwen2Vl | Arch::Qwen25Vl => Some(Arc::new(qwen2_vl::load(w, dir, cfg)?)),
        Arch::Glm4v | Arch::Glm4vMoe => Some(Arc::new(glm4v::load(w, dir, cfg)?)),
        _ => None,
    })
}
