//! The GLM-4.xV vision tower (a ViT over 14x14 patches):
//!   x = RMSNorm(PatchEmbed(pixels)) + P(grid)     P: the learned position table, resampled
//!                                                   bicubically to the image's patch grid
//!   x = x + Attn(Norm(x), rot2d);  x = x + MLP(Norm(x))     per block, whole-image attention
//!   z = Conv_{m x m, stride m}(RMSNorm(x))        one token per m x m patches
//!   y = MLP_gated(GELU(LayerNorm(W z)))           the merger
//! Rotary embeddings are 2-D as in Qwen2-VL: half the frequencies follow the patch row, half its
//! column.

use candle_core::{DType, Device, Result, Tensor};

use super::config::VisionConfig;
use crate::config::Activation;
use crate::layers::grid_sample::bicubic_border;
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::norm::{LayerNorm, NormStyle, RmsNorm};
use crate::layers::rotary::RotaryAngles;
use crate::layers::vision::{check_patches, patch_position, segment_attention, PatchRotary};
use crate::media::PixelValues;
use crate::ops::activation;
use crate::weights::{Weights, WeightsError};

/// torch's `nn.LayerNorm` default, which the merger uses.
const LAYER_NORM_EPS: f64 = 1e-5;

struct Block {
    norm1: RmsNorm,
    qkv: Linear,
    proj: Linear,
    norm2: RmsNorm,
    mlp: GatedMlp,
}

pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Linear,
    post_conv_norm: RmsNorm,
    /// The learned position table `[side, side, hidden]`, f32 (resampled in f32 as transformers does).
    positions: Vec<f32>,
    blocks: Vec<Block>,
    post_norm: RmsNorm,
    /// The m x m stride-m convolution over each merge block's patches, as one matrix over the
    /// block's rows (row in block, column in block, channel).
    downsample: Linear,
    merger_proj: Linear,
    merger_norm: LayerNorm,
    merger_mlp: GatedMlp,
    rotary: PatchRotary,
    device: Device,
    dtype: DType,
}

impl VisionTower {
    pub fn load(w: &Weights, cfg: VisionConfig) -> std::result::Result<Self, WeightsError> {
        let (h, out, eps) = (cfg.hidden_size, cfg.out_hidden_size, cfg.rms_norm_eps);
        let rms = |name: &str| RmsNorm::load(w, name, h, eps, NormStyle::Plain);
        let conv = w.conv(
            "visual.patch_embed.proj.weight",
            &[h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size],
        )?;
        let patch_embed = Linear::from_dense_with_bias(
            conv.reshape((h, cfg.patch_dim()))?,
            w.dense("visual.patch_embed.proj.bias", &[h])?,
        );
        let side = cfg.position_side();
        let positions = w
            .dense_f32("visual.embeddings.position_embedding.weight", &[side * side, h])?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let p = format!("visual.blocks.{i}");
                Ok(Block {
                    norm1: rms(&format!("{p}.norm1.weight"))?,
                    qkv: Linear::load(w, &format!("{p}.attn.qkv"), h, 3 * h, cfg.attention_bias)?,
                    proj: Linear::load(w, &format!("{p}.attn.proj"), h, h, false)?,
                    norm2: rms(&format!("{p}.norm2.weight"))?,
                    // The blocks' MLP is as wide as the language model (transformers' Glm4VisionMlp).
                    mlp: GatedMlp::load(w, &format!("{p}.mlp"), h, out, cfg.activation)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let m = cfg.spatial_merge_size;
        let down =
            w.conv("visual.downsample.weight", &[out, h, m, m])?.permute((0, 2, 3, 1))?.reshape((out, m * m * h))?;
        Ok(VisionTower {
            patch_embed,
            post_conv_norm: rms("visual.post_conv_layernorm.weight")?,
            positions,
            blocks,
            post_norm: rms("visual.post_layernorm.weight")?,
            downsample: Linear::from_dense_with_bias(down, w.dense("visual.downsample.bias", &[out])?),
            merger_proj: Linear::load(w, "visual.merger.proj", out, out, false)?,
            merger_norm: LayerNorm::load(w, "visual.merger.post_projection_norm", out, LAYER_NORM_EPS)?,
            merger_mlp: GatedMlp::load(w, "visual.merger", out, cfg.intermediate_size, cfg.activation)?,
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
        let x = self.post_conv_norm.forward(&self.patch_embed.forward(&pixels)?)?;
        let mut x = (x + self.position_embeddings(&places, gh, gw)?)?;
        let rot = self.rotary.angles(&places, &self.device, self.dtype)?;
        let frames: Vec<(usize, usize)> = (0..t).map(|f| (f * gh * gw, gh * gw)).collect();
        for b in &self.blocks {
            let a = self.attention(b, &b.norm1.forward(&x)?, &rot, &frames)?;
            x = (&x + a)?;
            x = (&x + b.mlp.forward(&b.norm2.forward(&x)?)?)?;
        }
        let x = self.post_norm.forward(&x)?;
        // Each merge block's m * m rows are consecutive: one row of the convolution's input.
        let blocks = x.reshape((px.rows / (m * m), m * m * self.cfg.hidden_size))?;
        let z = self.merger_proj.forward(&self.downsample.forward(&blocks)?)?;
        self.merger_mlp.forward(&activation::apply(Activation::Gelu, &self.merger_norm.forward(&z)?)?)
    }

    /// The position table resampled at each patch's place in a `gh x gw` grid (cell centres
    /// of the grid mapped onto the table's extent).
    fn position_embeddings(&self, places: &[(usize, usize)], gh: usize, gw: usize) -> Result<Tensor> {
        let (side, hidden) = (self.cfg.position_side(), self.cfg.hidden_size);
        // transformers' float steps: ((coord + 0.5) / size) * 2 - 1, in f32
        let norm = |c: usize, size: usize| ((c as f32 + 0.5) / size as f32) * 2.0 - 1.0;
        let points: Vec<(f32, f32)> = places.iter().map(|&(h, w)| (norm(w, gw), norm(h, gh))).collect();
        let sampled = bicubic_border(&self.positions, side, side, hidden, &points);
        Tensor::from_vec(sampled, (places.len(), hidden), &self.device)?.to_dtype(self.dtype)
    }

    fn attention(&self, b: &Block, x: &Tensor, rot: &RotaryAngles, segs: &[(usize, usize)]) -> Result<Tensor> {
        let out = segment_attention(&b.qkv.forward(x)?, self.cfg.num_heads, self.cfg.head_dim(), rot, segs)?;
        b.proj.forward(&out)
    }
}
