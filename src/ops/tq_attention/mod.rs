//! Paged attention over TurboQuant codes, for any mix of prefill chunks and decodes.
//!
//! A key stored as (n, idx) stands for n R^T c[idx], so q . k = n (R q) . c[idx]: each query
//! head is rotated once, and every key costs a codebook lookup per coordinate, no inverse
//! rotation. Values are summed in the rotated space, sum_j p_j n_j c[idx_j], and rotated back
//! once per query head at the end.
//!
//! With a float window of w tokens, a row at position p reads positions p - w < j <= p from
//! floats instead: the chunk's own rows from this step's keys and values, older ones from its
//! sequence's ring. Which positions a row reads as codes depends only on p, so a sequence's
//! values are the same however its prompt was chunked and whatever shares its batch.
//!
//! A row's softmax is computed per segment of 256 positions and the segments merged in order
//! (the online softmax of flash attention). Work items are (tile of up to 16 rows of one
//! sequence, kv head), a tile decoding each block of codes once for all its rows; a decode's
//! lone row is split further into one item per segment, merged by a second loop, so a long
//! context uses every thread. Each row's arithmetic is the same however it was split, so
//! prefill, chunked prefill and token-by-token decode give bit-identical results.
//!
//! `op.rs` says what the op reads (shared with the CUDA launches, `cuda.rs`); this file has
//! the CPU work items and the candle op; `kernel.rs` their inner operations.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::kv_elem::{f32_slice, to_f32_slice, KvElem};
use super::kv_write::KvWrite;
use super::paged_attention::softmax::{exp_shifted, fold};
use super::paged_attention::{Job, JobPlan, PagedAttention};
use super::team::{team, OutPtr};
use super::tq_write::TqWrite;
use super::turboquant::{TqCodec, TqLayerCache};
use crate::simd::{Simd, WithSimd};

#[cfg(feature = "cuda")]
mod cuda;
mod kernel;
mod op;

use kernel::{Kernel, Lanes, Portable};
pub use op::{FloatInputs, TqAttention};

/// Rows per tile at most.
const TILE_ROWS: usize = 16;
/// A row's softmax runs per segment of absolute positions [k S, (k+1) S), merged in order
/// (online softmax), so a long context splits into work items without changing a row's
/// arithmetic.
const SEGMENT: usize = 256;

/// `FloatInputs` as slices.
struct Floats<'s, T> {
    len: usize,
    k: FloatSource<'s, T>,
    v: FloatSource<'s, T>,
}

/// Where float keys (or values) are: this step's rows, and the rings of earlier positions.
struct FloatSource<'s, T> {
    ring: &'s [T],
    new: &'s [f32],
}

/// A float vector's row: in this step's rows, or in the rings.
#[derive(Clone, Copy)]
enum FloatRow {
    New(usize),
    Ring(usize),
}

/// One row's key positions: codes in [lo, split), floats in [split, end).
#[derive(Clone, Copy)]
struct RowSpan {
    lo: usize,
    split: usize,
    end: usize,
}

impl TqAttention<'_> {
    /// q: `[T, heads, head_dim]` f32; codes `[slots, kv_heads, row]` u8. Returns `[T, heads, head_dim]` f32.
    pub fn forward(&self, q: &Tensor, k_codes: &Tensor, v_codes: &Tensor) -> Result<Tensor> {
        q.apply_op3_no_bwd(k_codes, v_codes, self)
    }

    fn run<T: KvElem>(
        &self,
        q: &[f32],
        kc: &[u8],
        vc: &[u8],
        n_slots: usize,
        fl: Option<Floats<T>>,
    ) -> Result<Vec<f32>> {
        let a = &self.attn;
        let meta = a.meta;
        let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let rows = meta.num_rows();
        self.check(q.len(), n_slots)?;
        let mut rings: &[u32] = &[];
        if let (Some(f), Some(inputs)) = (&fl, &self.float) {
            rings = inputs.rings(meta, f.k.ring.len() / (hkv * d))?;
            let new = rows * hkv * d;
            if f.k.new.len() != new || f.v.new.len() != new || f.v.ring.len() != f.k.ring.len() {
                candle_core::bail!("tq-attention: float window inputs of the wrong size");
            }
        }
        let group = hq / hkv;
        let fw = fl.as_ref().map_or(0, |f| f.len);
        // Tiles of up to TILE_ROWS rows of one sequence. A tile of several rows is one work
        // item per kv head; a lone row (a decode) is one per kv head and segment of its
        // context, merged by a second loop, so long contexts use every thread.
        let mut tiles = Vec::new();
        for (si, s) in meta.seqs.iter().enumerate() {
            let mut r = s.q_start;
            while r < s.q_start + s.q_len {
                let e = (r + TILE_ROWS).min(s.q_start + s.q_len);
                tiles.push(Tile::new(a, fw, si, r..e));
                r = e;
            }
        }
        let JobPlan { jobs, merges, parts } = JobPlan::new(tiles.iter().map(|t| (t.rows.len(), t.segments())), hkv);
        let part_len = group * (d + 2);
        let mut partials = vec![0f32; parts * part_len];
        let pdst = OutPtr(partials.as_mut_ptr());
        let mut out = vec![0f32; q.len()];
        let dst = OutPtr(out.as_mut_ptr());
        let io = Io { q, kc, vc, fl: fl.as_ref(), rings, dst };
        // 16-lane kernels for head dims of whole vectors and codes of 2 to 4 bits (the
        // decoder's lookup); the portable one otherwise.
        let lanes = d % 16 == 0 && [self.key.bits(), self.value.bits()].iter().all(|b| (2..=4).contains(b));
        let isa = self.attn.isa;
        // Runs `work` with the kernel for this machine and head size.
        let with_kernel = |work: Work<'_>, tile: &Tile, g: usize| {
            if !lanes {
                return Run::<T, 0> { op: self, io: &io, tile, g, work }.with(Portable);
            }
            match d / 16 {
                4 => isa.run(Run::<T, 4> { op: self, io: &io, tile, g, work }),
                8 => isa.run(Run::<T, 8> { op: self, io: &io, tile, g, work }),
                16 => isa.run(Run::<T, 16> { op: self, io: &io, tile, g, work }),
                _ => isa.run(Run::<T, 0> { op: self, io: &io, tile, g, work }),
            }
        };
        team().for_each(jobs.len(), |i| match jobs[i] {
            Job::Whole { tile, g } => with_kernel(Work::Whole, &tiles[tile], g),
            Job::Segment { tile, heads, seg, part, stride } => {
                for (g, slot) in Job::segment_heads(heads, part, stride) {
                    // SAFETY: each (segment, head) owns its slot of `partials`.
                    let p = unsafe { std::slice::from_raw_parts_mut(pdst.at(slot * part_len), part_len) };
                    with_kernel(Work::Segment(seg, p), &tiles[tile], g)
                }
            }
        });
        team().for_each(merges.len(), |i| {
            let (tile, g, first, n) = merges[i];
            with_kernel(Work::Merge(&partials[first * part_len..(first + n) * part_len]), &tiles[tile], g)
        });
        Ok(out)
    }

    /// The queries of a tile's rows for kv head `g`, rotated like the keys: `[rows, group, d]`.
    #[inline(always)]
    fn rotated_queries(&self, q: &[f32], tile: &Tile, g: usize) -> Vec<f32> {
        let a = &self.attn;
        let (hq, d) = (a.num_heads, a.head_dim);
        let group = hq / a.num_kv_heads;
        let mut qr = vec![0f32; tile.rows.len() * group * d];
        let mut scaled = vec![0f32; d];
        for (r, t) in tile.rows.clone().enumerate() {
            for h in 0..group {
                let qh = &q[(t * hq + g * group + h) * d..][..d];
                let qh = match self.key_scale {
                    Some(s) => {
                        scaled.iter_mut().zip(qh.iter().zip(&s[g * d..][..d])).for_each(|(o, (a, b))| *o = a / b);
                        &scaled
                    }
                    None => qh,
                };
                self.key.rotation().apply(qh, &mut qr[(r * group + h) * d..][..d]);
            }
        }
        qr
    }

    /// One segment [a, b) of coded positions for every row of `tile`: per (row, head) the
    /// segment's max score m, sum l of exp(s - m), and the values weighted by exp(s - m)
    /// (rotated space), into `part` as `[rows, group, 2 + d]`; m = -inf where a row has no
    /// coded position in the segment.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn segment<T: KvElem, K: Kernel>(
        &self,
        k: K,
        io: &Io<T>,
        tile: &Tile,
        qr: &[f32],
        g: usize,
        (a0, b0): (usize, usize),
        part: &mut [f32],
    ) {
        let a = &self.attn;
        let (hkv, d, bs) = (a.num_kv_heads, a.head_dim, a.meta.block_size);
        let group = a.num_heads / hkv;
        let seq = &a.meta.seqs[tile.si];
        let n = b0 - a0;
        let mut scores = vec![0f32; tile.spans.len() * group * n];
        let mut buf = vec![0f32; bs * d];
        let mut norms = vec![0f32; bs];
        // The part of the segment each row reads as codes.
        let range = |s: &RowSpan| (a0.max(s.lo), b0.min(s.split));
        let mut dots = [0f32; 16];
        for (b, j0, j1) in block_parts(a0, b0, bs) {
            self.decode_block(k, self.key, io.kc, seq.block_table[b] as usize, j0..j1, g, &mut buf, &mut norms);
            for (r, s) in tile.spans.iter().enumerate() {
                let (lo, hi) = range(s);
                let (x0, x1) = (j0.max(lo), j1.min(hi));
                for h in 0..group {
                    let q = &qr[(r * group + h) * d..][..d];
                    let sc = &mut scores[(r * group + h) * n..][..n];
                    // 16 keys at a time while the block holds 16 more (those past the row's
                    // range are computed and dropped), then one by one: the same bits either way.
                    let mut j = x0;
                    while j < x1 && j + 16 <= j1 {
                        k.dot16(q, &buf[(j - j0) * d..][..16 * d], &mut dots);
                        for (i, &x) in dots.iter().enumerate().take(x1 - j) {
                            sc[j + i - a0] = a.score(norms[j + i - j0] * x);
                        }
                        j += 16;
                    }
                    for j in j..x1 {
                        sc[j - a0] = a.score(norms[j - j0] * k.dot(q, &buf[(j - j0) * d..][..d]));
                    }
                }
            }
        }
        part.iter_mut().for_each(|x| *x = 0.0);
        for (r, s) in tile.spans.iter().enumerate() {
            let (lo, hi) = range(s);
            for h in 0..group {
                let p = &mut part[(r * group + h) * (d + 2)..][..d + 2];
                if hi <= lo {
                    p[0] = f32::NEG_INFINITY;
                    continue;
                }
                let sc = &mut scores[(r * group + h) * n + lo - a0..(r * group + h) * n + hi - a0];
                let (m, l) = exp_shifted(sc);
                p[0] = m;
                p[1] = l;
            }
        }
        let mut weights = vec![0f32; bs];
        for (b, j0, j1) in block_parts(a0, b0, bs) {
            self.decode_block(k, self.value, io.vc, seq.block_table[b] as usize, j0..j1, g, &mut buf, &mut norms);
            for (r, s) in tile.spans.iter().enumerate() {
                let (lo, hi) = range(s);
                let (x0, x1) = (j0.max(lo), j1.min(hi));
                if x0 >= x1 {
                    continue;
                }
                for h in 0..group {
                    let w = &mut weights[..x1 - x0];
                    for (j, wj) in (x0..x1).zip(w.iter_mut()) {
                        *wj = scores[(r * group + h) * n + j - a0] * norms[j - j0];
                    }
                    k.axpy_rows(&mut part[(r * group + h) * (d + 2) + 2..][..d], w, &buf[(x0 - j0) * d..]);
                }
            }
        }
    }

    /// The output heads of row `r` of `tile` from its merged coded state (M, L, rotated total):
    /// the float window's positions joined as a last segment, one inverse rotation, 1 / L.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn finish<T: KvElem, K: Kernel>(&self, k: K, io: &Io<T>, tile: &Tile, r: usize, g: usize, states: &mut [f32]) {
        let a = &self.attn;
        let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let group = hq / hkv;
        let seq = &a.meta.seqs[tile.si];
        let s = tile.spans[r];
        let t = tile.rows.start + r;
        // SAFETY: the item finishing (row t, kv head g) is the only writer of its heads.
        let o = unsafe { std::slice::from_raw_parts_mut(io.dst.at((t * hq + g * group) * d), group * d) };
        for (h, oh) in o.chunks_exact_mut(d).enumerate() {
            let st = &states[h * (d + 2)..][..d + 2];
            if st[0] == f32::NEG_INFINITY {
                oh.iter_mut().for_each(|x| *x = 0.0);
            } else {
                self.value.rotation().apply_inverse(&st[2..], oh);
            }
        }
        let mut ls: Vec<f32> = (0..group).map(|h| states[h * (d + 2) + 1]).collect();
        if let (Some(f), true) = (io.fl, s.split < s.end) {
            let first = seq.first_position();
            let float_row = |j: usize| {
                if j < first {
                    FloatRow::Ring(io.rings[tile.si] as usize * f.len + j % f.len)
                } else {
                    FloatRow::New(seq.q_start + j - first)
                }
            };
            let n = s.end - s.split;
            let mut scores = vec![0f32; group * n];
            let mut buf = vec![0f32; d];
            for j in s.split..s.end {
                let kj = f.k.get(float_row(j), g, hkv, d, &mut buf);
                for h in 0..group {
                    let qh = &io.q[(t * hq + g * group + h) * d..][..d];
                    scores[h * n + j - s.split] = a.score(k.dot(qh, kj));
                }
            }
            let mut acc = vec![0f32; group * d];
            let mut ms = vec![0f32; group];
            let mut lf = vec![0f32; group];
            for h in 0..group {
                (ms[h], lf[h]) = exp_shifted(&mut scores[h * n..(h + 1) * n]);
            }
            for j in s.split..s.end {
                let vj = f.v.get(float_row(j), g, hkv, d, &mut buf);
                for h in 0..group {
                    k.axpy(&mut acc[h * d..][..d], scores[h * n + j - s.split], vj);
                }
            }
            for (h, oh) in o.chunks_exact_mut(d).enumerate() {
                let mc = states[h * (d + 2)];
                let mn = mc.max(ms[h]);
                let (x, y) = ((mc - mn).exp(), (ms[h] - mn).exp());
                k.scale(oh, x);
                k.axpy(oh, y, &acc[h * d..][..d]);
                ls[h] = ls[h] * x + lf[h] * y;
            }
        }
        for (h, oh) in o.chunks_exact_mut(d).enumerate() {
            k.scale(oh, 1.0 / ls[h]);
        }
    }

    /// A work item for a tile of several rows and kv head `g`: every segment, then finish.
    #[inline(always)]
    fn whole<T: KvElem, K: Kernel>(&self, k: K, io: &Io<T>, tile: &Tile, g: usize) {
        let d = self.attn.head_dim;
        let group = self.attn.num_heads / self.attn.num_kv_heads;
        let rows = tile.rows.len();
        let qr = self.rotated_queries(io.q, tile, g);
        let mut states = vec![0f32; rows * group * (d + 2)];
        for st in states.chunks_exact_mut(d + 2) {
            st[0] = f32::NEG_INFINITY;
        }
        let mut part = vec![0f32; rows * group * (d + 2)];
        for seg in tile.segments() {
            self.segment(k, io, tile, &qr, g, seg, &mut part);
            for (st, p) in states.chunks_exact_mut(d + 2).zip(part.chunks_exact(d + 2)) {
                fold(st, p);
            }
        }
        for r in 0..rows {
            self.finish(k, io, tile, r, g, &mut states[r * group * (d + 2)..][..group * (d + 2)]);
        }
    }

    /// A work item for one segment of a lone row's context.
    #[inline(always)]
    fn segment_job<T: KvElem, K: Kernel>(
        &self,
        k: K,
        io: &Io<T>,
        tile: &Tile,
        g: usize,
        seg: (usize, usize),
        part: &mut [f32],
    ) {
        let qr = self.rotated_queries(io.q, tile, g);
        self.segment(k, io, tile, &qr, g, seg, part);
    }

    /// Merges a lone row's segments (`parts`, in order) and finishes it.
    #[inline(always)]
    fn merge<T: KvElem, K: Kernel>(&self, k: K, io: &Io<T>, tile: &Tile, g: usize, parts: &[f32]) {
        let d = self.attn.head_dim;
        let group = self.attn.num_heads / self.attn.num_kv_heads;
        let mut states = vec![0f32; group * (d + 2)];
        for st in states.chunks_exact_mut(d + 2) {
            st[0] = f32::NEG_INFINITY;
        }
        for part in parts.chunks_exact(group * (d + 2)) {
            for (st, p) in states.chunks_exact_mut(d + 2).zip(part.chunks_exact(d + 2)) {
                fold(st, p);
            }
        }
        self.finish(k, io, tile, 0, g, &mut states);
    }

    /// Decodes the codes of kv head `g` at positions `js` (all in block `block`) into `tile`
    /// (rotated unit vectors, c[idx]) and `norms`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn decode_block<K: Kernel>(
        &self,
        k: K,
        codec: &TqCodec,
        codes: &[u8],
        block: usize,
        js: std::ops::Range<usize>,
        g: usize,
        tile: &mut [f32],
        norms: &mut [f32],
    ) {
        let (bs, hkv, d) = (self.attn.meta.block_size, self.attn.num_kv_heads, self.attn.head_dim);
        let row = codec.row_bytes();
        let j0 = js.start;
        for j in js {
            let off = ((block * bs + j % bs) * hkv + g) * row;
            let src = &codes[off..off + row];
            k.decode(codec, src, &mut tile[(j - j0) * d..][..d]);
            norms[j - j0] = codec.norm(src);
        }
    }
}

/// The op's inputs and output, for its work items.
struct Io<'s, T> {
    q: &'s [f32],
    kc: &'s [u8],
    vc: &'s [u8],
    fl: Option<&'s Floats<'s, T>>,
    /// Each sequence's float-window ring (checked against the rings' size), with `fl`.
    rings: &'s [u32],
    dst: OutPtr,
}

/// Rows of one sequence computed together, and what each row reads.
struct Tile {
    si: usize,
    rows: std::ops::Range<usize>,
    spans: Vec<RowSpan>,
}

impl Tile {
    fn new(a: &PagedAttention<'_>, float_window: usize, si: usize, rows: std::ops::Range<usize>) -> Self {
        let seq = &a.meta.seqs[si];
        let first = seq.first_position();
        let ranges = a.bidirectional_ranges(si);
        let spans = rows
            .clone()
            .map(|t| {
                let p = first + (t - seq.q_start);
                let lo = a.window.map_or(0, |w| (p + 1).saturating_sub(w));
                // A row in a bidirectional range reads to its end (no float window then).
                let end = ranges.iter().find(|&&(a, b)| a <= p && p < b).map_or(p + 1, |&(_, b)| b);
                RowSpan { lo, split: end.saturating_sub(float_window).max(lo), end }
            })
            .collect();
        Tile { si, rows, spans }
    }

    /// The segments [a, b) of absolute positions any row reads as codes, in order.
    fn segments(&self) -> Vec<(usize, usize)> {
        let lo = self.spans.iter().map(|s| s.lo).min().unwrap_or(0);
        let hi = self.spans.iter().map(|s| s.split).max().unwrap_or(0);
        if hi <= lo {
            return Vec::new();
        }
        (lo / SEGMENT..=(hi - 1) / SEGMENT).map(|k| ((k * SEGMENT).max(lo), ((k + 1) * SEGMENT).min(hi))).collect()
    }
}

/// What a work item does (see `Job`): a whole tile, one segment of a lone row into its slot of
/// the partial states, or the merge of a lone row's segments.
enum Work<'a> {
    Whole,
    Segment((usize, usize), &'a mut [f32]),
    Merge(&'a [f32]),
}

/// A work item of tile `tile` and kv head `g`, run with a kernel: `Lanes` of the set
/// `Isa::run` gives it (its code inlines into the set's entry point), or `Portable`.
struct Run<'a, T, const DV: usize> {
    op: &'a TqAttention<'a>,
    io: &'a Io<'a, T>,
    tile: &'a Tile,
    g: usize,
    work: Work<'a>,
}

impl<T: KvElem, const DV: usize> Run<'_, T, DV> {
    #[inline(always)]
    fn with<K: Kernel>(self, k: K) {
        let Run { op, io, tile, g, work } = self;
        match work {
            Work::Whole => op.whole(k, io, tile, g),
            Work::Segment(seg, part) => op.segment_job(k, io, tile, g, seg, part),
            Work::Merge(parts) => op.merge(k, io, tile, g, parts),
        }
    }
}

impl<T: KvElem, const DV: usize> WithSimd for Run<'_, T, DV> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        self.with(Lanes::<S, DV>(s))
    }
}

/// Attention over a TurboQuant cache that already holds the step's keys and values
/// (`QkvRope::forward_into_tq_cache`), then the step's last tokens kept in the sequences'
/// rings. `fresh`: the step's k and v rows, which a float window reads (the model's type on
/// a GPU, f32 on the CPU).
pub fn attend_written(
    attn: PagedAttention<'_>,
    c: &TqLayerCache,
    q: &Tensor,
    fresh: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    let meta = attn.meta;
    if c.window.is_some() && (0..meta.seqs.len()).any(|i| !attn.bidirectional_ranges(i).is_empty()) {
        candle_core::bail!("tq-attention: bidirectional image ranges beside a float window are not supported");
    }
    let float = match (&c.window, fresh) {
        (None, _) => None,
        (Some(w), Some((k, v))) => Some(FloatInputs { len: w.len, ring_k: &w.k, ring_v: &w.v, new_k: k, new_v: v }),
        (Some(_), None) => candle_core::bail!("tq-attention: a float window reads the step's keys and values"),
    };
    let out = TqAttention::over(attn, c, float).forward(q, &c.k, &c.v)?;
    // After the op: it reads the rings' older positions, which these writes may replace.
    if let (Some(w), Some((k, v))) = (&c.window, fresh) {
        let write = KvWrite::to_ring(meta, w.len)?;
        w.k.inplace_op2(k, &write)?;
        w.v.inplace_op2(v, &write)?;
    }
    Ok(out)
}

/// A layer's whole step on a TurboQuant cache: quantizes the step's keys and values into
/// their slots, then `attend_written`. `q`, `k`, `v` are the step's contiguous rows.
pub fn write_and_attend(
    attn: PagedAttention<'_>,
    c: &TqLayerCache,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor> {
    let meta = attn.meta;
    c.k.inplace_op2(k, &TqWrite::keys(c, &meta.slot_mapping, meta.device.as_ref()))?;
    c.v.inplace_op2(v, &TqWrite::values(c, &meta.slot_mapping, meta.device.as_ref()))?;
    attend_written(attn, c, q, Some((k, v)))
}

/// The parts [j0, j1) of [lo, hi) in each block b, as (b, j0, j1), in order. (A loop over
/// these rather than a callback: a closure would not inherit the AVX-512 target feature of
/// its caller, and its intrinsics would not inline.)
fn block_parts(lo: usize, hi: usize, bs: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let blocks = if hi > lo { lo / bs..(hi - 1) / bs + 1 } else { 0..0 };
    blocks.map(move |b| (b, (b * bs).max(lo), ((b + 1) * bs).min(hi)))
}

impl<T: KvElem> FloatSource<'_, T> {
    /// Head `g` of the vector at `row`. This step's rows are rounded to the rings' type, so
    /// that a value reads the same before and after it moved into a ring.
    fn get<'b>(&'b self, row: FloatRow, g: usize, hkv: usize, d: usize, buf: &'b mut [f32]) -> &'b [f32] {
        match row {
            FloatRow::New(t) => {
                let x = &self.new[(t * hkv + g) * d..][..d];
                if T::as_f32(self.ring).is_some() {
                    return x;
                }
                buf.iter_mut().zip(x).for_each(|(b, v)| *b = T::from_f32(*v).to_f32());
                buf
            }
            FloatRow::Ring(r) => to_f32_slice(&self.ring[(r * hkv + g) * d..][..d], buf),
        }
    }
}

/// The contiguous data of a CPU tensor, for the inputs this op reads besides its operands.
fn cpu_storage<'g>(s: &'g Storage, what: &str) -> Result<&'g CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        _ => candle_core::bail!("tq-attention: {what} is not on the CPU"),
    }
}

impl CustomOp3 for TqAttention<'_> {
    fn name(&self) -> &'static str {
        "tq-attention"
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
        let q = f32_slice(q, q_l, "tq-attention q")?;
        let (kc, vc) = match (k, v) {
            (CpuStorage::U8(k), CpuStorage::U8(v)) => (k, v),
            _ => candle_core::bail!("tq-attention: the caches must be u8 codes"),
        };
        let (hkv, d) = (self.attn.num_kv_heads, self.attn.head_dim);
        for (l, row) in [(k_l, self.key.row_bytes()), (v_l, self.value.row_bytes())] {
            if l.dims().len() != 3 || !l.is_contiguous() || l.dims()[1] != hkv || l.dims()[2] != row {
                candle_core::bail!("tq-attention: caches must be contiguous [slots, {hkv}, row bytes]");
            }
        }
        if k_l.dims()[0] != v_l.dims()[0] {
            candle_core::bail!("tq-attention: key and value caches differ in slots");
        }
        let n_slots = k_l.dims()[0];
        let (kc, vc) = (&kc[k_l.start_offset()..], &vc[v_l.start_offset()..]);
        let out = match &self.float {
            None => self.run::<f32>(q, kc, vc, n_slots, None)?,
            Some(f) => {
                let (nk_g, nk_l) = f.new_k.storage_and_layout();
                let (nv_g, nv_l) = f.new_v.storage_and_layout();
                let new_k = f32_slice(cpu_storage(&nk_g, "new keys")?, nk_l, "tq-attention new keys")?;
                let new_v = f32_slice(cpu_storage(&nv_g, "new values")?, nv_l, "tq-attention new values")?;
                let (rk_g, rk_l) = f.ring_k.storage_and_layout();
                let (rv_g, rv_l) = f.ring_v.storage_and_layout();
                if !rk_l.is_contiguous() || !rv_l.is_contiguous() {
                    candle_core::bail!("tq-attention: float rings must be contiguous");
                }
                let (ko, vo) = (rk_l.start_offset(), rv_l.start_offset());
                fn floats<'s, T>(len: usize, rk: &'s [T], rv: &'s [T], nk: &'s [f32], nv: &'s [f32]) -> Floats<'s, T> {
                    Floats { len, k: FloatSource { ring: rk, new: nk }, v: FloatSource { ring: rv, new: nv } }
                }
                match (cpu_storage(&rk_g, "key ring")?, cpu_storage(&rv_g, "value ring")?) {
                    (CpuStorage::F32(rk), CpuStorage::F32(rv)) => {
                        self.run(q, kc, vc, n_slots, Some(floats(f.len, &rk[ko..], &rv[vo..], new_k, new_v)))?
                    }
                    (CpuStorage::BF16(rk), CpuStorage::BF16(rv)) => {
                        self.run(q, kc, vc, n_slots, Some(floats(f.len, &rk[ko..], &rv[vo..], new_k, new_v)))?
                    }
                    (CpuStorage::F16(rk), CpuStorage::F16(rv)) => {
                        self.run(q, kc, vc, n_slots, Some(floats(f.len, &rk[ko..], &rv[vo..], new_k, new_v)))?
                    }
                    (rk, _) => candle_core::bail!("tq-attention: unsupported ring dtype {:?}", rk.dtype()),
                }
            }
        };
        let shape = Shape::from((self.attn.meta.num_rows(), self.attn.num_heads, d));
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
        if (0..self.attn.meta.seqs.len()).any(|i| !self.attn.bidirectional_ranges(i).is_empty()) {
            candle_core::bail!("tq-attention: bidirectional image ranges have no CUDA kernel yet");
        }
        cuda::forward(self, q, q_l, k, k_l, v, v_l)
    }
}

#[cfg(test)]
mod tests;
