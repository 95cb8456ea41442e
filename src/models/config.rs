//! The text model's hyper-parameters, read from an HF `config.json` (plain or nested under
//! `text_config`) or from GGUF metadata, normalised into one `TextConfig`.

use std::path::Path;

use serde_json::Value;

use crate::weights::WeightsError;

/// Model families iris implements. Names follow HF's `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen2-VL's language model: Qwen2 with multimodal rotary embeddings (M-RoPE).
    Qwen2Vl,
    /// Qwen2.5-VL: the same language model; the vision tower differs.
    Qwen25Vl,
}

impl Arch {
    pub fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "llama" | "smollm" | "mistral" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3_text" | "gemma3" => Some(Arch::Gemma3),
            "qwen2_vl" | "qwen2_vl_text" => Some(Arch::Qwen2Vl),
            "qwen2_5_vl" | "qwen2_5_vl_text" => Some(Arch::Qwen25Vl),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3_text",
            Arch::Qwen2Vl => "qwen2_vl",
            Arch::Qwen25Vl => "qwen2_5_vl",
        }
    }

    /// Vision-language models, whose top-level `model_type` names the whole model.
    pub fn is_vision_language(self) -> bool {
        matches!(self, Arch::Qwen2Vl | Arch::Qwen25Vl)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Silu,
    GeluTanh,
    /// Exact GELU, `x * Phi(x)` (PyTorch's `nn.GELU()`).
    Gelu,
    /// `x * sigmoid(1.702 x)` (CLIP-style vision towers).
    QuickGelu,
}

impl Activation {
    /// HF's `hidden_act` names.
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(Activation::GeluTanh),
            "gelu" => Some(Activation::Gelu),
            "quick_gelu" => Some(Activation::QuickGelu),
            _ => None,
        }
    }

    pub fn apply(self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        match self {
            Activation::Silu => candle_nn::ops::silu(x),
            Activation::GeluTanh => x.gelu(),
            Activation::Gelu => x.gelu_erf(),
            Activation::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
        }
    }
}

/// Whether a layer attends to the whole context or a sliding window of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Full,
    Sliding,
}

/// How rotary pairs are laid out in a head: HF's `rotate_half` (first half with second half)
/// or adjacent pairs. llama.cpp permutes llama q/k weights so that adjacent pairs apply; using
/// the interleaved form on those weights is the same math without un-permuting quantized data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    Half,
    Interleaved,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: f64 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// M-RoPE: how many rotary frequencies (from the first) follow the temporal, height and
    /// width position of a token; their sum is `head_dim / 2`.
    pub mrope_section: Option<Vec<usize>>,
}

#[derive(Debug, Clone)]
pub struct TextConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub activation: Activation,
    /// Rotary settings of full-attention layers.
    pub rope: RopeConfig,
    /// Rotary settings of sliding-window layers (Gemma 3 uses a smaller base there).
    pub rope_local: Option<RopeConfig>,
    pub rope_layout: RopeLayout,
    pub sliding_window: Option<usize>,
    pub layer_kinds: Vec<LayerKind>,
    /// Softmax scale is `query_pre_attn_scalar^-0.5` (Gemma) instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl TextConfig {
    pub fn attention_scale(&self) -> f64 {
        self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64).powf(-0.5)
    }

    pub fn rope_for(&self, layer: usize) -> &RopeConfig {
        match (self.layer_kinds[layer], &self.rope_local) {
            (LayerKind::Sliding, Some(local)) => local,
            _ => &self.rope,
        }
    }

    pub fn window_for(&self, layer: usize) -> Option<usize> {
        match self.layer_kinds[layer] {
            LayerKind::Sliding => self.sliding_window,
            LayerKind::Full => None,
        }
    }

    /// Reads `config.json` in a model directory.
    pub fn from_hf_file(path: &Path) -> Result<Self, WeightsError> {
        let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::Config { path: path.to_path_buf(), msg: format!("not valid JSON: {e}") })?;
        Self::from_hf_json(&json).map_err(|msg| WeightsError::Config { path: path.to_path_buf(), msg })
    }

    /// Parses HF's config layout. Text models keep their fields at the top; VLMs nest them
    /// under `text_config` (fields there win, the top level fills gaps such as token ids).
    pub fn from_hf_json(root: &Value) -> Result<Self, String> {
        let text = root.get("text_config").filter(|v| v.is_object());
        let get = |key: &str| -> Option<&Value> {
            text.and_then(|t| t.get(key)).filter(|v| !v.is_null()).or_else(|| root.get(key).filter(|v| !v.is_null()))
        };
        let usize_of = |key: &str| -> Result<usize, String> {
            get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| format!("missing or non-integer field `{key}`"))
        };
        // A VLM's top-level model_type names the whole model (text_config's may be e.g.
        // `qwen2_vl_text`); either maps to the same family.
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .filter(|t| Arch::from_model_type(t).is_some_and(Arch::is_vision_language))
            .or_else(|| get("model_type").and_then(Value::as_str))
            .ok_or("missing field `model_type`")?;
        let arch = Arch::from_model_type(model_type).ok_or_else(|| {
            format!(
                "unsupported architecture `{model_type}` (iris supports llama, qwen2, qwen3, gemma3_text, qwen2_vl, qwen2_5_vl)"
            )
        })?;

        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        if num_heads == 0 {
            return Err("`num_attention_heads` must be positive".into());
        }
        let num_kv_heads = get("num_key_value_heads").and_then(Value::as_u64).map(|v| v as usize).unwrap_or(num_heads);
        let head_dim = get("head_dim").and_then(Value::as_u64).map(|v| v as usize).unwrap_or(hidden_size / num_heads);
        let num_layers = usize_of("num_hidden_layers")?;

        let act = get("hidden_activation").or_else(|| get("hidden_act")).and_then(Value::as_str).unwrap_or("silu");
        let activation = match act {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu" => Activation::GeluTanh,
            other => return Err(format!("unsupported activation `{other}`")),
        };

        let default_theta = if arch == Arch::Gemma3 { 1_000_000.0 } else { 10_000.0 };
        let (rope, rope_local) = parse_rope(&get, default_theta, arch)?;

        let sliding_window = get("sliding_window").and_then(Value::as_u64).map(|v| v as usize);
        let layer_kinds = match get("layer_types").and_then(Value::as_array) {
            Some(types) => {
                if types.len() != num_layers {
                    return Err(format!("layer_types has {} entries for {num_layers} layers", types.len()));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(LayerKind::Full),
                        Some("sliding_attention") => Ok(LayerKind::Sliding),
                        other => Err(format!("unsupported layer type {other:?}")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None if arch == Arch::Gemma3 => {
                let pattern = get("sliding_window_pattern").and_then(Value::as_u64).unwrap_or(6) as usize;
                gemma_layer_pattern(num_layers, pattern)
            }
            None => vec![LayerKind::Full; num_layers],
        };
        // A sliding window in qwen2's config only applies with `use_sliding_window`.
        let sliding_window = match arch {
            Arch::Gemma3 => sliding_window,
            _ if get("use_sliding_window").and_then(Value::as_bool) == Some(true) => sliding_window,
            _ if layer_kinds.contains(&LayerKind::Sliding) => sliding_window,
            _ => None,
        };

        let eos_token_ids = match get("eos_token_id") {
            Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_u64).map(|v| v as u32).collect(),
            Some(v) => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            None => vec![],
        };
        let cfg = TextConfig {
            arch,
            vocab_size: usize_of("vocab_size")?,
            hidden_size,
            intermediate_size: usize_of("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            max_position_embeddings: get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(4096) as usize,
            tie_word_embeddings: get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(arch == Arch::Gemma3),
            attention_bias: get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(matches!(arch, Arch::Qwen2 | Arch::Qwen2Vl | Arch::Qwen25Vl)),
            activation,
            rope,
            rope_local,
            rope_layout: RopeLayout::Half,
            sliding_window,
            layer_kinds,
            query_pre_attn_scalar: if arch == Arch::Gemma3 {
                get("query_pre_attn_scalar").and_then(Value::as_f64)
            } else {
                None
            },
            final_logit_softcapping: get("final_logit_softcapping").and_then(Value::as_f64),
            attn_logit_softcapping: get("attn_logit_softcapping").and_then(Value::as_f64),
            bos_token_id: get("bos_token_id").and_then(Value::as_u64).map(|v| v as u32),
            eos_token_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects values the model code cannot run with (zero sizes, heads that do not group),
    /// naming the HF config field at fault.
    pub fn validate(&self) -> Result<(), String> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(format!("`{field}` must be positive"));
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(format!(
                "`num_attention_heads` ({}) is not a multiple of `num_key_value_heads` ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.layer_kinds.len() != self.num_layers {
            return Err(format!("{} layer types for `num_hidden_layers` {}", self.layer_kinds.len(), self.num_layers));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!("`rms_norm_eps` must be a finite number >= 0, got {}", self.rms_norm_eps));
        }
        for rope in std::iter::once(&self.rope).chain(self.rope_local.as_ref()) {
            if !(rope.theta.is_finite() && rope.theta > 0.0) {
                return Err(format!("`rope_theta` must be positive, got {}", rope.theta));
            }
            if let Some(sections) = &rope.mrope_section {
                if sections.len() != 3 || sections.iter().sum::<usize>() != self.head_dim / 2 {
                    return Err(format!(
                        "`mrope_section` {sections:?} must have 3 entries summing to head_dim / 2 = {}",
                        self.head_dim / 2
                    ));
                }
            }
        }
        if self.arch.is_vision_language() && self.rope.mrope_section.is_none() {
            return Err("a vision-language model needs `mrope_section` in its rotary settings".into());
        }
        if self.sliding_window == Some(0) {
            return Err("`sliding_window` must be positive".into());
        }
        Ok(())
    }

    /// Parameters of the text model (embedding counted once when tied).
    pub fn parameter_count(&self) -> u64 {
        let (h, i, l, v) =
            (self.hidden_size as u64, self.intermediate_size as u64, self.num_layers as u64, self.vocab_size as u64);
        let (q, kv) = ((self.num_heads * self.head_dim) as u64, (self.num_kv_heads * self.head_dim) as u64);
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.attention_bias {
            attn += q + 2 * kv;
        }
        let mut norms = 2 * h;
        match self.arch {
            Arch::Qwen3 => norms += 2 * self.head_dim as u64,
            Arch::Gemma3 => norms += 2 * h + 2 * self.head_dim as u64,
            _ => {}
        }
        let per_layer = attn + 3 * h * i + norms;
        let embed = v * h * if self.tie_word_embeddings { 1 } else { 2 };
        l * per_layer + embed + h
    }
}

/// Gemma 3 without `layer_types`: every `pattern`-th layer is global, the others slide.
pub fn gemma_layer_pattern(num_layers: usize, pattern: usize) -> Vec<LayerKind> {
    (0..num_layers)
        .map(|i| if pattern > 0 && (i + 1) % pattern == 0 { LayerKind::Full } else { LayerKind::Sliding })
        .collect()
}

/// Rotary settings, accepting transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
/// (`rope_parameters`, possibly one entry per layer type) layouts.
fn parse_rope<'a>(
    get: &dyn Fn(&str) -> Option<&'a Value>,
    default_theta: f64,
    arch: Arch,
) -> Result<(RopeConfig, Option<RopeConfig>), String> {
    let params = get("rope_parameters").filter(|v| v.is_object());
    let per_type = params.and_then(|p| p.get("full_attention")).is_some();
    let full_src =
        if per_type { params.and_then(|p| p.get("full_attention")) } else { params.or_else(|| get("rope_scaling")) };
    let theta_top = get("rope_theta").and_then(Value::as_f64);
    let rope = parse_one_rope(full_src, theta_top.unwrap_or(default_theta))?;
    let rope_local = if arch == Arch::Gemma3 {
        let local_src = if per_type { params.and_then(|p| p.get("sliding_attention")) } else { None };
        let local_theta = get("rope_local_base_freq").and_then(Value::as_f64).unwrap_or(10_000.0);
        Some(match local_src {
            Some(src) => parse_one_rope(Some(src), local_theta)?,
            None => RopeConfig { theta: local_theta, scaling: RopeScaling::None, mrope_section: None },
        })
    } else {
        None
    };
    Ok((rope, rope_local))
}

fn parse_one_rope(src: Option<&Value>, default_theta: f64) -> Result<RopeConfig, String> {
    let Some(src) = src.filter(|v| v.is_object()) else {
        return Ok(RopeConfig { theta: default_theta, scaling: RopeScaling::None, mrope_section: None });
    };
    let theta = src.get("rope_theta").and_then(Value::as_f64).unwrap_or(default_theta);
    let kind = src.get("rope_type").or_else(|| src.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f = |k: &str, d: f64| src.get(k).and_then(Value::as_f64).unwrap_or(d);
    let mrope_section = match src.get("mrope_section") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| v.as_u64().map(|v| v as usize).ok_or("`mrope_section` must list integers"))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err("`mrope_section` must be a list of integers".into()),
    };
    let scaling = match kind {
        // Qwen2-VL's hub configs name M-RoPE as a rope type; the frequencies are the default ones.
        "default" | "mrope" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: f("factor", 1.0) },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor", 8.0),
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_position: f("original_max_position_embeddings", 8192.0),
        },
        other => return Err(format!("unsupported rope type `{other}`")),
    };
    Ok(RopeConfig { theta, scaling, mrope_section })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_text_config_and_per_type_rope() {
        let j: Value = serde_json::json!({
            "model_type": "gemma3", "eos_token_id": [1, 106],
            "text_config": {
                "model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                "sliding_window": 4, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
                },
                "query_pre_attn_scalar": 2
            }
        });
        let c = TextConfig::from_hf_json(&j).unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        assert_eq!(c.eos_token_ids, vec![1, 106]);
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.rope_for(0).theta, 10000.0);
        assert_eq!(c.rope_for(2).theta, 1_000_000.0);
        assert_eq!(c.window_for(0), Some(4));
        assert_eq!(c.window_for(2), None);
        assert!((c.attention_scale() - 2f64.powf(-0.5)).abs() < 1e-12);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let j = serde_json::json!({"model_type": "mamba"});
        let err = TextConfig::from_hf_json(&j).unwrap_err();
        assert!(err.contains("mamba"), "{err}");
    }

    #[test]
    fn gemma_pattern_marks_every_sixth_global() {
        let k = gemma_layer_pattern(12, 6);
        assert_eq!(k.iter().filter(|k| **k == LayerKind::Full).count(), 2);
        assert_eq!(k[5], LayerKind::Full);
        assert_eq!(k[11], LayerKind::Full);
    }
}
