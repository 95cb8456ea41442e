//! Attention over a paged KV cache for a flat batch of any mix of prefill chunks and decodes.
//!
//! Row t of sequence s sits at absolute position p = context_len - q_len + i and attends to
//! the cached keys at positions [lo, p], lo = p + 1 - window for sliding layers, else 0 (and,
//! on a layer marked `bidirectional`, to [lo, end) when p lies in one of the meta's
//! bidirectional ranges [start, end): an image seen whole). The chunk's own keys were written
//! to the cache before this op runs, so prefill with a cached prefix and decode are the same
//! computation.

pub(super) mod softmax;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::kv_elem::{f32_slice, to_f32_slice, KvElem};
use super::team::{team, OutPtr};
use crate::batch::{AttentionMeta, SeqSlice};
use crate::simd::{axpy_f32, dot_f32, Isa};
use softmax::{exp_shifted, fold};

pub struct PagedAttention<'a> {
    pub meta: &'a AttentionMeta,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    /// The instruction set of the CPU kernels (`Isa::active()`; tests pick each).
    pub isa: Isa,
    /// Rows in the meta's bidirectional ranges also see the later rows of their range.
    pub bidirectional: bool,
}

impl PagedAttention<'_> {
    /// q: `[T, heads, head_dim]` (f32 on the CPU; f32 or the caches' type on CUDA); caches
    /// `[slots, kv_heads, head_dim]`. Returns `[T, heads, head_dim]` in q's type.
    pub fn forward(&self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        q.apply_op3_no_bwd(k_cache, v_cache, self)
    }

    /// Sequence `i`'s ranges whose rows see each other both ways on this layer.
    pub(crate) fn bidirectional_ranges(&self, i: usize) -> &[(usize, usize)] {
        match (&self.meta.bidirectional, self.bidirectional) {
            (Some(r), true) => r.get(i).map_or(&[], |r| &r[..]),
            _ => &[],
        }
    }

    /// Every sequence's block table covers its context with blocks inside the cache.
    pub(super) fn check_tables(&self, n_slots: usize) -> Result<()> {
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
        // Tiles of up to TILE_ROWS consecutive rows of one sequence. A tile's rows read one run
        // of keys, so each key is fetched from memory once for all of them and the query heads
        // of their GQA group. Every row's context is cut into segments of SEGMENT positions
        // (fixed by position, not by the step), each giving a partial softmax, folded in
        // position order: a tile of several rows is one work item per kv head; a lone row (a
        // decode) is one per kv head and segment, folded by a second loop, so that a long
        // context uses every thread. Either way a row gets the same arithmetic.
        let tiles: Vec<Tile> = self
            .meta
            .seqs
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                let end = s.q_start + s.q_len;
                let ranges = self.bidirectional_ranges(i);
                (s.q_start..end)
                    .step_by(TILE_ROWS)
                    .map(move |t0| Tile::new(self, s, t0..(t0 + TILE_ROWS).min(end), ranges))
            })
            .collect();
        let part_len = group * (d + 2);
        let JobPlan { jobs, merges, parts } = JobPlan::new(tiles.iter().map(|t| (t.rows.len(), t.segments())), hkv);
        let mut partials = vec![0f32; parts * part_len];
        let pdst = OutPtr(partials.as_mut_ptr());
        let mut out = vec![0f32; q.len()];
        let dst = OutPtr(out.as_mut_ptr());
        let isa = self.isa;
        // The positions `seg` of `tile`: kv head 0's vector offsets (head g's are g * d further:
        // its k and v are read from there) and each row's span among them. The same for every
        // kv head, so a work item of several heads computes them once.
        let window = |tile: &Tile, seg: (usize, usize)| -> (Vec<usize>, Vec<(usize, usize)>) {
            let spans = tile
                .spans
                .iter()
                .map(|&(lo, end)| {
                    let (a, b) = (lo.max(seg.0), end.min(seg.1));
                    if a < b {
                        (a - seg.0, b - seg.0)
                    } else {
                        (0, 0)
                    }
                })
                .collect();
            (tile.offsets(seg), spans)
        };
        // Partial softmax states of a tile's rows (query values `qt`, `[rows, group, d]`) over
        // the positions of `window` for kv head `g`, into `part` (`[rows, group, d + 2]`).
        let partial = |qt: &[f32], g: usize, (offs, spans): &(Vec<usize>, Vec<(usize, usize)>), part: &mut [f32]| {
            let (k, v) = (&k[g * d..], &v[g * d..]);
            if d % 16 != 0 {
                return self.partial_portable(qt, spans, offs, k, v, part);
            }
            // Offsets are in bounds (block tables were checked against the cache, whose shape
            // `cpu_fwd` checked); spans lie within the offsets.
            let (scale, softcap) = (self.scale, self.softcap);
            with_scratch(|scratch| {
                isa.run(Partial { q: qt, group, spans, offs, k, v, d, scale, softcap, scratch, part })
            })
        };
        // SAFETY (both loops): the item finishing (tile, g) is the only writer of its rows'
        // heads of group g, each written once.
        let finish = |tile: &Tile, g: usize, states: &[f32]| {
            for (r, t) in tile.rows.clone().enumerate() {
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at((t * hq + g * group) * d), group * d) };
                for (oh, st) in o.chunks_exact_mut(d).zip(states[r * part_len..][..part_len].chunks_exact(d + 2)) {
                    let inv = 1.0 / st[1];
                    for (x, y) in oh.iter_mut().zip(&st[2..]) {
                        *x = y * inv;
                    }
                }
            }
        };
        let empty_states = |rows: usize| {
            let mut st = vec![0f32; rows * part_len];
            st.chunks_exact_mut(d + 2).for_each(|s| s[0] = f32::NEG_INFINITY);
            st
        };
        team().for_each(jobs.len(), |i| match jobs[i] {
            Job::Whole { tile, g } => {
                let tile = &tiles[tile];
                let qt = tile.queries(q, g);
                let mut states = empty_states(tile.rows.len());
                let mut part = vec![0f32; states.len()];
                for seg in tile.segments() {
                    partial(&qt, g, &window(tile, seg), &mut part);
                    for (st, p) in states.chunks_exact_mut(d + 2).zip(part.chunks_exact(d + 2)) {
                        fold(st, p);
                    }
                }
                finish(tile, g, &states);
            }
            Job::Segment { tile, heads, seg, part, stride } => {
                let (tile, positions) = (&tiles[tile], window(&tiles[tile], seg));
                for (g, slot) in Job::segment_heads(heads, part, stride) {
                    // SAFETY: each (segment, head) owns its slot of `partials`.
                    let p = unsafe { std::slice::from_raw_parts_mut(pdst.at(slot * part_len), part_len) };
                    partial(&tile.queries(q, g), g, &positions, p);
                }
            }
        });
        team().for_each(merges.len(), |i| {
            let (tile, g, first, n) = merges[i];
            let mut states = empty_states(1);
            for part in partials[first * part_len..(first + n) * part_len].chunks_exact(part_len) {
                for (st, p) in states.chunks_exact_mut(d + 2).zip(part.chunks_exact(d + 2)) {
                    fold(st, p);
                }
            }
            finish(&tiles[tile], g, &states);
        });
        Ok(out)
    }

    /// `kernel::Partial` for head sizes that are not a multiple of 16, one row at a time.
    fn partial_portable<T: KvElem>(
        &self,
        qt: &[f32],
        spans: &[(usize, usize)],
        offs: &[usize],
        k: &[T],
        v: &[T],
        part: &mut [f32],
    ) {
        let d = self.head_dim;
        let group = self.num_heads / self.num_kv_heads;
        let mut buf = vec![0f32; d];
        for (r, &(s0, s1)) in spans.iter().enumerate() {
            let n = s1 - s0;
            let mut scores = vec![0f32; group * n];
            for (jj, &off) in offs[s0..s1].iter().enumerate() {
                let kj = to_f32_slice(&k[off..off + d], &mut buf);
                for h in 0..group {
                    scores[h * n + jj] = self.score(dot_f32(&qt[(r * group + h) * d..][..d], kj));
                }
            }
            for h in 0..group {
                let p = &mut part[(r * group + h) * (d + 2)..][..d + 2];
                p.fill(0.0);
                if n == 0 {
                    p[0] = f32::NEG_INFINITY;
                    continue;
                }
                (p[0], p[1]) = exp_shifted(&mut scores[h * n..(h + 1) * n]);
            }
            for (jj, &off) in offs[s0..s1].iter().enumerate() {
                let vj = to_f32_slice(&v[off..off + d], &mut buf);
                for h in 0..group {
                    axpy_f32(&mut part[(r * group + h) * (d + 2) + 2..][..d], scores[h * n + jj], vj);
                }
            }
        }
    }
}

/// Rows of one sequence per work item of the CPU op (one tile of a prompt chunk).
const TILE_ROWS: usize = 16;

/// Positions per softmax segment (segments start at multiples of it).
const SEGMENT: usize = 256;

/// A work item of the attention ops on the CPU (this one and the TurboQuant one).
#[derive(Clone, Copy)]
pub(super) enum Job {
    /// Every segment of a tile of several rows, folded and finished.
    Whole { tile: usize, g: usize },
    /// One segment of a lone row for kv heads `heads.0..heads.1`: head g's partial state goes
    /// to slot `part + (g - heads.0) * stride`.
    Segment { tile: usize, heads: (usize, usize), seg: (usize, usize), part: usize, stride: usize },
}

impl Job {
    /// A `Segment`'s kv heads, each with its partial-state slot.
    pub fn segment_heads(heads: (usize, usize), part: usize, stride: usize) -> impl Iterator<Item = (usize, usize)> {
        (heads.0..heads.1).map(move |g| (g, part + (g - heads.0) * stride))
    }
}

/// The work items of a step: per tile and kv head, one `Whole` item for a tile of several
/// rows, or `Segment` items for each segment of a lone row's context, whose partial states
/// `merges` (tile, kv head, first slot, segments) folds in order.
pub(super) struct JobPlan {
    pub jobs: Vec<Job>,
    pub merges: Vec<(usize, usize, usize, usize)>,
    /// Partial-state slots the `Segment` items fill.
    pub parts: usize,
}

impl JobPlan {
    /// `tiles`: each tile's number of rows and its segments.
    pub fn new(tiles: impl Iterator<Item = (usize, Vec<(usize, usize)>)>, hkv: usize) -> Self {
        let threads = team().threads();
        // Each job with its cost (rows x positions).
        let (mut jobs, mut merges, mut parts) = (Vec::new(), Vec::new(), 0);
        for (ti, (rows, segs)) in tiles.enumerate() {
            if rows > 1 {
                let cost = rows * segs.iter().map(|s| s.1 - s.0).sum::<usize>();
                jobs.extend((0..hkv).map(|g| (cost, Job::Whole { tile: ti, g })));
                continue;
            }
            // A segment's kv heads in one item where there are items enough for the threads:
            // the heads' vectors lie side by side in the cache, so the item reads the
            // segment's memory as one stream. With the kernel's prefetches, 8,192 positions
            // of SmolLM2 streamed from DRAM in 0.96 ms a layer against 1.31 with an item per
            // head, and 0.86 against 1.00 in a quieter run (medians of 5 alternated runs of
            // `cargo bench --bench prefill_attention -- --rows 1 --contexts 8192 --layers
            // 30`). Which heads share an item changes no result.
            let n = segs.len();
            let per_item = (n * hkv / (4 * threads)).clamp(1, hkv);
            merges.extend((0..hkv).map(|g| (ti, g, parts + g * n, n)));
            for (i, &seg) in segs.iter().enumerate() {
                for g0 in (0..hkv).step_by(per_item) {
                    let heads = (g0, (g0 + per_item).min(hkv));
                    let cost = (seg.1 - seg.0) * (heads.1 - heads.0);
                    jobs.push((cost, Job::Segment { tile: ti, heads, seg, part: parts + g0 * n + i, stride: n }));
                }
            }
            parts += hkv * n;
        }
        // The longest first, so that the threads finish together (a prompt's later tiles see
        // more positions; the team hands out jobs in order).
        jobs.sort_by_key(|j| std::cmp::Reverse(j.0));
        JobPlan { jobs: jobs.into_iter().map(|j| j.1).collect(), merges, parts }
    }
}

/// Rows `rows` of one sequence, with each row's positions `[lo, p + 1)` in `spans`.
struct Tile<'a> {
    seq: &'a SeqSlice,
    rows: std::ops::Range<usize>,
    spans: Vec<(usize, usize)>,
    hq: usize,
    hkv: usize,
    d: usize,
    bs: usize,
}

impl<'a> Tile<'a> {
    /// `ranges`: the sequence's bidirectional ranges on this layer (none when causal).
    fn new(a: &PagedAttention<'_>, seq: &'a SeqSlice, rows: std::ops::Range<usize>, ranges: &[(usize, usize)]) -> Self {
        let pos0 = seq.first_position() + (rows.start - seq.q_start);
        let spans = (pos0..pos0 + rows.len())
            .map(|p| {
                let end = ranges.iter().find(|&&(a, b)| a <= p && p < b).map_or(p + 1, |&(_, b)| b);
                (a.window.map_or(0, |w| (p + 1).saturating_sub(w)), end)
            })
            .collect();
        let (hq, hkv, d, bs) = (a.num_heads, a.num_kv_heads, a.head_dim, a.meta.block_size);
        Tile { seq, rows, spans, hq, hkv, d, bs }
    }

    /// The segments of the tile's run of positions, in order.
    fn segments(&self) -> Vec<(usize, usize)> {
        // Rows start no earlier than the first; a bidirectional range may end past the last.
        let lo = self.spans[0].0;
        let hi = self.spans.iter().map(|s| s.1).max().unwrap_or(lo + 1);
        (lo / SEGMENT..=(hi - 1) / SEGMENT).map(|k| ((k * SEGMENT).max(lo), ((k + 1) * SEGMENT).min(hi))).collect()
    }

    /// Offsets of kv head 0's vectors for positions `seg`, block by block (no division per
    /// position).
    fn offsets(&self, (lo, hi): (usize, usize)) -> Vec<usize> {
        let (bs, hkv, d) = (self.bs, self.hkv, self.d);
        let mut offs = Vec::with_capacity(hi - lo);
        for b in lo / bs..=(hi - 1) / bs {
            let base = self.seq.block_table[b] as usize * bs;
            let (j0, j1) = ((b * bs).max(lo), ((b + 1) * bs).min(hi));
            offs.extend((j0..j1).map(|j| (base + j % bs) * hkv * d));
        }
        offs
    }

    /// The query heads of group `g` for the tile's rows, `[rows, group, d]`.
    fn queries(&self, q: &[f32], g: usize) -> Vec<f32> {
        let (hq, d, group) = (self.hq, self.d, self.hq / self.hkv);
        let mut out = Vec::with_capacity(self.rows.len() * group * d);
        for t in self.rows.clone() {
            out.extend_from_slice(&q[(t * hq + g * group) * d..][..group * d]);
        }
        out
    }
}

impl PagedAttention<'_> {
    /// A raw dot product q.k as an attention logit.
    #[inline(always)]
    pub(crate) fn score(&self, dot: f32) -> f32 {
        let s = dot * self.scale;
        match self.softcap {
            Some(cap) => (s / cap).tanh() * cap,
            None => s,
        }
    }
}

mod kernel;
use kernel::{with_scratch, Partial};

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
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        if hkv == 0 || hq % hkv != 0 {
            candle_core::bail!("paged-attention: {hq} query heads do not group over {hkv} KV heads");
        }
        // The kernels read the caches by raw offsets computed from this shape.
        let contiguous = k_l.is_contiguous() && v_l.is_contiguous() && v_l.dims() == k_l.dims();
        let n_slots = match k_l.dims() {
            &[n, h, dd] if h == hkv && dd == d && contiguous => n,
            _ => candle_core::bail!(
                "paged-attention: caches must be contiguous [slots, {hkv}, {d}] tensors of one shape, \
                 got {:?} and {:?}",
                k_l.dims(),
                v_l.dims()
            ),
        };
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
        use super::cuda::Kernel;
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S, WrapErr};

        use super::cuda::{dtype_name, with_u32_slice, PAGED_ATTENTION, PREFILL_ATTENTION};
        use crate::batch::{PREFILL_MIN_ROWS, PREFILL_TILE_ROWS};

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
        if !super::cuda::PAGED_HEAD_DIMS.contains(&d) {
            candle_core::bail!("paged-attention: no CUDA kernel for head_dim {d}");
        }
        // Rows inside an image read to its end (the meta's row_end); the tensor-core prompt
        // kernel knows only causal tiles, so such a layer's chunks go to the kernel below.
        let bidi = (0..self.meta.seqs.len()).any(|i| !self.bidirectional_ranges(i).is_empty());
        let dm = self.meta.device.as_ref().ok_or_else(|| {
            candle_core::Error::Msg(
                "paged-attention: the step's metadata is not on the device (AttentionMeta::upload)".into(),
            )
        })?;
        let group = hq / hkv;
        // Query heads per block: the largest divisor of the group the kernel holds at once, or
        // one when there are too few rows to fill the GPU's ~130 multiprocessors otherwise (a
        // decode step of a few sequences is bound by the latency of each block's loop).
        // With `--batch-invariant`, always one: the two kernels sum in different orders.
        let hb = if rows * hkv < 128 || crate::device::batch_invariant() {
            1
        } else {
            (1..=group.min(8)).rev().find(|h| group % h == 0).unwrap_or(1)
        };
        let (qt, ct) = (dtype_name(q.dtype())?, dtype_name(k.dtype())?);
        // 16-bit rows go to the tensor-core kernel whose blocks take every query head of a KV
        // head (`gqa_decode`), so each key is read once for the group. Its key splits depend on
        // each row's own keys, so a row's bits do not depend on the batch.
        let gqa = qt == ct
            && qt != "f32"
            && super::cuda::PREFILL_HEAD_DIMS.contains(&d)
            && crate::switches::switched_on!("IRIS_CUDA_GQA_DECODE");
        // Otherwise, with one head per block, the kernel that splits each key over lanes and
        // keeps a softmax per lane group (`paged_decode`) instead of block-wide phases, over
        // DECODE_SPLITS blocks per (row, head) that each take every DECODE_SPLITS-th chunk of
        // positions. `IRIS_CUDA_PAGED_DECODE=0` keeps the block-wide kernel, to compare.
        let lane_split = !gqa && hb == 1 && crate::switches::switched_on!("IRIS_CUDA_PAGED_DECODE");
        /// PD_SPLITS in paged_attention.cu.
        const DECODE_SPLITS: usize = 16;
        // Split states are merged by the last block of each to finish (counted on the device)
        // when the blocks fit the GPU at once, or by a kernel of their own
        // (`IRIS_CUDA_FUSED_MERGE=0`: always, to compare): the count costs each block a fence
        // and an atomic, which only hides when all blocks run together.
        let split_merge = |n: usize, blocks: usize, threads: usize, merge: (&super::cuda::Module, String)| {
            let counters = match crate::switches::switched_on!("IRIS_CUDA_FUSED_MERGE") {
                true => super::cuda::arrival_counters(&dev, n, blocks, threads)?,
                false => None,
            };
            Ok::<_, candle_core::Error>(match counters {
                Some(c) => SplitMerge::Counters(c),
                None => SplitMerge::Kernel(merge.0.func(&dev, &merge.1)?),
            })
        };
        let (rows_kernel, decode_cfg) = if gqa {
            let max_splits = crate::switches::tuned!("IRIS_CUDA_DECODE_SPLITS", i32, 32).clamp(1, 64);
            let min_tiles = crate::switches::tuned!("IRIS_CUDA_DECODE_SPLIT_TILES", i32, 2).max(1);
            let (kernel, cfg) = super::cuda::gqa_decode_launch(&dev, qt, d, (rows, hkv, group, max_splits as usize))?;
            let (y, z) = (cfg.grid_dim.1 as usize, max_splits as usize);
            // Counted as threads of a multiprocessor: its shared memory holds two such blocks.
            let merge = (&super::cuda::DECODE_ATTENTION, format!("gqa_decode_merge_{qt}_{d}"));
            let merge = split_merge(rows * y, rows * y * z, 1024, merge)?;
            (RowsKernel::Gqa { kernel, merge, max_splits, min_tiles }, cfg)
        } else {
            let kernel = if lane_split { "paged_decode" } else { "paged_attention" };
            let kernel = PAGED_ATTENTION.func(&dev, &format!("{kernel}_{qt}_{ct}_{d}"))?;
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, (hkv * group / hb) as u32, if lane_split { DECODE_SPLITS as u32 } else { 1 }),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            match lane_split {
                true => {
                    let merge = (&PAGED_ATTENTION, format!("paged_decode_merge_{qt}_{d}"));
                    let merge = split_merge(rows * hq, rows * hq * DECODE_SPLITS, 256, merge)?;
                    (RowsKernel::LaneSplit { kernel, merge }, cfg)
                }
                false => (RowsKernel::BlockWide(kernel), cfg),
            }
        };
        let l = dm.layout;
        if l.rows != rows {
            candle_core::bail!("paged-attention: device metadata has {} rows, the step {rows}", l.rows);
        }
        // Prompt chunks of 16-bit models go to the tensor-core kernel, the other rows here.
        // Their tiles' keys split over up to `splits` blocks, merged by `prefill_merge`. With
        // `--batch-invariant` every row comes here: which kernel takes a prompt row would depend
        // on how its prompt was cut into chunks, and so on the load.
        let prefill = if l.num_tiles > 0
            && !crate::device::batch_invariant()
            && !bidi
            && qt == ct
            && qt != "f32"
            && super::cuda::PREFILL_HEAD_DIMS.contains(&d)
        {
            let grid = (l.num_tiles, hq, l.max_splits);
            let (attend, cfg) = super::cuda::prefill_launch(&dev, "prefill_attention", qt, d, grid)?;
            let merge = PREFILL_ATTENTION.func(&dev, &format!("prefill_merge_{qt}_{d}"))?;
            Some(Prefill { attend, cfg, merge, units: l.split_units, head_dim: d })
        } else {
            None
        };
        let p = Params {
            decode: decode_cfg,
            ints: [hq as i32, hkv as i32, hb as i32, self.meta.block_size as i32],
            bidi: bidi as i32,
            scale: self.scale,
            softcap: self.softcap.unwrap_or(0.0),
            window: self.window.map_or(0, |w| w as i32),
            skip: if prefill.is_some() { PREFILL_MIN_ROWS as i32 } else { i32::MAX },
            chunk: decode_chunk(),
        };
        let (ko, vo) = (k_l.start_offset(), v_l.start_offset());

        struct Prefill {
            attend: Kernel,
            cfg: LaunchConfig,
            merge: Kernel,
            /// Partial states of the split tiles, in units of PREFILL_TILE_ROWS rows.
            units: usize,
            head_dim: usize,
        }
        /// The kernel of the rows the prompt kernel does not take.
        enum RowsKernel {
            /// `paged_attention`: hb query heads a block, block-wide phases.
            BlockWide(Kernel),
            /// `paged_decode`: a query head a block, its position splits merged as given.
            LaneSplit { kernel: Kernel, merge: SplitMerge },
            /// `gqa_decode`: up to 16 query heads of a KV head a block, on tensor cores.
            Gqa { kernel: Kernel, merge: SplitMerge, max_splits: i32, min_tiles: i32 },
        }
        /// How a kernel's key splits are merged.
        enum SplitMerge {
            /// By the last block to finish, counting arrivals in these (left at zero).
            Counters(&'static CudaSlice<u32>),
            /// By a kernel of its own.
            Kernel(Kernel),
        }
        struct Params {
            decode: LaunchConfig,
            ints: [i32; 4],
            /// 1: rows read to their meta's row_end.
            bidi: i32,
            scale: f32,
            softcap: f32,
            window: i32,
            skip: i32,
            /// Positions per chunk of the lane-split kernel.
            chunk: i32,
        }
        struct Meta<'m> {
            row_seq: CudaView<'m, u32>,
            seq_info: CudaView<'m, u32>,
            tiles: CudaView<'m, u32>,
            block_tables: CudaView<'m, u32>,
            row_end: CudaView<'m, u32>,
        }
        #[allow(clippy::too_many_arguments)]
        fn launch<Q: CudaDType + DeviceRepr, C: DeviceRepr>(
            dev: &candle_core::cuda_backend::CudaDevice,
            decode: &RowsKernel,
            prefill: &Option<Prefill>,
            p: &Params,
            n_out: usize,
            (q, k, v): (CudaView<Q>, CudaView<C>, CudaView<C>),
            m: &Meta,
        ) -> Result<CudaStorage> {
            // SAFETY: the kernels together write every element of the output.
            let out: CudaSlice<Q> = unsafe { dev.alloc::<Q>(n_out)? };
            let [hq, hkv, hb, bs] = p.ints;
            let (rows, splits) = (p.decode.grid_dim.0 as usize, p.decode.grid_dim.2 as usize);
            let d = n_out / (rows * hq as usize);
            match decode {
                RowsKernel::Gqa { kernel, merge, max_splits, min_tiles } => {
                    // SAFETY: each split block writes its rows' whole states; the merge reads only
                    // the splits of rows the blocks wrote (both skip the same rows).
                    let part: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows * hq as usize * splits * (d + 2))? };
                    let mut b = kernel.dependent();
                    b.mem(&out);
                    match merge {
                        SplitMerge::Counters(c) => b.mem(*c),
                        SplitMerge::Kernel(_) => b.null(),
                    };
                    b.mem(&part).mem(&q).mem(&k).mem(&v).mem(&m.row_seq).mem(&m.seq_info).mem(&m.block_tables);
                    b.mem(&m.row_end).scalar(&p.bidi).scalar(&hq).scalar(&hkv).scalar(&bs).scalar(&p.scale);
                    b.scalar(&p.window).scalar(&p.softcap).scalar(&p.skip).scalar(max_splits).scalar(min_tiles);
                    // SAFETY: argument types and counts match the kernel's signature; block tables
                    // were checked; the counters hold an entry per (row, block of heads)
                    // (arrival_counters); the kernel waits (pdl_wait) before it reads or writes.
                    unsafe { b.launch(p.decode) }?;
                    if let SplitMerge::Kernel(merge) = merge {
                        let cfg = LaunchConfig {
                            grid_dim: (rows as u32, p.decode.grid_dim.1, 1),
                            block_dim: (128, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let mut b = merge.dependent();
                        b.mem(&out).mem(&part).mem(&m.row_seq).mem(&m.seq_info).mem(&m.row_end).scalar(&p.bidi);
                        b.scalar(&hq).scalar(&hkv).scalar(&p.window).scalar(&p.skip).scalar(max_splits);
                        b.scalar(min_tiles);
                        // SAFETY: as above.
                        unsafe { b.launch(cfg) }?;
                    }
                }
                RowsKernel::LaneSplit { kernel, merge } => {
                    // SAFETY: each decode block writes its whole state; the merge reads only rows the
                    // decode blocks wrote (both skip the same prompt chunks).
                    let part: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows * hq as usize * splits * (d + 2))? };
                    let mut b = kernel.dependent();
                    b.mem(&out);
                    match merge {
                        SplitMerge::Counters(c) => b.mem(*c),
                        SplitMerge::Kernel(_) => b.null(),
                    };
                    b.mem(&part).mem(&q).mem(&k).mem(&v).mem(&m.row_seq).mem(&m.seq_info).mem(&m.block_tables);
                    b.mem(&m.row_end).scalar(&p.bidi).scalar(&hq).scalar(&hkv).scalar(&hb).scalar(&bs);
                    b.scalar(&p.scale).scalar(&p.window).scalar(&p.softcap).scalar(&p.skip).scalar(&p.chunk);
                    // SAFETY: argument types and counts match the kernel's signature; block tables were
                    // checked; the counters hold rows x heads entries (arrival_counters); the kernel
                    // waits (pdl_wait) before it reads or writes.
                    unsafe { b.launch(p.decode) }?;
                    if let SplitMerge::Kernel(merge) = merge {
                        let cfg = LaunchConfig {
                            grid_dim: (rows as u32, hq as u32, 1),
                            block_dim: (d.min(256) as u32, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let mut b = merge.dependent();
                        b.mem(&out).mem(&part).mem(&m.row_seq).mem(&m.seq_info).scalar(&hq).scalar(&p.skip);
                        // SAFETY: as above.
                        unsafe { b.launch(cfg) }?;
                    }
                }
                RowsKernel::BlockWide(kernel) => {
                    let mut b = kernel.builder();
                    b.arg(&out).arg(&q).arg(&k).arg(&v).arg(&m.row_seq).arg(&m.seq_info).arg(&m.block_tables);
                    b.arg(&m.row_end)
                        .arg(&p.bidi)
                        .arg(&hq)
                        .arg(&hkv)
                        .arg(&hb)
                        .arg(&bs)
                        .arg(&p.scale)
                        .arg(&p.window)
                        .arg(&p.softcap)
                        .arg(&p.skip);
                    // SAFETY: argument types and counts match the kernel's signature; block tables were checked.
                    unsafe { b.launch(p.decode) }.w()?;
                }
            }
            if let Some(pf) = prefill {
                // SAFETY: the split blocks write every partial state the merge reads.
                let part: CudaSlice<f32> = unsafe {
                    dev.alloc::<f32>((pf.units * PREFILL_TILE_ROWS * hq as usize * (pf.head_dim + 2)).max(1))?
                };
                let mut b = pf.attend.builder();
                b.arg(&out).arg(&part).arg(&q).arg(&k).arg(&v).arg(&m.tiles).arg(&m.seq_info).arg(&m.block_tables);
                b.arg(&hq).arg(&hkv).arg(&bs).arg(&p.scale).arg(&p.window).arg(&p.softcap);
                // SAFETY: as above; the tiles cover exactly the rows the first kernel skipped, and
                // their partial states fit `part` (MetaLayout::split_units).
                unsafe { b.launch(pf.cfg) }.w()?;
                if pf.units > 0 {
                    let cfg = LaunchConfig {
                        grid_dim: (pf.cfg.grid_dim.0, hq as u32, 1),
                        block_dim: (32, 8, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut b = pf.merge.builder();
                    b.arg(&out).arg(&part).arg(&m.tiles).arg(&m.seq_info).arg(&hq).arg(&p.window);
                    // SAFETY: as above; it reads the partial states the launch before wrote.
                    unsafe { b.launch(cfg) }.w()?;
                }
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let out = with_u32_slice(&dm.data, |data| {
            let m = Meta {
                row_seq: data.slice(l.row_seq..l.row_seq + rows),
                seq_info: data.slice(l.seq_info..l.rings),
                tiles: data.slice(l.tiles..l.block_tables),
                block_tables: data.slice(l.block_tables..),
                row_end: data.slice(l.row_end..l.tiles),
            };
            let n = rows * hq * d;
            match (&q.slice, &k.slice, &v.slice) {
                (S::F32(q), S::F32(k), S::F32(v)) => {
                    launch(&dev, &rows_kernel, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::F32(q), S::BF16(k), S::BF16(v)) => {
                    launch(&dev, &rows_kernel, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::F32(q), S::F16(k), S::F16(v)) => {
                    launch(&dev, &rows_kernel, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::BF16(q), S::BF16(k), S::BF16(v)) => {
                    launch(&dev, &rows_kernel, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                (S::F16(q), S::F16(k), S::F16(v)) => {
                    launch(&dev, &rows_kernel, &prefill, &p, n, (q.slice(qa..qb), k.slice(ko..), v.slice(vo..)), &m)
                }
                _ => candle_core::bail!("paged-attention: {qt} queries over a {ct} cache are not supported"),
            }
        })?;
        Ok((out, shape))
    }
}

#[cfg(test)]
mod tests;

/// Positions per chunk of the lane-split decode kernel (its blocks take every 16th chunk): 64,
/// so that short contexts spread over several blocks (`IRIS_CUDA_DECODE_CHUNK=N`, to compare).
#[cfg(feature = "cuda")]
fn decode_chunk() -> i32 {
    crate::switches::tuned!("IRIS_CUDA_DECODE_CHUNK", i32, 64).max(1)
}
