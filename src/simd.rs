//! Small SIMD kernels, picked at run time (AVX-512 where the CPU has it). The bottom of the
//! crate, next to `config`: the ops and the TurboQuant codec build on them; they use nothing
//! else of iris.

/// Dot product of two equal-length f32 slices.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { dot_f32_avx512(a, b) };
        }
    }
    dot_f32_portable(a, b)
}

fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16)), _mm512_loadu_ps(pb.add(i + 16)), acc1);
        i += 32;
    }
    if i + 16 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        i += 16;
    }
    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        s += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    s
}

/// `y += a * x` over equal-length slices.
#[inline]
pub fn axpy_f32(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { axpy_f32_avx512(y, a, x) };
        }
    }
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_f32_avx512(y: &mut [f32], a: f32, x: &[f32]) {
    use std::arch::x86_64::*;
    let n = y.len().min(x.len());
    let (py, px) = (y.as_mut_ptr(), x.as_ptr());
    let av = _mm512_set1_ps(a);
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(py.add(i), _mm512_fmadd_ps(av, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i))));
        i += 16;
    }
    while i < n {
        *py.add(i) += a * *px.add(i);
        i += 1;
    }
}

/// exp(x): range reduction by ln 2 and a degree-7 polynomial, each step one IEEE operation so
/// the kernels' `exp_det` (cuda/common.cuh) gives the same bits, and so does [`exp_sub_sum`]'s
/// AVX-512 path, lane for lane. Accurate to a few ulp; 0 at or below -87 (and for NaN),
/// infinite above 89.
pub fn exp_det(x: f32) -> f32 {
    if !(x > -87.0) {
        return 0.0;
    }
    if x > 89.0 {
        return f32::INFINITY;
    }
    let n = (x * EXP_LOG2E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2_HI, x);
    let r = (-n).mul_add(EXP_LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    let e = n as i32;
    if e < -126 {
        return 0.0;
    }
    if e > 127 {
        // 2^128 has no f32: scale by 2^127, then by 2.
        return p * f32::from_bits(254 << 23) * 2.0;
    }
    p * f32::from_bits(((e + 127) as u32) << 23)
}

// exp_det's constants, spelled digit for digit as in the kernel so that the two can be compared
// by eye (1.44269504 is log2(e); both round to the same f32 as the named constants).
#[allow(clippy::excessive_precision, clippy::approx_constant)]
const EXP_LOG2E: f32 = 1.442_695_04;
#[allow(clippy::excessive_precision)]
const EXP_LN2_HI: f32 = 0.693_145_752;
#[allow(clippy::excessive_precision)]
const EXP_LN2_LO: f32 = 1.428_606_77e-6;
/// The polynomial's coefficients, highest degree first (Horner).
#[allow(clippy::excessive_precision)]
const EXP_POLY: [f32; 8] =
    [1.984_126_98e-4, 1.388_888_89e-3, 8.333_333_33e-3, 4.166_666_67e-2, 1.666_666_67e-1, 0.5, 1.0, 1.0];

/// In place: x <- exp_det(x - m); returns the sum of the results, accumulated in 16 running
/// sums (element i into sum i mod 16) added in order at the end, which the AVX-512 path and the
/// portable one both do: the same bits on every machine. (A softmax's exponentials: libm's
/// scalar expf was a fifth of the time of attention on TurboQuant codes in a CPU prefill.)
#[inline]
pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { exp_sub_sum_avx512(x, m) };
        }
    }
    exp_sub_sum_portable(x, m)
}

fn exp_sub_sum_portable(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; 16];
    for (i, v) in x.iter_mut().enumerate() {
        *v = exp_det(*v - m);
        acc[i % 16] += *v;
    }
    acc.iter().fold(0.0, |s, &a| s + a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sub_sum_avx512(x: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let p = x.as_mut_ptr();
    let mv = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let k: __mmask16 = if n - i >= 16 { 0xffff } else { ((1u32 << (n - i)) - 1) as u16 };
        let e = exp_det_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(i)), mv));
        _mm512_mask_storeu_ps(p.add(i), k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
        i += 16;
    }
    let mut lanes = [0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
    lanes.iter().fold(0.0, |s, &a| s + a)
}

/// exp_det of each lane, by the same operations in the same order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn exp_det_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let valid = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(-87.0));
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(89.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(EXP_LOG2E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    let mut q = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(*c));
    }
    let e = _mm512_cvtps_epi32(n);
    let tiny = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(-126));
    let huge = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(127));
    let ec = _mm512_max_epi32(_mm512_min_epi32(e, _mm512_set1_epi32(127)), _mm512_set1_epi32(-126));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(ec, _mm512_set1_epi32(127))));
    let y = _mm512_mul_ps(q, scale);
    let y = _mm512_mask_mul_ps(y, huge, y, _mm512_set1_ps(2.0));
    let y = _mm512_maskz_mov_ps(valid & !tiny, y);
    _mm512_mask_mov_ps(y, big, _mm512_set1_ps(f32::INFINITY))
}

/// The horizontal sums of 16 vectors at once, in lane order: lane i holds `a[i]`'s sum with
/// the same bits as `_mm512_reduce_add_ps(a[i])`, whose tree of adds it repeats (lanes i + i+8,
/// then i + i+4, i + i+2, i + i+1) by shuffles across the vectors: ~30 instructions for 16 sums
/// instead of ~8 each.
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn reduce_add16(a: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reduce_add16_is_sixteen_reductions() {
        use std::arch::x86_64::*;
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        // Values of mixed magnitudes, so that another order of the adds would round otherwise.
        let x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.731).sin() * 10f32.powi(i % 7 - 3)).collect();
        // SAFETY: AVX-512F checked above; 256 values read 16 at a time.
        unsafe {
            let mut a = [_mm512_setzero_ps(); 16];
            for (i, v) in a.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(x.as_ptr().add(16 * i));
            }
            let mut got = [0f32; 16];
            _mm512_storeu_ps(got.as_mut_ptr(), reduce_add16(&a));
            for (i, v) in a.iter().enumerate() {
                assert_eq!(got[i].to_bits(), _mm512_reduce_add_ps(*v).to_bits(), "vector {i}");
            }
        }
    }

    #[test]
    fn dot_matches_scalar_for_all_tail_lengths() {
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 100, 576] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_f32(&a, &b) as f64 - want).abs() < 1e-4, "n={n}");
            assert!((dot_f32_portable(&a, &b) as f64 - want).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn exp_det_is_exp_within_a_few_ulp() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let (a, b) = (exp_det(x), x.exp());
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b.max(f32::MIN_POSITIVE), "exp({x}): {a} vs {b}");
            x -= 0.0137;
        }
        assert_eq!(exp_det(0.0), 1.0);
        // Below e^-87 (near f32's smallest normal) weights count as nothing.
        assert_eq!(exp_det(-87.5), 0.0);
        assert_eq!(exp_det(f32::NAN), 0.0);
        assert_eq!(exp_det(90.0), f32::INFINITY);
    }

    /// The AVX-512 path gives exp_det's bits in every lane, and the same sum as the portable
    /// path, at every tail length and over the whole range (underflow, -inf and NaN included).
    #[test]
    fn exp_sub_sum_is_the_same_on_every_path() {
        for n in [0, 1, 15, 16, 17, 31, 33, 100, 257] {
            let base: Vec<f32> = (0..n)
                .map(|i| match i % 11 {
                    3 => f32::NEG_INFINITY,
                    7 => -200.0,
                    _ => (i as f32 * 0.7).sin() * 90.0 - 3.0,
                })
                .collect();
            let m = base.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut portable = base.clone();
            let sp = exp_sub_sum_portable(&mut portable, m);
            for (x, y) in base.iter().zip(&portable) {
                assert_eq!(exp_det(x - m).to_bits(), y.to_bits(), "n={n} x={x}");
            }
            let mut fast = base.clone();
            let sf = exp_sub_sum(&mut fast, m);
            assert_eq!(sf.to_bits(), sp.to_bits(), "n={n}");
            assert_eq!(
                fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                portable.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            let want: f64 = base.iter().map(|x| ((x - m) as f64).exp()).sum();
            assert!((sf as f64 - want).abs() <= 1e-5 * want.max(1.0), "n={n}: {sf} vs {want}");
        }
    }

    #[test]
    fn axpy_matches_scalar_for_all_tail_lengths() {
        for n in [0, 1, 15, 16, 17, 33, 64] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: Vec<f64> = y.iter().zip(&x).map(|(y, x)| *y as f64 + 0.7 * *x as f64).collect();
            axpy_f32(&mut y, 0.7, &x);
            assert!(y.iter().zip(&want).all(|(a, b)| (*a as f64 - b).abs() < 1e-6), "n={n}");
        }
    }
}
