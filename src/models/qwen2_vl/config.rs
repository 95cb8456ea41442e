//! The vision half of a Qwen2-VL / Qwen2.5-VL / Qwen3.5 `config.json` (`vision_config` and
//! the top-level image token ids).

use std::path::Path;

use serde_json::Value;

use crate::config::{Activation, Arch};
use crate::weights::WeightsError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionKind {
    /// LayerNorm, plain MLP, full attention in every block.
    Qwen2Vl,
    /// RMSNorm, gated MLP, windowed attention except in `fullatt_block_indexes`.
    Qwen25Vl,
    /// Qwen3.5 (both `qwen3_5` and `qwen3_5_moe`): LayerNorm, plain MLP, full attention, and a
    /// learned position table resampled to each image's grid (`qwen35_vision`).
    Qwen35,
}

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub kind: VisionKind,
    pub depth: usize,
    /// Width of the vision blocks.
    pub hidden_size: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub activation: Activation,
    /// Width of the merger's output: the language model's hidden size.
    pub out_hidden_size: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// Side of an attention window in pixels (Qwen2.5-VL).
    pub window_size: usize,
    pub fullatt_block_indexes: Vec<usize>,
    /// Entries of the learned position table, a square grid (Qwen3.5; 0 for the others).
    pub num_position_embeddings: usize,
    pub rope_theta: f64,
    pub image_token_id: u32,
    pub video_token_id: Option<u32>,
    pub vision_start_token_id: Option<u32>,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Side of the learned position table's square grid.
    pub fn position_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// Values per patch: channels x temporal patch x patch x patch.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    pub fn from_hf_file(path: &Path, arch: Arch) -> Result<Self, WeightsError> {
        let text = std::fs::read_to_string(path).map_err(|e| WeightsError::io(path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::Config { path: path.to_path_buf(), msg: format!("not valid JSON: {e}") })?;
        Self::from_hf_json(&json, arch).map_err(|msg| WeightsError::Config { path: path.to_path_buf(), msg })
    }

    pub fn from_hf_json(root: &Value, arch: Arch) -> Result<Self, String> {
        let kind = match arch {
            Arch::Qwen2Vl => VisionKind::Qwen2Vl,
            Arch::Qwen25Vl => VisionKind::Qwen25Vl,
            Arch::Qwen35 | Arch::Qwen35Moe => VisionKind::Qwen35,
            other => return Err(format!("`{}` has no vision tower", other.name())),
        };
        let v = root.get("vision_config").filter(|v| v.is_object()).ok_or("missing object `vision_config`")?;
        let int = |key: &str| v.get(key).and_then(Value::as_u64).map(|n| n as usize);
        let need = |key: &str| {
            int(key).filter(|&n| n > 0).ok_or_else(|| format!("`vision_config.{key}` must be a positive integer"))
        };
        let text_hidden = root
            .get("text_config")
            .and_then(|t| t.get("hidden_size"))
            .or_else(|| root.get("hidden_size"))
            .and_then(Value::as_u64)
            .map(|n| n as usize);
        let (hidden_size, out_hidden_size, intermediate_size, default_act) = match kind {
            // Qwen2-VL names the block width `embed_dim` and the merger output `hidden_size`.
            VisionKind::Qwen2Vl => {
                let embed = need("embed_dim")?;
                let ratio = v.get("mlp_ratio").and_then(Value::as_f64).unwrap_or(4.0);
                (embed, need("hidden_size")?, (embed as f64 * ratio) as usize, "quick_gelu")
            }
            VisionKind::Qwen25Vl | VisionKind::Qwen35 => (
                need("hidden_size")?,
                int("out_hidden_size").or(text_hidden).ok_or("missing `vision_config.out_hidden_size`")?,
                need("intermediate_size")?,
                if kind == VisionKind::Qwen35 { "gelu_pytorch_tanh" } else { "silu" },
            ),
        };
        let act_name = v.get("hidden_act").and_then(Value::as_str).unwrap_or(default_act);
        let activation =
            Activation::from_hf(act_name).ok_or_else(|| format!("unsupported vision activation `{act_name}`"))?;
        let num_heads = need("num_heads")?;
        if hidden_size % num_heads != 0 || (hidden_size / num_heads) % 4 != 0 {
            return Err(format!("vision width {hidden_size} does not split into {num_heads} heads of a multiple of 4"));
        }
        let fullatt_block_indexes = match v.get("fullatt_block_indexes") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|n| n as usize).ok_or("`fullatt_block_indexes` must list integers"))
                .collect::<Result<Vec<_>, _>>()?,
            _ => vec![],
        };
        let top_id = |key: &str| root.get(key).and_then(Value::as_u64).map(|n| n as u32);
        let cfg = VisionConfig {
            kind,
            depth: need("depth")?,
            hidden_size,
            num_heads,
            intermediate_size,
            activation,
            out_hidden_size,
            in_channels: int("in_channels").or_else(|| int("in_chans")).unwrap_or(3),
            patch_size: int("patch_size")
                .or_else(|| int("spatial_patch_size"))
                .unwrap_or(if kind == VisionKind::Qwen35 { 16 } else { 14 }),
            temporal_patch_size: int("temporal_patch_size").unwrap_or(2),
            spatial_merge_size: int("spatial_merge_size").unwrap_or(2),
            window_size: int("window_size").unwrap_or(112),
            fullatt_block_indexes,
            num_position_embeddings: match kind {
                VisionKind::Qwen35 => int("num_position_embeddings").unwrap_or(2304),
                _ => 0,
            },
            rope_theta: v
                .get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
            image_token_id: top_id("image_token_id").ok_or("missing `image_token_id`")?,
            video_token_id: top_id("video_token_id"),
            vision_start_token_id: top_id("vision_start_token_id"),
        };
        if cfg.patch_size == 0 || cfg.spatial_merge_size == 0 || cfg.temporal_patch_size == 0 {
            return Err("vision patch sizes must be positive".into());
        }
        if kind == VisionKind::Qwen25Vl && cfg.window_size < cfg.patch_size * cfg.spatial_merge_size {
            return Err(format!("`window_size` {} is smaller than one merged patch", cfg.window_size));
        }
        if kind == VisionKind::Qwen35 {
            let side = cfg.position_side();
            if side == 0 || side * side != cfg.num_position_embeddings {
                return Err(format!(
                    "`vision_config.num_position_embeddings` {} is not the square of a positive integer",
                    cfg.num_position_embeddings
                ));
            }
        }
        Ok(cfg)
    }
}
