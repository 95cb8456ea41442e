//! `Simd` on AVX2 with FMA (x86-64-v3): two 8-lane registers per sixteen lanes, lanes 0..8
//! in the first. Masks are vectors of all-ones or zero lanes.

use std::arch::x86_64::*;

use super::lanes::Simd;

/// Made only by `Isa::run`, on a CPU with AVX2 and FMA.
#[derive(Clone, Copy)]
pub struct Avx2(pub(super) ());

type F = [__m256; 2];
type I = [__m256i; 2];

/// Applies an 8-lane operation to both halves.
macro_rules! both {
    ($f:ident($($a:expr),*)) => {
        unsafe { [$f($($a[0]),*), $f($($a[1]),*)] }
    };
}

/// The sum of 8 lanes by the tree of `Simd::reduce_add`'s last steps: i + i+4, i + i+2,
/// i + i+1.
///
/// # Safety
/// AVX (the callers' features).
#[inline(always)]
pub(super) unsafe fn reduce8(v: __m256) -> f32 {
    let b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
}

/// The 8 x 8 matrix whose rows are `a`, transposed.
///
/// # Safety
/// AVX (the callers' features).
#[inline(always)]
unsafe fn transpose8(a: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then 4 x 4 blocks within 128-bit halves, then the halves.
    let t: [__m256; 8] = std::array::from_fn(|k| {
        let (x, y) = (a[k / 2 * 2], a[k / 2 * 2 + 1]);
        if k % 2 == 0 {
            _mm256_unpacklo_ps(x, y)
        } else {
            _mm256_unpackhi_ps(x, y)
        }
    });
    // u[4i+k], half H: lane 4H+k of rows 4i..4i+4.
    let u: [__m256; 8] = std::array::from_fn(|n| {
        let (i, k) = (n / 4, n % 4);
        let (x, y) = (t[4 * i + k / 2], t[4 * i + 2 + k / 2]);
        if k % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(x, y)
        } else {
            _mm256_shuffle_ps::<0xEE>(x, y)
        }
    });
    std::array::from_fn(|c| {
        let (h, k) = (c / 4, c % 4);
        if h == 0 {
            _mm256_permute2f128_ps::<0x20>(u[k], u[4 + k])
        } else {
            _mm256_permute2f128_ps::<0x31>(u[k], u[4 + k])
        }
    })
}

/// Lanes `0..n` of each half as a load/store mask (n <= 16).
#[inline(always)]
unsafe fn first_lanes(n: usize) -> I {
    let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let n = n as i32;
    [_mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota), _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), iota)]
}

// SAFETY (every intrinsic call below): an `Avx2` exists only where the CPU has AVX2 and FMA,
// and these methods inline into functions compiled with them.
impl Simd for Avx2 {
    type F = F;
    type I = I;
    type M = F;
    const REGISTERS: usize = 8;

    #[inline(always)]
    fn splat(self, x: f32) -> F {
        unsafe { [_mm256_set1_ps(x); 2] }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> F {
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
    #[inline(always)]
    unsafe fn load_n(self, p: *const f32, n: usize) -> F {
        let m = first_lanes(n);
        [_mm256_maskload_ps(p, m[0]), _mm256_maskload_ps(p.add(8), m[1])]
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: F) {
        _mm256_storeu_ps(p, v[0]);
        _mm256_storeu_ps(p.add(8), v[1]);
    }
    #[inline(always)]
    unsafe fn store_n(self, p: *mut f32, n: usize, v: F) {
        let m = first_lanes(n);
        _mm256_maskstore_ps(p, m[0], v[0]);
        _mm256_maskstore_ps(p.add(8), m[1], v[1]);
    }
    #[inline(always)]
    fn add(self, a: F, b: F) -> F {
        both!(_mm256_add_ps(a, b))
    }
    #[inline(always)]
    fn sub(self, a: F, b: F) -> F {
        both!(_mm256_sub_ps(a, b))
    }
    #[inline(always)]
    fn mul(self, a: F, b: F) -> F {
        both!(_mm256_mul_ps(a, b))
    }
    #[inline(always)]
    fn div(self, a: F, b: F) -> F {
        both!(_mm256_div_ps(a, b))
    }
    #[inline(always)]
    fn fmadd(self, a: F, b: F, c: F) -> F {
        both!(_mm256_fmadd_ps(a, b, c))
    }
    #[inline(always)]
    fn fnmadd(self, a: F, b: F, c: F) -> F {
        both!(_mm256_fnmadd_ps(a, b, c))
    }
    #[inline(always)]
    fn round_even(self, a: F) -> F {
        unsafe {
            [
                _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a[0]),
                _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a[1]),
            ]
        }
    }
    #[inline(always)]
    fn reduce_add(self, v: F) -> f32 {
        // Lanes i + i+8 are the two halves' lanes i.
        unsafe { reduce8(_mm256_add_ps(v[0], v[1])) }
    }

    /// Four 8 x 8 transposes, one per quarter of the matrix.
    #[inline(always)]
    fn transpose16(self, a: &[F; 16]) -> [F; 16] {
        // SAFETY: as above.
        unsafe {
            let q = |rows: usize, half: usize| transpose8(std::array::from_fn(|i| a[rows + i][half]));
            let (tl, tr, bl, br) = (q(0, 0), q(0, 1), q(8, 0), q(8, 1));
            std::array::from_fn(|i| if i < 8 { [tl[i], bl[i]] } else { [tr[i - 8], br[i - 8]] })
        }
    }

    #[inline(always)]
    fn splat_i(self, x: i32) -> I {
        unsafe { [_mm256_set1_epi32(x); 2] }
    }
    #[inline(always)]
    fn splat2_i(self, lo: i32, hi: i32) -> I {
        unsafe { [_mm256_set1_epi32(lo), _mm256_set1_epi32(hi)] }
    }
    #[inline(always)]
    fn from_i32s(self, a: [i32; 16]) -> I {
        unsafe { [_mm256_loadu_si256(a.as_ptr().cast()), _mm256_loadu_si256(a.as_ptr().add(8).cast())] }
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> I {
        [_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())), _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast()))]
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const u8) -> I {
        [_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())), _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8).cast()))]
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> I {
        [_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())), _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(8).cast()))]
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> F {
        // F16C, part of x86-64-v3.
        [_mm256_cvtph_ps(_mm_loadu_si128(p.cast())), _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast()))]
    }
    #[inline(always)]
    fn and_i(self, a: I, b: I) -> I {
        both!(_mm256_and_si256(a, b))
    }
    #[inline(always)]
    fn or_i(self, a: I, b: I) -> I {
        both!(_mm256_or_si256(a, b))
    }
    #[inline(always)]
    fn add_i(self, a: I, b: I) -> I {
        both!(_mm256_add_epi32(a, b))
    }
    #[inline(always)]
    fn sub_i(self, a: I, b: I) -> I {
        both!(_mm256_sub_epi32(a, b))
    }
    #[inline(always)]
    fn min_i(self, a: I, b: I) -> I {
        both!(_mm256_min_epi32(a, b))
    }
    #[inline(always)]
    fn max_i(self, a: I, b: I) -> I {
        both!(_mm256_max_epi32(a, b))
    }
    #[inline(always)]
    fn srli<const N: i32>(self, a: I) -> I {
        unsafe {
            let n = _mm256_set1_epi32(N);
            [_mm256_srlv_epi32(a[0], n), _mm256_srlv_epi32(a[1], n)]
        }
    }
    #[inline(always)]
    fn slli<const N: i32>(self, a: I) -> I {
        unsafe {
            let n = _mm256_set1_epi32(N);
            [_mm256_sllv_epi32(a[0], n), _mm256_sllv_epi32(a[1], n)]
        }
    }
    #[inline(always)]
    fn srlv(self, a: I, counts: I) -> I {
        both!(_mm256_srlv_epi32(a, counts))
    }
    #[inline(always)]
    fn bit_lanes(self, bits: u16) -> I {
        unsafe {
            let b = _mm256_set1_epi32(bits as i32);
            let one = _mm256_set1_epi32(1);
            [
                _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), one),
                _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)), one),
            ]
        }
    }
    #[inline(always)]
    fn to_f(self, a: I) -> F {
        both!(_mm256_cvtepi32_ps(a))
    }
    #[inline(always)]
    fn round_to_i(self, a: F) -> I {
        both!(_mm256_cvtps_epi32(a))
    }
    #[inline(always)]
    fn bits_to_f(self, a: I) -> F {
        both!(_mm256_castsi256_ps(a))
    }

    #[inline(always)]
    fn gt(self, a: F, b: F) -> F {
        unsafe { [_mm256_cmp_ps::<_CMP_GT_OQ>(a[0], b[0]), _mm256_cmp_ps::<_CMP_GT_OQ>(a[1], b[1])] }
    }
    #[inline(always)]
    fn lt_i(self, a: I, b: I) -> F {
        unsafe {
            [_mm256_castsi256_ps(_mm256_cmpgt_epi32(b[0], a[0])), _mm256_castsi256_ps(_mm256_cmpgt_epi32(b[1], a[1]))]
        }
    }
    #[inline(always)]
    fn gt_i(self, a: I, b: I) -> F {
        unsafe {
            [_mm256_castsi256_ps(_mm256_cmpgt_epi32(a[0], b[0])), _mm256_castsi256_ps(_mm256_cmpgt_epi32(a[1], b[1]))]
        }
    }
    #[inline(always)]
    fn and_not(self, a: F, b: F) -> F {
        unsafe { [_mm256_andnot_ps(b[0], a[0]), _mm256_andnot_ps(b[1], a[1])] }
    }
    #[inline(always)]
    fn select(self, m: F, a: F, b: F) -> F {
        unsafe { [_mm256_blendv_ps(b[0], a[0], m[0]), _mm256_blendv_ps(b[1], a[1], m[1])] }
    }

    /// Both table halves permuted by the index's low 3 bits, then the one its bit 3 names
    /// (moved to the sign bit, which the blend reads).
    #[inline(always)]
    fn lookup16(self, table: F, idx: I) -> F {
        unsafe {
            let one = |i: __m256i| {
                let (a, b) = (_mm256_permutevar8x32_ps(table[0], i), _mm256_permutevar8x32_ps(table[1], i));
                _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i)))
            };
            [one(idx[0]), one(idx[1])]
        }
    }
}
