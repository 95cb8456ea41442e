//! Builds an engine from a model path and the user's memory and batching settings.

use std::path::Path;

use candle_core::{DType, Device};

use super::core::{Engine, EngineConfig};
use super::scheduler::SchedulerConfig;
use crate::kv::{KvCache, KvCacheSpec, KvDtype};
use crate::loader::{self, LoadError};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub dtype: DType,
    /// None: same as the model dtype.
    pub kv_dtype: Option<KvDtype>,
    /// None: a share of the device's memory (see `default_kv_budget`).
    pub kv_memory: Option<u64>,
    pub block_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            dtype: DType::F32,
            kv_dtype: None,
            kv_memory: None,
            block_size: 16,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("KV cache: {0}")]
    Kv(String),
    #[error("invalid setting: {0}")]
    Setting(String),
}

/// What the engine was built with, for the startup log.
#[derive(Debug, Clone)]
pub struct StartupReport {
    pub kv_bytes_per_token: usize,
    pub kv_capacity_tokens: usize,
    pub kv_allocated_bytes: usize,
    pub kv_dtype: KvDtype,
    pub max_model_len: usize,
    pub weight_bytes: u64,
}

/// On a GPU: its free memory (weights already loaded) less a tenth of its total (at least
/// 2 GiB) for a step's activations. On the CPU: a quarter of physical memory, or 4 GiB if that
/// cannot be read.
pub fn default_kv_budget(device: &Device) -> u64 {
    if let Some((free, total)) = crate::device::memory_info(device) {
        return free.saturating_sub((total / 10).max(2 << 30));
    }
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    total.map(|t| t / 4).unwrap_or(4 << 30)
}

pub fn build_engine(path: &Path, device: &Device, opts: &EngineOptions) -> Result<(Engine, StartupReport), BuildError> {
    if opts.block_size == 0 || opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
        return Err(BuildError::Setting("block size, max-num-seqs and max-num-batched-tokens must be positive".into()));
    }
    let loaded = loader::load(path, device, opts.dtype)?;
    let cfg = loaded.config().clone();
    let kv_dtype = opts.kv_dtype.or_else(|| KvDtype::from_dtype(opts.dtype)).unwrap_or(KvDtype::F32);
    let per_token = KvCacheSpec::bytes_per_token(&cfg, kv_dtype);
    let wanted_len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings);
    // No need to reserve more than every sequence at full length could use.
    let useful = (per_token as u64) * (wanted_len as u64) * (opts.max_num_seqs as u64);
    let budget = opts
        .kv_memory
        .unwrap_or_else(|| default_kv_budget(device).min(useful.max(per_token as u64 * opts.block_size as u64)));
    let spec = KvCacheSpec::from_budget(&cfg, kv_dtype, opts.block_size, budget);
    if spec.num_blocks == 0 {
        return Err(BuildError::Kv(format!(
            "a budget of {budget} bytes holds no block of {} tokens ({per_token} bytes per token); raise --kv-cache-memory",
            opts.block_size
        )));
    }
    let capacity = spec.capacity_tokens();
    let max_model_len = match opts.max_model_len {
        Some(n) if n > capacity => {
            return Err(BuildError::Kv(format!(
                "--max-model-len {n} exceeds the KV capacity of {capacity} tokens; raise --kv-cache-memory or lower it"
            )))
        }
        Some(n) => n,
        None => wanted_len.min(capacity),
    };
    let kv = KvCache::new(&cfg, spec, device).map_err(|e| BuildError::Kv(e.to_string()))?;
    let report = StartupReport {
        kv_bytes_per_token: per_token,
        kv_capacity_tokens: capacity,
        kv_allocated_bytes: kv.allocated_bytes(),
        kv_dtype,
        max_model_len,
        weight_bytes: loaded.weight_bytes,
    };
    let engine_cfg = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_batched_tokens: opts.max_num_batched_tokens,
            max_num_seqs: opts.max_num_seqs,
            block_size: opts.block_size,
        },
        max_model_len,
    };
    let engine = Engine::new(loaded.model, kv, loaded.tokenizer, engine_cfg, device.clone()).with_vision(loaded.vision);
    Ok((engine, report))
}
