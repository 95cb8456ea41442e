//! Self-attention over the paged KV cache: projections, optional per-head q/k norms, rotary,
//! cache write, attention, output projection. Gated attention (Qwen3.5) also takes from q_proj
//! an output gate per head (`[q_h | gate_h]` for each head h) and projects attn * sigmoid(gate).

use candle_core::{DType, Result, Tensor};

use super::linear::{Linear, StackedLinear};
use super::norm::{NormStyle, RmsNorm};
use super::rotary::RotaryAngles;
use crate::batch::AttentionMeta;
use crate::config::{LayerKind, RopeLayout, TextConfig};
use crate::kv::LayerCache;
use crate::ops::kv_write::KvWrite;
use crate::ops::paged_attention::PagedAttention;
use crate::ops::qkv_rope::QkvRope;
use crate::ops::tq_attention;
use crate::weights::{Weights, WeightsError};

pub struct SelfAttention {
    /// q, k and v; q and k (`KvInput::KeyIsValue`); or q alone (`KvInput::Shared`).
    qkv_proj: StackedLinear,
    o_proj: Linear,
    /// Per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3 and 4; a KV-sharing layer
    /// has q's alone).
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// Per-head RMSNorm of v without a scale (Gemma 4).
    v_norm: Option<RmsNorm>,
    kv_input: KvInput,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
    /// q_proj gives each head's query and then its output gate.
    gated: bool,
    /// Image tokens see their whole image (`TextConfig::image_sees_whole`).
    bidirectional: bool,
}

/// Where a layer's keys and values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KvInput {
    /// Their own projections of the layer's input.
    Projected,
    /// The key projection is the values too, taken before `k_norm` (Gemma 4's K-eq-V).
    KeyIsValue,
    /// None: the layer attends over the keys and values another layer stored (Gemma 4's KV
    /// sharing; `KvCache::layer` hands out that layer's cache) and writes nothing.
    Shared,
}

/// What a family's attention adds to the plain one.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionOptions {
    /// Per-head q and k norms of this style.
    pub qk_norm: Option<NormStyle>,
    /// q_proj holds `[q_h | gate_h]` for each head h (twice the query width).
    pub gated: bool,
    /// A scale-free RMSNorm of each value head (Gemma 4).
    pub v_norm: bool,
}

impl SelfAttention {
    pub fn load(
        w: &Weights,
        cfg: &TextConfig,
        layer: usize,
        qk_norm: Option<NormStyle>,
    ) -> std::result::Result<Self, WeightsError> {
        Self::load_with(w, cfg, layer, AttentionOptions { qk_norm, ..Default::default() })
    }

    /// The layer's head geometry, K-eq-V and KV sharing come from `cfg`.
    pub fn load_with(
        w: &Weights,
        cfg: &TextConfig,
        layer: usize,
        opts: AttentionOptions,
    ) -> std::result::Result<Self, WeightsError> {
        Self::load_at(w, cfg, &format!("model.layers.{layer}"), layer, opts)
    }

    /// `load_with` for the layer whose tensors are under `{prefix}.self_attn` (an MTP layer's
    /// `mtp.layers.0`, whose cache `layer` follows the decoder's).
    pub fn load_at(
        w: &Weights,
        cfg: &TextConfig,
        prefix: &str,
        layer: usize,
        opts: AttentionOptions,
    ) -> std::result::Result<Self, WeightsError> {
        let p = format!("{prefix}.self_attn");
        let crate::config::KvShape { num_kv_heads, head_dim: d } = cfg.kv_shape(layer);
        let h = cfg.hidden_size;
        let (qd, kvd) = (cfg.num_heads * d, num_kv_heads * d);
        let bias = cfg.attention_bias;
        let kv_input = if cfg.kv_source(layer).is_some() {
            KvInput::Shared
        } else if cfg.gemma4.is_some_and(|g| g.k_eq_v) && cfg.layer_kind(layer) == LayerKind::Full {
            KvInput::KeyIsValue
        } else {
            KvInput::Projected
        };
        let norm = |name: &str, style| RmsNorm::load(w, &format!("{p}.{name}.weight"), d, cfg.rms_norm_eps, style);
        let q_norm = opts.qk_norm.map(|s| norm("q_norm", s)).transpose()?;
        let k_norm = opts.qk_norm.filter(|_| kv_input != KvInput::Shared).map(|s| norm("k_norm", s)).transpose()?;
        let v_norm = (opts.v_norm && kv_input != KvInput::Shared)
            .then(|| RmsNorm::unit(d, cfg.rms_norm_eps, w.dtype(), w.device()))
            .transpose()?;
        let q_width = if opts.gated { 2 * qd } else { qd };
        let (names, widths): (Vec<String>, Vec<usize>) = match kv_input {
            KvInput::Projected => {
                (vec![format!("{p}.q_proj"), format!("{p}.k_proj"), format!("{p}.v_proj")], vec![q_width, kvd, kvd])
            }
            KvInput::KeyIsValue => (vec![format!("{p}.q_proj"), format!("{p}.k_proj")], vec![q_width, kvd]),
            KvInput::Shared => (vec![format!("{p}.q_proj")], vec![q_width]),
        };
        Ok(SelfAttention {
            qkv_proj: StackedLinear::load(w, &names, h, &widths, bias)?,
            o_proj: Linear::load(w, &format!("{p}.o_proj"), qd, h, false)?,
            q_norm,
            k_norm,
            v_norm,
            kv_input,
            num_heads: cfg.num_heads,
            num_kv_heads,
            head_dim: d,
            scale: cfg.attention_scale() as f32,
            window: cfg.window_for(layer),
            softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
            gated: opts.gated,
            bidirectional: cfg.image_sees_whole(layer),
        })
    }

    /// `x`: `[T, hidden]` -> `[T, hidden]`.
    pub fn forward(&self, x: &Tensor, rot: &RotaryAngles, cache: &LayerCache, meta: &AttentionMeta) -> Result<Tensor> {
        let t = x.dim(0)?;
        // The fused kernel rotates whole heads and knows no gate; the rest goes op by op.
        let fused = x.device().is_cuda()
            && rot.rotated_dims()? == self.head_dim
            && !self.gated
            && self.kv_input == KvInput::Projected
            && self.v_norm.is_none();
        let rope = self.qkv_proj.merged().filter(|_| fused).map(|qkv| {
            let (cos, sin, layout) = rot.parts();
            let op = QkvRope {
                num_heads: self.num_heads,
                num_kv_heads: self.num_kv_heads,
                head_dim: self.head_dim,
                bias: qkv.bias(),
                cos,
                sin,
                qk_norm: self.q_norm.as_ref().zip(self.k_norm.as_ref()).map(|(q, k)| (q.weight(), k.weight(), q.eps())),
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
        let (q, kv, gate) = match rope {
            Some((qkv, op)) => {
                let (q, k, v) = op.forward(&qkv.forward_unbiased(x)?)?;
                (q, Some((k, v)), None)
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
        let Some((k, v)) = kv else {
            return Ok((self.attend_stored(&op_input(q)?, cache, meta)?, gate));
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
            LayerCache::Recurrent(_) | LayerCache::Shared { .. } => {
                candle_core::bail!("an attention layer was given no key/value storage")
            }
        };
        Ok((out, gate))
    }

    /// A KV-sharing layer's attention over keys and values another layer stored this step.
    fn attend_stored(&self, q: &Tensor, cache: &LayerCache, meta: &AttentionMeta) -> Result<Tensor> {
        match cache {
            LayerCache::Dense { k, v } => self.paged(meta).forward(q, k, v),
            LayerCache::Calibration(c) => self.paged(meta).forward(&q.to_dtype(DType::F32)?, &c.k, &c.v),
            // The engine refuses KV sharing beside a float window (whose ring holds the step's
            // rows only once the storing layer has moved them there).
            LayerCache::TurboQuant(c) => tq_attention::attend_written(self.paged(meta), c, q, None),
            LayerCache::Recurrent(_) | LayerCache::Shared { .. } => {
                candle_core::bail!("a KV-sharing layer was given no key/value storage")
            }
        }
    }

    /// Op by op what `QkvRope` does in one pass on CUDA: `[T, hidden]` -> q, k and v heads,
    /// q and k normed (where the model has it) and rotated, v normed (Gemma 4); a KV-sharing
    /// layer has no k and v. And a gated layer's gate.
    #[allow(clippy::type_complexity)]
    fn project_and_rotate(
        &self,
        x: &Tensor,
        rot: &RotaryAngles,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>, Option<Tensor>)> {
        let t = x.dim(0)?;
        let mut parts = self.qkv_proj.forward(x)?.into_iter();
        let mut next = || parts.next().ok_or_else(|| candle_core::Error::Msg("qkv: too few parts".into()));
        let q = next()?;
        let (hd, d) = (self.num_heads * self.head_dim, self.head_dim);
        let (q, gate) = if self.gated {
            let qg = q.contiguous()?.reshape((t, self.num_heads, 2 * d))?;
            (qg.narrow(2, 0, d)?, Some(qg.narrow(2, d, d)?.contiguous()?.reshape((t, hd))?))
        } else {
            (q, None)
        };
        let q = q.contiguous()?.reshape((t, self.num_heads, d))?;
        let q = rot.apply(&self.q_norm.as_ref().map_or(Ok(q.clone()), |n| n.forward(&q))?)?;
        let heads = |y: Tensor| y.contiguous()?.reshape((t, self.num_kv_heads, d));
        let (k, v) = match self.kv_input {
            KvInput::Shared => return Ok((q, None, gate)),
            KvInput::Projected => (heads(next()?)?, heads(next()?)?),
            KvInput::KeyIsValue => {
                let k = heads(next()?)?;
                (k.clone(), k)
            }
        };
        let k = self.k_norm.as_ref().map_or(Ok(k.clone()), |n| n.forward(&k))?;
        let v = self.v_norm.as_ref().map_or(Ok(v.clone()), |n| n.forward(&v))?;
        Ok((q, Some((rot.apply(&k)?, v)), gate))
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
            bidirectional: self.bidirectional,
        }
    }
}
