//! Fused dequantize-and-dot kernels for GGUF weights (the 32-weight formats and the
//! k-quants), one source for every instruction set (`crate::simd::Simd`), on rows packed by
//! `packed.rs`: each weight block is decoded once into two 16-lane vectors, exactly as the
//! scalar dequantizer computes it (`q * d`, then `+ m`, two roundings), and multiplied with up
//! to `M` activation rows, so each weight byte is read once per step for all of a small
//! batch's rows. The decoding costs about as much as streaming the bytes from memory does
//! (~4 cycles per block from L2 with AVX-512), hence the table lookups (`Simd::lut16`).

use crate::simd::{prefetch, Simd, WithSimd};

pub use super::packed::BlockFormat;

/// Bytes ahead of the current codes to prefetch (rows are contiguous, so this runs into the
/// next rows of the same task). Weights that come from DRAM need it far ahead: on a
/// 70 MB matrix, 2 KiB ahead decoded ~20% faster than 512 B (4 KiB and 8 KiB: no better).
const PREFETCH_AHEAD: usize = 2048;

/// A packed row (see `packed.rs`): `nb` blocks, `F::FORMAT.words()` arrays of per-block 32-bit
/// words, then the codes.
#[derive(Clone, Copy)]
struct Row {
    p: *const u8,
    nb: usize,
}

impl Row {
    /// Word array `i`, block `b`, as f32.
    ///
    /// # Safety
    /// `b < nb`, `i < words`.
    #[inline(always)]
    unsafe fn scale(self, i: usize, b: usize) -> f32 {
        (self.p.add(4 * (i * self.nb + b)) as *const f32).read_unaligned()
    }

    #[inline(always)]
    unsafe fn word(self, i: usize, b: usize) -> u32 {
        (self.p.add(4 * (i * self.nb + b)) as *const u32).read_unaligned()
    }

    #[inline(always)]
    unsafe fn codes<F: Decode>(self, b: usize) -> *const u8 {
        self.p.add(4 * F::FORMAT.words() * self.nb + b * F::FORMAT.code_bytes())
    }
}

/// One block format's decoder: the 32 weights of block `b` as two vectors (elements 0..16
/// and 16..32). A type per format, so each kernel is compiled for one format with no
/// per-block dispatch.
///
/// The 4- and 5-bit formats have only 16 or 32 distinct values per block: their decoders
/// give `lut16`/`lut32` each code's value as the scalar dequantizer computes it (`q * d`, then
/// `+ m`), which sets with a permute turn into a table.
trait Decode {
    const FORMAT: BlockFormat;
    /// # Safety
    /// `row` holds block `b`.
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2];
}

/// The 16 code bytes at `p`: lane j holds byte j, whose low nibble is element j and high
/// nibble element j + 16. The first vector keeps the high nibble above the low one (a lookup
/// reads only the low bits; `low` clears them).
#[inline(always)]
unsafe fn nibbles<S: Simd>(s: S, p: *const u8) -> [S::I; 2] {
    let e = s.load_u8(p);
    [e, s.srli::<4>(e)]
}

#[inline(always)]
fn low<S: Simd>(s: S, e: S::I) -> S::I {
    s.and_i(e, s.splat_i(15))
}

struct Q4_0;
impl Decode for Q4_0 {
    const FORMAT: BlockFormat = BlockFormat::Q4_0;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let d = s.splat(row.scale(0, b));
        s.lut16(nibbles(s, row.codes::<Self>(b)), |q| s.mul(s.sub(q, s.splat(8.0)), d))
    }
}

struct Q4_1;
impl Decode for Q4_1 {
    const FORMAT: BlockFormat = BlockFormat::Q4_1;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let (d, m) = (s.splat(row.scale(0, b)), s.splat(row.scale(1, b)));
        s.lut16(nibbles(s, row.codes::<Self>(b)), |q| s.add(s.mul(q, d), m))
    }
}

/// A block's 5-bit codes: the low nibbles at `codes` (see `nibbles`), the fifth bits in `qh`,
/// bit j for element j.
#[inline(always)]
unsafe fn codes5<S: Simd>(s: S, codes: *const u8, qh: u32) -> [S::I; 2] {
    let [lo, hi] = nibbles(s, codes);
    [s.or_i(low(s, lo), s.slli::<4>(s.bit_lanes(qh as u16))), s.or_i(hi, s.slli::<4>(s.bit_lanes((qh >> 16) as u16)))]
}

struct Q5_0;
impl Decode for Q5_0 {
    const FORMAT: BlockFormat = BlockFormat::Q5_0;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let d = s.splat(row.scale(0, b));
        s.lut32(codes5(s, row.codes::<Self>(b), row.word(1, b)), |q| s.mul(s.sub(q, s.splat(16.0)), d))
    }
}

struct Q5_1;
impl Decode for Q5_1 {
    const FORMAT: BlockFormat = BlockFormat::Q5_1;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let (d, m) = (s.splat(row.scale(0, b)), s.splat(row.scale(1, b)));
        s.lut32(codes5(s, row.codes::<Self>(b), row.word(2, b)), |q| s.add(s.mul(q, d), m))
    }
}

/// Lane i gets bits 2i and 2i + 1 of `word`.
#[inline(always)]
fn pairs<S: Simd>(s: S, word: u32) -> S::I {
    let shifts = s.from_i32s([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]);
    s.and_i(s.srlv(s.splat_i(word as i32), shifts), s.splat_i(3))
}

/// `(i - offset) * scale` for integer codes `i`.
#[inline(always)]
fn scaled<S: Simd>(s: S, i: S::I, offset: i32, scale: f32) -> S::F {
    s.mul(s.to_f(s.sub_i(i, s.splat_i(offset))), s.splat(scale))
}

/// 64 values per block are too many for a permute table: the codes are converted instead.
struct Q6;
impl Decode for Q6 {
    const FORMAT: BlockFormat = BlockFormat::Q6;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let [lo, hi] = nibbles(s, row.codes::<Self>(b));
        let i0 = s.or_i(low(s, lo), s.slli::<4>(pairs(s, row.word(2, b))));
        let i1 = s.or_i(hi, s.slli::<4>(pairs(s, row.word(3, b))));
        [scaled(s, i0, 32, row.scale(0, b)), scaled(s, i1, 32, row.scale(1, b))]
    }
}

struct Q3;
impl Decode for Q3 {
    const FORMAT: BlockFormat = BlockFormat::Q3;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let h = row.word(4, b);
        let i0 = s.or_i(pairs(s, row.word(2, b)), s.slli::<2>(s.bit_lanes(h as u16)));
        let i1 = s.or_i(pairs(s, row.word(3, b)), s.slli::<2>(s.bit_lanes((h >> 16) as u16)));
        [scaled(s, i0, 4, row.scale(0, b)), scaled(s, i1, 4, row.scale(1, b))]
    }
}

struct Q8_0;
impl Decode for Q8_0 {
    const FORMAT: BlockFormat = BlockFormat::Q8_0;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let d = s.splat(row.scale(0, b));
        let c = row.codes::<Self>(b);
        [s.mul(s.to_f(s.load_i8(c)), d), s.mul(s.to_f(s.load_i8(c.add(16))), d)]
    }
}

struct A8;
impl Decode for A8 {
    const FORMAT: BlockFormat = BlockFormat::A8;
    #[inline(always)]
    unsafe fn decode<S: Simd>(s: S, row: Row, b: usize) -> [S::F; 2] {
        let (d, m) = (s.splat(row.scale(0, b)), s.splat(row.scale(1, b)));
        let c = row.codes::<Self>(b);
        [s.add(s.mul(s.to_f(s.load_u8(c)), d), m), s.add(s.mul(s.to_f(s.load_u8(c.add(16))), d), m)]
    }
}

/// `out[i] = dot(dequant(row), x[i * k..(i + 1) * k])` for `i < M`, where `row` holds the
/// `k / 32` blocks of one weight row. Two accumulators per row halve the FMA dependency chain.
#[inline(always)]
unsafe fn dot_rows_of<S: Simd, F: Decode, const M: usize>(s: S, row: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    debug_assert!(x.len() >= M * k && row.len() >= k / 32 * F::FORMAT.packed_bytes() && out.len() >= M);
    let mut acc0 = [s.zero(); M];
    let mut acc1 = [s.zero(); M];
    let xp = x.as_ptr();
    let rp = Row { p: row.as_ptr(), nb: k / 32 };
    for b in 0..k / 32 {
        // Weights stream from L3 or memory once per step: ask for them well ahead, a block's
        // share of the bytes per block (so the stream keeps pace whatever the layout; Q3 has
        // no code bytes). Past the end of the matrix it is only a hint: wrapping_add.
        prefetch(rp.p.wrapping_add(b * F::FORMAT.packed_bytes() + PREFETCH_AHEAD));
        let [w0, w1] = F::decode(s, rp, b);
        for i in 0..M {
            let xi = xp.add(i * k + b * 32);
            acc0[i] = s.fmadd(w0, s.load(xi), acc0[i]);
            acc1[i] = s.fmadd(w1, s.load(xi.add(16)), acc1[i]);
        }
    }
    for i in 0..M {
        out[i] = s.reduce_add(s.add(acc0[i], acc1[i]));
    }
}

/// `dot_rows_of` for sets whose registers cannot hold `M` rows' accumulators next to the
/// decoded weights (AVX2 and NEON: 8 vectors of 16 lanes): the row is decoded once into `w`
/// (in L1), then dotted with the activation rows two at a time, each pair sharing the weight
/// loads. Each output takes the same operations in the same order as in `dot_rows_of` (two
/// accumulators over the blocks' halves, then their sum reduced), so the bits are the same.
#[inline(always)]
unsafe fn dot_rows_buffered<S: Simd, F: Decode, const M: usize>(
    s: S,
    row: &[u8],
    x: &[f32],
    k: usize,
    w: &mut [f32],
    out: &mut [f32],
) {
    dequant_row_of::<S, F>(s, row, &mut w[..k]);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i + 2 <= M {
        let (xa, xb) = (xp.add(i * k), xp.add((i + 1) * k));
        let [mut a0, mut a1, mut b0, mut b1] = [s.zero(); 4];
        for c in (0..k).step_by(32) {
            let (w0, w1) = (s.load(wp.add(c)), s.load(wp.add(c + 16)));
            a0 = s.fmadd(w0, s.load(xa.add(c)), a0);
            a1 = s.fmadd(w1, s.load(xa.add(c + 16)), a1);
            b0 = s.fmadd(w0, s.load(xb.add(c)), b0);
            b1 = s.fmadd(w1, s.load(xb.add(c + 16)), b1);
        }
        out[i] = s.reduce_add(s.add(a0, a1));
        out[i + 1] = s.reduce_add(s.add(b0, b1));
        i += 2;
    }
    if i < M {
        let xa = xp.add(i * k);
        let [mut a0, mut a1] = [s.zero(); 2];
        for c in (0..k).step_by(32) {
            a0 = s.fmadd(s.load(wp.add(c)), s.load(xa.add(c)), a0);
            a1 = s.fmadd(s.load(wp.add(c + 16)), s.load(xa.add(c + 16)), a1);
        }
        out[i] = s.reduce_add(s.add(a0, a1));
    }
}

/// Every row of `rows` (consecutive packed rows of `row_bytes`) against `M` activation rows:
/// `out[r * M + i] = dot(dequant(row r), x[i * k..(i + 1) * k])`. The loop over rows runs
/// here, inside the set's code, so a row costs no call: rows are short (an LM head's are
/// 20 blocks on Gemma-3) and there are many of them.
#[inline(always)]
unsafe fn dot_row_range<S: Simd, F: Decode, const M: usize>(
    s: S,
    rows: &[u8],
    row_bytes: usize,
    x: &[f32],
    k: usize,
    out: &mut [f32],
) {
    // Accumulators for M rows (2 vectors each) and the decoded block (2) in registers?
    if M == 1 || 2 * M + 4 <= S::REGISTERS {
        for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
            dot_rows_of::<S, F, M>(s, row, x, k, &mut out[r * M..(r + 1) * M]);
        }
        return;
    }
    // One decoded-row buffer per thread, kept across calls (a matmul has thousands of tasks).
    thread_local! {
        static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ROW.with_borrow_mut(|w| {
        w.resize(k, 0.0);
        for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
            dot_rows_buffered::<S, F, M>(s, row, x, k, w, &mut out[r * M..(r + 1) * M]);
        }
    });
}

/// `out[r * M + i] = dot(dequant(row r), x[i * k..(i + 1) * k])` for every packed row r of
/// `rows` and `i < M`. Its fields must hold: `rows` whole packed rows of `row_bytes` (`k / 32`
/// blocks of `fmt`), `x` `M * k` values, `out` `M` values per row (`QMatrix` makes them so).
pub struct DotRows<'a, const M: usize> {
    pub fmt: BlockFormat,
    pub rows: &'a [u8],
    pub row_bytes: usize,
    pub x: &'a [f32],
    pub k: usize,
    pub out: &'a mut [f32],
}

impl<const M: usize> WithSimd for DotRows<'_, M> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let DotRows { fmt, rows, row_bytes, x, k, out } = self;
        assert!(x.len() >= M * k && out.len() >= M * (rows.len() / row_bytes.max(1)));
        assert!(row_bytes >= k / 32 * fmt.packed_bytes());
        // SAFETY: sizes checked above.
        unsafe {
            match fmt {
                BlockFormat::Q4_0 => dot_row_range::<S, Q4_0, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::Q4_1 => dot_row_range::<S, Q4_1, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::Q5_0 => dot_row_range::<S, Q5_0, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::Q5_1 => dot_row_range::<S, Q5_1, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::Q8_0 => dot_row_range::<S, Q8_0, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::Q6 => dot_row_range::<S, Q6, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::Q3 => dot_row_range::<S, Q3, M>(s, rows, row_bytes, x, k, out),
                BlockFormat::A8 => dot_row_range::<S, A8, M>(s, rows, row_bytes, x, k, out),
            }
        }
    }
}

#[inline(always)]
unsafe fn dequant_row_of<S: Simd, F: Decode>(s: S, row: &[u8], out: &mut [f32]) {
    let (rp, op) = (Row { p: row.as_ptr(), nb: out.len() / 32 }, out.as_mut_ptr());
    for b in 0..out.len() / 32 {
        let [w0, w1] = F::decode(s, rp, b);
        s.store(op.add(b * 32), w0);
        s.store(op.add(b * 32 + 16), w1);
    }
}

/// Decodes one packed row of blocks into f32 (the GEMM path's tile fill, embedding lookups):
/// `row` one whole packed row of `fmt`, `out` its `k` values.
pub struct DequantRow<'a> {
    pub fmt: BlockFormat,
    pub row: &'a [u8],
    pub out: &'a mut [f32],
}

impl WithSimd for DequantRow<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let DequantRow { fmt, row, out } = self;
        assert!(row.len() >= out.len() / 32 * fmt.packed_bytes());
        // SAFETY: size checked above.
        unsafe {
            match fmt {
                BlockFormat::Q4_0 => dequant_row_of::<S, Q4_0>(s, row, out),
                BlockFormat::Q4_1 => dequant_row_of::<S, Q4_1>(s, row, out),
                BlockFormat::Q5_0 => dequant_row_of::<S, Q5_0>(s, row, out),
                BlockFormat::Q5_1 => dequant_row_of::<S, Q5_1>(s, row, out),
                BlockFormat::Q8_0 => dequant_row_of::<S, Q8_0>(s, row, out),
                BlockFormat::Q6 => dequant_row_of::<S, Q6>(s, row, out),
                BlockFormat::Q3 => dequant_row_of::<S, Q3>(s, row, out),
                BlockFormat::A8 => dequant_row_of::<S, A8>(s, row, out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::Isa;

    /// Rows through `dot_rows_of` (accumulators in registers) and `dot_rows_buffered` (a
    /// decoded row in memory): the same bits for every group size, on every set this CPU has.
    struct BothPaths<'a, const M: usize>(&'a [u8], &'a [f32], usize);
    impl<const M: usize> WithSimd for BothPaths<'_, M> {
        type Output = ();
        fn run<S: Simd>(self, s: S) {
            let BothPaths(row, x, k) = self;
            let (mut a, mut b, mut w) = ([0f32; M], [0f32; M], vec![0f32; k]);
            // SAFETY: one whole Q4_1 row of k weights, M activation rows of k.
            unsafe {
                dot_rows_of::<S, Q4_1, M>(s, row, x, k, &mut a);
                dot_rows_buffered::<S, Q4_1, M>(s, row, x, k, &mut w, &mut b);
            }
            assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "M = {M}");
        }
    }

    #[test]
    fn buffered_rows_equal_register_rows_bit_for_bit() {
        let k = 320;
        let nb = k / 32;
        // A packed Q4_1 row: scales, minimums, then codes.
        let mut row = Vec::new();
        for b in 0..nb {
            row.extend_from_slice(&(0.01 + b as f32 * 0.003).to_le_bytes());
        }
        for b in 0..nb {
            row.extend_from_slice(&(-0.1 - b as f32 * 0.01).to_le_bytes());
        }
        row.extend((0..16 * nb).map(|i| (i * 37 % 256) as u8));
        let x: Vec<f32> = (0..8 * k).map(|i| ((i as f32) * 0.377).sin() * 10f32.powi(i as i32 % 5 - 2)).collect();
        for isa in Isa::available() {
            isa.run(BothPaths::<2>(&row, &x, k));
            isa.run(BothPaths::<3>(&row, &x, k));
            isa.run(BothPaths::<5>(&row, &x, k));
            isa.run(BothPaths::<8>(&row, &x, k));
        }
    }
}
