use std::path::{Path, PathBuf};

use crate::config::ConfigError;

/// Why a model could not be loaded. Every variant names the file (and tensor) at fault.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{path}: no such file or directory")]
    NotFound { path: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a model: expected a directory with config.json and *.safetensors, or a .gguf file")]
    UnknownFormat { path: PathBuf },
    #[error("{path}: holds {count} .gguf files; pass the one to load")]
    AmbiguousGguf { path: PathBuf, count: usize },
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("{path}: no such file, but {index} lists it")]
    MissingShard { path: PathBuf, index: PathBuf },
    #[error("{dir}: no *.safetensors files")]
    NoSafetensors { dir: PathBuf },
    #[error("{path}: invalid safetensors file ({msg}); the file may be truncated or corrupt")]
    Safetensors { path: PathBuf, msg: String },
    #[error("{path}: invalid GGUF file ({msg})")]
    Gguf { path: PathBuf, msg: String },
    #[error("{origin}: tensor `{name}` not found")]
    MissingTensor { name: String, origin: PathBuf },
    #[error("{origin}: tensor `{name}` has shape {actual:?}, the config implies {expected:?}")]
    ShapeMismatch { name: String, origin: PathBuf, expected: Vec<usize>, actual: Vec<usize> },
    #[error("{origin}: tensor `{name}`: {msg}")]
    BadTensor { name: String, origin: PathBuf, msg: String },
    /// The model's config (config.json or GGUF metadata) is unusable.
    #[error(transparent)]
    ModelConfig(#[from] ConfigError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl WeightsError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        WeightsError::Io { path: path.to_path_buf(), source }
    }
}
