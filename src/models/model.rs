//! What a model is to the engine: a text model (batch, caches -> hidden states, logits) and the
//! vision side of a vision-language model.

use candle_core::{Result, Tensor};

use super::mrope::{PositionError, PromptPositions};
use crate::batch::Batch;
use crate::config::TextConfig;
use crate::kv::KvCache;
use crate::media::{ImageError, PixelValues, RgbImage};

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

    /// The MTP head (`layers::mtp`) over rows of (next token, target hidden row): the batch
    /// carries each row's next token, position and place in the head's cache layer, `hidden`
    /// the target's final hidden rows `[T, hidden]`. Writes the head's keys and values; returns
    /// its hidden rows (their logits by `logits`). Only models loaded with a head have it.
    fn mtp_forward(&self, _batch: &Batch, _hidden: &Tensor, _kv: &KvCache) -> Result<Tensor> {
        candle_core::bail!("{} has no MTP head", self.config().arch.name())
    }

    /// Draft logits `[N, V]` (f32) of MTP head rows: over the whole vocabulary (None), or over
    /// the head's draft vocabulary, whose tokens are given.
    fn mtp_logits(&self, _m: &Tensor) -> Result<(Tensor, Option<&[u32]>)> {
        candle_core::bail!("{} has no MTP head", self.config().arch.name())
    }

    /// The input embeddings `[T, hidden]` of token ids, as the first layer reads them (a
    /// drafter model reads the target's). Only models with such a drafter have it.
    fn input_embeddings(&self, _ids: &Tensor) -> Result<Tensor> {
        candle_core::bail!("{} has no drafter that reads its input embeddings", self.config().arch.name())
    }

    /// Whether a decode step of this model can be captured as a CUDA graph on the engine's
    /// device (not a model divided among devices, whose ranks run on threads of their own).
    fn graph_capturable(&self) -> bool {
        true
    }
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

    /// What stands for an image of `n` image tokens in the prompt, in place of the chat
    /// template's one placeholder: the tokens themselves, or wrapped in markers the model adds
    /// (Gemma 4's `<|image>` .. `<image|>`).
    fn placeholder(&self, n: usize) -> Vec<u32> {
        vec![self.image_token_id(); n]
    }

    /// Positions of every prompt token; `images` in prompt order.
    fn prompt_positions(
        &self,
        tokens: &[u32],
        images: &[&PixelValues],
    ) -> std::result::Result<PromptPositions, PositionError>;

    /// The image's embeddings, `[num_image_tokens, hidden]`.
    fn encode(&self, pixels: &PixelValues) -> Result<Tensor>;
}
