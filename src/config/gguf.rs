//! `TextConfig` from a GGUF file's metadata: llama.cpp's keys (`general.architecture`,
//! `{arch}.embedding_length`, ...) and the conventions its converter bakes in.

use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};

use super::error::ConfigError;
use super::text::{gemma_layer_pattern, Activation, Arch, LayerKind, RopeConfig, RopeLayout, RopeScaling, TextConfig};

/// The model family of a GGUF file (`general.architecture`).
pub fn gguf_arch(content: &Content) -> Result<Arch, ConfigError> {
    let key = "general.architecture";
    let name = content
        .metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .ok_or_else(|| ConfigError::Metadata { key: key.into() })?;
    Arch::from_model_type(name).ok_or_else(|| ConfigError::Unsupported {
        what: "architecture",
        value: name.clone(),
        supported: "llama, qwen2, qwen3, gemma3",
    })
}

impl TextConfig {
    /// The text model's hyper-parameters from the metadata of the GGUF file at `path`.
    pub fn from_gguf(path: &Path, content: &Content) -> Result<Self, ConfigError> {
        let meta = Metadata { content, arch: gguf_arch(content).map_err(|e| e.in_file(path))? };
        meta.text_config().map_err(|e| e.in_file(path))
    }
}

struct Metadata<'a> {
    content: &'a Content,
    arch: Arch,
}

impl Metadata<'_> {
    fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn contains(&self, tensor: &str) -> bool {
        self.content.tensor_infos.contains_key(tensor)
    }

    fn arch_key(&self, key: &str) -> String {
        let prefix = match self.arch {
            Arch::Gemma3 => "gemma3",
            a => a.name(),
        };
        format!("{prefix}.{key}")
    }

    fn u(&self, key: &str) -> Option<usize> {
        self.meta(&self.arch_key(key))
            .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
            .map(|v| v as usize)
    }

    fn f(&self, key: &str) -> Option<f64> {
        self.meta(&self.arch_key(key)).and_then(|v| v.to_f32().ok().map(f64::from).or_else(|| v.to_f64().ok()))
    }

    fn need(&self, key: &str) -> Result<usize, ConfigError> {
        self.u(key).ok_or_else(|| ConfigError::Metadata { key: self.arch_key(key) })
    }

    fn text_config(&self) -> Result<TextConfig, ConfigError> {
        let arch = self.arch;
        let hidden_size = self.need("embedding_length")?;
        let num_heads = self.need("attention.head_count")?;
        let num_kv_heads = self.u("attention.head_count_kv").unwrap_or(num_heads);
        let num_layers = self.need("block_count")?;
        let head_dim = self.u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match self.u("vocab_size") {
            Some(v) => v,
            None => {
                self.meta("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok()).map(Vec::len).ok_or_else(|| {
                    ConfigError::Metadata { key: format!("{} (or tokenizer.ggml.tokens)", self.arch_key("vocab_size")) }
                })?
            }
        };
        let default_theta = if arch == Arch::Gemma3 { 1_000_000.0 } else { 10_000.0 };
        let scaling = match (
            self.meta(&self.arch_key("rope.scaling.type")).and_then(|v| v.to_string().ok()).map(String::as_str),
            self.f("rope.scaling.factor"),
        ) {
            (Some("linear"), Some(factor)) if factor != 1.0 => RopeScaling::Linear { factor },
            _ => RopeScaling::None,
        };
        let rope = RopeConfig {
            theta: self.f("rope.freq_base").unwrap_or(default_theta),
            scaling,
            mrope_section: None,
            mrope_interleaved: false,
        };
        let (rope_local, sliding_window, layer_kinds) = if arch == Arch::Gemma3 {
            // llama.cpp fixes Gemma 3's local rotary base at 10k and every 6th layer global.
            (
                Some(RopeConfig {
                    theta: 10_000.0,
                    scaling: RopeScaling::None,
                    mrope_section: None,
                    mrope_interleaved: false,
                }),
                self.u("attention.sliding_window"),
                gemma_layer_pattern(num_layers, 6),
            )
        } else {
            (None, None, vec![LayerKind::Full; num_layers])
        };
        let token_id = |k: &str| self.meta(k).and_then(|v| v.to_u32().ok());
        let mut eos_token_ids: Vec<u32> = token_id("tokenizer.ggml.eos_token_id").into_iter().collect();
        if let Some(eot) = token_id("tokenizer.ggml.eot_token_id") {
            if !eos_token_ids.contains(&eot) {
                eos_token_ids.push(eot);
            }
        }
        let cfg = TextConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: self.need("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim: head_dim,
            rms_norm_eps: self.f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            max_position_embeddings: self.u("context_length").unwrap_or(4096),
            tie_word_embeddings: !self.contains("output.weight"),
            attention_bias: self.contains("blk.0.attn_q.bias"),
            activation: if arch == Arch::Gemma3 { Activation::GeluTanh } else { Activation::Silu },
            rope,
            rope_local,
            // llama.cpp permutes llama's q/k rows for adjacent-pair rotary.
            rope_layout: if arch == Arch::Llama { RopeLayout::Interleaved } else { RopeLayout::Half },
            sliding_window,
            layer_kinds,
            query_pre_attn_scalar: (arch == Arch::Gemma3).then_some(head_dim as f64),
            final_logit_softcapping: self.f("final_logit_softcapping"),
            attn_logit_softcapping: self.f("attn_logit_softcapping"),
            bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
            eos_token_ids,
            moe: None,
            linear_attn: None,
            layer_kv: vec![],
            kv_source: vec![],
            gemma4: None,
            // A GGUF declares none; the loader counts a sidecar's `mtp.layers.N` when asked.
            mtp_layers: 0,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
