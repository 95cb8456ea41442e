//! The Qwen2-VL / Qwen2.5-VL vision tower (a ViT over 14x14 patches):
//!   x = PatchEmbed(pixels)                     (the 3-D convolution, as one matmul)
//!   x = x + Attn(Norm(x), rot2d);  x = x + MLP(Norm(x))     per block
//!   y = MLP(Norm(x) regrouped 2x2)             (the patch merger: one token per 2x2 patches)
//! Attention is bidirectional within one image (Qwen2-VL), or within windows of
//! `window_size` pixels except in `fullatt_block_indexes` (Qwen2.5-VL). Rotary embeddings
//! are 2-D: half the frequencies follow the patch row, half its column.

use candle_core::{DType, Device, Result, Tensor};

use super::config::{VisionConfig, VisionKind};
use crate::config::Activation;
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::norm::{LayerNorm, NormStyle, RmsNorm};
use crate::layers::rotary::RotaryAngles;
use crate::layers::vision::{check_patches, patch_position, segment_attention, PatchRotary, Segments};
use crate::media::PixelValues;
use crate::ops::activation;
use crate::weights::{Weights, WeightsError};

const NORM_EPS: f64 = 1e-6;

enum Norm {
    Layer(LayerNorm),
    Rms(RmsNorm),
}

impl Norm {
    fn load(w: &Weights, kind: VisionKind, prefix: &str, dim: usize) -> std::result::Result<Self, WeightsError> {
        Ok(match kind {
            VisionKind::Qwen25Vl => {
                Norm::Rms(RmsNorm::load(w, &format!("{prefix}.weight"), dim, NORM_EPS, NormStyle::Plain)?)
            }
            _ => Norm::Layer(LayerNorm::load(w, prefix, dim, NORM_EPS)?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Layer(n) => n.forward(x),
            Norm::Rms(n) => n.forward(x),
        }
    }
}

enum Mlp {
    Plain { fc1: Linear, fc2: Linear, act: Activation },
    Gated(GatedMlp),
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlp::Plain { fc1, fc2, act } => fc2.forward(&activation::apply(*act, &fc1.forward(x)?)?),
            Mlp::Gated(m) => m.forward(x),
        }
    }
}

struct Block {
    norm1: Norm,
    qkv: Linear,
    proj: Linear,
    norm2: Norm,
    mlp: Mlp,
    /// Attends over the whole image rather than within windows.
    full: bool,
}

pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Linear,
    blocks: Vec<Block>,
    merger_norm: Norm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    rotary: PatchRotary,
    device: Device,
    dtype: DType,
}

impl VisionTower {
    pub fn load(w: &Weights, cfg: VisionConfig) -> std::result::Result<Self, WeightsError> {
        let (h, kind) = (cfg.hidden_size, cfg.kind);
        let conv = w.conv(
            "visual.patch_embed.proj.weight",
            &[h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size],
        )?;
        let patch_embed = Linear::from_dense(conv.reshape((h, cfg.patch_dim()))?);
        let blocks = (0..cfg.depth)
            .map(|i| {
                let p = format!("visual.blocks.{i}");
                let mlp = match kind {
                    VisionKind::Qwen25Vl => Mlp::Gated(GatedMlp::load_with_bias(
                        w,
                        &format!("{p}.mlp"),
                        h,
                        cfg.intermediate_size,
                        cfg.activation,
                        true,
                    )?),
                    _ => Mlp::Plain {
                        fc1: Linear::load(w, &format!("{p}.mlp.fc1"), h, cfg.intermediate_size, true)?,
                        fc2: Linear::load(w, &format!("{p}.mlp.fc2"), cfg.intermediate_size, h, true)?,
                        act: cfg.activation,
                    },
                };
                Ok(Block {
                    norm1: Norm::load(w, kind, &format!("{p}.norm1"), h)?,
                    qkv: Linear::load(w, &format!("{p}.attn.qkv"), h, 3 * h, true)?,
                    proj: Linear::load(w, &format!("{p}.attn.proj"), h, h, true)?,
                    norm2: Norm::load(w, kind, &format!("{p}.norm2"), h)?,
                    mlp,
                    full: kind != VisionKind::Qwen25Vl || cfg.fullatt_block_indexes.contains(&i),
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let merged = h * cfg.spatial_merge_size * cfg.spatial_merge_size;
        Ok(VisionTower {
            patch_embed,
            blocks,
            merger_norm: Norm::load(w, kind, "visual.merger.ln_q", h)?,
            merger_fc1: Linear::load(w, "visual.merger.mlp.0", merged, merged, true)?,
            merger_fc2: Linear::load(w, "visual.merger.mlp.2", merged, cfg.out_hidden_size, true)?,
            rotary: PatchRotary::new(cfg.head_dim(), cfg.rope_theta),
            device: w.device().clone(),
            dtype: w.dtype(),
            cfg,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// One image's embeddings for the language model, `[t * h * w / merge^2, out_hidden]`,
    /// in the order of its image tokens (merged rows, then merged columns).
    pub fn forward(&self, px: &PixelValues) -> Result<Tensor> {
        let m = self.cfg.spatial_merge_size;
        let [t, gh, gw] = px.grid_thw;
        check_patches(px, self.cfg.patch_dim(), m)?;
        let unit = m * m;
        // Qwen2.5-VL regroups merge units window by window so each window is contiguous.
        let (order, windows) = match self.cfg.kind {
            VisionKind::Qwen25Vl => self.windows(px.grid_thw),
            _ => ((0..px.rows / unit).collect::<Vec<_>>(), vec![]),
        };
        let rows: Vec<u32> = order.iter().flat_map(|&u| (u * unit..(u + 1) * unit).map(|r| r as u32)).collect();
        let frames: Segments = (0..t).map(|f| (f * gh * gw, gh * gw)).collect();
        let windows: Segments = windows
            .iter()
            .scan(0, |start, &n| {
                let s = (*start, n * unit);
                *start += n * unit;
                Some(s)
            })
            .collect();

        let pixels = Tensor::from_slice(&px.data, (px.rows, px.cols), &self.device)?.to_dtype(self.dtype)?;
        let mut x = self.patch_embed.forward(&pixels)?;
        let permuted = self.cfg.kind == VisionKind::Qwen25Vl;
        let rows_t = Tensor::new(rows.as_slice(), &self.device)?;
        if permuted {
            x = x.index_select(&rows_t, 0)?;
        }
        let rot = self.rotary(px.grid_thw, &rows)?;
        for b in &self.blocks {
            let segs = if b.full { &frames } else { &windows };
            let a = self.attention(b, &b.norm1.forward(&x)?, &rot, segs)?;
            x = (&x + a)?;
            x = (&x + b.mlp.forward(&b.norm2.forward(&x)?)?)?;
        }
        let merged = self.merger_norm.forward(&x)?.reshape((px.rows / unit, self.cfg.hidden_size * unit))?;
        let y = self.merger_fc2.forward(&activation::apply(Activation::Gelu, &self.merger_fc1.forward(&merged)?)?)?;
        if !permuted {
            return Ok(y);
        }
        let mut inverse = vec![0u32; order.len()];
        for (i, &u) in order.iter().enumerate() {
            inverse[u] = i as u32;
        }
        y.index_select(&Tensor::new(inverse.as_slice(), &self.device)?, 0)
    }

    /// Merge units ordered window by window (each window's units row by row), and the number
    /// of units in each window. Windows tile each frame's merged grid from the top left;
    /// those on the right and bottom edges may be partial.
    fn windows(&self, [t, gh, gw]: [usize; 3]) -> (Vec<usize>, Vec<usize>) {
        let m = self.cfg.spatial_merge_size;
        let side = (self.cfg.window_size / m / self.cfg.patch_size).max(1);
        let (lh, lw) = (gh / m, gw / m);
        let mut order = Vec::with_capacity(t * lh * lw);
        let mut sizes = Vec::new();
        for f in 0..t {
            for wy in (0..lh).step_by(side) {
                for wx in (0..lw).step_by(side) {
                    let before = order.len();
                    for y in wy..(wy + side).min(lh) {
                        for x in wx..(wx + side).min(lw) {
                            order.push(f * lh * lw + y * lw + x);
                        }
                    }
                    sizes.push(order.len() - before);
                }
            }
        }
        (order, sizes)
    }

    /// 2-D rotary angles for the patches in `rows` order (indices into the processor's order).
    fn rotary(&self, grid: [usize; 3], rows: &[u32]) -> Result<RotaryAngles> {
        let m = self.cfg.spatial_merge_size;
        let positions: Vec<(usize, usize)> = rows.iter().map(|&r| patch_position(r as usize, grid, m)).collect();
        self.rotary.angles(&positions, &self.device, self.dtype)
    }

    fn attention(&self, b: &Block, x: &Tensor, rot: &RotaryAngles, segs: &Segments) -> Result<Tensor> {
        let out = segment_attention(&b.qkv.forward(x)?, self.cfg.num_heads, self.cfg.head_dim(), rot, segs)?;
        b.proj.forward(&out)
    }
}
