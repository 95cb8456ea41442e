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
//! Work items are (tile of up to 16 rows of one sequence, kv head). A tile decodes each block
//! of codes once for all its rows; each row's arithmetic is the same whatever tile it is in,
//! so prefill and token-by-token decode give bit-identical results.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::kv_elem::{f32_slice, to_f32_slice, KvElem};
use super::kv_write::KvWrite;
use super::paged_attention::{softmax, PagedAttention};
use super::simd::{axpy_f32, dot_f32};
use super::team::{team, OutPtr};
use super::tq_write::TqWrite;
use crate::batch::{AttentionMeta, NO_SLOT};
use crate::kv::turboquant::TqCodec;
use crate::kv::TqLayerCache;

/// Rows per work item at most.
const TILE_ROWS: usize = 16;
/// Scores one work item may hold (rows x heads x context); longer contexts get smaller tiles.
const TILE_SCORES: usize = 1 << 19;

pub struct TqAttention<'a> {
    /// Shapes, scale, sliding window and softcap, as for the dense op.
    pub attn: PagedAttention<'a>,
    pub key: &'a TqCodec,
    pub value: &'a TqCodec,
    pub float: Option<FloatInputs<'a>>,
}

/// The unquantized recent tokens (see the module doc). Rings are `[rings * len, kv_heads,
/// head_dim]` in a float type, the sequence's ring index in `meta.window_rings`; `new_k`,
/// `new_v` are this step's `[T, kv_heads, head_dim]` f32.
pub struct FloatInputs<'a> {
    pub len: usize,
    pub ring_k: &'a Tensor,
    pub ring_v: &'a Tensor,
    pub new_k: &'a Tensor,
    pub new_v: &'a Tensor,
}

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
        if q.len() != rows * hq * d || self.key.dim() != d || self.value.dim() != d || hq % hkv != 0 {
            candle_core::bail!("tq-attention: q has {} values, expected {rows}x{hq}x{d}", q.len());
        }
        let bs = meta.block_size;
        for s in &meta.seqs {
            let needed = s.context_len.div_ceil(bs);
            if s.block_table.len() < needed || s.block_table.iter().any(|&b| (b as usize + 1) * bs > n_slots) {
                candle_core::bail!("tq-attention: block table does not cover {} tokens", s.context_len);
            }
        }
        if let Some(f) = &fl {
            let ring_rows = f.k.ring.len() / (hkv * d);
            let fits = |r: &u32| (*r as usize + 1) * f.len <= ring_rows;
            if f.len == 0 || meta.window_rings.len() != meta.seqs.len() || !meta.window_rings.iter().all(fits) {
                candle_core::bail!("tq-attention: a float window needs a ring per sequence");
            }
            let new = rows * hkv * d;
            if f.k.new.len() != new || f.v.new.len() != new || f.v.ring.len() != f.k.ring.len() {
                candle_core::bail!("tq-attention: float window inputs of the wrong size");
            }
        }
        let group = hq / hkv;
        // Tiles of rows of one sequence, smaller where the context is long.
        let mut tiles = Vec::new();
        for (si, s) in meta.seqs.iter().enumerate() {
            let per = (TILE_SCORES / (group * s.context_len.max(1))).clamp(1, TILE_ROWS);
            let mut r = s.q_start;
            while r < s.q_start + s.q_len {
                let e = (r + per).min(s.q_start + s.q_len);
                tiles.push((si, r, e));
                r = e;
            }
        }
        let mut out = vec![0f32; q.len()];
        let dst = OutPtr(out.as_mut_ptr());
        team().for_each(tiles.len() * hkv, |item| {
            let ((si, r0, r1), g) = (tiles[item / hkv], item % hkv);
            self.attend_tile(q, kc, vc, fl.as_ref(), si, r0..r1, g, dst);
        });
        Ok(out)
    }

    /// Rows `rows` (of sequence `si`) against kv head `g`; writes their `group` output heads.
    #[allow(clippy::too_many_arguments)]
    fn attend_tile<T: KvElem>(
        &self,
        q: &[f32],
        kc: &[u8],
        vc: &[u8],
        fl: Option<&Floats<T>>,
        si: usize,
        rows: std::ops::Range<usize>,
        g: usize,
        dst: OutPtr,
    ) {
        let a = &self.attn;
        let (hq, hkv, d, bs) = (a.num_heads, a.num_kv_heads, a.head_dim, a.meta.block_size);
        let group = hq / hkv;
        let seq = &a.meta.seqs[si];
        let first = seq.first_position();
        let fw = fl.map_or(0, |f| f.len);
        let spans: Vec<RowSpan> = rows
            .clone()
            .map(|t| {
                let end = first + (t - seq.q_start) + 1;
                let lo = a.window.map_or(0, |w| end.saturating_sub(w));
                RowSpan { lo, split: end.saturating_sub(fw).max(lo), end }
            })
            .collect();
        let n = spans.len();
        let qh = |r: usize, h: usize| &q[((rows.start + r) * hq + g * group + h) * d..][..d];
        let mut qr = vec![0f32; n * group * d];
        for r in 0..n {
            for h in 0..group {
                self.key.rotation().apply(qh(r, h), &mut qr[(r * group + h) * d..][..d]);
            }
        }
        // Scores of (row r, head h) at base[r] + h * len(r), one per position lo..end.
        let mut base = Vec::with_capacity(n);
        let mut total = 0;
        for s in &spans {
            base.push(total);
            total += group * (s.end - s.lo);
        }
        let mut scores = vec![0f32; total];
        let code_lo = spans.iter().map(|s| s.lo).min().unwrap_or(0);
        let code_hi = spans.iter().map(|s| s.split).max().unwrap_or(0);
        let mut tile = vec![0f32; bs * d];
        let mut norms = vec![0f32; bs];

        // Keys stored as codes, block by block.
        for_blocks(code_lo, code_hi, bs, |b, j0, j1| {
            self.decode_block(self.key, kc, seq.block_table[b] as usize, j0..j1, g, &mut tile, &mut norms);
            for (r, s) in spans.iter().enumerate() {
                let len = s.end - s.lo;
                for j in j0.max(s.lo)..j1.min(s.split) {
                    let kj = &tile[(j - j0) * d..][..d];
                    for h in 0..group {
                        let dot = norms[j - j0] * dot_f32(&qr[(r * group + h) * d..][..d], kj);
                        scores[base[r] + h * len + j - s.lo] = a.score(dot);
                    }
                }
            }
        });
        // Keys in the float window: this step's rows, or earlier ones in the sequence's ring.
        let float_row = |j: usize| match fl {
            Some(f) if j < first => FloatRow::Ring(a.meta.window_rings[si] as usize * f.len + j % f.len),
            _ => FloatRow::New(seq.q_start + j - first),
        };
        let mut buf = vec![0f32; d];
        if let Some(f) = fl {
            for (r, s) in spans.iter().enumerate() {
                let len = s.end - s.lo;
                for j in s.split..s.end {
                    let kj = f.k.get(float_row(j), g, hkv, d, &mut buf);
                    for h in 0..group {
                        scores[base[r] + h * len + j - s.lo] = a.score(dot_f32(qh(r, h), kj));
                    }
                }
            }
        }
        for (r, s) in spans.iter().enumerate() {
            scores[base[r]..base[r] + group * (s.end - s.lo)].chunks_exact_mut(s.end - s.lo).for_each(softmax);
        }

        // Values: codes summed in the rotated space, floats in the original one.
        let mut acc = vec![0f32; n * group * d];
        for_blocks(code_lo, code_hi, bs, |b, j0, j1| {
            self.decode_block(self.value, vc, seq.block_table[b] as usize, j0..j1, g, &mut tile, &mut norms);
            for (r, s) in spans.iter().enumerate() {
                let len = s.end - s.lo;
                for j in j0.max(s.lo)..j1.min(s.split) {
                    let vj = &tile[(j - j0) * d..][..d];
                    for h in 0..group {
                        let p = scores[base[r] + h * len + j - s.lo];
                        axpy_f32(&mut acc[(r * group + h) * d..][..d], p * norms[j - j0], vj);
                    }
                }
            }
        });
        for (r, t) in rows.clone().enumerate() {
            // SAFETY: each (row, kv head) item writes only its own `group` heads of its row.
            let o = unsafe { std::slice::from_raw_parts_mut(dst.at((t * hq + g * group) * d), group * d) };
            for (h, oh) in o.chunks_exact_mut(d).enumerate() {
                self.value.rotation().apply_inverse(&acc[(r * group + h) * d..][..d], oh);
            }
        }
        if let Some(f) = fl {
            for (r, s) in spans.iter().enumerate() {
                let t = rows.start + r;
                // SAFETY: as above.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at((t * hq + g * group) * d), group * d) };
                let len = s.end - s.lo;
                for j in s.split..s.end {
                    let vj = f.v.get(float_row(j), g, hkv, d, &mut buf);
                    for (h, oh) in o.chunks_exact_mut(d).enumerate() {
                        axpy_f32(oh, scores[base[r] + h * len + j - s.lo], vj);
                    }
                }
            }
        }
    }

    /// Decodes the codes of kv head `g` at positions `js` (all in block `block`) into `tile`
    /// (rotated unit vectors, c[idx]) and `norms`.
    #[allow(clippy::too_many_arguments)]
    fn decode_block(
        &self,
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
            codec.decode_rotated(src, &mut tile[(j - j0) * d..][..d]);
            norms[j - j0] = codec.norm(src);
        }
    }
}

/// A layer's whole step on a TurboQuant cache: quantizes the step's keys and values into
/// their slots, attends over the codes (and the float window), then keeps the step's last
/// tokens in the sequences' rings. `q`, `k`, `v` are the step's contiguous f32 rows.
pub fn write_and_attend(
    attn: PagedAttention<'_>,
    c: &TqLayerCache,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor> {
    let meta = attn.meta;
    let codecs = &c.codecs;
    c.k.inplace_op2(k, &TqWrite { slot_mapping: &meta.slot_mapping, codec: &codecs.key })?;
    c.v.inplace_op2(v, &TqWrite { slot_mapping: &meta.slot_mapping, codec: &codecs.value })?;
    let float = c.window.as_ref().map(|w| FloatInputs { len: w.len, ring_k: &w.k, ring_v: &w.v, new_k: k, new_v: v });
    let op = TqAttention { attn, key: &codecs.key, value: &codecs.value, float };
    let out = op.forward(q, &c.k, &c.v)?;
    // After the op: it reads the rings' older positions, which these writes may replace.
    if let Some(w) = &c.window {
        let slots = ring_slots(meta, w.len)?;
        let write = KvWrite::to_slots(&slots);
        w.k.inplace_op2(k, &write)?;
        w.v.inplace_op2(v, &write)?;
    }
    Ok(out)
}

/// The ring row of each batch row whose position stays among its sequence's last `len`
/// after this step, `NO_SLOT` for the others.
fn ring_slots(meta: &AttentionMeta, len: usize) -> Result<Vec<u32>> {
    if meta.window_rings.len() != meta.seqs.len() {
        candle_core::bail!(
            "a float window needs a ring per sequence ({} for {})",
            meta.window_rings.len(),
            meta.seqs.len()
        );
    }
    let mut slots = Vec::with_capacity(meta.num_rows());
    for (s, &ring) in meta.seqs.iter().zip(&meta.window_rings) {
        let keep = s.context_len.saturating_sub(len);
        slots.extend((s.first_position()..s.context_len).map(|p| {
            if p >= keep {
                (ring as usize * len + p % len) as u32
            } else {
                NO_SLOT
            }
        }));
    }
    Ok(slots)
}

/// Calls `f(block, j0, j1)` for the part [j0, j1) of [lo, hi) in each block, in order.
fn for_blocks(lo: usize, hi: usize, bs: usize, mut f: impl FnMut(usize, usize, usize)) {
    if hi <= lo {
        return;
    }
    for b in lo / bs..=(hi - 1) / bs {
        f(b, (b * bs).max(lo), ((b + 1) * bs).min(hi));
    }
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
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::batch::SeqSlice;
    use crate::kv::turboquant::{Codebook, LayerCodecs};
    use crate::kv::FloatWindow;
    use candle_core::{DType, Device};

    fn randn(shape: (usize, usize, usize), seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut unit = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..shape.0 * shape.1 * shape.2)
            .map(|_| ((-2.0 * unit().ln()).sqrt() * (std::f64::consts::TAU * unit()).cos()) as f32)
            .collect()
    }

    fn layer(
        d: usize,
        hkv: usize,
        slots: usize,
        bits: (u8, u8),
        window: usize,
        rings: usize,
        float: DType,
    ) -> TqLayerCache {
        let dev = Device::Cpu;
        let codecs = LayerCodecs::for_layer(
            3,
            d,
            &Arc::new(Codebook::lloyd_max(d, bits.0)),
            &Arc::new(Codebook::lloyd_max(d, bits.1)),
        );
        let floats = || Tensor::zeros((rings * window, hkv, d), float, &dev).unwrap();
        TqLayerCache {
            k: Tensor::zeros((slots, hkv, codecs.key.row_bytes()), DType::U8, &dev).unwrap(),
            v: Tensor::zeros((slots, hkv, codecs.value.row_bytes()), DType::U8, &dev).unwrap(),
            window: (window > 0).then(|| FloatWindow { len: window, k: floats(), v: floats() }),
            codecs,
        }
    }

    fn attn(meta: &AttentionMeta, hq: usize, hkv: usize, d: usize, window: Option<usize>) -> PagedAttention<'_> {
        PagedAttention {
            meta,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            window,
            softcap: None,
        }
    }

    /// Every slot's vectors decoded back to floats: `[slots, hkv, d]`.
    fn dequantize(codes: &Tensor, codec: &TqCodec) -> Vec<f32> {
        let (d, row) = (codec.dim(), codec.row_bytes());
        let bytes: Vec<u8> = codes.flatten_all().unwrap().to_vec1().unwrap();
        let mut out = vec![0f32; bytes.len() / row * d];
        let mut y = vec![0f32; d];
        for (r, o) in bytes.chunks_exact(row).zip(out.chunks_exact_mut(d)) {
            codec.decode(r, o, &mut y);
        }
        out
    }

    /// Attention on codes equals attention on the dequantized cache (f64 reference), for two
    /// sequences in one call (a 5-row chunk after a 30-token prefix, a decode at 40; blocks
    /// out of order), GQA, head dims with Hadamard and dense rotations, sliding windows, and
    /// float windows whose keys come from the rings and from the step's own rows. Without a
    /// float window it is also checked against the dense op run on the dequantized cache.
    #[test]
    fn codes_match_dequantize_then_attend() {
        let dev = Device::Cpu;
        let (bs, hq, hkv) = (4, 6, 2);
        for (d, bits) in [(32, (3, 4)), (64, (2, 3)), (80, (4, 4)), (128, (3, 4)), (256, (2, 2))] {
            for sliding in [None, Some(7)] {
                for fw in [0, 3, 9] {
                    let seqs = vec![
                        SeqSlice { q_start: 0, q_len: 5, context_len: 35, block_table: (0..9).rev().collect() },
                        SeqSlice { q_start: 5, q_len: 1, context_len: 41, block_table: (9..20).collect() },
                    ];
                    let mut meta = AttentionMeta::new(bs, seqs);
                    meta.window_rings = vec![1, 0];
                    let slots = 20 * bs;
                    let c = layer(d, hkv, slots, bits, fw, 2, DType::F32);
                    // Original keys and values of every slot, all quantized into the cache.
                    let (ko, vo) = (randn((slots, hkv, d), d as u64), randn((slots, hkv, d), d as u64 + 1));
                    let all: Vec<u32> = (0..slots as u32).collect();
                    let kt = Tensor::from_vec(ko.clone(), (slots, hkv, d), &dev).unwrap();
                    let vt = Tensor::from_vec(vo.clone(), (slots, hkv, d), &dev).unwrap();
                    c.k.inplace_op2(&kt, &TqWrite { slot_mapping: &all, codec: &c.codecs.key }).unwrap();
                    c.v.inplace_op2(&vt, &TqWrite { slot_mapping: &all, codec: &c.codecs.value }).unwrap();
                    let (kd, vd) = (dequantize(&c.k, &c.codecs.key), dequantize(&c.v, &c.codecs.value));
                    let slot = |si: usize, j: usize| meta.seqs[si].block_table[j / bs] as usize * bs + j % bs;
                    // The float rows: this step's from the originals, older ones in the rings.
                    let rows = meta.num_rows();
                    let pick = |src: &[f32]| -> Vec<f32> {
                        meta.slot_mapping
                            .iter()
                            .flat_map(|&s| src[s as usize * hkv * d..][..hkv * d].to_vec())
                            .collect()
                    };
                    let (new_k, new_v) = (pick(&ko), pick(&vo));
                    let (new_kt, new_vt) = (
                        Tensor::from_vec(new_k, (rows, hkv, d), &dev).unwrap(),
                        Tensor::from_vec(new_v, (rows, hkv, d), &dev).unwrap(),
                    );
                    if let Some(w) = &c.window {
                        let mut rk = vec![0f32; 2 * fw * hkv * d];
                        let mut rv = rk.clone();
                        for (si, s) in meta.seqs.iter().enumerate() {
                            let first = s.first_position();
                            for j in first.saturating_sub(fw)..first {
                                let r = meta.window_rings[si] as usize * fw + j % fw;
                                rk[r * hkv * d..][..hkv * d].copy_from_slice(&ko[slot(si, j) * hkv * d..][..hkv * d]);
                                rv[r * hkv * d..][..hkv * d].copy_from_slice(&vo[slot(si, j) * hkv * d..][..hkv * d]);
                            }
                        }
                        let shape = (2 * fw, hkv, d);
                        w.k.slice_set(&Tensor::from_vec(rk, shape, &dev).unwrap(), 0, 0).unwrap();
                        w.v.slice_set(&Tensor::from_vec(rv, shape, &dev).unwrap(), 0, 0).unwrap();
                    }
                    let q = Tensor::randn(0f32, 1.0, (rows, hq, d), &dev).unwrap();
                    let qv: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
                    let a = attn(&meta, hq, hkv, d, sliding);
                    let float = c.window.as_ref().map(|w| FloatInputs {
                        len: fw,
                        ring_k: &w.k,
                        ring_v: &w.v,
                        new_k: &new_kt,
                        new_v: &new_vt,
                    });
                    let op = TqAttention { attn: a, key: &c.codecs.key, value: &c.codecs.value, float };
                    let got: Vec<f32> = op.forward(&q, &c.k, &c.v).unwrap().flatten_all().unwrap().to_vec1().unwrap();

                    // f64 reference: row at p reads j in (p - fw, p] from the originals.
                    let mut want = vec![0f64; got.len()];
                    for t in 0..rows {
                        let si = meta.row_seq[t] as usize;
                        let s = &meta.seqs[si];
                        let p = s.first_position() + t - s.q_start;
                        let lo = sliding.map_or(0, |w| (p + 1).saturating_sub(w));
                        for h in 0..hq {
                            let g = h / (hq / hkv);
                            let at = |src_f: &[f32], src_q: &[f32], j: usize| -> Vec<f64> {
                                let src = if p - j < fw { src_f } else { src_q };
                                src[(slot(si, j) * hkv + g) * d..][..d].iter().map(|x| *x as f64).collect()
                            };
                            let qh = &qv[(t * hq + h) * d..][..d];
                            let sc: Vec<f64> = (lo..=p)
                                .map(|j| {
                                    let k = at(&ko, &kd, j);
                                    k.iter().zip(qh).map(|(a, b)| a * *b as f64).sum::<f64>() / (d as f64).sqrt()
                                })
                                .collect();
                            let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                            let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                            let z: f64 = e.iter().sum();
                            for (jj, j) in (lo..=p).enumerate() {
                                let v = at(&vo, &vd, j);
                                for i in 0..d {
                                    want[(t * hq + h) * d + i] += e[jj] / z * v[i];
                                }
                            }
                        }
                    }
                    let err = got.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                    assert!(err < 1e-4, "d={d} bits={bits:?} sliding={sliding:?} float window {fw}: max error {err}");

                    if fw == 0 {
                        let kdt = Tensor::from_vec(kd.clone(), (slots, hkv, d), &dev).unwrap();
                        let vdt = Tensor::from_vec(vd.clone(), (slots, hkv, d), &dev).unwrap();
                        let dense: Vec<f32> = attn(&meta, hq, hkv, d, sliding)
                            .forward(&q, &kdt, &vdt)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap();
                        let err = got.iter().zip(&dense).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                        assert!(err < 1e-4, "d={d} bits={bits:?} sliding={sliding:?}: {err} from the dense op");
                    }
                }
            }
        }
    }

    /// One sequence's 23 tokens written and attended in one chunk, in chunks of 7, and one at
    /// a time give bit-identical outputs, with and without a float window (bf16 rings too).
    #[test]
    fn prefill_equals_token_by_token() {
        let dev = Device::Cpu;
        let (bs, hq, hkv, d, n) = (4, 4, 2, 64, 23);
        let (ks, vs, qs) = (randn((n, hkv, d), 1), randn((n, hkv, d), 2), randn((n, hq, d), 3));
        for (fw, ring_dtype, sliding) in [(0, DType::F32, None), (5, DType::F32, None), (6, DType::BF16, Some(9))] {
            let run = |chunk: usize| -> Vec<f32> {
                let c = layer(d, hkv, 8 * bs, (3, 4), fw, 3, ring_dtype);
                let mut out = Vec::new();
                let mut start = 0;
                while start < n {
                    let end = (start + chunk).min(n);
                    let seq = SeqSlice {
                        q_start: 0,
                        q_len: end - start,
                        context_len: end,
                        block_table: vec![7, 2, 5, 0, 1, 3],
                    };
                    let mut meta = AttentionMeta::new(bs, vec![seq]);
                    meta.window_rings = vec![2];
                    let rows = |src: &[f32], h: usize| {
                        Tensor::from_vec(src[start * h * d..end * h * d].to_vec(), (end - start, h, d), &dev).unwrap()
                    };
                    let o = write_and_attend(
                        attn(&meta, hq, hkv, d, sliding),
                        &c,
                        &rows(&qs, hq),
                        &rows(&ks, hkv),
                        &rows(&vs, hkv),
                    )
                    .unwrap();
                    out.extend(o.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                    start = end;
                }
                out
            };
            let whole = run(n);
            assert_eq!(whole, run(1), "float window {fw}: token by token differs from one prefill");
            assert_eq!(whole, run(7), "float window {fw}: chunks of 7 differ from one prefill");
        }
    }
}
