//! The inner operations of attention on codes (decode a row of codes, dots, weighted sums),
//! portable or with AVX-512: `Kernel`, `Portable`, `Avx512`.

use crate::ops::turboquant::TqCodec;
use crate::simd::{axpy_f32, dot_f32};

/// The inner operations of the op, portable or vectorised. Within one process one kernel
/// computes every row, so a row's result never depends on which tile it was in.
pub(super) trait Kernel: Copy {
    /// The codes of `row` as centroids (the rotated unit vector's reconstruction).
    fn decode(self, codec: &TqCodec, row: &[u8], out: &mut [f32]);
    fn dot(self, a: &[f32], b: &[f32]) -> f32;
    /// The dots of `q` with the 16 head vectors in `keys` (`16 * q.len()` values), each with
    /// the same bits as `dot` gives it.
    fn dot16(self, q: &[f32], keys: &[f32], out: &mut [f32; 16]) {
        let d = q.len();
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.dot(q, &keys[i * d..][..d]);
        }
    }
    /// `y += w x`.
    fn axpy(self, y: &mut [f32], w: f32, x: &[f32]);
    /// `y += w[i] x_i` for the `w.len()` head vectors `x_i` in `xs`, in order: the same bits
    /// as that many `axpy` calls.
    fn axpy_rows(self, y: &mut [f32], w: &[f32], xs: &[f32]) {
        let d = y.len();
        for (i, &wi) in w.iter().enumerate() {
            self.axpy(y, wi, &xs[i * d..][..d]);
        }
    }
    /// `y *= w`.
    fn scale(self, y: &mut [f32], w: f32);
}

#[derive(Clone, Copy)]
pub(super) struct Portable;

impl Kernel for Portable {
    fn decode(self, codec: &TqCodec, row: &[u8], out: &mut [f32]) {
        codec.decode_rotated(row, out)
    }
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        dot_f32(a, b)
    }
    fn axpy(self, y: &mut [f32], w: f32, x: &[f32]) {
        axpy_f32(y, w, x)
    }
    fn scale(self, y: &mut [f32], w: f32) {
        y.iter_mut().for_each(|v| *v *= w)
    }
}

/// AVX-512 with `DV = head_dim / 16` 16-lane vectors per head vector (0: any multiple of 16).
/// Only used from `avx512_entry`, for head dims that are multiples of 16 and codes of 2 to 4
/// bits.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx512<const DV: usize>;

#[cfg(target_arch = "x86_64")]
impl<const DV: usize> Kernel for Avx512<DV> {
    #[inline(always)]
    fn decode(self, codec: &TqCodec, row: &[u8], out: &mut [f32]) {
        let d = out.len();
        debug_assert!(row.len() >= codec.row_bytes() && d.is_multiple_of(16) && (2..=4).contains(&codec.bits()));
        // SAFETY: only reached from `avx512_entry` (AVX-512F present), with d % 16 == 0
        // and 2..=4-bit codes; `row` is a whole stored row (codes, then the norm).
        unsafe {
            crate::ops::turboquant::codec::decode_rotated_avx512(
                row.as_ptr(),
                codec.bits(),
                codec.table16(),
                d,
                out.as_mut_ptr(),
            )
        }
    }

    #[inline(always)]
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let dv = if DV > 0 { DV } else { a.len() / 16 };
        debug_assert!(a.len() >= 16 * dv && b.len() >= 16 * dv);
        // SAFETY: AVX-512F (see above); 16 * dv values in both slices.
        unsafe {
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut acc = _mm512_mul_ps(_mm512_loadu_ps(pa), _mm512_loadu_ps(pb));
            for c in 1..dv {
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(16 * c)), _mm512_loadu_ps(pb.add(16 * c)), acc);
            }
            _mm512_reduce_add_ps(acc)
        }
    }

    /// The 16 products as `dot` forms them, then their 16 horizontal sums at once
    /// (`simd::reduce_add16`, the same bits as `dot`'s one at a time).
    #[inline(always)]
    fn dot16(self, q: &[f32], keys: &[f32], out: &mut [f32; 16]) {
        use std::arch::x86_64::*;
        let d = q.len();
        let dv = if DV > 0 { DV } else { d / 16 };
        debug_assert!(d >= 16 * dv && keys.len() >= 16 * d);
        // SAFETY: AVX-512F (see above); 16 * dv values in q and in each of the 16 keys.
        unsafe {
            let (pq, pk) = (q.as_ptr(), keys.as_ptr());
            let mut a = [_mm512_setzero_ps(); 16];
            for (i, acc) in a.iter_mut().enumerate() {
                let kp = pk.add(i * d);
                let mut x = _mm512_mul_ps(_mm512_loadu_ps(pq), _mm512_loadu_ps(kp));
                for c in 1..dv {
                    x = _mm512_fmadd_ps(_mm512_loadu_ps(pq.add(16 * c)), _mm512_loadu_ps(kp.add(16 * c)), x);
                }
                *acc = x;
            }
            _mm512_storeu_ps(out.as_mut_ptr(), crate::simd::reduce_add16(&a));
        }
    }

    #[inline(always)]
    fn axpy(self, y: &mut [f32], w: f32, x: &[f32]) {
        use std::arch::x86_64::*;
        let dv = if DV > 0 { DV } else { y.len() / 16 };
        debug_assert!(y.len() >= 16 * dv && x.len() >= 16 * dv);
        // SAFETY: AVX-512F (see above); 16 * dv values in both slices.
        unsafe {
            let (py, px, wv) = (y.as_mut_ptr(), x.as_ptr(), _mm512_set1_ps(w));
            for c in 0..dv {
                let o = py.add(16 * c);
                _mm512_storeu_ps(o, _mm512_fmadd_ps(wv, _mm512_loadu_ps(px.add(16 * c)), _mm512_loadu_ps(o)));
            }
        }
    }

    /// `axpy`'s fused multiply-adds with `y` held in registers across the rows.
    #[inline(always)]
    fn axpy_rows(self, y: &mut [f32], w: &[f32], xs: &[f32]) {
        use std::arch::x86_64::*;
        if DV == 0 {
            let d = y.len();
            for (i, &wi) in w.iter().enumerate() {
                self.axpy(y, wi, &xs[i * d..][..d]);
            }
            return;
        }
        debug_assert!(y.len() >= 16 * DV && xs.len() >= w.len() * y.len());
        let d = y.len();
        // SAFETY: AVX-512F (see above); 16 * DV values in y and in each of the w.len() rows.
        unsafe {
            let (py, px) = (y.as_mut_ptr(), xs.as_ptr());
            let mut acc = [_mm512_setzero_ps(); DV];
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(py.add(16 * c));
            }
            for (i, &wi) in w.iter().enumerate() {
                let (wv, x) = (_mm512_set1_ps(wi), px.add(i * d));
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.add(16 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(py.add(16 * c), *a);
            }
        }
    }

    #[inline(always)]
    fn scale(self, y: &mut [f32], w: f32) {
        use std::arch::x86_64::*;
        let dv = if DV > 0 { DV } else { y.len() / 16 };
        debug_assert!(y.len() >= 16 * dv);
        // SAFETY: AVX-512F (see above); 16 * dv values.
        unsafe {
            let (py, wv) = (y.as_mut_ptr(), _mm512_set1_ps(w));
            for c in 0..dv {
                let o = py.add(16 * c);
                _mm512_storeu_ps(o, _mm512_mul_ps(wv, _mm512_loadu_ps(o)));
            }
        }
    }
}
