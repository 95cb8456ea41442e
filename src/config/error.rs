use std::path::{Path, PathBuf};

/// Why a model's config (its `config.json`, or a GGUF file's metadata) cannot be used. Each
/// message names the field or key at fault and says what to do; `In` adds the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read the model config ({source}); check the path and that the download is complete", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: not valid JSON ({source}); the file is damaged or truncated: download it again", path.display())]
    Json { path: PathBuf, source: serde_json::Error },
    /// A problem found in the file at `path`.
    #[error("{}: {source}", path.display())]
    In { path: PathBuf, source: Box<ConfigError> },
    #[error("field `{field}` is missing or not {expected}: set it as the model's original config.json does")]
    Field { field: String, expected: &'static str },
    #[error("missing metadata `{key}`: convert the model again with a current llama.cpp (convert_hf_to_gguf.py)")]
    Metadata { key: String },
    #[error("unsupported {what} `{value}`: iris supports {supported}; use a model with one of those")]
    Unsupported { what: &'static str, value: String, supported: &'static str },
    /// A value the model code cannot run with.
    #[error("{0}; the config does not match a model iris can run: compare it with the model's original config")]
    Invalid(String),
}

impl ConfigError {
    /// This error, as found in the file at `path`.
    pub fn in_file(self, path: &Path) -> Self {
        ConfigError::In { path: path.to_path_buf(), source: Box::new(self) }
    }
}
