//! The Qwen2-VL / Qwen2.5-VL vision tower (a ViT over 14x14 patches):
//!   x = PatchEmbed(pixels)                     (the 3-D convolution, as one matmul)
//!   x = x + Attn(Norm(x), rot2d);  x = x + MLP(Norm(x))     per block
//!   y = MLP(Norm(x) regrouped 2x2)             (the patch merger: one token per 2x2 patches)
//! Attention is bidirectional within one image (Qwen2-VL), or within windows of
//! `window_size` pixels except in `fullatt_block_indexes` (Qwen2.5-VL). Rotary embeddings
//! are 2-D: half the frequencies follow the patch row, half its column.

use candle_core::{DType, Device, Result, Tensor, D};

use super::config::{VisionConfig, VisionKind};
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::norm::{LayerNorm, NormStyle, RmsNorm};
use crate::layers::rotary::RotaryAngles;
use crate::media::PixelValues;
use crate::models::config::{Activation, RopeLayout};
use crate::weights::{Weights, WeightsError};

const NORM_EPS: f64 = 1e-6;
/// Bound on one attention score block (heads x query rows x keys), in values.
const MAX_SCORES: usize = 1 << 26;

enum Norm {
    Layer(LayerNorm),
    Rms(RmsNorm),
}

impl Norm {
    fn load(w: &Weights, kind: VisionKind, prefix: &str, dim: usize) -> std::result::Result<Self, WeightsError> {
        Ok(match kind {
            VisionKind::Qwen2Vl => Norm::Layer(LayerNorm::load(w, prefix, dim, NORM_EPS)?),
            VisionKind::Qwen25Vl => {
                Norm::Rms(RmsNorm::load(w, &format!("{prefix}.weight"), dim, NORM_EPS, NormStyle::Plain)?)
            }
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
            Mlp::Plain { fc1, fc2, act } => fc2.forward(&act.apply(&fc1.forward(x)?)?),
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
    inv_freq: Vec<f32>,
    device: Device,
    dtype: DType,
}

/// Contiguous runs of rows that attend to each other.
type Segments = Vec<(usize, usize)>;

impl VisionTower {
    pub fn load(w: &Weights, cfg: VisionConfig) -> std::result::Result<Self, WeightsError> {
        let (h, kind) = (cfg.hidden_size, cfg.kind);
        let conv = w.dense(
            "visual.patch_embed.proj.weight",
            &[h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size],
        )?;
        let patch_embed = Linear::from_dense(conv.reshape((h, cfg.patch_dim()))?);
        let blocks = (0..cfg.depth)
            .map(|i| {
                let p = format!("visual.blocks.{i}");
                let mlp = match kind {
                    VisionKind::Qwen2Vl => Mlp::Plain {
                        fc1: Linear::load(w, &format!("{p}.mlp.fc1"), h, cfg.intermediate_size, true)?,
                        fc2: Linear::load(w, &format!("{p}.mlp.fc2"), cfg.intermediate_size, h, true)?,
                        act: cfg.activation,
                    },
                    VisionKind::Qwen25Vl => Mlp::Gated(GatedMlp::load_with_bias(
                        w,
                        &format!("{p}.mlp"),
                        h,
                        cfg.intermediate_size,
                        cfg.activation,
                        true,
                    )?),
                };
                Ok(Block {
                    norm1: Norm::load(w, kind, &format!("{p}.norm1"), h)?,
                    qkv: Linear::load(w, &format!("{p}.attn.qkv"), h, 3 * h, true)?,
                    proj: Linear::load(w, &format!("{p}.attn.proj"), h, h, true)?,
                    norm2: Norm::load(w, kind, &format!("{p}.norm2"), h)?,
                    mlp,
                    full: kind == VisionKind::Qwen2Vl || cfg.fullatt_block_indexes.contains(&i),
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let merged = h * cfg.spatial_merge_size * cfg.spatial_merge_size;
        // Frequencies of one spatial axis: a quarter of the head's dimensions each.
        let spatial = cfg.head_dim() / 2;
        let theta = cfg.rope_theta as f32;
        let inv_freq = (0..spatial / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / spatial as f32)).collect();
        Ok(VisionTower {
            patch_embed,
            blocks,
            merger_norm: Norm::load(w, kind, "visual.merger.ln_q", h)?,
            merger_fc1: Linear::load(w, "visual.merger.mlp.0", merged, merged, true)?,
            merger_fc2: Linear::load(w, "visual.merger.mlp.2", merged, cfg.out_hidden_size, true)?,
            inv_freq,
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
        if px.cols != self.cfg.patch_dim() || px.rows != t * gh * gw || gh % m != 0 || gw % m != 0 || px.rows == 0 {
            candle_core::bail!(
                "pixel values [{}, {}] with grid {:?} do not fit this vision tower (patch dim {}, merge {m})",
                px.rows,
                px.cols,
                px.grid_thw,
                self.cfg.patch_dim()
            );
        }
        let unit = m * m;
        // Qwen2.5-VL regroups merge units window by window so each window is contiguous.
        let (order, windows) = match self.cfg.kind {
            VisionKind::Qwen2Vl => ((0..px.rows / unit).collect::<Vec<_>>(), vec![]),
            VisionKind::Qwen25Vl => self.windows(px.grid_thw),
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
        let y = self.merger_fc2.forward(&Activation::Gelu.apply(&self.merger_fc1.forward(&merged)?)?)?;
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
    fn rotary(&self, [_, gh, gw]: [usize; 3], rows: &[u32]) -> Result<RotaryAngles> {
        let m = self.cfg.spatial_merge_size;
        let per_frame = gh * gw;
        let q = self.inv_freq.len();
        let mut angles = Vec::with_capacity(rows.len() * 2 * q);
        for &r in rows {
            // Processor rows run over (block row, block col, row in block, col in block).
            let r = r as usize % per_frame;
            let (block, within) = (r / (m * m), r % (m * m));
            let (hpos, wpos) = ((block / (gw / m)) * m + within / m, (block % (gw / m)) * m + within % m);
            angles.extend(self.inv_freq.iter().map(|&f| hpos as f32 * f));
            angles.extend(self.inv_freq.iter().map(|&f| wpos as f32 * f));
        }
        RotaryAngles::from_angles(&angles, rows.len(), RopeLayout::Half, &self.device, self.dtype)
    }

    fn attention(&self, b: &Block, x: &Tensor, rot: &RotaryAngles, segs: &Segments) -> Result<Tensor> {
        let (n, heads, hd) = (x.dim(0)?, self.cfg.num_heads, self.cfg.head_dim());
        let qkv = b.qkv.forward(x)?.reshape((n, 3, heads, hd))?;
        let q = rot.apply(&qkv.narrow(1, 0, 1)?.squeeze(1)?)?;
        let k = rot.apply(&qkv.narrow(1, 1, 1)?.squeeze(1)?)?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let scale = (hd as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(segs.len());
        for &(start, len) in segs {
            let heads_first = |t: &Tensor| t.narrow(0, start, len)?.transpose(0, 1)?.contiguous();
            let (qs, ks, vs) = (heads_first(&q)?, heads_first(&k)?, heads_first(&v)?);
            let kt = ks.t()?;
            // Query rows in blocks so the score matrix stays bounded for large images.
            let block = (MAX_SCORES / (heads * len)).max(1);
            let mut start_q = 0;
            while start_q < len {
                let nq = block.min(len - start_q);
                let scores = (qs.narrow(1, start_q, nq)?.matmul(&kt)? * scale)?;
                let p = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(self.dtype)?;
                outs.push(p.matmul(&vs)?.transpose(0, 1)?.reshape((nq, heads * hd))?);
                start_q += nq;
            }
        }
        let out = Tensor::cat(&outs, 0)?;
        debug_assert_eq!(out.dim(D::Minus2)?, n);
        b.proj.forward(&out)
    }
}
