//! `Simd` on AVX-512 (F and BW): one register per sixteen lanes.

use std::arch::x86_64::*;

use super::lanes::{Simd, CODES};

/// Made only by `Isa::run`, on a CPU with AVX-512F and BW.
#[derive(Clone, Copy)]
pub struct Avx512(pub(super) ());

// SAFETY (every intrinsic call below): an `Avx512` exists only where the CPU has AVX-512F/BW,
// and these methods inline into functions compiled with those features.
impl Simd for Avx512 {
    type F = __m512;
    type I = __m512i;
    type M = __mmask16;
    const REGISTERS: usize = 32;

    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_n(self, p: *const f32, n: usize) -> __m512 {
        _mm512_maskz_loadu_ps(first_lanes(n), p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn store_n(self, p: *mut f32, n: usize, v: __m512) {
        _mm512_mask_storeu_ps(p, first_lanes(n), v)
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn fmadd(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn fnmadd(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn round_even(self, a: __m512) -> __m512 {
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    fn reduce_add(self, v: __m512) -> f32 {
        unsafe {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            super::avx2::reduce8(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
        }
    }
    /// The tree of adds repeated by shuffles across the vectors (lanes i + i+8, then i + i+4,
    /// i + i+2, i + i+1): ~30 instructions for 16 sums instead of ~8 each.
    #[inline(always)]
    fn reduce_add16(self, a: &[__m512; 16]) -> __m512 {
        unsafe {
            // Lanes i + i+8: vector k's 8 sums in the low half of b[k], vector k+8's in the high.
            let mut b = [_mm512_setzero_ps(); 8];
            for (k, bk) in b.iter_mut().enumerate() {
                let (x, y) = (a[k], a[k + 8]);
                *bk = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y));
            }
            // Lanes i + i+4: c[k]'s quarters hold vectors k, k+8, k+4, k+12 (4 sums each).
            let mut c = [_mm512_setzero_ps(); 4];
            for (k, ck) in c.iter_mut().enumerate() {
                let (x, y) = (b[k], b[k + 4]);
                *ck = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y));
            }
            // Lanes i + i+2, then i + i+1, within each quarter.
            let d0 = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(c[0], c[2]), _mm512_shuffle_ps::<0xEE>(c[0], c[2]));
            let d1 = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(c[1], c[3]), _mm512_shuffle_ps::<0xEE>(c[1], c[3]));
            let e = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(d0, d1), _mm512_shuffle_ps::<0xDD>(d0, d1));
            // e's lanes hold vectors 0 2 1 3, 8 10 9 11, 4 6 5 7, 12 14 13 15: back in order.
            let order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
            _mm512_permutexvar_ps(order, e)
        }
    }

    /// Four rounds of 16 shuffles: 2 x 2 blocks within 128-bit lanes (unpack), 4 x 4 (two
    /// lanes' pairs), then the 128-bit blocks across the registers (two rounds of
    /// `shuffle_f32x4`).
    #[inline(always)]
    fn transpose16(self, a: &[__m512; 16]) -> [__m512; 16] {
        unsafe {
            // t[4i], t[4i+1]: rows 4i, 4i+1 interleaved (lanes 0, 1 / 2, 3 of each 128-bit lane);
            // t[4i+2], t[4i+3]: rows 4i+2, 4i+3.
            let t: [__m512; 16] = std::array::from_fn(|k| {
                let (x, y) = (a[k / 2 * 2], a[k / 2 * 2 + 1]);
                match k % 2 {
                    0 => _mm512_unpacklo_ps(x, y),
                    _ => _mm512_unpackhi_ps(x, y),
                }
            });
            // u[4i+k], 128-bit lane L: lane 4L+k of rows 4i..4i+4.
            let u: [__m512; 16] = std::array::from_fn(|n| {
                let (i, k) = (n / 4, n % 4);
                let (x, y) = (t[4 * i + k / 2], t[4 * i + 2 + k / 2]);
                match k % 2 {
                    0 => _mm512_shuffle_ps::<0x44>(x, y),
                    _ => _mm512_shuffle_ps::<0xEE>(x, y),
                }
            });
            // Row 4L+k of the result: 128-bit lane L of u[k], u[4+k], u[8+k], u[12+k].
            let mut out = [_mm512_setzero_ps(); 16];
            for k in 0..4 {
                let (v0, v1, v2, v3) = (u[k], u[4 + k], u[8 + k], u[12 + k]);
                let x0 = _mm512_shuffle_f32x4::<0x88>(v0, v1);
                let x1 = _mm512_shuffle_f32x4::<0xDD>(v0, v1);
                let x2 = _mm512_shuffle_f32x4::<0x88>(v2, v3);
                let x3 = _mm512_shuffle_f32x4::<0xDD>(v2, v3);
                out[k] = _mm512_shuffle_f32x4::<0x88>(x0, x2);
                out[4 + k] = _mm512_shuffle_f32x4::<0x88>(x1, x3);
                out[8 + k] = _mm512_shuffle_f32x4::<0xDD>(x0, x2);
                out[12 + k] = _mm512_shuffle_f32x4::<0xDD>(x1, x3);
            }
            out
        }
    }

    #[inline(always)]
    fn splat_i(self, x: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(x) }
    }
    #[inline(always)]
    fn splat2_i(self, lo: i32, hi: i32) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi)) }
    }
    #[inline(always)]
    fn from_i32s(self, a: [i32; 16]) -> __m512i {
        unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const u8) -> __m512i {
        _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> __m512i {
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    fn and_i(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    fn or_i(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    fn add_i(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn sub_i(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    fn min_i(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_min_epi32(a, b) }
    }
    #[inline(always)]
    fn max_i(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_max_epi32(a, b) }
    }
    #[inline(always)]
    fn srli<const N: i32>(self, a: __m512i) -> __m512i {
        unsafe { _mm512_srlv_epi32(a, _mm512_set1_epi32(N)) }
    }
    #[inline(always)]
    fn slli<const N: i32>(self, a: __m512i) -> __m512i {
        unsafe { _mm512_sllv_epi32(a, _mm512_set1_epi32(N)) }
    }
    #[inline(always)]
    fn srlv(self, a: __m512i, counts: __m512i) -> __m512i {
        unsafe { _mm512_srlv_epi32(a, counts) }
    }
    #[inline(always)]
    fn bit_lanes(self, bits: u16) -> __m512i {
        unsafe { _mm512_maskz_mov_epi32(bits, _mm512_set1_epi32(1)) }
    }
    #[inline(always)]
    fn to_f(self, a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    fn round_to_i(self, a: __m512) -> __m512i {
        unsafe { _mm512_cvtps_epi32(a) }
    }
    #[inline(always)]
    fn bits_to_f(self, a: __m512i) -> __m512 {
        unsafe { _mm512_castsi512_ps(a) }
    }

    #[inline(always)]
    fn gt(self, a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) }
    }
    #[inline(always)]
    fn lt_i(self, a: __m512i, b: __m512i) -> __mmask16 {
        unsafe { _mm512_cmplt_epi32_mask(a, b) }
    }
    #[inline(always)]
    fn gt_i(self, a: __m512i, b: __m512i) -> __mmask16 {
        unsafe { _mm512_cmpgt_epi32_mask(a, b) }
    }
    #[inline(always)]
    fn and_not(self, a: __mmask16, b: __mmask16) -> __mmask16 {
        a & !b
    }
    #[inline(always)]
    fn select(self, m: __mmask16, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mask_mov_ps(b, m, a) }
    }

    #[inline(always)]
    fn lut16(self, idx: [__m512i; 2], f: impl Fn(__m512) -> __m512) -> [__m512; 2] {
        // SAFETY: as above; CODES holds 16 values. Permutes read only an index's low 4 bits.
        unsafe {
            let table = f(_mm512_loadu_ps(CODES.as_ptr()));
            [_mm512_permutexvar_ps(idx[0], table), _mm512_permutexvar_ps(idx[1], table)]
        }
    }
    #[inline(always)]
    fn lookup16(self, table: __m512, idx: __m512i) -> __m512 {
        unsafe { _mm512_permutexvar_ps(idx, table) }
    }
    #[inline(always)]
    fn lut32(self, idx: [__m512i; 2], f: impl Fn(__m512) -> __m512) -> [__m512; 2] {
        // SAFETY: as above; two-source permutes read an index's low 5 bits.
        unsafe {
            let codes = _mm512_loadu_ps(CODES.as_ptr());
            let (low, high) = (f(codes), f(_mm512_add_ps(codes, _mm512_set1_ps(16.0))));
            [_mm512_permutex2var_ps(low, idx[0], high), _mm512_permutex2var_ps(low, idx[1], high)]
        }
    }
}

/// The mask of lanes `0..n` (n <= 16).
#[inline(always)]
fn first_lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as u16
    }
}
