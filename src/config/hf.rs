//! `TextConfig` from a Hugging Face `config.json`: a text model's (fields at the top) or a
//! vision-language model's (text fields nested under `text_config`), in the layouts of
//! transformers 4.x and 5.x.

use std::path::Path;

use serde_json::Value;

use super::error::ConfigError::{self, Invalid};
use super::text::{
    gemma_layer_pattern, Activation, Arch, LayerKind, LinearAttnConfig, MoeConfig, MoeScoring, RopeConfig, RopeLayout,
    RopeScaling, TextConfig,
};

impl TextConfig {
    /// Reads `config.json` in a model directory.
    pub fn from_hf_file(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let json: Value =
            serde_json::from_str(&text).map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })?;
        Self::from_hf_json(&json).map_err(|e| e.in_file(path))
    }

    /// Parses HF's config layout. Text models keep their fields at the top; VLMs nest them
    /// under `text_config` (fields there win, the top level fills gaps such as token ids).
    pub fn from_hf_json(root: &Value) -> Result<Self, ConfigError> {
        let text = root.get("text_config").filter(|v| v.is_object());
        let get = |key: &str| -> Option<&Value> {
            text.and_then(|t| t.get(key)).filter(|v| !v.is_null()).or_else(|| root.get(key).filter(|v| !v.is_null()))
        };
        let usize_of = |key: &str| -> Result<usize, ConfigError> {
            get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| ConfigError::Field { field: key.into(), expected: "a non-negative integer" })
        };
        // A VLM's top-level model_type names the whole model (text_config's may be e.g.
        // `qwen2_vl_text`); either maps to the same family.
        // `glm46v` (GLM-4.6V's processor generation) wraps either GLM language model: its
        // text_config says which.
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .filter(|&t| t != "glm46v")
            .filter(|t| Arch::from_model_type(t).is_some_and(Arch::is_vision_language))
            .or_else(|| get("model_type").and_then(Value::as_str))
            .ok_or(ConfigError::Field { field: "model_type".into(), expected: "a string" })?;
        let arch = Arch::from_model_type(model_type).ok_or_else(|| ConfigError::Unsupported {
            what: "architecture",
            value: model_type.into(),
            supported: "llama, qwen2, qwen3, gemma3_text, gemma4, gemma4_text, gemma4_unified, gemma4_unified_text, qwen2_vl, qwen2_5_vl, glm4v, glm4v_moe, qwen3_5, qwen3_5_moe",
        })?;
        let qwen35 = matches!(arch, Arch::Qwen35 | Arch::Qwen35Moe);
        let gemma = matches!(arch, Arch::Gemma3 | Arch::Gemma4);

        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        if num_heads == 0 {
            return Err(Invalid("`num_attention_heads` must be positive".into()));
        }
        let num_kv_heads = get("num_key_value_heads").and_then(Value::as_u64).map(|v| v as usize).unwrap_or(num_heads);
        // GLM-4.1V's attention always splits the hidden size into the heads.
        let head_dim = match get("head_dim").and_then(Value::as_u64) {
            Some(d) if arch != Arch::Glm4v => d as usize,
            _ => hidden_size / num_heads,
        };
        // transformers 5 keeps the factor in `rope_parameters`, the hub files next to it; GLM-4.5V's
        // config class defaults it to 0.5, Qwen3.5's to 0.25.
        let partial = get("rope_parameters")
            .and_then(|r| r.get("partial_rotary_factor"))
            .or_else(|| get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .unwrap_or(match arch {
                Arch::Glm4vMoe => 0.5,
                Arch::Qwen35 | Arch::Qwen35Moe => 0.25,
                _ => 1.0,
            });
        // Gemma 4's sliding layers turn whole heads; its full layers' fraction is a property of
        // their proportional RoPE, not of the head.
        let partial = if arch == Arch::Gemma4 { 1.0 } else { partial };
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(Invalid(format!("`partial_rotary_factor` must be in (0, 1], got {partial}")));
        }
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let num_layers = usize_of("num_hidden_layers")?;

        let act = get("hidden_activation").or_else(|| get("hidden_act")).and_then(Value::as_str).unwrap_or("silu");
        let activation = match act {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu" => Activation::GeluTanh,
            other => {
                return Err(ConfigError::Unsupported {
                    what: "activation",
                    value: other.into(),
                    supported: "silu, swish, gelu_pytorch_tanh, gelu_new, gelu",
                })
            }
        };

        let default_theta = if arch == Arch::Gemma3 { 1_000_000.0 } else { 10_000.0 };
        let (rope, rope_local) = parse_rope(&get, default_theta, arch)?;

        let sliding_window = get("sliding_window").and_then(Value::as_u64).map(|v| v as usize);
        let layer_kinds = match get("layer_types").and_then(Value::as_array) {
            Some(types) => {
                if types.len() != num_layers {
                    return Err(Invalid(format!("layer_types has {} entries for {num_layers} layers", types.len())));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(LayerKind::Full),
                        Some("sliding_attention") => Ok(LayerKind::Sliding),
                        Some("linear_attention") if qwen35 => Ok(LayerKind::Linear),
                        other => Err(ConfigError::Unsupported {
                            what: "layer type",
                            value: other.map_or_else(|| t.to_string(), String::from),
                            supported: "full_attention, sliding_attention (and linear_attention in qwen3_5)",
                        }),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None if gemma => {
                let pattern = get("sliding_window_pattern").and_then(Value::as_u64).unwrap_or(6) as usize;
                gemma_layer_pattern(num_layers, pattern)
            }
            // Qwen3.5 without `layer_types`: every `full_attention_interval`-th layer attends,
            // the others are Gated DeltaNet (transformers' rule).
            None if qwen35 => {
                let interval = get("full_attention_interval").and_then(Value::as_u64).unwrap_or(4) as usize;
                if interval == 0 {
                    return Err(Invalid("`full_attention_interval` must be positive".into()));
                }
                (0..num_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerKind::Full } else { LayerKind::Linear })
                    .collect()
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

        let moe = match arch {
            Arch::Glm4vMoe => Some(parse_moe(&get)?),
            Arch::Qwen35Moe => Some(parse_qwen_moe(&get)?),
            _ => None,
        };
        let linear_attn = if qwen35 { Some(parse_linear_attn(&get)?) } else { None };
        // Qwen3.5-MoE has no dense MLP width; its routed experts' width stands in (unused).
        let intermediate_size = match (&moe, get("intermediate_size")) {
            (Some(m), None) => m.intermediate_size,
            _ => usize_of("intermediate_size")?,
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
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rms_norm_eps: get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            max_position_embeddings: get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(4096) as usize,
            // A vision-language model ties (or not) as its top-level config says: transformers
            // builds the whole model from it, whatever text_config repeats.
            tie_word_embeddings: text
                .and(root.get("tie_word_embeddings"))
                .or_else(|| get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(gemma),
            // GLM-4.1V's q/k/v always have biases (its config has no switch).
            attention_bias: arch == Arch::Glm4v
                || get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(matches!(arch, Arch::Qwen2 | Arch::Qwen2Vl | Arch::Qwen25Vl | Arch::Glm4vMoe)),
            activation,
            rope,
            rope_local,
            // GLM-4.1V rotates adjacent pairs (`rotate_half_llm`); GLM-4.5V the two halves.
            rope_layout: if arch == Arch::Glm4v { RopeLayout::Interleaved } else { RopeLayout::Half },
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
            moe,
            linear_attn,
            layer_kv: vec![],
            kv_source: vec![],
            gemma4: None,
            mtp_layers: get("mtp_num_hidden_layers")
                .or_else(|| get("num_nextn_predict_layers"))
                .and_then(Value::as_u64)
                .unwrap_or(0) as usize,
        };
        let mut cfg = cfg;
        if arch == Arch::Gemma4 {
            // Whether a field is there at all, null included (`get` passes over nulls).
            let present = |key: &str| text.and_then(|t| t.get(key)).or_else(|| root.get(key)).is_some();
            super::gemma4::complete(&mut cfg, &get, &present)?;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// GLM-4.5V's MoE fields (transformers' `Glm4vMoeTextConfig` defaults where absent).
fn parse_moe<'a>(get: &dyn Fn(&str) -> Option<&'a Value>) -> Result<MoeConfig, ConfigError> {
    let int = |key: &str, default: usize| -> Result<usize, ConfigError> {
        match get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| ConfigError::Field { field: key.into(), expected: "a non-negative integer" }),
        }
    };
    let (inter, shared) = (int("moe_intermediate_size", 1408)?, int("n_shared_experts", 1)?);
    Ok(MoeConfig {
        scoring: MoeScoring::SigmoidGrouped,
        shared_intermediate_size: inter * shared,
        shared_expert_gate: false,
        num_experts: int("n_routed_experts", 128)?,
        top_k: int("num_experts_per_tok", 8)?,
        n_group: int("n_group", 1)?,
        topk_group: int("topk_group", 1)?,
        intermediate_size: inter,
        n_shared_experts: shared,
        norm_topk_prob: get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(true),
        routed_scaling_factor: get("routed_scaling_factor").and_then(Value::as_f64).unwrap_or(1.0),
        first_k_dense_replace: int("first_k_dense_replace", 1)?,
    })
}

/// A non-negative integer field, `default` when absent.
fn int_or<'a>(get: &dyn Fn(&str) -> Option<&'a Value>, key: &str, default: usize) -> Result<usize, ConfigError> {
    match get(key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| ConfigError::Field { field: key.into(), expected: "a non-negative integer" }),
    }
}

/// Qwen3.5-MoE's experts (`Qwen3_5MoeTextConfig` defaults where absent): softmax over all
/// experts, the top k always renormalised (the config has no switch for it), one shared expert
/// behind a sigmoid gate, in every layer.
fn parse_qwen_moe<'a>(get: &dyn Fn(&str) -> Option<&'a Value>) -> Result<MoeConfig, ConfigError> {
    Ok(MoeConfig {
        scoring: MoeScoring::Softmax,
        num_experts: int_or(get, "num_experts", 256)?,
        top_k: int_or(get, "num_experts_per_tok", 8)?,
        n_group: 1,
        topk_group: 1,
        intermediate_size: int_or(get, "moe_intermediate_size", 512)?,
        n_shared_experts: 1,
        shared_intermediate_size: int_or(get, "shared_expert_intermediate_size", 512)?,
        shared_expert_gate: true,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
        first_k_dense_replace: 0,
    })
}

/// Qwen3.5's Gated DeltaNet sizes (`Qwen3_5TextConfig` defaults where absent).
fn parse_linear_attn<'a>(get: &dyn Fn(&str) -> Option<&'a Value>) -> Result<LinearAttnConfig, ConfigError> {
    Ok(LinearAttnConfig {
        num_key_heads: int_or(get, "linear_num_key_heads", 16)?,
        num_value_heads: int_or(get, "linear_num_value_heads", 32)?,
        key_head_dim: int_or(get, "linear_key_head_dim", 128)?,
        value_head_dim: int_or(get, "linear_value_head_dim", 128)?,
        conv_kernel: int_or(get, "linear_conv_kernel_dim", 4)?,
    })
}

/// Rotary settings, accepting transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
/// (`rope_parameters`, possibly one entry per layer type) layouts.
fn parse_rope<'a>(
    get: &dyn Fn(&str) -> Option<&'a Value>,
    default_theta: f64,
    arch: Arch,
) -> Result<(RopeConfig, Option<RopeConfig>), ConfigError> {
    let params = get("rope_parameters").filter(|v| v.is_object());
    let per_type = params.and_then(|p| p.get("full_attention")).is_some();
    let full_src =
        if per_type { params.and_then(|p| p.get("full_attention")) } else { params.or_else(|| get("rope_scaling")) };
    let theta_top = get("rope_theta").and_then(Value::as_f64);
    let mut rope = parse_one_rope(full_src, theta_top.unwrap_or(default_theta))?;
    // transformers' Qwen3.5 rotary always interleaves the sections and its Qwen2-VL and GLM-4.xV
    // ones never do, whatever `mrope_interleaved` says; a config that says otherwise is one
    // transformers would run differently from what it describes, so it is refused.
    let interleaves = matches!(arch, Arch::Qwen35 | Arch::Qwen35Moe);
    match full_src.and_then(|s| s.get("mrope_interleaved")) {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) if *b == interleaves => {}
        Some(Value::Bool(b)) => {
            return Err(ConfigError::Unsupported {
                what: "mrope_interleaved",
                value: format!("{b} for {}", arch.name()),
                supported: "true for qwen3_5 and qwen3_5_moe, false or absent otherwise",
            })
        }
        Some(_) => return Err(ConfigError::Field { field: "mrope_interleaved".into(), expected: "a boolean" }),
    }
    rope.mrope_interleaved = interleaves && rope.mrope_section.is_some();
    let rope_local = if matches!(arch, Arch::Gemma3 | Arch::Gemma4) {
        let local_src = if per_type { params.and_then(|p| p.get("sliding_attention")) } else { None };
        let local_theta = get("rope_local_base_freq").and_then(Value::as_f64).unwrap_or(10_000.0);
        Some(match local_src {
            Some(src) => parse_one_rope(Some(src), local_theta)?,
            None => RopeConfig {
                theta: local_theta,
                scaling: RopeScaling::None,
                mrope_section: None,
                mrope_interleaved: false,
            },
        })
    } else {
        None
    };
    Ok((rope, rope_local))
}

fn parse_one_rope(src: Option<&Value>, default_theta: f64) -> Result<RopeConfig, ConfigError> {
    let Some(src) = src.filter(|v| v.is_object()) else {
        return Ok(RopeConfig {
            theta: default_theta,
            scaling: RopeScaling::None,
            mrope_section: None,
            mrope_interleaved: false,
        });
    };
    let theta = src.get("rope_theta").and_then(Value::as_f64).unwrap_or(default_theta);
    let kind = src.get("rope_type").or_else(|| src.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f = |k: &str, d: f64| src.get(k).and_then(Value::as_f64).unwrap_or(d);
    let bad_sections = || ConfigError::Field { field: "mrope_section".into(), expected: "a list of integers" };
    let mrope_section = match src.get("mrope_section") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter().map(|v| v.as_u64().map(|v| v as usize).ok_or_else(bad_sections)).collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(bad_sections()),
    };
    let scaling = match kind {
        // Qwen2-VL's hub configs name M-RoPE as a rope type; the frequencies are the default ones.
        "default" | "mrope" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: f("factor", 1.0) },
        // Gemma 4's full layers: the leading fraction of the angles turn, the rest stay still.
        "proportional" => {
            let fraction = f("partial_rotary_factor", 1.0);
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(Invalid(format!("`partial_rotary_factor` must be in (0, 1], got {fraction}")));
            }
            RopeScaling::Proportional { fraction, factor: f("factor", 1.0) }
        }
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor", 8.0),
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_position: f("original_max_position_embeddings", 8192.0),
        },
        other => {
            return Err(ConfigError::Unsupported {
                what: "rope type",
                value: other.into(),
                supported: "default, mrope, linear, llama3, proportional",
            })
        }
    };
    Ok(RopeConfig { theta, scaling, mrope_section, mrope_interleaved: false })
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

    /// The unified Gemma 4 family (a VLM wrapper around `gemma4_unified_text`): Gemma 4's text
    /// without per-layer inputs, images bidirectional by default, causal when the field is null.
    #[test]
    fn gemma4_unified_has_no_per_layer_inputs_and_bidirectional_images() {
        let mut j = serde_json::json!({
            "model_type": "gemma4_unified",
            "text_config": {
                "model_type": "gemma4_unified_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                "global_head_dim": 8, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]
            }
        });
        let c = TextConfig::from_hf_json(&j).unwrap();
        assert_eq!(c.arch, Arch::Gemma4);
        let g = c.gemma4.as_ref().expect("Gemma 4 fields");
        assert!(g.per_layer_input.is_none() && g.vision_bidirectional);
        j["text_config"]["use_bidirectional_attention"] = Value::Null;
        assert!(!TextConfig::from_hf_json(&j).unwrap().gemma4.expect("Gemma 4 fields").vision_bidirectional);
    }

    #[test]
    fn glm4v_moe_hub_config_and_parameter_counts() {
        // GLM-4.5V's hub layout: rotary settings next to the other text fields.
        let j = serde_json::json!({
            "model_type": "glm4v_moe",
            "text_config": {
                "model_type": "glm4v_moe_text", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 40,
                "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 12,
                "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                "rope_scaling": {"type": "default", "mrope_section": [1, 1, 1]},
                "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                "moe_intermediate_size": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "routed_scaling_factor": 2.5, "norm_topk_prob": true, "attention_bias": true
            }
        });
        let c = TextConfig::from_hf_json(&j).unwrap();
        assert_eq!((c.arch, c.head_dim, c.rotary_dim, c.rope_layout), (Arch::Glm4vMoe, 12, 6, RopeLayout::Half));
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.top_k, m.n_group, m.topk_group, m.routed_scaling_factor), (8, 2, 2, 1, 2.5));
        assert!(!m.is_moe_layer(0) && m.is_moe_layer(1));
        // attention 16*24 + 2*16*12 + 24*16 + biases 24+24, norms 32; dense MLP 3*16*40;
        // MoE: router 8*16 + bias 8, shared 3*16*4, experts 3*16*4 each
        let (attn, norms) = (16 * 24 * 2 + 2 * 16 * 12 + 48, 32);
        let (dense, always, expert) = (3 * 16 * 40, 8 * 16 + 8 + 3 * 16 * 4, 3 * 16 * 4);
        let embed = 2 * 100 * 16 + 16;
        assert_eq!(c.parameter_count(), (3 * (attn + norms) + dense + 2 * (always + 8 * expert) + embed) as u64);
        assert_eq!(c.active_parameter_count(), (3 * (attn + norms) + dense + 2 * (always + 2 * expert) + embed) as u64);

        // transformers 5's layout: the factor inside rope_parameters; GLM-4.1V ignores head_dim
        // and rotates adjacent pairs.
        let j = serde_json::json!({
            "model_type": "glm4v",
            "text_config": {
                "vocab_size": 100, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 99,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                    "partial_rotary_factor": 0.5}
            }
        });
        let c = TextConfig::from_hf_json(&j).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim, c.rope_layout, c.attention_bias), (16, 8, RopeLayout::Interleaved, true));
        assert!(c.moe.is_none());
        // `glm46v` names the wrapper; its text_config names the language model.
        let mut j46 = j.clone();
        j46["model_type"] = "glm46v".into();
        assert_eq!(TextConfig::from_hf_json(&j46).unwrap().arch, Arch::Glm4v);
        j46["text_config"]["model_type"] = "glm4v_moe_text".into();
        j46["text_config"]["num_hidden_layers"] = 2.into();
        j46["text_config"]["head_dim"] = 16.into();
        assert_eq!(TextConfig::from_hf_json(&j46).unwrap().arch, Arch::Glm4vMoe);
        // sections must cover the rotated frequencies only
        let mut bad = j.clone();
        bad["text_config"]["rope_parameters"]["mrope_section"] = serde_json::json!([2, 3, 3]);
        assert!(TextConfig::from_hf_json(&bad).unwrap_err().to_string().contains("mrope_section"));
        // GLM-4.xV's sections lie end to end; transformers would not interleave them.
        assert!(!c.rope.mrope_interleaved);
        let mut bad = j.clone();
        bad["text_config"]["rope_parameters"]["mrope_interleaved"] = true.into();
        assert!(TextConfig::from_hf_json(&bad).unwrap_err().to_string().contains("mrope_interleaved"));
    }

    #[test]
    fn bad_moe_settings_are_named() {
        let base = serde_json::json!({
            "model_type": "glm4v_moe", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "partial_rotary_factor": 1.0,
            "rope_scaling": {"type": "default", "mrope_section": [1, 1, 0]},
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2
        });
        assert!(TextConfig::from_hf_json(&base).is_ok());
        for (key, value, needle) in [
            ("n_group", 3, "n_group"),
            ("topk_group", 5, "topk_group"),
            ("num_experts_per_tok", 5, "num_experts_per_tok"),
            ("n_routed_experts", 0, "n_routed_experts"),
            ("first_k_dense_replace", 3, "first_k_dense_replace"),
        ] {
            let mut j = base.clone();
            j[key] = serde_json::json!(value);
            let err = TextConfig::from_hf_json(&j).unwrap_err().to_string();
            assert!(err.contains(needle), "{key}: {err}");
        }
    }

    /// Qwen3.5's text config: layer kinds from `full_attention_interval` when `layer_types` is
    /// absent, the DeltaNet sizes, partial rotary from `rope_parameters` (0.25 by default), and
    /// the MoE variant's softmax routing with a gated shared expert, top level or nested.
    #[test]
    fn qwen35_text_and_moe_configs() {
        let text = serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 4,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 4
        });
        let c = TextConfig::from_hf_json(&text).unwrap();
        assert_eq!(c.arch, Arch::Qwen35);
        assert_eq!(c.attention_layers(), vec![3, 7]);
        assert_eq!(c.linear_layers(), vec![0, 1, 2, 4, 5, 6]);
        assert_eq!(c.rotary_dim, 4);
        assert!(c.moe.is_none());
        let l = c.linear_attn.as_ref().unwrap();
        assert_eq!((l.key_dim(), l.value_dim(), l.conv_dim()), (8, 48, 64));
        assert_eq!(l.state_bytes(), 4 * (3 * 64 + 6 * 4 * 8));
        assert_eq!(c.window_for(0), None);

        let mut bad = text.clone();
        bad["linear_num_value_heads"] = 5.into();
        let err = TextConfig::from_hf_json(&bad).unwrap_err().to_string();
        assert!(err.contains("linear_num_value_heads"), "{err}");
        let mut bad = text.clone();
        bad["layer_types"] = serde_json::json!(vec!["linear_attention"; 8]);
        bad["model_type"] = "qwen3".into();
        let err = TextConfig::from_hf_json(&bad).unwrap_err().to_string();
        assert!(err.contains("linear_attention"), "only qwen3_5 has linear layers: {err}");

        let mut inner = text.clone();
        inner["model_type"] = "qwen3_5_moe_text".into();
        inner["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]);
        inner["num_hidden_layers"] = 2.into();
        inner["rope_parameters"] = serde_json::json!({"rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                                      "mrope_section": [2, 1, 1], "mrope_interleaved": true});
        inner["num_experts"] = 8.into();
        inner["num_experts_per_tok"] = 2.into();
        inner["moe_intermediate_size"] = 4.into();
        inner["shared_expert_intermediate_size"] = 6.into();
        inner.as_object_mut().unwrap().remove("intermediate_size");
        let moe = serde_json::json!({"model_type": "qwen3_5_moe", "text_config": inner, "vision_config": {}});
        let c = TextConfig::from_hf_json(&moe).unwrap();
        assert_eq!((c.arch, c.rotary_dim, c.rope.theta), (Arch::Qwen35Moe, 8, 1e7));
        assert!(c.rope.mrope_interleaved, "Qwen3.5 interleaves its M-RoPE sections");
        let mut flat = moe.clone();
        flat["text_config"]["rope_parameters"]["mrope_interleaved"] = false.into();
        let err = TextConfig::from_hf_json(&flat).unwrap_err().to_string();
        assert!(err.contains("mrope_interleaved"), "transformers interleaves regardless: {err}");
        assert_eq!(c.layer_kinds, vec![LayerKind::Linear, LayerKind::Full]);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.scoring, m.top_k, m.shared_intermediate_size, m.shared_expert_gate),
            (MoeScoring::Softmax, 2, 6, true)
        );
        assert!(m.is_moe_layer(0) && m.norm_topk_prob);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let j = serde_json::json!({"model_type": "mamba"});
        let err = TextConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(err.contains("mamba"), "{err}");
    }
}
