//! A Gemma 4 assistant drafter's config (`gemma4_assistant`, transformers 5.24's
//! `Gemma4AssistantConfig`) checked against the target it drafts for: its layers keep no keys
//! and values and read the target's, so heads, windows and rotary must match the target's.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::config::{ConfigError, LayerKind, TextConfig};
use crate::weights::WeightsError;

#[derive(Debug, thiserror::Error)]
pub enum AssistantError {
    #[error("{path}: cannot read the drafter's config ({source}); pass the directory of a gemma4_assistant checkpoint as the speculative model")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: not JSON ({source})")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: model_type `{found}` is not a Gemma 4 assistant; method gemma4_mtp needs a gemma4_assistant checkpoint")]
    NotAssistant { path: PathBuf, found: String },
    #[error("{path}: {source}")]
    Config { path: PathBuf, source: ConfigError },
    #[error("the gemma4_mtp drafter needs a Gemma 4 target, not {0}; serve a gemma4 / gemma4_text model with it")]
    Target(&'static str),
    #[error("the drafter does not fit the target: its {what} is {drafter}, the target's {target}; use the assistant published with this target")]
    Mismatch { what: &'static str, drafter: usize, target: usize },
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

/// The centroid head's shape (`use_ordered_embeddings`): the vocabulary in `num_centroids`
/// clusters of equal size, logits computed for the `top_k` best clusters only.
#[derive(Debug, Clone, Copy)]
pub struct Centroids {
    pub num_centroids: usize,
    pub top_k: usize,
}

#[derive(Debug, Clone)]
pub struct AssistantConfig {
    /// The assistant's own layers, each reading the target layer `cfg.kv_source`, with the
    /// sliding window widened by one (see `AssistantConfig::load`).
    pub text: TextConfig,
    /// The target's hidden size (its embeddings and final hidden rows are the input).
    pub backbone_hidden: usize,
    pub centroids: Option<Centroids>,
}

impl AssistantConfig {
    /// Reads `dir/config.json` and ties the assistant's layers to `target`'s caches.
    pub fn load(dir: &Path, target: &TextConfig) -> Result<Self, AssistantError> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|source| AssistantError::Read { path: path.clone(), source })?;
        let root: Value =
            serde_json::from_str(&text).map_err(|source| AssistantError::Json { path: path.clone(), source })?;
        Self::from_json(&root, target).map_err(|e| match e {
            AssistantError::Config { source, .. } => AssistantError::Config { path: path.clone(), source },
            AssistantError::NotAssistant { found, .. } => AssistantError::NotAssistant { path: path.clone(), found },
            e => e,
        })
    }

    pub fn from_json(root: &Value, target: &TextConfig) -> Result<Self, AssistantError> {
        let config = |source| AssistantError::Config { path: PathBuf::new(), source };
        let found = root.get("model_type").and_then(Value::as_str).unwrap_or("(none)");
        if found != "gemma4_assistant" {
            return Err(AssistantError::NotAssistant { path: PathBuf::new(), found: found.into() });
        }
        if target.gemma4.is_none() {
            return Err(AssistantError::Target(target.arch.name()));
        }
        let mut inner = root
            .get("text_config")
            .filter(|v| v.is_object())
            .cloned()
            .ok_or_else(|| config(ConfigError::Field { field: "text_config".into(), expected: "an object" }))?;
        // Every layer shares: the target's caches take the place of the assistant's own.
        inner["num_kv_shared_layers"] = Value::from(0);
        let mut text = TextConfig::from_hf_json(&inner).map_err(config)?;
        let int = |key: &str| root.get(key).and_then(Value::as_u64).map(|v| v as usize);
        let backbone_hidden = int("backbone_hidden_size").unwrap_or(1536);
        let check = |what, drafter: usize, target: usize| {
            if drafter == target {
                Ok(())
            } else {
                Err(AssistantError::Mismatch { what, drafter, target })
            }
        };
        check("backbone_hidden_size", backbone_hidden, target.hidden_size)?;
        check("vocab_size", text.vocab_size, target.vocab_size)?;
        check("sliding_window", text.sliding_window.unwrap_or(0), target.sliding_window.unwrap_or(0))?;
        let centroids = match root.get("use_ordered_embeddings").and_then(Value::as_bool).unwrap_or(false) {
            false => None,
            true => {
                let c = Centroids {
                    num_centroids: int("num_centroids").unwrap_or(2048),
                    top_k: int("centroid_intermediate_top_k").unwrap_or(32),
                };
                if c.num_centroids == 0
                    || !text.vocab_size.is_multiple_of(c.num_centroids)
                    || c.top_k == 0
                    || c.top_k > c.num_centroids
                {
                    return Err(config(ConfigError::Invalid(format!(
                        "{} centroids (top {}) do not divide a vocabulary of {}",
                        c.num_centroids, c.top_k, text.vocab_size
                    ))));
                }
                Some(c)
            }
        };
        // Each layer reads the last target layer of its kind that keeps keys and values.
        let owner = |kind: LayerKind| {
            (0..target.num_layers).rev().find(|&l| target.layer_kinds[l] == kind && target.kv_source(l).is_none())
        };
        let mut sources = Vec::with_capacity(text.num_layers);
        for l in 0..text.num_layers {
            let kind = text.layer_kinds[l];
            let src =
                owner(kind).ok_or(AssistantError::Target("a model without keys and values of every layer kind"))?;
            let (mine, theirs) = (text.kv_shape(l), target.kv_shape(src));
            check("key/value heads", mine.num_kv_heads, theirs.num_kv_heads)?;
            check("head_dim", mine.head_dim, theirs.head_dim)?;
            sources.push(Some(src));
        }
        text.kv_source = sources;
        // The draft row attends from the last cached position (see Gemma4Assistant::step):
        // transformers' window there is the last window + 1 keys, one more than a causal row's.
        text.sliding_window = text.sliding_window.map(|w| w + 1);
        Ok(AssistantConfig { text, backbone_hidden, centroids })
    }
}
