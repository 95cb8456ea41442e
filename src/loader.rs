//! Turns a model location into a ready model: config, weights, tokenizer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};

use crate::config::{ConfigError, TextConfig};
use crate::models::{load_text_model, load_vision_model, TextModel, VisionModel};
use crate::tokenizer::{TextTokenizer, TokenizerError};
use crate::weights::{GgufFile, MlxQuantization, ModelLocation, SafetensorsDir, Weights, WeightsError};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A GGUF file's vocabulary or chat template is unusable.
    #[error("{}: {source}", file.display())]
    GgufTokenizer { file: PathBuf, source: TokenizerError },
    /// MTP drafting was asked for and the checkpoint has no head, or its family none.
    #[error("--speculative-config method mtp: {0}")]
    Mtp(String),
    /// The model cannot be divided among the ranks `--tensor-parallel-size` asks for.
    #[error("--tensor-parallel-size {world}: {msg}")]
    TensorParallel { world: usize, msg: String },
}

/// Where an MTP head's weights are, when drafting with one (`--speculative-config` method mtp).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MtpWeights {
    /// In the checkpoint: `mtp.*` (also under `model.` or `language_model.`) in its shards or
    /// MLX sidecars (`weights::MTP_SIDECARS`); beside a GGUF file, `<stem>.mtp.safetensors`.
    Checkpoint,
    /// In this safetensors file (or directory of them): a head trained apart from the model.
    File(PathBuf),
}

pub struct LoadedModel {
    pub model: Box<dyn TextModel>,
    /// The vision tower of a vision-language model; it shares the weight store with `model`.
    pub vision: Option<Arc<dyn VisionModel>>,
    pub tokenizer: Arc<TextTokenizer>,
    pub location: ModelLocation,
    /// Bytes of weights the model holds, measured at load.
    pub held: HeldBytes,
}

/// Bytes of weights held in memory, as the store handed them out (dense tensors in the dtype
/// they were converted to, quantized matrices in their own format), by the part that took
/// them. The text model (with an MTP head when drafting with one) is the same whether or not
/// a vision tower is loaded beside it: image and text-only requests run through it alike.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    pub text: u64,
    /// 0 when no tower was loaded (a text-only model, or `--limit-mm-per-prompt` image 0).
    pub vision: u64,
}

impl HeldBytes {
    pub fn total(&self) -> u64 {
        self.text + self.vision
    }

    /// "12.3 MB of weights (text model 10.1 MB, vision tower 2.2 MB)".
    pub fn summary(&self) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        if self.vision == 0 {
            return format!("{:.1} MB of weights", mb(self.text));
        }
        format!(
            "{:.1} MB of weights (text model {:.1} MB, vision tower {:.1} MB)",
            mb(self.total()),
            mb(self.text),
            mb(self.vision)
        )
    }
}

impl LoadedModel {
    pub fn config(&self) -> &TextConfig {
        self.model.config()
    }
}

/// Reads the config only (cheap; for `inspect` and KV sizing before loading weights).
pub fn read_config(path: &Path) -> Result<(ModelLocation, TextConfig), LoadError> {
    let loc = ModelLocation::resolve(path)?;
    let mut cfg = match &loc {
        ModelLocation::HfDir(dir) => TextConfig::from_hf_file(&dir.join("config.json"))?,
        ModelLocation::Gguf(file) => TextConfig::from_gguf(file, GgufFile::open(file)?.content())?,
    };
    // As `load` sees it: no MTP layers unless drafting with them.
    cfg.mtp_layers = 0;
    Ok((loc, cfg))
}

pub fn load(path: &Path, device: &Device, dtype: DType) -> Result<LoadedModel, LoadError> {
    load_with(path, None, device, dtype)
}

/// As `load`, with the tokenizer (and chat template) read from `tokenizer` instead of the model
/// when given: a directory with tokenizer.json (`--tokenizer`), or a .gguf file's vocabulary.
pub fn load_with(
    path: &Path,
    tokenizer: Option<&Path>,
    device: &Device,
    dtype: DType,
) -> Result<LoadedModel, LoadError> {
    load_model(path, tokenizer, device, dtype, None)
}

/// As `load_with`, with the MTP head the model drafts with when `mtp` says where it is.
pub fn load_model(
    path: &Path,
    tokenizer: Option<&Path>,
    device: &Device,
    dtype: DType,
    mtp: Option<&MtpWeights>,
) -> Result<LoadedModel, LoadError> {
    load_model_parts(path, tokenizer, device, dtype, mtp, true)
}

/// As `load_model`; without `vision`, a vision-language checkpoint's tower is not loaded at
/// all (`--limit-mm-per-prompt '{"image": 0}'`): its language model alone, from the same store.
pub fn load_model_parts(
    path: &Path,
    tokenizer: Option<&Path>,
    device: &Device,
    dtype: DType,
    mtp: Option<&MtpWeights>,
    vision: bool,
) -> Result<LoadedModel, LoadError> {
    let loc = ModelLocation::resolve(path)?;
    let (mut cfg, tokenizer, gguf) = config_and_tokenizer(&loc, tokenizer)?;
    let mut weights = weights_store(&loc, gguf, device, dtype)?;
    cfg.mtp_layers = match mtp {
        None => 0,
        Some(m) => {
            weights = with_mtp_weights(weights, &loc, &cfg, m)?;
            1
        }
    };
    let model = load_text_model(&weights, &cfg)?;
    let text = weights.held_bytes();
    let vision = match &loc {
        ModelLocation::HfDir(dir) if vision => load_vision_model(&weights, dir, &cfg)?,
        _ => None,
    };
    let held = HeldBytes { text, vision: weights.held_bytes() - text };
    Ok(LoadedModel { model, vision, tokenizer: Arc::new(tokenizer), location: loc, held })
}

/// A checkpoint's text model (safetensors, or one GGUF file) divided among `world` ranks
/// (tensor parallelism):
/// rank 0 on `first`, the others on the GPUs after it (or on the CPU too). Each rank loads its
/// part of every divided tensor (`parallel::Shard::split_of`) and the layers a config of its
/// share implies (`parallel::rank_config`). On the CPU the ranks meet through threads
/// (`thread_group`), on CUDA devices through NCCL. What the model allows is checked before any
/// GPU is opened. With `vision`, a vision-language checkpoint's tower is loaded whole on rank
/// 0's device (its image rows go to every rank with the step). The weight figure is rank 0's.
pub fn load_tensor_parallel(
    path: &Path,
    tokenizer: Option<&Path>,
    first: &Device,
    world: usize,
    dtype: DType,
    vision: bool,
) -> Result<LoadedModel, LoadError> {
    let refuse = |msg: String| LoadError::TensorParallel { world, msg };
    let loc = ModelLocation::resolve(path)?;
    let (mut cfg, tokenizer, mut gguf) = config_and_tokenizer(&loc, tokenizer)?;
    // No MTP head is loaded (drafters are refused with tensor parallelism).
    cfg.mtp_layers = 0;
    if let Some(why) = crate::parallel::unsupported(&cfg, world) {
        return Err(refuse(why));
    }
    let devices = rank_devices(first, world).map_err(refuse)?;
    let comms = if devices.iter().all(Device::is_cpu) {
        crate::parallel::thread_group(world)
    } else {
        #[cfg(feature = "nccl")]
        {
            for d in &devices {
                crate::ops::cuda::preload(d.as_cuda_device().map_err(|e| refuse(e.to_string()))?);
            }
            crate::parallel::nccl_group(&devices).map_err(|e| refuse(e.to_string()))?
        }
        #[cfg(not(feature = "nccl"))]
        return Err(refuse("GPU ranks meet through NCCL, which this build lacks (cargo build --features nccl)".into()));
    };
    let rank_cfg = crate::parallel::rank_config(&cfg, world);
    let mut ranks = Vec::with_capacity(world);
    let mut text = 0;
    for (device, comm) in devices.iter().zip(&comms) {
        let shard = crate::parallel::Shard { comm: comm.clone() };
        // Rank 0 reads through the file already open, the others open it again.
        let w = weights_store(&loc, gguf.take(), device, dtype)?.with_shard(shard);
        ranks.push((load_text_model(&w, &rank_cfg)?, device.clone()));
        if ranks.len() == 1 {
            text = w.held_bytes();
        }
    }
    let model =
        crate::models::tensor_parallel::TensorParallel::new(ranks, &comms).map_err(|e| refuse(e.to_string()))?;
    // The tower from a store of its own, which divides nothing.
    let (vision, vision_bytes) = match &loc {
        ModelLocation::HfDir(dir) if vision => {
            let towers = weights_store(&loc, None, first, dtype)?;
            (load_vision_model(&towers, dir, &cfg)?, towers.held_bytes())
        }
        _ => (None, 0),
    };
    let held = HeldBytes { text, vision: vision_bytes };
    Ok(LoadedModel { model: Box::new(model), vision, tokenizer: Arc::new(tokenizer), location: loc, held })
}

/// A checkpoint's text config (with its generation config) and tokenizer (read from
/// `tokenizer` when given: a directory with tokenizer.json, or a .gguf file's vocabulary),
/// and a GGUF file as opened for them, for `weights_store` to read on.
fn config_and_tokenizer(
    loc: &ModelLocation,
    tokenizer: Option<&Path>,
) -> Result<(TextConfig, TextTokenizer, Option<GgufFile>), LoadError> {
    Ok(match loc {
        ModelLocation::HfDir(dir) => {
            let mut cfg = TextConfig::from_hf_file(&dir.join("config.json"))?;
            merge_generation_config(dir, &mut cfg);
            let tok = match tokenizer {
                Some(t) => read_tokenizer(t)?,
                None => TextTokenizer::from_dir(dir)?,
            };
            (cfg, tok, None)
        }
        ModelLocation::Gguf(file) => {
            let g = GgufFile::open(file)?;
            let cfg = TextConfig::from_gguf(file, g.content())?;
            let tok = match tokenizer {
                Some(t) => read_tokenizer(t)?,
                None => TextTokenizer::from_gguf(g.content())
                    .map_err(|source| LoadError::GgufTokenizer { file: file.clone(), source })?,
            };
            (cfg, tok, Some(g))
        }
    })
}

/// A store of a checkpoint's tensors for `device` (the MLX quantization its config names
/// applied); a GGUF checkpoint through `opened` where the file is open already.
fn weights_store(
    loc: &ModelLocation,
    opened: Option<GgufFile>,
    device: &Device,
    dtype: DType,
) -> Result<Weights, LoadError> {
    Ok(match loc {
        ModelLocation::HfDir(dir) => {
            let mlx = mlx_quantization(&dir.join("config.json"))?;
            Weights::from_safetensors(SafetensorsDir::open(dir)?, device.clone(), dtype).with_mlx_quantization(mlx)
        }
        ModelLocation::Gguf(file) => {
            let g = match opened {
                Some(g) => g,
                None => GgufFile::open(file)?,
            };
            Weights::from_gguf(g, device.clone(), dtype)
        }
    })
}

/// The devices of `n` ranks: `first` and the GPUs after it, or `n` times the CPU.
fn rank_devices(first: &Device, n: usize) -> Result<Vec<Device>, String> {
    let first_id = match first.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        _ => return Ok(vec![first.clone(); n]),
    };
    let last = first_id + n - 1;
    let others = (first_id + 1..=last).map(|i| {
        crate::device::open(&format!("cuda:{i}")).map_err(|e| format!("needs GPUs cuda:{first_id} to cuda:{last}: {e}"))
    });
    std::iter::once(Ok(first.clone())).chain(others).collect()
}

/// `weights` able to serve the MTP head `mtp` names, checked to hold one.
fn with_mtp_weights(
    mut weights: Weights,
    loc: &ModelLocation,
    cfg: &TextConfig,
    mtp: &MtpWeights,
) -> Result<Weights, LoadError> {
    use crate::layers::mtp::MtpLayout;
    let Some(layout) = MtpLayout::of(cfg.arch) else {
        return Err(LoadError::Mtp(format!(
            "{} has no MTP head iris can run (Qwen3.5 and Llama-family heads in the Qwen3.5 layout, and GLM-4.5V / GLM-4.6V NextN layers, can)",
            cfg.arch.name()
        )));
    };
    let marker = layout.marker(cfg.num_layers);
    let side = match (layout, mtp, loc) {
        // A NextN layer is part of the checkpoint: its tensors sit among the decoder's.
        (MtpLayout::NextN, MtpWeights::File(p), _) => {
            return Err(LoadError::Mtp(format!(
                "{} drafts with the NextN layer in its own shards (`{marker}`); \"model\" ({}) names a head in the Qwen3.5 layout",
                cfg.arch.name(),
                p.display()
            )))
        }
        (MtpLayout::NextN, _, _) | (_, MtpWeights::Checkpoint, ModelLocation::HfDir(_)) => None,
        (_, MtpWeights::File(p), _) => Some(p.clone()),
        (_, MtpWeights::Checkpoint, ModelLocation::Gguf(file)) => Some(file.with_extension("mtp.safetensors")),
    };
    if layout == MtpLayout::NextN {
        // Its quantized matrices (an MLX conversion's) become floats, as `mtp.*` heads' do.
        weights = weights.with_mtp_layer(format!("model.layers.{}.", cfg.num_layers));
    }
    if let Some(side) = side {
        let store = if side.is_dir() {
            SafetensorsDir::open(&side)?
        } else if side.is_file() {
            SafetensorsDir::open_files(side.parent().unwrap_or(Path::new(".")), vec![side.clone()])?
        } else {
            return Err(LoadError::Mtp(format!("no MTP head at {}", side.display())));
        };
        // A GGUF llama's q/k rows are in llama.cpp's pair order; the head's are HF's.
        let pairs = matches!(loc, ModelLocation::Gguf(_)) && cfg.rope_layout == crate::config::RopeLayout::Interleaved;
        weights = weights.with_mtp_sidecar(store, pairs.then_some(cfg.head_dim));
    }
    if !weights.contains(&marker) {
        let origin = weights.origin().display();
        return Err(LoadError::Mtp(match layout {
            MtpLayout::NextN => format!("{origin} has no MTP head (no NextN layer: no {marker} in its shards); start without it"),
            MtpLayout::Qwen => format!(
                "{origin} has no MTP head (no {marker} in its shards, nor in {}); start without it, or name the head's file with \"model\"",
                crate::weights::MTP_SIDECARS.join(" or ")
            ),
        }));
    }
    if cfg.mtp_layers > 1 {
        tracing::warn!("the checkpoint has {} MTP layers; drafting uses the first", cfg.mtp_layers);
    }
    Ok(weights)
}

/// The `quantization` block of an MLX conversion's config.json (None for other checkpoints).
pub fn mlx_quantization(config: &Path) -> Result<Option<MlxQuantization>, WeightsError> {
    let text = std::fs::read_to_string(config).map_err(|e| WeightsError::io(config, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| WeightsError::Config { path: config.to_path_buf(), msg: format!("not valid JSON: {e}") })?;
    MlxQuantization::from_config(&json, config)
}

/// A tokenizer on its own: a .gguf file's vocabulary, or a directory's tokenizer.json.
fn read_tokenizer(path: &Path) -> Result<TextTokenizer, LoadError> {
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        return TextTokenizer::from_gguf_file(path)
            .map_err(|source| LoadError::GgufTokenizer { file: path.to_path_buf(), source });
    }
    Ok(TextTokenizer::from_dir(path)?)
}

/// `generation_config.json` may list more end-of-sequence ids than config.json.
fn merge_generation_config(dir: &Path, cfg: &mut TextConfig) {
    let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else { return };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else { return };
    let ids: Vec<u32> = match json.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
        Some(v) => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        None => vec![],
    };
    for id in ids {
        if !cfg.eos_token_ids.contains(&id) {
            cfg.eos_token_ids.push(id);
        }
    }
}
