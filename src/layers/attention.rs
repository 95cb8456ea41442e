//! Self-attention over the paged KV cache: projections, optional per-head q/k norms, rotary,
//! cache write, attention, output projection. Gated attention (Qwen3.5) also takes from q_proj
//! an output gate per head (`[q_h | gate_h]` for each head h) and projects attn * sigmoid(gate).

use candle_core::{DType, Result, Tensor};

use super::linear::{Linear, StackedLinear};
use super::norm::{NormStyle, RmsNorm};
use super::rotary::RotaryAngles;
use crate::batch::AttentionMeta;
use crate::config::{RopeLayout, TextConfig};
use crate::kv::LayerCache;
use crate::ops::kv_write::KvWrite;
use crate::ops::paged_attention::PagedAttention;
use crate::ops::qkv_rope::QkvRope;
use crate::ops::tq_attention;
use crate::weights::{Weights, WeightsError};

pub struct SelfAttention {
    qkv_proj: StackedLinear,
    o_proj: Linear,
    /// Per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
    /// q_proj gives each head's query and then its output gate.
    gated: bool,
}

impl SelfAttention {
    pub fn load(
        w: &Weights,
        cfg: &TextConfig,
        layer: usize,
        qk_norm: Option<NormStyle>,
    ) -> std::result::Result<Self, WeightsError> {
        Self::load_gated(w, cfg, layer, qk_norm, false)
    }

    /// With `gated`, q_proj holds `[q_h | gate_h]` for each head h (twice the query width).
    pub fn load_gated(
        w: &Weights,
        cfg: &TextConfig,
        layer: usize,
        qk_norm: Option<NormStyle>,
        gated: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let p = format!("model.layers.{layer}.self_attn");
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let bias = cfg.attention_bias;
        let qk_norm = match qk_norm {
            Some(style) => Some((
                RmsNorm::load(w, &format!("{p}.q_norm.weight"), d, cfg.rms_norm_eps, style)?,
                RmsNorm::load(w, &format!("{p}.k_norm.weight"), d, cfg.rms_norm_eps, style)?,
            )),
            None => None,
        };
        Ok(SelfAttention {
            qkv_proj: StackedLinear::load(
                w,
                &[format!("{p}.q_proj"), format!("{p}.k_proj"), format!("{p}.v_proj")],
                h,
                &[if gated { 2 * qd } else { qd }, kvd, kvd],
                bias,
            )?,
            o_proj: Linear::load(w, &format!("{p}.o_proj"), qd, h, false)?,
            qk_norm,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
            scale: cfg.attention_scale() as f32,
            window: cfg.window_for(layer),
            softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
            gated,
        })
    }

    /// `x`: `[T, hidden]` -> `[T, hidden]`.
    pub fn forward(&self, x: &Tensor, rot: &RotaryAngles, cache: &LayerCache, meta: &AttentionMeta) -> Result<Tensor> {
        let t = x.dim(0)?;
        // The fused kernel rotates whole heads and knows no gate; the rest goes op by op.
        let fused = x.device().is_cuda() && rot.rotated_dims()? == self.head_dim && !self.gated;
        let rope = self.qkv_proj.merged().filter(|_| fused).map(|qkv| {
            let (cos, sin, layout) = rot.parts();
            let op = QkvRope {
                num_heads: self.num_heads,
                num_kv_heads: self.num_kv_heads,
                head_dim: self.head_dim,
                bias: qkv.bias(),
                cos,
                sin,
                qk_norm: self.qk_norm.as_ref().map(|(q, k)| (q.weight(), k.weight(), q.eps())),
                interleaved: layout == RopeLayout::Interleaved,
            };
            (qkv, op)
        });
        let dtype = x.dtype();
        let out = match (&rope, cache) {
            // A dense cache takes k and v straight from the fused kernel.
            (Some((qkv, rope)), LayerCache::Dense { k: kc, v: vc }) => {
                let q = rope.forward_into_cache(&qkv.forward_unbiased(x)?, kc, vc, meta)?;
                self.paged(meta).forward(&q, kc, vc)?
            }
            // So does a TurboQuant cache (it encodes them; a float window also reads them).
            (Some((qkv, rope)), LayerCache::TurboQuant(c)) => {
                let (q, fresh) = rope.forward_into_tq_cache(&qkv.forward_unbiased(x)?, c, meta)?;
                tq_attention::attend_written(self.paged(meta), c, &q, fresh.as_ref().map(|(k, v)| (k, v)))?
            }
            _ => {
                let (out, gate) = self.attend(x, rot, rope.as_ref().map(|(qkv, op)| (*qkv, op)), cache, meta)?;
                let out = out.to_dtype(dtype)?.reshape((t, self.num_heads * self.head_dim))?;
                if let Some(gate) = gate {
                    return self.o_proj.forward(&(out * candle_nn::ops::sigmoid(&gate)?)?);
                }
                out
            }
        };
        let out = out.to_dtype(dtype)?.reshape((t, self.num_heads * self.head_dim))?;
        self.o_proj.forward(&out)
    }

    /// Projects, rotates, stores and attends op by op where the fused paths don't apply; also
    /// returns the output gate `[T, heads * head_dim]` of a gated layer.
    fn attend(
        &self,
        x: &Tensor,
        rot: &RotaryAngles,
        rope: Option<(&Linear, &QkvRope)>,
        cache: &LayerCache,
        meta: &AttentionMeta,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (q, k, v, gate) = match rope {
            Some((qkv, op)) => {
                let (q, k, v) = op.forward(&qkv.forward_unbiased(x)?)?;
                (q, k, v, None)
            }
            None => self.project_and_rotate(x, rot)?,
        };
        // The CPU ops take f32 inputs, the CUDA kernels the model's type; the cache stores its own.
        let op_input = |t: Tensor| -> Result<Tensor> {
            if t.device().is_cpu() {
                t.to_dtype(DType::F32)?.contiguous()
            } else {
                t.contiguous()
            }
        };
        let (k, v) = (op_input(k)?, op_input(v)?);
        let out = match cache {
            LayerCache::Dense { k: kc, v: vc } => self.attend_dense(&op_input(q)?, &k, &v, kc, vc, meta)?,
            LayerCache::Calibration(c) => {
                // Calibration records f32 moments over an f32 cache, on any device.
                let f32 = |t: &Tensor| t.to_dtype(DType::F32);
                let (q, k, v) = (f32(&op_input(q)?)?, f32(&k)?, f32(&v)?);
                c.record(&q, &k)?;
                self.attend_dense(&q, &k, &v, &c.k, &c.v, meta)?
            }
            LayerCache::TurboQuant(c) => tq_attention::write_and_attend(self.paged(meta), c, &op_input(q)?, &k, &v)?,
            LayerCache::Recurrent(_) => candle_core::bail!("an attention layer was given a recurrent state"),
        };
        Ok((out, gate))
    }

    /// Op by op what `QkvRope` does in one pass on CUDA: `[T, hidden]` -> q, k and v heads,
    /// q and k normed (where the model has it) and rotated; and a gated layer's gate.
    fn project_and_rotate(&self, x: &Tensor, rot: &RotaryAngles) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let t = x.dim(0)?;
        let [q, k, v]: [Tensor; 3] =
            self.qkv_proj.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("qkv: 3 parts".into()))?;
        let (hd, d) = (self.num_heads * self.head_dim, self.head_dim);
        let (q, gate) = if self.gated {
            let qg = q.contiguous()?.reshape((t, self.num_heads, 2 * d))?;
            (qg.narrow(2, 0, d)?, Some(qg.narrow(2, d, d)?.contiguous()?.reshape((t, hd))?))
        } else {
            (q, None)
        };
        let q = q.contiguous()?.reshape((t, self.num_heads, self.head_dim))?;
        let k = k.contiguous()?.reshape((t, self.num_kv_heads, self.head_dim))?;
        let v = v.contiguous()?.reshape((t, self.num_kv_heads, self.head_dim))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        Ok((rot.apply(&q)?, rot.apply(&k)?, v, gate))
    }

    /// Stores the step's keys and values in a dense cache and attends over it.
    fn attend_dense(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
        meta: &AttentionMeta,
    ) -> Result<Tensor> {
        let write = KvWrite::step(meta);
        kc.inplace_op2(k, &write)?;
        vc.inplace_op2(v, &write)?;
        self.paged(meta).forward(q, kc, vc)
    }

    fn paged<'m>(&self, meta: &'m AttentionMeta) -> PagedAttention<'m> {
        PagedAttention {
            meta,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            scale: self.scale,
            window: self.window,
            softcap: self.softcap,
            isa: crate::simd::Isa::active(),
        }
    }
}
