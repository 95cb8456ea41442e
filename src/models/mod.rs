//! Model families. A model is a pure function of (batch, kv cache) -> hidden states; it owns
//! no per-sequence state.

pub mod config;
pub mod gemma3;
pub mod llama;

use candle_core::{Result, Tensor};

use crate::batch::Batch;
use crate::kv::KvCache;
use crate::weights::{Weights, WeightsError};
use config::{Arch, TextConfig};

/// Hidden states captured during a forward pass (tests compare them with transformers).
#[derive(Default)]
pub struct Taps {
    /// Input of the first decoder layer.
    pub embed: Option<Tensor>,
    /// Output of each decoder layer.
    pub layers: Vec<Tensor>,
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
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => Box::new(llama::Llama::load(w, cfg.clone())?),
        Arch::Gemma3 => Box::new(gemma3::Gemma3::load(w, cfg.clone())?),
    })
}
