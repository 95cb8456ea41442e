//! A model's configuration, read from a Hugging Face `config.json` (plain, or nested under
//! `text_config` for a vision-language model) or from GGUF metadata, normalised into one
//! typed `TextConfig` and checked before any model code sees it. The bottom of the crate: it
//! uses no other module of iris, and its errors are its own (`ConfigError`).

mod error;
mod gemma4;
mod gguf;
mod hf;
mod json;
mod text;
mod validate;

pub use error::ConfigError;
pub use gguf::gguf_arch;
pub use json::positive_int;
pub use text::{
    Activation, Arch, Gemma4Layers, KvShape, LayerKind, LinearAttnConfig, MoeConfig, MoeScoring, PerLayerInput,
    RopeConfig, RopeLayout, RopeScaling, TextConfig,
};
