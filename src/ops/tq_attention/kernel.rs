//! The inner operations of attention on codes (decode a row of codes, dots, weighted sums):
//! `Kernel`, done by `Portable` (whole slices, any head size) or by `Lanes` (16-lane vectors
//! of any instruction set).

use crate::ops::turboquant::TqCodec;
use crate::simd::{axpy_f32, dot_f32, Simd};

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

/// 16-lane vectors of an instruction set, `DV = head_dim / 16` of them per head vector (0:
/// any multiple of 16). Only made by `Run` (mod.rs) for head dims that are multiples of 16 and
/// codes of 2 to 4 bits.
#[derive(Clone, Copy)]
pub(super) struct Lanes<S, const DV: usize>(pub S);

impl<S: Simd, const DV: usize> Kernel for Lanes<S, DV> {
    #[inline(always)]
    fn decode(self, codec: &TqCodec, row: &[u8], out: &mut [f32]) {
        codec.decode_rotated_v(self.0, row, out)
    }

    #[inline(always)]
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let s = self.0;
        let dv = if DV > 0 { DV } else { a.len() / 16 };
        assert!(a.len() >= 16 * dv && b.len() >= 16 * dv);
        // SAFETY: 16 * dv values in both slices.
        unsafe {
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut acc = s.mul(s.load(pa), s.load(pb));
            for c in 1..dv {
                acc = s.fmadd(s.load(pa.add(16 * c)), s.load(pb.add(16 * c)), acc);
            }
            s.reduce_add(acc)
        }
    }

    /// The 16 products as `dot` forms them, then their 16 horizontal sums at once
    /// (`Simd::reduce_add16`, the same bits as `dot`'s one at a time).
    #[inline(always)]
    fn dot16(self, q: &[f32], keys: &[f32], out: &mut [f32; 16]) {
        let s = self.0;
        let d = q.len();
        let dv = if DV > 0 { DV } else { d / 16 };
        assert!(d >= 16 * dv && keys.len() >= 16 * d);
        // SAFETY: 16 * dv values in q and in each of the 16 keys.
        unsafe {
            let (pq, pk) = (q.as_ptr(), keys.as_ptr());
            let mut a = [s.zero(); 16];
            for (i, acc) in a.iter_mut().enumerate() {
                let kp = pk.add(i * d);
                let mut x = s.mul(s.load(pq), s.load(kp));
                for c in 1..dv {
                    x = s.fmadd(s.load(pq.add(16 * c)), s.load(kp.add(16 * c)), x);
                }
                *acc = x;
            }
            s.store(out.as_mut_ptr(), s.reduce_add16(&a));
        }
    }

    #[inline(always)]
    fn axpy(self, y: &mut [f32], w: f32, x: &[f32]) {
        let s = self.0;
        let dv = if DV > 0 { DV } else { y.len() / 16 };
        assert!(y.len() >= 16 * dv && x.len() >= 16 * dv);
        // SAFETY: 16 * dv values in both slices.
        unsafe {
            let (py, px, wv) = (y.as_mut_ptr(), x.as_ptr(), s.splat(w));
            for c in 0..dv {
                let o = py.add(16 * c);
                s.store(o, s.fmadd(wv, s.load(px.add(16 * c)), s.load(o)));
            }
        }
    }

    /// `axpy`'s fused multiply-adds with `y` held in registers across the rows.
    #[inline(always)]
    fn axpy_rows(self, y: &mut [f32], w: &[f32], xs: &[f32]) {
        let s = self.0;
        if DV == 0 {
            let d = y.len();
            for (i, &wi) in w.iter().enumerate() {
                self.axpy(y, wi, &xs[i * d..][..d]);
            }
            return;
        }
        let d = y.len();
        assert!(d >= 16 * DV && xs.len() >= w.len() * d);
        // SAFETY: 16 * DV values in y and in each of the w.len() rows.
        unsafe {
            let (py, px) = (y.as_mut_ptr(), xs.as_ptr());
            let mut acc = [s.zero(); DV];
            for (c, a) in acc.iter_mut().enumerate() {
                *a = s.load(py.add(16 * c));
            }
            for (i, &wi) in w.iter().enumerate() {
                let (wv, x) = (s.splat(wi), px.add(i * d));
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = s.fmadd(wv, s.load(x.add(16 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                s.store(py.add(16 * c), *a);
            }
        }
    }

    #[inline(always)]
    fn scale(self, y: &mut [f32], w: f32) {
        let s = self.0;
        let dv = if DV > 0 { DV } else { y.len() / 16 };
        assert!(y.len() >= 16 * dv);
        // SAFETY: 16 * dv values.
        unsafe {
            let (py, wv) = (y.as_mut_ptr(), s.splat(w));
            for c in 0..dv {
                let o = py.add(16 * c);
                s.store(o, s.mul(wv, s.load(o)));
            }
        }
    }
}
