//! Gemma 4's vision tower and projector: patches (values in [0, 1]) -> `2x - 1` -> linear
//! embedding + a learned table per axis; ViT layers with sandwich RMSNorms, q/k/v norms,
//! axial 2-D rotary and attention scale 1 over the whole image; k x k cells of patches averaged
//! (times sqrt(width)), optionally standardized; then a scale-free RMSNorm and a linear map into
//! the language model's width.
//!   h = x + Norm(Attn(Norm(x)));   x' = h + Norm(MLP(Norm(h)))

use candle_core::{DType, Device, Result, Tensor};

use super::config::VisionConfig;
use crate::layers::linear::Linear;
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::vision::{attention_within, PatchRotary};
use crate::media::PixelValues;
use crate::ops::activation;
use crate::weights::{Weights, WeightsError};

/// A projection that may clamp its input and output to bounds stored beside it (E2B, E4B).
struct ClippedLinear {
    linear: Linear,
    input: Option<(f64, f64)>,
    output: Option<(f64, f64)>,
}

impl ClippedLinear {
    fn load(w: &Weights, p: &str, inp: usize, out: usize, clipped: bool) -> std::result::Result<Self, WeightsError> {
        let bounds = |side: &str| -> std::result::Result<Option<(f64, f64)>, WeightsError> {
            let (lo, hi) = (format!("{p}.{side}_min"), format!("{p}.{side}_max"));
            if !clipped || !w.contains(&lo) {
                return Ok(None);
            }
            let scalar = |n: &str| -> std::result::Result<f64, WeightsError> {
                Ok(w.dense_f32(n, &[])?.to_device(&Device::Cpu)?.to_vec0::<f32>()? as f64)
            };
            Ok(Some((scalar(&lo)?, scalar(&hi)?)))
        };
        Ok(ClippedLinear {
            linear: Linear::load(w, &format!("{p}.linear"), inp, out, false)?,
            input: bounds("input")?,
            output: bounds("output")?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.input {
            Some((lo, hi)) => x.clamp(lo, hi)?,
            None => x.clone(),
        };
        let y = self.linear.forward(&x)?;
        match self.output {
            Some((lo, hi)) => y.clamp(lo, hi),
            None => Ok(y),
        }
    }
}

struct Layer {
    input_norm: RmsNorm,
    q_proj: ClippedLinear,
    k_proj: ClippedLinear,
    v_proj: ClippedLinear,
    o_proj: ClippedLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    gate: ClippedLinear,
    up: ClippedLinear,
    down: ClippedLinear,
    post_mlp_norm: RmsNorm,
}

pub struct VisionTower {
    cfg: VisionConfig,
    input_proj: Linear,
    /// `[2, position_embedding_size, hidden]`: row 0 by patch column, row 1 by patch row.
    positions: Tensor,
    layers: Vec<Layer>,
    rotary: PatchRotary,
    /// (bias, scale) of the pooled output's standardization.
    standardize: Option<(Tensor, Tensor)>,
    projector_norm: RmsNorm,
    projector: Linear,
    dtype: DType,
}

impl VisionTower {
    pub fn load(w: &Weights, cfg: VisionConfig, text_hidden: usize) -> std::result::Result<Self, WeightsError> {
        let (h, d, eps, clip) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps, cfg.use_clipped_linears);
        let (qd, kvd) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("vision_tower.encoder.layers.{i}");
                let norm = |n: &str, dim| RmsNorm::load(w, &format!("{p}.{n}.weight"), dim, eps, NormStyle::Plain);
                let lin = |n: &str, inp, out| ClippedLinear::load(w, &format!("{p}.{n}"), inp, out, clip);
                Ok(Layer {
                    input_norm: norm("input_layernorm", h)?,
                    q_proj: lin("self_attn.q_proj", h, qd)?,
                    k_proj: lin("self_attn.k_proj", h, kvd)?,
                    v_proj: lin("self_attn.v_proj", h, kvd)?,
                    o_proj: lin("self_attn.o_proj", qd, h)?,
                    q_norm: norm("self_attn.q_norm", d)?,
                    k_norm: norm("self_attn.k_norm", d)?,
                    v_norm: RmsNorm::unit(d, eps, w.dtype(), w.device())?,
                    post_attn_norm: norm("post_attention_layernorm", h)?,
                    pre_mlp_norm: norm("pre_feedforward_layernorm", h)?,
                    gate: lin("mlp.gate_proj", h, cfg.intermediate_size)?,
                    up: lin("mlp.up_proj", h, cfg.intermediate_size)?,
                    down: lin("mlp.down_proj", cfg.intermediate_size, h)?,
                    post_mlp_norm: norm("post_feedforward_layernorm", h)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let standardize = if cfg.standardize {
            Some((w.dense_f32("vision_tower.std_bias", &[h])?, w.dense_f32("vision_tower.std_scale", &[h])?))
        } else {
            None
        };
        Ok(VisionTower {
            input_proj: Linear::load(w, "vision_tower.patch_embedder.input_proj", cfg.patch_dim(), h, false)?,
            positions: w
                .dense("vision_tower.patch_embedder.position_embedding_table", &[2, cfg.position_embedding_size, h])?,
            layers,
            rotary: PatchRotary::new(d, cfg.rope_theta),
            standardize,
            projector_norm: RmsNorm::unit(h, eps, w.dtype(), w.device())?,
            projector: Linear::load(w, "embed_vision.embedding_projection", h, text_hidden, false)?,
            dtype: w.dtype(),
            cfg,
        })
    }

    /// One image's embeddings in the language model's width, `[cells, text hidden]`, cells row
    /// by row over the pooled grid.
    pub fn forward(&self, px: &PixelValues) -> Result<Tensor> {
        let [_, gh, gw] = px.grid_thw;
        let k = self.cfg.pooling_kernel_size;
        let side = self.cfg.position_embedding_size;
        if px.cols != self.cfg.patch_dim() || px.rows != gh * gw || gh % k != 0 || gw % k != 0 || gh.max(gw) > side {
            candle_core::bail!(
                "pixel values [{}, {}] with grid {:?} do not fit this vision tower (patch dim {}, pooling {k}, at most {side} patches a side)",
                px.rows, px.cols, px.grid_thw, self.cfg.patch_dim()
            );
        }
        let dev = self.positions.device();
        // transformers maps [0, 1] to [-1, 1] in f32 before the weights' dtype.
        let pixels = Tensor::from_slice(&px.data, (px.rows, px.cols), dev)?;
        let pixels = ((pixels - 0.5)? * 2.0)?.to_dtype(self.dtype)?;
        let (xs, ys): (Vec<u32>, Vec<u32>) = (0..px.rows).map(|r| ((r % gw) as u32, (r / gw) as u32)).unzip();
        let table = |axis: usize, ids: &[u32]| self.positions.get(axis)?.index_select(&Tensor::new(ids, dev)?, 0);
        let mut x = ((self.input_proj.forward(&pixels)? + table(0, &xs)?)? + table(1, &ys)?)?;
        let places: Vec<(usize, usize)> = xs.iter().zip(&ys).map(|(&x, &y)| (x as usize, y as usize)).collect();
        // The first half of each head turns by the patch column, the second by its row.
        let rot = self.rotary.split_angles(&places, dev, self.dtype)?;
        let (n, d) = (px.rows, self.cfg.head_dim);
        for l in &self.layers {
            let a = l.input_norm.forward(&x)?;
            let heads = |t: Tensor, h: usize| t.reshape((n, h, d));
            let q = rot.apply(&l.q_norm.forward(&heads(l.q_proj.forward(&a)?, self.cfg.num_heads)?)?)?;
            let k = rot.apply(&l.k_norm.forward(&heads(l.k_proj.forward(&a)?, self.cfg.num_kv_heads)?)?)?;
            let v = l.v_norm.forward(&heads(l.v_proj.forward(&a)?, self.cfg.num_kv_heads)?)?;
            let group = self.cfg.num_heads / self.cfg.num_kv_heads;
            let (k, v) = (repeat_heads(&k, group)?, repeat_heads(&v, group)?);
            // Scale 1: the q and k norms set the scores' scale.
            let o = attention_within(&q, &k, &v, &[(0, n)])?;
            x = (&x + l.post_attn_norm.forward(&l.o_proj.forward(&o)?)?)?;
            let m = l.pre_mlp_norm.forward(&x)?;
            let m = (activation::apply(self.cfg.activation, &l.gate.forward(&m)?)? * l.up.forward(&m)?)?;
            x = (&x + l.post_mlp_norm.forward(&l.down.forward(&m)?)?)?;
        }
        self.project(&self.pool(&x, gh, gw)?)
    }

    /// k x k cells averaged in f32 and rounded to the model's dtype, then times sqrt(width) and
    /// standardized in f32, as transformers rounds them.
    fn pool(&self, x: &Tensor, gh: usize, gw: usize) -> Result<Tensor> {
        let (k, h) = (self.cfg.pooling_kernel_size, self.cfg.hidden_size);
        let cells = x.to_dtype(DType::F32)?.reshape((gh / k, k, gw / k, k, h))?.mean(3)?.mean(1)?;
        let cells = cells.reshape(((gh / k) * (gw / k), h))?.to_dtype(self.dtype)?.to_dtype(DType::F32)?;
        let mut out = (cells * (h as f64).sqrt())?;
        if let Some((bias, scale)) = &self.standardize {
            out = out.broadcast_sub(bias)?.broadcast_mul(scale)?;
        }
        out.to_dtype(self.dtype)
    }

    fn project(&self, cells: &Tensor) -> Result<Tensor> {
        self.projector.forward(&self.projector_norm.forward(cells)?)
    }
}

/// `[n, kv heads, d]` -> `[n, kv heads * group, d]`, each key/value head serving `group` query
/// heads in turn.
fn repeat_heads(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (n, h, d) = x.dims3()?;
    x.unsqueeze(2)?.expand((n, h, group, d))?.reshape((n, h * group, d))
}
