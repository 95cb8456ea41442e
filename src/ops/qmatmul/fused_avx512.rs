//! Fused dequantize-and-dot kernels for GGUF weights (the 32-weight formats and the
//! k-quants) with AVX-512, on rows packed by `packed.rs`: each weight block is decoded
//! once into two f32 vectors, exactly as the scalar dequantizer computes it (`q * d`, then
//! `+ m`, two roundings), and multiplied with up to `M` activation rows, so each weight byte
//! is read once per step for all of a small batch's rows. The decoding costs about as much as
//! streaming the bytes from memory does (~4 cycles per block from L2), hence the table
//! lookups below.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

pub use super::packed::BlockFormat;

pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Bytes ahead of the current codes to prefetch (rows are contiguous, so this runs into the
/// next rows of the same task). Weights that come from DRAM need it far ahead: on a
/// 70 MB matrix, 2 KiB ahead decoded ~20% faster than 512 B (4 KiB and 8 KiB: no better).
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 2048;

/// `[0, 1, .., 15]`: the 4-bit codes as floats, to build a block's 16-entry value table.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn codes16() -> __m512 {
    _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.)
}

/// A packed row (see `packed.rs`): `nb` blocks, `F::FORMAT.words()` arrays of per-block 32-bit
/// words, then the codes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Row {
    p: *const u8,
    nb: usize,
}

#[cfg(target_arch = "x86_64")]
impl Row {
    /// Word array `i`, block `b`, in every lane.
    #[inline(always)]
    unsafe fn splat(self, i: usize, b: usize) -> __m512 {
        _mm512_set1_ps((self.p.add(4 * (i * self.nb + b)) as *const f32).read_unaligned())
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
/// The 4- and 5-bit formats have only 16 or 32 distinct values per block: the decoders build
/// that table (each entry computed exactly as the scalar dequantizer computes it: `q * d`,
/// then `+ m`) and look the codes up with a permute, instead of converting 32 integers.
#[cfg(target_arch = "x86_64")]
trait Decode {
    const FORMAT: BlockFormat;
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512);
}

/// The 16 code bytes at `p` widened to 32-bit lanes: lane j holds byte j, whose low nibble
/// is element j and high nibble element j + 16. Permutes read only the low bits of an index.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn code_bytes(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

#[cfg(target_arch = "x86_64")]
struct Q4_0;
#[cfg(target_arch = "x86_64")]
impl Decode for Q4_0 {
    const FORMAT: BlockFormat = BlockFormat::Q4_0;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let table = _mm512_mul_ps(_mm512_sub_ps(codes16(), _mm512_set1_ps(8.0)), row.splat(0, b));
        let e = code_bytes(row.codes::<Self>(b));
        (_mm512_permutexvar_ps(e, table), _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), table))
    }
}

#[cfg(target_arch = "x86_64")]
struct Q4_1;
#[cfg(target_arch = "x86_64")]
impl Decode for Q4_1 {
    const FORMAT: BlockFormat = BlockFormat::Q4_1;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let table = _mm512_add_ps(_mm512_mul_ps(codes16(), row.splat(0, b)), row.splat(1, b));
        let e = code_bytes(row.codes::<Self>(b));
        (_mm512_permutexvar_ps(e, table), _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), table))
    }
}

#[cfg(target_arch = "x86_64")]
struct Q5_0;
#[cfg(target_arch = "x86_64")]
impl Decode for Q5_0 {
    const FORMAT: BlockFormat = BlockFormat::Q5_0;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let d = row.splat(0, b);
        // Codes 0..16 are the values -16..0, codes 16..32 the values 0..16.
        let low = _mm512_mul_ps(_mm512_sub_ps(codes16(), _mm512_set1_ps(16.0)), d);
        let high = _mm512_mul_ps(codes16(), d);
        lookup32(row.codes::<Self>(b), row.word(1, b), low, high)
    }
}

/// A block of 5-bit codes looked up in its 32 values (`low` for codes 0..16, `high` for
/// 16..32): the low nibbles at `codes` (see `code_bytes`), the fifth bits in `qh`, bit j for
/// element j.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lookup32(codes: *const u8, qh: u32, low: __m512, high: __m512) -> (__m512, __m512) {
    let e = code_bytes(codes);
    let sixteen = _mm512_set1_epi32(16);
    let lo = _mm512_and_si512(e, _mm512_set1_epi32(15));
    let i0 = _mm512_mask_or_epi32(lo, qh as u16, lo, sixteen);
    let hi = _mm512_srli_epi32(e, 4);
    let i1 = _mm512_mask_or_epi32(hi, (qh >> 16) as u16, hi, sixteen);
    (_mm512_permutex2var_ps(low, i0, high), _mm512_permutex2var_ps(low, i1, high))
}

#[cfg(target_arch = "x86_64")]
struct Q5_1;
#[cfg(target_arch = "x86_64")]
impl Decode for Q5_1 {
    const FORMAT: BlockFormat = BlockFormat::Q5_1;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let (d, m) = (row.splat(0, b), row.splat(1, b));
        let low = _mm512_add_ps(_mm512_mul_ps(codes16(), d), m);
        let high = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(codes16(), _mm512_set1_ps(16.0)), d), m);
        lookup32(row.codes::<Self>(b), row.word(2, b), low, high)
    }
}

/// Lane i gets bits 2i and 2i + 1 of `word`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pairs(word: u32) -> __m512i {
    let shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(word as i32), shifts), _mm512_set1_epi32(3))
}

/// `(i - offset) * scale` for integer codes `i`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scaled(i: __m512i, offset: i32, scale: __m512) -> __m512 {
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_set1_epi32(offset))), scale)
}

/// 64 values per block are too many for a permute table: the codes are converted instead.
#[cfg(target_arch = "x86_64")]
struct Q6;
#[cfg(target_arch = "x86_64")]
impl Decode for Q6 {
    const FORMAT: BlockFormat = BlockFormat::Q6;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let e = code_bytes(row.codes::<Self>(b));
        let i0 =
            _mm512_or_si512(_mm512_and_si512(e, _mm512_set1_epi32(15)), _mm512_slli_epi32(pairs(row.word(2, b)), 4));
        let i1 = _mm512_or_si512(_mm512_srli_epi32(e, 4), _mm512_slli_epi32(pairs(row.word(3, b)), 4));
        (scaled(i0, 32, row.splat(0, b)), scaled(i1, 32, row.splat(1, b)))
    }
}

#[cfg(target_arch = "x86_64")]
struct Q3;
#[cfg(target_arch = "x86_64")]
impl Decode for Q3 {
    const FORMAT: BlockFormat = BlockFormat::Q3;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let (l0, l1, h) = (pairs(row.word(2, b)), pairs(row.word(3, b)), row.word(4, b));
        let four = _mm512_set1_epi32(4);
        let i0 = _mm512_mask_or_epi32(l0, h as u16, l0, four);
        let i1 = _mm512_mask_or_epi32(l1, (h >> 16) as u16, l1, four);
        (scaled(i0, 4, row.splat(0, b)), scaled(i1, 4, row.splat(1, b)))
    }
}

#[cfg(target_arch = "x86_64")]
struct Q8_0;
#[cfg(target_arch = "x86_64")]
impl Decode for Q8_0 {
    const FORMAT: BlockFormat = BlockFormat::Q8_0;
    #[inline(always)]
    unsafe fn decode(row: Row, b: usize) -> (__m512, __m512) {
        let d = row.splat(0, b);
        let c = row.codes::<Self>(b);
        let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c as *const __m128i)));
        let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c.add(16) as *const __m128i)));
        (_mm512_mul_ps(q0, d), _mm512_mul_ps(q1, d))
    }
}

/// `out[i] = dot(dequant(row), x[i * k..(i + 1) * k])` for `i < M`, where `row` holds the
/// `k / 32` blocks of one weight row. Two accumulators per row halve the FMA dependency chain.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_rows_of<F: Decode, const M: usize>(row: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    debug_assert!(x.len() >= M * k && row.len() >= k / 32 * F::FORMAT.packed_bytes() && out.len() >= M);
    let mut acc0 = [_mm512_setzero_ps(); M];
    let mut acc1 = [_mm512_setzero_ps(); M];
    let xp = x.as_ptr();
    let rp = Row { p: row.as_ptr(), nb: k / 32 };
    for b in 0..k / 32 {
        // Weights stream from L3 or memory once per step: ask for them well ahead, a block's
        // share of the bytes per block (so the stream keeps pace whatever the layout; Q3 has
        // no code bytes). Past the end of the matrix it is only a hint: wrapping_add.
        let ahead = rp.p.wrapping_add(b * F::FORMAT.packed_bytes() + PREFETCH_AHEAD);
        _mm_prefetch(ahead as *const i8, _MM_HINT_T0);
        let (w0, w1) = F::decode(rp, b);
        for i in 0..M {
            let xi = xp.add(i * k + b * 32);
            acc0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xi), acc0[i]);
            acc1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi.add(16)), acc1[i]);
        }
    }
    for i in 0..M {
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
    }
}

/// Every row of `rows` (consecutive packed rows of `row_bytes`) against `M` activation rows:
/// `out[r * M + i] = dot(dequant(row r), x[i * k..(i + 1) * k])`. The loop over rows runs
/// here, inside the AVX-512 code, so a row costs no call: rows are short (an LM head's are
/// 20 blocks on Gemma-3) and there are many of them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_row_range<F: Decode, const M: usize>(
    rows: &[u8],
    row_bytes: usize,
    x: &[f32],
    k: usize,
    out: &mut [f32],
) {
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        dot_rows_of::<F, M>(row, x, k, &mut out[r * M..(r + 1) * M]);
    }
}

/// `out[r * M + i] = dot(dequant(row r), x[i * k..(i + 1) * k])` for every packed row r of
/// `rows` and `i < M`.
///
/// # Safety
/// The CPU must have AVX-512F/BW; `rows` must be whole packed rows of `row_bytes` (`k / 32`
/// blocks of `fmt`), `x` `M * k` values, `out` `M` values per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn dot_rows<const M: usize>(
    fmt: BlockFormat,
    rows: &[u8],
    row_bytes: usize,
    x: &[f32],
    k: usize,
    out: &mut [f32],
) {
    match fmt {
        BlockFormat::Q4_0 => dot_row_range::<Q4_0, M>(rows, row_bytes, x, k, out),
        BlockFormat::Q4_1 => dot_row_range::<Q4_1, M>(rows, row_bytes, x, k, out),
        BlockFormat::Q5_0 => dot_row_range::<Q5_0, M>(rows, row_bytes, x, k, out),
        BlockFormat::Q5_1 => dot_row_range::<Q5_1, M>(rows, row_bytes, x, k, out),
        BlockFormat::Q8_0 => dot_row_range::<Q8_0, M>(rows, row_bytes, x, k, out),
        BlockFormat::Q6 => dot_row_range::<Q6, M>(rows, row_bytes, x, k, out),
        BlockFormat::Q3 => dot_row_range::<Q3, M>(rows, row_bytes, x, k, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dequant_row_of<F: Decode>(row: &[u8], out: &mut [f32]) {
    let (rp, op) = (Row { p: row.as_ptr(), nb: out.len() / 32 }, out.as_mut_ptr());
    for b in 0..out.len() / 32 {
        let (w0, w1) = F::decode(rp, b);
        _mm512_storeu_ps(op.add(b * 32), w0);
        _mm512_storeu_ps(op.add(b * 32 + 16), w1);
    }
}

/// Decodes one row of blocks into f32 (the gemm path's tile fill).
///
/// # Safety
/// As for [`dot_rows`]; `out` holds `k` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn dequant_row(fmt: BlockFormat, row: &[u8], out: &mut [f32]) {
    match fmt {
        BlockFormat::Q4_0 => dequant_row_of::<Q4_0>(row, out),
        BlockFormat::Q4_1 => dequant_row_of::<Q4_1>(row, out),
        BlockFormat::Q5_0 => dequant_row_of::<Q5_0>(row, out),
        BlockFormat::Q5_1 => dequant_row_of::<Q5_1>(row, out),
        BlockFormat::Q8_0 => dequant_row_of::<Q8_0>(row, out),
        BlockFormat::Q6 => dequant_row_of::<Q6>(row, out),
        BlockFormat::Q3 => dequant_row_of::<Q3>(row, out),
    }
}
