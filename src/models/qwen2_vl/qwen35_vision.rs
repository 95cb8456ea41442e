//! The Qwen3.5 vision tower (`qwen3_5`, `qwen3_5_moe`; a ViT over 16x16 patches):
//!   x = PatchEmbed(pixels) + P(grid)          the 3-D convolution (with bias) as one matmul;
//!                                             P: the learned position table, resampled
//!                                             bilinearly (corners aligned) to the patch grid
//!   x = x + Attn(LN(x), rot2d);  x = x + MLP(LN(x))     per block, whole-image attention
//!   y = fc2(GELU(fc1(LN(x) regrouped m x m)))  the merger: one token per m x m patches
//! The blocks' MLP is plain (fc1, activation, fc2); the merger's GELU is the exact (erf) one.
//! Rotary embeddings are 2-D as in Qwen2-VL. No deepstack features: transformers' Qwen3.5
//! has no deepstack mergers.

use candle_core::{DType, Device, Result, Tensor};

use super::config::VisionConfig;
use crate::config::Activation;
use crate::layers::grid_sample::bilinear_corners;
use crate::layers::linear::Linear;
use crate::layers::norm::LayerNorm;
use crate::layers::rotary::RotaryAngles;
use crate::layers::vision::{check_patches, patch_position, segment_attention, PatchRotary};
use crate::media::PixelValues;
use crate::ops::activation;
use crate::weights::{Weights, WeightsError};

/// Every LayerNorm of the tower (transformers builds them with eps 1e-6).
const NORM_EPS: f64 = 1e-6;

struct Block {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

pub struct Qwen35Tower {
    cfg: VisionConfig,
    patch_embed: Linear,
    /// The learned position table `[side, side, hidden]` in f32 (transformers weighs its taps
    /// in f32 and casts the sum to the model's dtype).
    positions: Vec<f32>,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    rotary: PatchRotary,
    device: Device,
    dtype: DType,
}

impl Qwen35Tower {
    pub fn load(w: &Weights, cfg: VisionConfig) -> std::result::Result<Self, WeightsError> {
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let conv = w.conv(
            "visual.patch_embed.proj.weight",
            &[h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size],
        )?;
        let patch_embed = Linear::from_dense_with_bias(
            conv.reshape((h, cfg.patch_dim()))?,
            w.dense("visual.patch_embed.proj.bias", &[h])?,
        );
        let positions = w
            .dense_f32("visual.pos_embed.weight", &[cfg.num_position_embeddings, h])?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let p = format!("visual.blocks.{i}");
                Ok(Block {
                    norm1: LayerNorm::load(w, &format!("{p}.norm1"), h, NORM_EPS)?,
                    qkv: Linear::load(w, &format!("{p}.attn.qkv"), h, 3 * h, true)?,
                    proj: Linear::load(w, &format!("{p}.attn.proj"), h, h, true)?,
                    norm2: LayerNorm::load(w, &format!("{p}.norm2"), h, NORM_EPS)?,
                    fc1: Linear::load(w, &format!("{p}.mlp.linear_fc1"), h, inter, true)?,
                    fc2: Linear::load(w, &format!("{p}.mlp.linear_fc2"), inter, h, true)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let merged = h * cfg.spatial_merge_size * cfg.spatial_merge_size;
        Ok(Qwen35Tower {
            patch_embed,
            positions,
            blocks,
            merger_norm: LayerNorm::load(w, "visual.merger.norm", h, NORM_EPS)?,
            merger_fc1: Linear::load(w, "visual.merger.linear_fc1", merged, merged, true)?,
            merger_fc2: Linear::load(w, "visual.merger.linear_fc2", merged, cfg.out_hidden_size, true)?,
            rotary: PatchRotary::new(cfg.head_dim(), cfg.rope_theta),
            device: w.device().clone(),
            dtype: w.dtype(),
            cfg,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// One image's embeddings for the language model, `[t * h * w / merge^2, out_hidden]`, in
    /// the order of its image tokens (merged rows, then merged columns).
    pub fn forward(&self, px: &PixelValues) -> Result<Tensor> {
        let m = self.cfg.spatial_merge_size;
        let [t, gh, gw] = px.grid_thw;
        check_patches(px, self.cfg.patch_dim(), m)?;
        let places: Vec<(usize, usize)> = (0..px.rows).map(|r| patch_position(r, px.grid_thw, m)).collect();
        let pixels = Tensor::from_slice(&px.data, (px.rows, px.cols), &self.device)?.to_dtype(self.dtype)?;
        let mut x = (self.patch_embed.forward(&pixels)? + self.position_embeddings(&places, gh, gw)?)?;
        let rot = self.rotary.angles(&places, &self.device, self.dtype)?;
        // Each frame attends within itself.
        let frames: Vec<(usize, usize)> = (0..t).map(|f| (f * gh * gw, gh * gw)).collect();
        for b in &self.blocks {
            x = (&x + self.attention(b, &b.norm1.forward(&x)?, &rot, &frames)?)?;
            let mlp =
                b.fc2.forward(&activation::apply(self.cfg.activation, &b.fc1.forward(&b.norm2.forward(&x)?)?)?)?;
            x = (&x + mlp)?;
        }
        // Each merge block's m * m rows are consecutive: one row of the merger's input.
        let merged = self.merger_norm.forward(&x)?.reshape((px.rows / (m * m), self.cfg.hidden_size * m * m))?;
        self.merger_fc2.forward(&activation::apply(Activation::Gelu, &self.merger_fc1.forward(&merged)?)?)
    }

    /// The position table resampled at each patch's place in a `gh x gw` grid.
    fn position_embeddings(&self, places: &[(usize, usize)], gh: usize, gw: usize) -> Result<Tensor> {
        let (side, hidden) = (self.cfg.position_side(), self.cfg.hidden_size);
        let sampled = bilinear_corners(&self.positions, (side, side), hidden, (gh, gw), places);
        Tensor::from_vec(sampled, (places.len(), hidden), &self.device)?.to_dtype(self.dtype)
    }

    fn attention(&self, b: &Block, x: &Tensor, rot: &RotaryAngles, segs: &[(usize, usize)]) -> Result<Tensor> {
        let out = segment_attention(&b.qkv.forward(x)?, self.cfg.num_heads, self.cfg.head_dim(), rot, segs)?;
        b.proj.forward(&out)
    }
}
