//! Builds an engine from a model path and the user's memory and batching settings.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use super::calibrate;
use super::core::{Engine, EngineConfig};
use super::runner::ModelRunner;
use super::scheduler::SchedulerConfig;
use super::speculative::{DraftSource, SpeculativeConfig};
use crate::kv::format::resolve_layers;
use crate::kv::{CacheSpec, KvCache, KvCacheSpec, KvDtype, KvFormatError, TqBits, TqSpec};
use crate::loader::{self, LoadError};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub dtype: DType,
    /// None: same as the model dtype. In a TurboQuant cache, the type of its unquantized parts.
    pub kv_dtype: Option<KvDtype>,
    /// Store keys and values as TurboQuant codes of these bits (None: floats).
    pub kv_quant: Option<TqBits>,
    /// With `kv_quant`: how many of the most recent tokens each query reads unquantized.
    pub kv_float_window: usize,
    /// With `kv_quant`: layers that keep a float cache (negative indices count from the end).
    pub kv_skip_layers: Vec<i64>,
    /// With `kv_quant`: scale key channels by scales measured at start (`kv::calibration`).
    pub kv_key_scales: bool,
    /// None: a share of the device's memory (see `default_kv_budget`).
    pub kv_memory: Option<u64>,
    pub block_size: usize,
    pub max_num_batched_tokens: usize,
    /// vLLM's `--long-prefill-token-threshold` (0: off): most prompt tokens one sequence
    /// computes per step.
    pub long_prefill_token_threshold: usize,
    pub max_num_seqs: usize,
    pub max_model_len: Option<usize>,
    /// Speculative decoding (`--speculative-config`).
    pub speculative: Option<SpeculativeConfig>,
    /// With `speculative`: where drafts come from besides the tokens (a Gemma 4 assistant's
    /// directory, or the target's MTP head).
    pub drafter: Option<DraftSource>,
    /// Automatic prefix caching (`--[no-]enable-prefix-caching`). None: on where it is exact
    /// (vLLM's default), off with a log line elsewhere; Some(true) where it cannot be exact
    /// is an error.
    pub enable_prefix_caching: Option<bool>,
    /// Tokenizer files from elsewhere than the model (`--tokenizer`): a directory or a .gguf.
    pub tokenizer: Option<PathBuf>,
    /// Most images one request may carry (`--limit-mm-per-prompt`; None: no limit). At 0 a
    /// vision-language model's tower is not loaded: its language model serves text alone.
    pub image_limit: Option<usize>,
    /// `--batch-invariant`: every row's bits independent of the batch on CUDA too
    /// (`device::set_batch_invariant`), at a cost in speed.
    pub batch_invariant: bool,
    /// `--tensor-parallel-size`: ranks the model is divided among (1: not divided).
    pub tensor_parallel_size: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            dtype: DType::F32,
            kv_dtype: None,
            kv_quant: None,
            kv_float_window: 0,
            kv_skip_layers: Vec::new(),
            kv_key_scales: true,
            kv_memory: None,
            block_size: 16,
            max_num_batched_tokens: 2048,
            long_prefill_token_threshold: 0,
            max_num_seqs: 256,
            max_model_len: None,
            speculative: None,
            drafter: None,
            enable_prefix_caching: None,
            tokenizer: None,
            image_limit: None,
            batch_invariant: false,
            tensor_parallel_size: 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("KV cache: {0}")]
    Kv(String),
    #[error(transparent)]
    KvFormat(#[from] KvFormatError),
    #[error("invalid setting: {0}")]
    Setting(String),
}

/// What the engine was built with, for the startup log.
#[derive(Debug, Clone)]
pub struct StartupReport {
    /// Bytes one token occupies in the paged blocks.
    pub kv_bytes_per_token: usize,
    pub kv_capacity_tokens: usize,
    pub kv_allocated_bytes: usize,
    /// The float type (of the whole cache, or of a TurboQuant cache's unquantized parts).
    pub kv_dtype: KvDtype,
    /// The TurboQuant layout, for a quantized cache.
    pub kv_quant: Option<TqSpec>,
    /// Whether full blocks are cached and shared between prompts.
    pub prefix_caching: bool,
    /// Tokens a bf16 cache would hold in the same memory.
    pub kv_bf16_capacity_tokens: usize,
    /// A hybrid model's recurrent state per sequence (all its linear-attention layers, with a
    /// checkpoint per draft token when speculating), in bytes; 0 for other models.
    pub state_bytes_per_seq: usize,
    /// Sequences whose state was reserved (`--max-num-seqs`), when there is a state.
    pub state_slots: usize,
    pub max_model_len: usize,
    /// Bytes of weights held, text model and vision tower apart.
    pub weights: loader::HeldBytes,
}

impl StartupReport {
    /// One line about the KV cache for the startup log.
    pub fn kv_summary(&self) -> String {
        let mib = self.kv_allocated_bytes as f64 / (1 << 20) as f64;
        let mut base =
            format!("{} bytes/token, {} tokens in {mib:.0} MiB", self.kv_bytes_per_token, self.kv_capacity_tokens);
        if self.state_bytes_per_seq > 0 {
            base += &format!(
                " (with the recurrent state of {} sequences, {:.2} MiB each)",
                self.state_slots,
                self.state_bytes_per_seq as f64 / (1 << 20) as f64
            );
        }
        if !self.prefix_caching {
            base += ", no prefix caching";
        }
        match &self.kv_quant {
            None => format!("KV cache {}: {base}", self.kv_dtype),
            Some(tq) => {
                let mut extra = String::new();
                if tq.float_window > 0 {
                    extra += &format!(", last {} tokens in {}", tq.float_window, self.kv_dtype);
                }
                if !tq.skip_layers.is_empty() {
                    extra += &format!(", layers {:?} in {}", tq.skip_layers, self.kv_dtype);
                }
                if !tq.key_scales.is_empty() {
                    extra += ", calibrated key scales";
                }
                let ratio = self.kv_capacity_tokens as f64 / self.kv_bf16_capacity_tokens.max(1) as f64;
                format!(
                    "KV cache {}{extra}: {base} ({ratio:.2}x the {} tokens of a bf16 cache)",
                    tq.bits, self.kv_bf16_capacity_tokens
                )
            }
        }
    }
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

/// Whether prefix caching is on: as asked, except where a cached prefix cannot give exactly
/// the keys, values and state a sequence would compute itself:
/// - a hybrid model's linear-attention layers carry a recurrent state per sequence, which
///   shared blocks do not hold (the state after a prefix is not kept);
/// - a TurboQuant float window: a query reads its last positions' keys unquantized from its
///   sequence's own ring, which a sequence starting after a cached prefix does not have (the
///   blocks hold only codes, and refilling the ring would need those keys computed, which needs
///   their own windows: everything back to the first token).
///
/// Asked for explicitly, either is an error; by default caching is off for them, logged.
fn prefix_caching_setting(
    cfg: &crate::config::TextConfig,
    tq: Option<&TqSpec>,
    asked: Option<bool>,
) -> Result<bool, BuildError> {
    let why = if !cfg.linear_layers().is_empty() {
        Some(format!(
            "{} keeps a recurrent state per sequence in its linear-attention layers, which cached blocks do not hold",
            cfg.arch.name()
        ))
    } else {
        tq.map(|t| t.float_window).filter(|&w| w > 0).map(|w| {
            format!(
                "with --kv-float-window {w} each query reads its last {w} keys unquantized from its own sequence's ring, which a sequence starting from cached blocks does not have"
            )
        })
    };
    match (asked, why) {
        (Some(false), _) => Ok(false),
        (Some(true), Some(why)) => Err(BuildError::Setting(format!(
            "--enable-prefix-caching is not supported here: {why}; run with --no-enable-prefix-caching"
        ))),
        (None, Some(why)) => {
            tracing::info!("prefix caching off: {why}");
            Ok(false)
        }
        (_, None) => Ok(true),
    }
}

pub fn build_engine(path: &Path, device: &Device, opts: &EngineOptions) -> Result<(Engine, StartupReport), BuildError> {
    if opts.block_size == 0 || opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
        return Err(BuildError::Setting("block size, max-num-seqs and max-num-batched-tokens must be positive".into()));
    }
    let mtp = match &opts.drafter {
        Some(DraftSource::Mtp(_)) if !device.is_cpu() => {
            return Err(BuildError::Setting(
                "--speculative-config method mtp runs on the CPU only so far; run without it on CUDA".into(),
            ));
        }
        Some(DraftSource::Mtp(m)) => Some(m),
        _ => None,
    };
    if opts.batch_invariant && device.is_cuda() && !matches!(opts.dtype, DType::BF16 | DType::F16) {
        return Err(BuildError::Setting(
            "--batch-invariant on CUDA takes --dtype bf16 or f16 (its products are 16-bit tensor-core kernels)".into(),
        ));
    }
    crate::device::set_batch_invariant(opts.batch_invariant);
    if opts.batch_invariant && device.is_cpu() {
        tracing::info!("--batch-invariant: the CPU kernels give every row the same bits in any batch already");
    }
    let with_vision = opts.image_limit != Some(0);
    let loaded = match opts.tensor_parallel_size {
        0 => return Err(BuildError::Setting("--tensor-parallel-size must be at least 1".into())),
        1 => loader::load_model_parts(path, opts.tokenizer.as_deref(), device, opts.dtype, mtp, with_vision)?,
        n => {
            let refused = match (&opts.drafter, opts.kv_quant) {
                (Some(_), _) => Some("MTP and assistant drafters"),
                (_, Some(_)) => Some("a TurboQuant KV cache"),
                _ => None,
            };
            if opts.batch_invariant && n > 2 && device.is_cuda() {
                return Err(BuildError::Setting(format!(
                    "--batch-invariant with --tensor-parallel-size {n}: NCCL's order of adding the ranks' parts may depend on the message size past 2 ranks; use 1 or 2"
                )));
            }
            if let Some(what) = refused {
                return Err(BuildError::Setting(format!(
                    "--tensor-parallel-size {n} does not run with {what} yet; n-gram speculation and float caches do"
                )));
            }
            loader::load_tensor_parallel(path, opts.tokenizer.as_deref(), device, n, opts.dtype, with_vision)?
        }
    };
    if !with_vision {
        tracing::info!("--limit-mm-per-prompt image 0: no vision tower loaded; requests with images are refused");
    }
    let cfg = loaded.config().clone();
    let kv_dtype = opts.kv_dtype.or_else(|| KvDtype::from_dtype(opts.dtype)).unwrap_or(KvDtype::F32);
    let tq = match opts.kv_quant {
        Some(bits) => Some(TqSpec {
            bits,
            skip_layers: resolve_layers(&opts.kv_skip_layers, cfg.num_layers)?,
            float_window: opts.kv_float_window,
            window_rings: opts.max_num_seqs,
            key_scales: if opts.kv_key_scales {
                calibrate::key_scales(loaded.model.as_ref(), &loaded.tokenizer, device)
                    .map_err(|e| BuildError::Kv(format!("measuring key scales: {e}")))?
            } else {
                Vec::new()
            },
        }),
        None if opts.kv_float_window > 0 => return Err(KvFormatError::NeedsTurboQuant("--kv-float-window").into()),
        None if !opts.kv_skip_layers.is_empty() => {
            return Err(KvFormatError::NeedsTurboQuant("--kv-skip-layers").into())
        }
        None => None,
    };
    if opts.speculative.is_some() && !cfg.linear_layers().is_empty() && !device.is_cpu() {
        // A verify step keeps the recurrent state after each of its rows, to roll back to once
        // the drafts are judged (`RecurrentState::restore`). The host recurrence records those
        // checkpoints; the state's device storage and kernels do not yet, so a GPU refuses.
        return Err(BuildError::Setting(format!(
            "--speculative-config is not supported for {} on a GPU yet (its linear-attention layers' state is rolled back from per-row checkpoints, which are kept on the CPU only so far); run without it, or on the CPU",
            cfg.arch.name()
        )));
    }
    if let (Some(spec), Some(tq)) = (&opts.speculative, &tq) {
        // A verify step writes a sequence's last token and its drafts into its ring at once; a
        // rejected draft's ring row is restored from a copy, which needs all of them in the ring.
        if tq.float_window > 0 && tq.float_window <= spec.num_tokens {
            return Err(BuildError::Setting(format!(
                "--kv-float-window {} must be larger than num_speculative_tokens {}",
                tq.float_window, spec.num_tokens
            )));
        }
    }
    let mut vision = loaded.vision;
    if tq.is_some() && device.is_cuda() && cfg.images_attend_both_ways() && vision.is_some() {
        // The CUDA kernels over codes know no bidirectional ranges yet; text still runs.
        tracing::warn!("images are refused: this checkpoint's image tokens see the whole image (use_bidirectional_attention = \"vision\"), which a TurboQuant cache on CUDA does not do yet; use a float --kv-cache-dtype for images");
        vision = None;
    }
    let prefix_caching = prefix_caching_setting(&cfg, tq.as_ref(), opts.enable_prefix_caching)?;
    // Every group of layers' memory: paged per token (attention layers only), and per state slot
    // (one per sequence that may run: float-window rings, recurrent states), fixed at start
    // outside the blocks. Speculating, a recurrent state is kept once more per draft token: a
    // verify step records the state after each of its rows, so that rejected drafts roll back.
    let caches = CacheSpec::for_model(&cfg, kv_dtype, tq.as_ref())
        .with_state_checkpoints(1 + opts.speculative.map_or(0, |s| s.num_tokens));
    let per_token = caches.bytes_per_token();
    let slot_bytes = (caches.bytes_per_slot() * opts.max_num_seqs) as u64;
    let wanted_len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings);
    // No need to reserve more than every sequence at full length could use.
    let useful = (per_token as u64) * (wanted_len as u64) * (opts.max_num_seqs as u64);
    // The default budget also leaves room for the runner's own buffers (CUDA graphs' logits:
    // (K + 1) rows per sequence with speculation), allocated later, at the first decode step.
    let max_rows = 1 + opts.speculative.map_or(0, |s| s.num_tokens);
    let runner_bytes = ModelRunner::reserved_bytes(device, opts.max_num_seqs, max_rows, cfg.vocab_size);
    let budget = opts.kv_memory.unwrap_or_else(|| {
        default_kv_budget(device)
            .saturating_sub(runner_bytes)
            .min(useful.max(per_token as u64 * opts.block_size as u64) + slot_bytes)
    });
    let Some(pool) = caches.pool(budget, opts.block_size, opts.max_num_seqs) else {
        let what = if cfg.linear_layers().is_empty() {
            format!(
                "the float window needs {slot_bytes} bytes ({} sequences x {} tokens)",
                opts.max_num_seqs, opts.kv_float_window
            )
        } else {
            format!(
                "the per-sequence state needs {slot_bytes} bytes ({} sequences x {} bytes)",
                opts.max_num_seqs,
                caches.bytes_per_slot()
            )
        };
        return Err(BuildError::Kv(format!(
            "{what}, the whole budget of {budget} bytes; raise --kv-cache-memory or lower --max-num-seqs"
        )));
    };
    let spec = KvCacheSpec { block_size: opts.block_size, num_blocks: pool.num_blocks, dtype: kv_dtype };
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
    let kv =
        KvCache::build_with_checkpoints(&cfg, spec, tq.as_ref(), opts.max_num_seqs, caches.state_checkpoints, device)
            .map_err(|e| BuildError::Kv(e.to_string()))?;
    let report = StartupReport {
        kv_bytes_per_token: per_token,
        kv_capacity_tokens: capacity,
        kv_allocated_bytes: kv.allocated_bytes(),
        kv_dtype,
        kv_quant: tq,
        prefix_caching,
        kv_bf16_capacity_tokens: KvCacheSpec::from_budget(&cfg, KvDtype::Bf16, opts.block_size, budget)
            .capacity_tokens(),
        state_bytes_per_seq: caches.recurrent_bytes_per_slot(),
        state_slots: opts.max_num_seqs,
        max_model_len,
        weights: loaded.held,
    };
    let engine_cfg = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_batched_tokens: opts.max_num_batched_tokens,
            max_num_seqs: opts.max_num_seqs,
            block_size: opts.block_size,
            whole_images: cfg.images_attend_both_ways(),
            long_prefill_token_threshold: opts.long_prefill_token_threshold,
        },
        max_model_len,
        speculative: opts.speculative,
        prefix_caching,
    };
    let mut engine = Engine::new(loaded.model, kv, loaded.tokenizer, engine_cfg, device.clone()).with_vision(vision);
    match &opts.drafter {
        Some(DraftSource::Assistant(dir)) => engine
            .set_model_drafter(load_draft_model(dir, &cfg, device, opts.dtype)?)
            .map_err(|e| BuildError::Setting(e.to_string()))?,
        Some(DraftSource::Mtp(_)) => engine.set_mtp_drafter().map_err(|e| BuildError::Setting(e.to_string()))?,
        None => {}
    }
    Ok((engine, report))
}

/// The drafter model in `dir` for a target of config `cfg` (the Gemma 4 assistant is the one
/// kind so far), refused in one line where it cannot serve.
fn load_draft_model(
    dir: &Path,
    cfg: &crate::config::TextConfig,
    device: &Device,
    dtype: DType,
) -> Result<super::model_drafter::ModelDrafter, BuildError> {
    if !device.is_cpu() {
        return Err(BuildError::Setting(
            "--speculative-config method gemma4_mtp runs on the CPU only so far; run without it on CUDA".into(),
        ));
    }
    let a = crate::models::gemma4::Gemma4Assistant::load(dir, cfg, device, dtype)
        .map_err(|e| BuildError::Setting(format!("--speculative-config model: {e}")))?;
    Ok(super::model_drafter::ModelDrafter::new(Box::new(a)))
}
