//! Model families. A model is a pure function of (batch, kv cache) -> hidden states; it owns
//! no per-sequence state. `model.rs` says what a model is (`TextModel`, `VisionModel`); this
//! file picks the family that loads one.

pub mod gemma3;
pub mod gemma4;
pub mod glm4v;
pub mod llama;
mod model;
pub mod mrope;
pub mod patch_vlm;
pub mod qwen2_vl;
pub mod qwen35;
pub mod tensor_parallel;

use std::path::Path;
use std::sync::Arc;

pub use model::{Taps, TextModel, VisionModel};
pub use mrope::{PositionError, PromptPositions};

use crate::config::{Arch, TextConfig};
use crate::weights::{Weights, WeightsError};

pub fn load_text_model(w: &Weights, cfg: &TextConfig) -> std::result::Result<Box<dyn TextModel>, WeightsError> {
    Ok(match cfg.arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Vl | Arch::Qwen25Vl => {
            Box::new(llama::Llama::load(w, cfg.clone())?)
        }
        Arch::Gemma3 => Box::new(gemma3::Gemma3::load(w, cfg.clone())?),
        Arch::Gemma4 => Box::new(gemma4::Gemma4::load(w, cfg.clone())?),
        Arch::Glm4v | Arch::Glm4vMoe => Box::new(glm4v::text::GlmText::load(w, cfg.clone())?),
        Arch::Qwen35 | Arch::Qwen35Moe => Box::new(qwen35::Qwen35::load(w, cfg.clone())?),
    })
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
        Arch::Gemma4 => gemma4::load(w, dir, cfg)?.map(|v| Arc::new(v) as Arc<dyn VisionModel>),
        Arch::Qwen35 | Arch::Qwen35Moe => {
            qwen2_vl::load_qwen35(w, dir, cfg)?.map(|v| Arc::new(v) as Arc<dyn VisionModel>)
        }
        _ => None,
    })
}
