//! Gemma 4's fields beyond the common ones (transformers 5.24's `Gemma4TextConfig`, whose
//! defaults apply where a field is absent): wider heads on the full layers, KV sharing, per-layer
//! embeddings, K-eq-V, the mixture of experts beside the dense MLP, proportional RoPE.

use std::collections::BTreeMap;

use serde_json::Value;

use super::error::ConfigError::{self, Invalid};
use super::text::{
    Gemma4Layers, KvShape, LayerKind, MoeConfig, MoeScoring, PerLayerInput, RopeConfig, RopeScaling, TextConfig,
};

type Get<'a, 'b> = &'b dyn Fn(&str) -> Option<&'a Value>;

fn int(get: Get, key: &str, default: usize) -> Result<usize, ConfigError> {
    match get(key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| ConfigError::Field { field: key.into(), expected: "a non-negative integer" }),
    }
}

fn flag(get: Get, key: &str) -> Result<bool, ConfigError> {
    match get(key) {
        None => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| ConfigError::Field { field: key.into(), expected: "a boolean" }),
    }
}

/// Completes `cfg` (parsed with the common fields) with Gemma 4's. The unified family
/// (`gemma4_unified_text`, transformers' `Gemma4UnifiedTextConfig`) has no per-layer inputs and
/// its images see each other both ways unless the config says otherwise.
/// `present`: whether the config has a field at all (a null one included).
pub(super) fn complete(cfg: &mut TextConfig, get: Get, present: &dyn Fn(&str) -> bool) -> Result<(), ConfigError> {
    let unified = get("model_type").and_then(Value::as_str).is_some_and(|t| t.starts_with("gemma4_unified"));
    let vision_bidirectional = match get("use_bidirectional_attention").and_then(Value::as_str) {
        // Absent: the family's default; null: causal (transformers' None).
        None => unified && !present("use_bidirectional_attention"),
        Some("vision") => true,
        Some(other) => {
            return Err(ConfigError::Unsupported {
                what: "use_bidirectional_attention",
                value: other.into(),
                supported: "\"vision\" or none (causal text)",
            })
        }
    };
    // transformers forces the last layer to attend to everything.
    if let Some(last) = cfg.layer_kinds.last_mut() {
        *last = LayerKind::Full;
    }
    // Attention scale 1: the q and k norms set the scale.
    cfg.query_pre_attn_scalar = Some(1.0);
    if get("rope_parameters").is_none() {
        cfg.rope = RopeConfig {
            theta: 1_000_000.0,
            scaling: RopeScaling::Proportional { fraction: 0.25, factor: 1.0 },
            mrope_section: None,
            mrope_interleaved: false,
        };
    }
    let k_eq_v = flag(get, "attention_k_eq_v")?;
    cfg.layer_kv = layer_shapes(cfg, get, k_eq_v)?;
    cfg.kv_source = kv_sources(cfg, int(get, "num_kv_shared_layers", 0)?)?;
    let ple = if unified { 0 } else { int(get, "hidden_size_per_layer_input", 256)? };
    cfg.gemma4 = Some(Gemma4Layers {
        per_layer_input: (ple > 0)
            .then(|| {
                Ok::<_, ConfigError>(PerLayerInput {
                    dim: ple,
                    vocab: int(get, "vocab_size_per_layer_input", 262_144)?,
                    pad_token_id: int(get, "pad_token_id", 0)? as u32,
                })
            })
            .transpose()?,
        double_wide_mlp: flag(get, "use_double_wide_mlp")?,
        k_eq_v,
        vision_bidirectional,
    });
    if flag(get, "enable_moe_block")? {
        let need = |key: &str| {
            get(key).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| ConfigError::Field {
                field: key.into(),
                expected: "a positive integer (with enable_moe_block)",
            })
        };
        cfg.moe = Some(MoeConfig {
            scoring: MoeScoring::GemmaScaled,
            num_experts: need("num_experts")?,
            top_k: need("top_k_experts")?,
            n_group: 1,
            topk_group: 1,
            intermediate_size: need("moe_intermediate_size")?,
            n_shared_experts: 0,
            shared_intermediate_size: 0,
            shared_expert_gate: false,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            first_k_dense_replace: 0,
        });
    }
    Ok(())
}

/// Each layer's K/V geometry: the sliding layers' `num_key_value_heads` x `head_dim`; the
/// full layers' `global_head_dim` (and with K-eq-V `num_global_key_value_heads`), or what
/// `per_layer_config` (as transformers saves it, keyed by layer) says.
fn layer_shapes(cfg: &TextConfig, get: Get, k_eq_v: bool) -> Result<Vec<KvShape>, ConfigError> {
    let base = KvShape { num_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim };
    let mut shapes = vec![base; cfg.num_layers];
    if let Some(per_layer) = get("per_layer_config").filter(|v| !v.is_null()) {
        let map: BTreeMap<String, Value> = serde_json::from_value(per_layer.clone()).map_err(|_| {
            ConfigError::Field { field: "per_layer_config".into(), expected: "an object keyed by layer" }
        })?;
        for (key, over) in map {
            let layer: usize = key.parse().ok().filter(|&l| l < cfg.num_layers).ok_or_else(|| {
                Invalid(format!("`per_layer_config` names layer {key} of a model with {} layers", cfg.num_layers))
            })?;
            let field = |k: &str, d: usize| over.get(k).and_then(Value::as_u64).map_or(d, |v| v as usize);
            shapes[layer] = KvShape {
                num_kv_heads: field("num_key_value_heads", base.num_kv_heads),
                head_dim: field("head_dim", base.head_dim),
            };
        }
    } else {
        let global = KvShape {
            num_kv_heads: if k_eq_v {
                int(get, "num_global_key_value_heads", base.num_kv_heads)?
            } else {
                base.num_kv_heads
            },
            head_dim: int(get, "global_head_dim", 512)?,
        };
        for (l, kind) in cfg.layer_kinds.iter().enumerate() {
            if *kind == LayerKind::Full {
                shapes[l] = global;
            }
        }
    }
    for (l, s) in shapes.iter().enumerate() {
        if s.num_kv_heads == 0
            || s.head_dim == 0
            || !cfg.num_heads.is_multiple_of(s.num_kv_heads)
            || s.head_dim % 2 != 0
        {
            return Err(Invalid(format!(
                "layer {l}: {} key/value heads of {} do not fit {} attention heads",
                s.num_kv_heads, s.head_dim, cfg.num_heads
            )));
        }
    }
    Ok(shapes)
}

/// The last `shared` layers keep no K/V: each attends over the last layer before them of its
/// own kind (transformers' `kv_sharing_modes`; not layer i - shared).
fn kv_sources(cfg: &TextConfig, shared: usize) -> Result<Vec<Option<usize>>, ConfigError> {
    if shared == 0 {
        return Ok(vec![]);
    }
    if shared >= cfg.num_layers {
        return Err(Invalid(format!(
            "`num_kv_shared_layers` {shared} leaves none of the {} layers to keep keys and values (a Gemma 4 \
             assistant drafts for a target model: pass it as the speculative model)",
            cfg.num_layers
        )));
    }
    let first = cfg.num_layers - shared;
    (0..cfg.num_layers)
        .map(|l| {
            if l < first {
                return Ok(None);
            }
            let kind = cfg.layer_kinds[l];
            (0..first).rev().find(|&s| cfg.layer_kinds[s] == kind).map(Some).ok_or_else(|| {
                Invalid(format!("KV-sharing layer {l} has no earlier layer of its kind to read keys and values from"))
            })
        })
        .collect()
}
