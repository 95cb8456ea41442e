//! The unified Gemma 4 family's (`gemma4_unified`, the 12B) encoder-free vision embedder: no
//! tower, each image's k x k cells of patches merged into one patch of (k p)^2 x 3 pixels, then
//!   x = LN_pos(LN_2(W LN_1(pixels) + b) + P_x[col] + P_y[row]);   e = E RMSNorm(x)
//! (transformers' `Gemma4UnifiedVisionEmbedder` and its multimodal embedder; the RMSNorm has no
//! scale). One merged patch is one image token, so an image has as many tokens as under Gemma 4's
//! pooling, and the processor (resize, patches of p) is Gemma 4's.

use candle_core::{Result, Tensor};
use serde_json::Value;

use crate::config::positive_int;
use crate::layers::linear::Linear;
use crate::layers::norm::{LayerNorm, RmsNorm};
use crate::media::PixelValues;
use crate::weights::{Weights, WeightsError};

/// `vision_config` of a `gemma4_unified` config.json (transformers 5.24's
/// `Gemma4UnifiedVisionConfig` defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct UnifiedVisionConfig {
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
    pub mm_embed_dim: usize,
    /// Rows of each axis' position table: the most merged patches a side.
    pub mm_posemb_size: usize,
    pub rms_norm_eps: f64,
}

impl UnifiedVisionConfig {
    pub fn from_hf_json(v: &Value) -> std::result::Result<Self, String> {
        let int = |key: &str, default| positive_int(v.get(key), default, format_args!("vision_config.{key}"));
        let cfg = UnifiedVisionConfig {
            patch_size: int("patch_size", 16)?,
            pooling_kernel_size: int("pooling_kernel_size", 3)?,
            mm_embed_dim: int("mm_embed_dim", 3840)?,
            mm_posemb_size: int("mm_posemb_size", 1120)?,
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
        };
        // The multimodal embedder's norm runs over output_proj_dims on the embedder's output.
        let proj = int("output_proj_dims", cfg.mm_embed_dim)?;
        if proj != cfg.mm_embed_dim {
            return Err(format!(
                "`vision_config.output_proj_dims` ({proj}) must equal `mm_embed_dim` ({})",
                cfg.mm_embed_dim
            ));
        }
        Ok(cfg)
    }

    /// Values per merged patch: 3 channels x (k p)^2.
    fn merged_dim(&self) -> usize {
        let side = self.patch_size * self.pooling_kernel_size;
        3 * side * side
    }
}

pub struct UnifiedEmbedder {
    cfg: UnifiedVisionConfig,
    ln1: LayerNorm,
    dense: Linear,
    ln2: LayerNorm,
    /// The position tables, `[mm_posemb_size, mm_embed_dim]` each: by merged-patch column and
    /// by row (axes 0 and 1 of the stored `[mm_posemb_size, 2, mm_embed_dim]`).
    positions: [Tensor; 2],
    pos_norm: LayerNorm,
    norm: RmsNorm,
    projection: Linear,
}

impl UnifiedEmbedder {
    pub fn load(w: &Weights, cfg: UnifiedVisionConfig, text_hidden: usize) -> std::result::Result<Self, WeightsError> {
        // nn.LayerNorm's default epsilon: the config does not set these norms'.
        const LN_EPS: f64 = 1e-5;
        let (m, e) = (cfg.merged_dim(), cfg.mm_embed_dim);
        let ln = |name: &str, dim| LayerNorm::load(w, &format!("vision_embedder.{name}"), dim, LN_EPS);
        Ok(UnifiedEmbedder {
            ln1: ln("patch_ln1", m)?,
            dense: Linear::load(w, "vision_embedder.patch_dense", m, e, true)?,
            ln2: ln("patch_ln2", e)?,
            positions: {
                let both = w.dense("vision_embedder.pos_embedding", &[cfg.mm_posemb_size, 2, e])?;
                let axis = |a| both.narrow(1, a, 1)?.squeeze(1)?.contiguous();
                [axis(0)?, axis(1)?]
            },
            pos_norm: ln("pos_norm", e)?,
            norm: RmsNorm::unit(e, cfg.rms_norm_eps, w.dtype(), w.device())?,
            projection: Linear::load(w, "embed_vision.embedding_projection", e, text_hidden, false)?,
            cfg,
        })
    }

    /// One image's embeddings in the language model's width, `[merged patches, text hidden]`,
    /// row by row over the merged grid, from the processor's patches of p (`px`).
    pub fn forward(&self, px: &PixelValues) -> Result<Tensor> {
        let [_, gh, gw] = px.grid_thw;
        let (p, k) = (self.cfg.patch_size, self.cfg.pooling_kernel_size);
        let side = self.cfg.mm_posemb_size;
        if px.cols != 3 * p * p || px.rows != gh * gw || gh % k != 0 || gw % k != 0 || (gh / k).max(gw / k) > side {
            candle_core::bail!(
                "pixel values [{}, {}] with grid {:?} do not fit this vision embedder (patch {p}, merged {k} x {k}, at most {side} merged patches a side)",
                px.rows, px.cols, px.grid_thw
            );
        }
        let (mh, mw) = (gh / k, gw / k);
        let merged = merge_patches(&px.data, (gh, gw), p, k);
        let dev = self.positions[0].device();
        let pixels =
            Tensor::from_vec(merged, (mh * mw, self.cfg.merged_dim()), dev)?.to_dtype(self.positions[0].dtype())?;
        let x = self.ln2.forward(&self.dense.forward(&self.ln1.forward(&pixels)?)?)?;
        let (cols, rows): (Vec<u32>, Vec<u32>) = (0..mh * mw).map(|i| ((i % mw) as u32, (i / mw) as u32)).unzip();
        let table = |axis: usize, ids: &[u32]| self.positions[axis].index_select(&Tensor::new(ids, dev)?, 0);
        let x = self.pos_norm.forward(&((x + table(0, &cols)?)? + table(1, &rows)?)?)?;
        self.projection.forward(&self.norm.forward(&x)?)
    }
}

/// Patches of p (rows over a `gh` x `gw` grid, each p x p x 3 values row, column, channel) into
/// patches of k p over the (gh / k) x (gw / k) grid, row by row, each (k p) x (k p) x 3 in the
/// same order: the pixels of the image's k p blocks.
pub fn merge_patches(data: &[f32], (gh, gw): (usize, usize), p: usize, k: usize) -> Vec<f32> {
    let (mh, mw, kp) = (gh / k, gw / k, k * p);
    let mut out = Vec::with_capacity(data.len());
    for my in 0..mh {
        for mx in 0..mw {
            for r in 0..kp {
                let (a, i) = (r / p, r % p);
                for b in 0..k {
                    let patch = (my * k + a) * gw + (mx * k + b);
                    let start = patch * 3 * p * p + i * 3 * p;
                    out.extend_from_slice(&data[start..start + 3 * p]);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2 x 2 grid of 1 x 1 patches merged 2 x 2 is the image's 2 x 2 block, row by row; a 2 x 4
    /// grid gives two blocks side by side.
    #[test]
    fn merged_patches_are_the_images_blocks() {
        // Patch (y, x) holds the pixel value 10 y + x in all three channels.
        let grid = |gh: usize, gw: usize| -> Vec<f32> {
            (0..gh * gw).flat_map(|i| [(10 * (i / gw) + i % gw) as f32; 3]).collect()
        };
        let one = merge_patches(&grid(2, 2), (2, 2), 1, 2);
        assert_eq!(one, [0., 0., 0., 1., 1., 1., 10., 10., 10., 11., 11., 11.]);
        let two = merge_patches(&grid(2, 4), (2, 4), 1, 2);
        let firsts: Vec<f32> = two.chunks(3).map(|c| c[0]).collect();
        assert_eq!(firsts, [0., 1., 10., 11., 2., 3., 12., 13.]);
    }
}
