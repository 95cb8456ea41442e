//! What the op computes over: the query shapes (as for the dense op), a layer's codecs, and
//! the float window. The CPU work items (`mod.rs`) and the CUDA launches (`cuda.rs`) both
//! read it.

use candle_core::{Result, Tensor};

use crate::batch::AttentionMeta;
use crate::ops::paged_attention::PagedAttention;
use crate::ops::turboquant::{DeviceCodecs, TqCodec, TqLayerCache};

pub struct TqAttention<'a> {
    /// Shapes, scale, sliding window and softcap, as for the dense op.
    pub attn: PagedAttention<'a>,
    pub key: &'a TqCodec,
    pub value: &'a TqCodec,
    /// Keys were stored as k * key_scale (`[kv_heads * head_dim]`): queries read them as
    /// q / key_scale.
    pub key_scale: Option<&'a [f32]>,
    pub float: Option<FloatInputs<'a>>,
    /// For caches on a GPU: the codecs (and key scales) in device memory.
    pub device: Option<&'a DeviceCodecs>,
}

/// The unquantized recent tokens (see the module doc). Rings are `[rings * len, kv_heads,
/// head_dim]` in a float type, each sequence's ring in `meta.window` (which must be of
/// `len`); `new_k`, `new_v` are this step's `[T, kv_heads, head_dim]` (f32 on the CPU).
pub struct FloatInputs<'a> {
    pub len: usize,
    pub ring_k: &'a Tensor,
    pub ring_v: &'a Tensor,
    pub new_k: &'a Tensor,
    pub new_v: &'a Tensor,
}

impl FloatInputs<'_> {
    /// The step's rings when `meta` gives every sequence one of this window's, each inside
    /// rings of `ring_rows` rows.
    pub(super) fn rings<'m>(&self, meta: &'m AttentionMeta, ring_rows: usize) -> Result<&'m [u32]> {
        match &meta.window {
            Some(w)
                if w.len == self.len
                    && w.rings.len() == meta.seqs.len()
                    && w.rings.iter().all(|&r| (r as usize + 1) * self.len <= ring_rows) =>
            {
                Ok(&w.rings)
            }
            _ => candle_core::bail!(
                "tq-attention: a float window of {} positions needs a ring per sequence inside its {ring_rows} rows (AttentionMeta::set_float_window)",
                self.len
            ),
        }
    }
}

impl<'a> TqAttention<'a> {
    /// The op over a layer's cache.
    pub fn over(attn: PagedAttention<'a>, c: &'a TqLayerCache, float: Option<FloatInputs<'a>>) -> Self {
        TqAttention {
            attn,
            key: &c.codecs.key,
            value: &c.codecs.value,
            key_scale: c.codecs.key_scale.as_deref(),
            float,
            device: c.device.as_ref(),
        }
    }

    /// Checks shapes, key scales and block tables against `q_len` query values and `n_slots`
    /// cache slots.
    pub(super) fn check(&self, q_len: usize, n_slots: usize) -> Result<()> {
        let a = &self.attn;
        let meta = a.meta;
        let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let rows = meta.num_rows();
        if q_len != rows * hq * d || self.key.dim() != d || self.value.dim() != d || hkv == 0 || hq % hkv != 0 {
            candle_core::bail!("tq-attention: q has {q_len} values, expected {rows}x{hq}x{d}");
        }
        if self.key_scale.is_some_and(|s| s.len() != hkv * d) {
            candle_core::bail!("tq-attention: key scales for another shape than {hkv}x{d}");
        }
        a.check_tables(n_slots)
    }
}
