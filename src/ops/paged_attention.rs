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
    /// q: `[T, heads, head_dim]` (f32 on the CPU; f32 or the caches' type on CUDA); caches
    /// `[slots, kv_heads, head_dim]`. Returns `[T, heads, head_dim]` in q's type.
    pub fn forward(&self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        q.apply_op3_no_bwd(k_cache, v_cache, self)
    }

    /// Every sequence's block table covers its context with blocks inside the cache.
    fn check_tables(&self, n_slots: usize) -> Result<()> {
        let bs = self.meta.block_size;
        for s in &self.meta.seqs {
            let needed = s.context_len.div_ceil(bs);
            if s.q_len > s.context_len
                || s.block_table.len() < needed
                || s.block_table.iter().any(|&b| (b as usize + 1) * bs > n_slots)
            {
                candle_core::bail!("paged-attention: block table does not cover {} tokens", s.context_len);
            }
        }
        Ok(())
    }

    fn run<T: KvElem>(&self, q: &[f32], k: &[T], v: &[T], n_slots: usize) -> Result<Vec<f32>> {
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let group = hq / hkv;
        let rows = self.meta.num_rows();
        if q.len() != rows * hq * d {
            candle_core::bail!("paged-attention: q has {} values, expected {rows}x{hq}x{d}", q.len());
        }
        self.check_tables(n_slots)?;
        let bs = self.meta.block_size;
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S, WrapErr};
        use super::cuda::Kernel;

        use super::cuda::{dtype_name, with_u32_slice, PAGED_ATTENTION, PREFILL_ATTENTION};
        use crate::batch::PREFILL_MIN_ROWS;

        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let rows = self.meta.num_rows();
        let shape = Shape::from((rows, hq, d));
        let kv_dims = [k_l.dims().first().copied().unwrap_or(0), hkv, d];
        if k_l.dims() != kv_dims || v_l.dims() != kv_dims || !k_l.is_contiguous() || !v_l.is_contiguous() {
            candle_core::bail!("paged-attention: caches must be contiguous [slots, {hkv}, {d}] tensors");
        }
        let Some((qa, qb)) = q_l.contiguous_offsets().filter(|(a, b)| b - a == rows * hq * d) else {
            candle_core::bail!("paged-attention: q must be a contiguous [{rows}, {hq}, {d}] tensor")
        };
        if hkv == 0 || hq % hkv != 0 {
            candle_core::bail!("paged-attention: {hq} query heads do not group over {hkv} KV heads");
        }
        self.check_tables(kv_dims[0])?;
        let dev = q.device().clone();
        if rows == 0 {
            let empty = unsafe { dev.alloc::<f32>(0)? };
            return Ok((CudaStorage::wrap_cuda_slice(empty, dev), shape));
        }
        if ![16, 32, 64, 80, 96, 128, 256].contains(&d) {
            candle_core::bail!("paged-attention: no CUDA kernel for head_dim {d}");
        }
        let dm = self.meta.device.as_ref().ok_or_else(|| {
            candle_core::Error::Msg("paged-attention: the step's metadata is not on the device (AttentionMeta::upload)".into())
        })?;
        let group = hq / hkv;
        // Query heads per block: the largest divisor of the group the kernel holds at once, or
        // one when there are too few rows to fill the GPU's ~130 multiprocessors otherwise (a
        // decode step of a few sequences is bound by the latency of each block's loop).
        let hb = if rows * hkv < 128 { 1 } else { (1..=group.min(8)).rev().find(|h| group % h == 0).unwrap_or(1) };
        let (qt, ct) = (dtype_name(q.dtype())?, dtype_name(k.dtype())?);
        let decode = PAGED_ATTENTION.func(&dev, &format!("paged_attention_{qt}_{ct}_{d}"))?;
        let l = dm.layout;
        if l.rows != rows {
            candle_core::bail!("paged-attention: device metadata has {} rows, the step {rows}", l.rows);
        }
        // Prompt chunks of 16-bit models go to the tensor-core kernel, the other rows here.
        let prefill = if l.num_tiles > 0 && qt == ct && qt != "f32" && [64, 80, 96, 128, 256].contains(&d) {
            let f = PREFILL_ATTENTION.func(&dev, &format!("prefill_attention_{qt}_{d}"))?;
            let smem = (640 * d + 30720) as u32;
            f.set_max_dynamic_shared(smem)?;
            let cfg = LaunchConfig { grid_dim: (l.num_tiles as u32, hq as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: smem };
            Some((f, cfg))
        } else {
            None
        };
        let p = Params {
            decode: LaunchConfig { grid_dim: (rows as u32, (hkv * group / hb) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 },
            ints: [hq as i32, hkv as i32, hb as i32, self.meta.block_size as i32],
            scale: self.scale,
            softcap: self.softcap.unwrap_or(0.0),
            window: self.window.map_or(0, |w| w as i32),
            skip: if prefill.is_some() { PREFILL_MIN_ROWS as i32 } else { i32::MAX },
        };
        let (ko, vo) = (k_l.start_offset(), v_l.start_offset());

        struct Params {
            decode: LaunchConfig,
            ints: [i32; 4],
            scale: f32,
            softcap: f32,
            window: i32,
            skip: i32,
        }
        struct Meta<'m> {
            row_seq: CudaView<'m, u32>,
            seq_info: CudaView<'m, u32>,
            tiles: CudaView<'m, u32>,
            block_tables: CudaView<'m, u32>,
        }
        #[allow(clippy::too_many_arguments)]
        fn launch<Q: CudaDType + DeviceRepr, C: DeviceRepr>(
            dev: &candle_core::cuda_backend::CudaDevice,
            decode: &Kernel,
            prefill: &Option<(Kernel, LaunchConfig)>,
            p: &Params,
            n_out: usize,
            (q, k, v): (CudaView<Q>, CudaView<C>, CudaView<C>),
            m: &Meta,
        ) -> Result<CudaStorage> {
            // SAFETY: the kernels together write every element of the output.
            let out: CudaSlice<Q> = unsafe { dev.alloc::<Q>(n_out)? };
            let [hq, hkv, hb, bs] = p.ints;
            let mut b = decode.builder();
            b.arg(&out).arg(&q).arg(&k).arg(&v).arg(&m.row_seq).arg(&m.seq_info).arg(&m.block_tables);
            b.arg(&hq).arg(&hkv).arg(&hb).arg(&bs).arg(&p.scale).arg(&p.window).arg(&p.softcap).arg(&p.skip);
            // SAFETY: argument types and counts match the kernel's signature; block tables were checked.
            unsafe { b.launch(p.decode) }.w()?;
            if let Some((f, cfg)) = prefill {
                let mut b = f.builder();
                b.arg(&out).arg(&q).arg(&k).arg(&v).arg(&m.tiles).arg(&m.seq_info).arg(&m.block_tables);
                b.arg(&hq).arg(&hkv).arg(&bs).arg(&p.scale).arg(&p.window).arg(&p.softcap);
                // SAFETY: as above; the tiles cover exactly the rows the first kernel skipped.
                unsafe { b.launch(*cfg) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let out = with_u32_slice(&dm.data, |data| {
            let m = Meta {
                row_seq: data.slice(l.row_seq..l.row_seq + rows),
                seq_info: data.slice(l.seq_info..l.tiles),
                tiles: data.slice(l.tiles..l.block_tables),
                block_tables: data.slice(l.block_tables..),
            };
            let n = rows * hq * d;
            match (&q.slice, &k.slice, &v.slice) {
                (S::F32(q), S::F32(k), S::F32(v)) => {
                    launch(&dev, &decode, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::F32(q), S::BF16(k), S::BF16(v)) => {
                    launch(&dev, &decode, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::F32(q), S::F16(k), S::F16(v)) => {
                    launch(&dev, &decode, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::BF16(q), S::BF16(k), S::BF16(v)) => {
                    launch(&dev, &decode, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::F16(q), S::F16(k), S::F16(v)) => {
                    launch(&dev, &decode, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                _ => candle_core::bail!("paged-attention: {qt} queries over a {ct} cache are not supported"),
            }
        })?;
        Ok((out, shape))
    }
}
