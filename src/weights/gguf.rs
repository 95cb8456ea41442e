use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::Device;

use super::safetensors::root_cause;
use super::{StoredTensor, WeightsError};
use crate::models::config::{
    gemma_layer_pattern, Activation, Arch, LayerKind, RopeConfig, RopeLayout, RopeScaling, TextConfig,
};

/// One GGUF file: its metadata and a reader for its tensors.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: Mutex<BufReader<File>>,
    arch: Arch,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, WeightsError> {
        let file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)
            .map_err(|e| WeightsError::Gguf { path: path.to_path_buf(), msg: root_cause(&e) })?;
        let arch_name =
            content.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).ok_or_else(|| {
                WeightsError::Gguf { path: path.to_path_buf(), msg: "no general.architecture".into() }
            })?;
        let arch = Arch::from_model_type(arch_name).ok_or_else(|| WeightsError::Config {
            path: path.to_path_buf(),
            msg: format!("unsupported architecture `{arch_name}` (iris supports llama, qwen2, qwen3, gemma3)"),
        })?;
        Ok(GgufFile { path: path.to_path_buf(), content, reader: Mutex::new(reader), arch })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn content(&self) -> &Content {
        &self.content
    }

    pub fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Quantization types present, with tensor counts (for `iris inspect`).
    pub fn dtype_histogram(&self) -> Vec<(GgmlDType, usize)> {
        let mut h: Vec<(GgmlDType, usize)> = Vec::new();
        for info in self.content.tensor_infos.values() {
            match h.iter_mut().find(|(d, _)| *d == info.ggml_dtype) {
                Some((_, n)) => *n += 1,
                None => h.push((info.ggml_dtype, 1)),
            }
        }
        h.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        h
    }

    pub fn load(&self, name: &str, device: &Device) -> Result<StoredTensor, WeightsError> {
        if !self.contains(name) {
            return Err(WeightsError::MissingTensor { name: name.to_string(), origin: self.path.clone() });
        }
        let bad = |e: candle_core::Error| WeightsError::BadTensor {
            name: name.to_string(),
            origin: self.path.clone(),
            msg: root_cause(&e),
        };
        let q = {
            let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
            self.content.tensor(&mut *reader, name, device).map_err(bad)?
        };
        let dense = matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if !dense {
            return Ok(StoredTensor::Quantized(Arc::new(q)));
        }
        let mut t = q.dequantize(device).map_err(bad)?;
        // llama.cpp stores Gemma's RMSNorm weights as 1 + w; the model code applies 1 + w itself.
        if self.arch == Arch::Gemma3 && name.ends_with("norm.weight") {
            t = (t - 1.0).map_err(bad)?;
        }
        Ok(StoredTensor::Dense(t))
    }

    fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
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

    fn need(&self, key: &str) -> Result<usize, WeightsError> {
        self.u(key).ok_or_else(|| WeightsError::Config {
            path: self.path.clone(),
            msg: format!("missing metadata `{}`", self.arch_key(key)),
        })
    }

    /// The text model's hyper-parameters from llama.cpp's metadata keys.
    pub fn text_config(&self) -> Result<TextConfig, WeightsError> {
        let arch = self.arch;
        let hidden_size = self.need("embedding_length")?;
        let num_heads = self.need("attention.head_count")?;
        let num_kv_heads = self.u("attention.head_count_kv").unwrap_or(num_heads);
        let num_layers = self.need("block_count")?;
        let head_dim = self.u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match self.u("vocab_size") {
            Some(v) => v,
            None => self
                .meta("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(Vec::len)
                .ok_or_else(|| WeightsError::Config { path: self.path.clone(), msg: "no vocabulary size".into() })?,
        };
        let default_theta = if arch == Arch::Gemma3 { 1_000_000.0 } else { 10_000.0 };
        let scaling = match (
            self.meta(&self.arch_key("rope.scaling.type")).and_then(|v| v.to_string().ok()).map(String::as_str),
            self.f("rope.scaling.factor"),
        ) {
            (Some("linear"), Some(factor)) if factor != 1.0 => RopeScaling::Linear { factor },
            _ => RopeScaling::None,
        };
        let rope =
            RopeConfig { theta: self.f("rope.freq_base").unwrap_or(default_theta), scaling, mrope_section: None };
        let (rope_local, sliding_window, layer_kinds) = if arch == Arch::Gemma3 {
            // llama.cpp fixes Gemma 3's local rotary base at 10k and every 6th layer global.
            (
                Some(RopeConfig { theta: 10_000.0, scaling: RopeScaling::None, mrope_section: None }),
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
        };
        cfg.validate().map_err(|msg| WeightsError::Config { path: self.path.clone(), msg })?;
        Ok(cfg)
    }
}
