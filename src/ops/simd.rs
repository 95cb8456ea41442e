//! Small SIMD kernels, picked at run time (AVX-512 where the CPU has it).

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

#[cfg(test)]
mod tests {
    use super::*;

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
