//! Attention over a paged KV cache for a flat batch of any mix of prefill chunks and decodes.
//!
//! Row t of sequence s sits at absolute position p = context_len - q_len + i and attends to
//! the cached keys at positions [lo, p], lo = p + 1 - window for sliding layers, else 0. The
//! chunk's own keys were written to the cache before this op runs, so prefill with a cached
//! prefix and decode are the same computation.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kv_elem::{f32_slice, to_f32_slice, KvElem};
use super::simd::dot_f32;
use crate::batch::AttentionMeta;

pub struct PagedAttention<'a> {
    pub meta: &'a AttentionMeta,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl PagedAttention<'_> {
    /// q: `[T, heads, head_dim]` f32; caches `[slots, kv_heads, head_dim]`. Returns `[T, heads, head_dim]` f32.
    pub fn forward(&self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        q.apply_op3_no_bwd(k_cache, v_cache, self)
    }

    fn run<T: KvElem>(&self, q: &[f32], k: &[T], v: &[T], n_slots: usize) -> Result<Vec<f32>> {
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let group = hq / hkv;
        let rows = self.meta.num_rows();
        if q.len() != rows * hq * d {
            candle_core::bail!("paged-attention: q has {} values, expected {rows}x{hq}x{d}", q.len());
        }
        let bs = self.meta.block_size;
        for s in &self.meta.seqs {
            let needed = s.context_len.div_ceil(bs);
            if s.block_table.len() < needed || s.block_table.iter().any(|&b| (b as usize + 1) * bs > n_slots) {
                candle_core::bail!("paged-attention: block table does not cover {} tokens", s.context_len);
            }
        }
        let mut out = vec![0f32; q.len()];
        // One work item per (row, kv head): the query heads of a GQA group share each key load.
        out.par_chunks_mut(group * d).enumerate().for_each(|(item, o)| {
            let (t, g) = (item / hkv, item % hkv);
            let seq = &self.meta.seqs[self.meta.row_seq[t] as usize];
            let pos = seq.first_position() + (t - seq.q_start);
            let lo = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let n = pos + 1 - lo;
            let qg = &q[(t * hq + g * group) * d..(t * hq + (g + 1) * group) * d];
            let slot_of = |j: usize| seq.block_table[j / bs] as usize * bs + j % bs;
            let mut scores = vec![0f32; group * n];
            let mut kf = vec![0f32; d];
            for (jj, j) in (lo..=pos).enumerate() {
                let off = (slot_of(j) * hkv + g) * d;
                let kj = to_f32_slice(&k[off..off + d], &mut kf);
                for h in 0..group {
                    let mut s = dot_f32(&qg[h * d..(h + 1) * d], kj) * self.scale;
                    if let Some(cap) = self.softcap {
                        s = (s / cap).tanh() * cap;
                    }
                    scores[h * n + jj] = s;
                }
            }
            for h in 0..group {
                let sc = &mut scores[h * n..(h + 1) * n];
                let max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in sc.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                for x in sc.iter_mut() {
                    *x *= inv;
                }
            }
            for (jj, j) in (lo..=pos).enumerate() {
                let off = (slot_of(j) * hkv + g) * d;
                let vj = to_f32_slice(&v[off..off + d], &mut kf);
                for h in 0..group {
                    let p = scores[h * n + jj];
                    for (acc, vv) in o[h * d..(h + 1) * d].iter_mut().zip(vj) {
                        *acc += p * vv;
                    }
                }
            }
        });
        Ok(out)
    }
}

impl CustomOp3 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let q = f32_slice(q, q_l, "paged-attention q")?;
        if !k_l.is_contiguous() || !v_l.is_contiguous() || k_l.dims() != v_l.dims() {
            candle_core::bail!("paged-attention: caches must be contiguous and of one shape");
        }
        let n_slots = k_l.dims()[0];
        let (ko, vo) = (k_l.start_offset(), v_l.start_offset());
        let out = match (k, v) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => self.run(q, &k[ko..], &v[vo..], n_slots)?,
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => self.run(q, &k[ko..], &v[vo..], n_slots)?,
            (CpuStorage::F16(k), CpuStorage::F16(v)) => self.run(q, &k[ko..], &v[vo..], n_slots)?,
            _ => candle_core::bail!("paged-attention: unsupported cache dtype {:?}", k.dtype()),
        };
        let shape = Shape::from((self.meta.num_rows(), self.num_heads, self.head_dim));
        Ok((CpuStorage::F32(out), shape))
    }
}
