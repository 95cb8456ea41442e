//! The kernel of the CPU op, one source for every instruction set: partial softmax states of
//! a tile's rows over one run of keys (`super::PagedAttention::run` cuts the runs and folds
//! the states).

use super::softmax::exp_shifted;
use crate::ops::kv_elem::KvElem;
use crate::simd::{Simd, WithSimd};

/// The partial softmax states (m, l, sum of exp(s - m) v) of `rows = spans.len()` query rows
/// of one sequence, each with `group` query heads (`q`: `[rows, group, d]`; `part`: `[rows,
/// group, d + 2]`), over the key/value vectors at `offs` (any cache type, widened to f32 as
/// it is read), row r reading `offs[spans[r].0..spans[r].1]` (m = -inf when that is empty).
/// `DV = d / 16` when it is a compile-time size (value sums then stay in registers), 0 for
/// any other multiple of 16.
///
/// A row's result has the same bits whatever the other rows of its tile, and on every
/// instruction set: its scores are the same dot products (16 keys' horizontal sums at once,
/// `reduce_add16`, equal to one `reduce_add` each), its softmax covers its own span, and its
/// value sums take its keys in order (the tile only decides when the sums pass through memory).
///
/// Its fields must hold (`PagedAttention::run` makes them so): `d % 16 == 0`; every `off + d`
/// within `k` and `v`; each span within `offs`; `q` holds `rows * group * d` values and `part`
/// `rows * group * (d + 2)`.
pub(super) struct Partial<'a, T, const DV: usize> {
    pub q: &'a [f32],
    pub spans: &'a [(usize, usize)],
    pub offs: &'a [usize],
    pub k: &'a [T],
    pub v: &'a [T],
    pub d: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    pub part: &'a mut [f32],
}

impl<T: KvElem, const DV: usize> WithSimd for Partial<'_, T, DV> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let Partial { q, spans, offs, k, v, d, scale, softcap, part } = self;
        debug_assert!(d % 16 == 0 && q.len() >= spans.len() * d);
        // SAFETY: as the struct's doc states.
        unsafe { partial::<S, T, DV>(s, q, spans, offs, k, v, d, scale, softcap, part) }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn partial<S: Simd, T: KvElem, const DV: usize>(
    s: S,
    q: &[f32],
    spans: &[(usize, usize)],
    offs: &[usize],
    k: &[T],
    v: &[T],
    d: usize,
    scale: f32,
    softcap: Option<f32>,
    part: &mut [f32],
) {
    let (rows, n) = (spans.len(), offs.len());
    let group = part.len() / (d + 2) / rows;
    let dv = if DV > 0 { DV } else { d / 16 };
    let (kp, vp, qp) = (k.as_ptr(), v.as_ptr(), q.as_ptr());
    let logit = |sum: f32| {
        let s = sum * scale;
        match softcap {
            Some(cap) => (s / cap).tanh() * cap,
            None => s,
        }
    };
    let touches = |&(s0, s1): &(usize, usize), a: usize, b: usize| a < s1 && s0 < b;
    // Scores, [rows, group, n]: a row's entries outside its span are left unused.
    let mut scores = vec![0f32; rows * group * n];
    let full = n - n % 16;
    let mut sums = [0f32; 16];
    for j0 in (0..full).step_by(16) {
        for (r, span) in spans.iter().enumerate() {
            if !touches(span, j0, j0 + 16) {
                continue;
            }
            for h in 0..group {
                let qh = qp.add((r * group + h) * d);
                let mut acc = [s.zero(); 16];
                for (i, a) in acc.iter_mut().enumerate() {
                    let kj = kp.add(offs[j0 + i]);
                    let mut x = s.mul(s.load(qh), T::load16(s, kj));
                    for c in 1..dv {
                        x = s.fmadd(s.load(qh.add(16 * c)), T::load16(s, kj.add(16 * c)), x);
                    }
                    *a = x;
                }
                s.store(sums.as_mut_ptr(), s.reduce_add16(&acc));
                let sc = &mut scores[(r * group + h) * n + j0..][..16];
                for (s, &x) in sc.iter_mut().zip(&sums) {
                    *s = logit(x);
                }
            }
        }
    }
    for (jj, &off) in offs.iter().enumerate().skip(full) {
        let kj = kp.add(off);
        for (r, span) in spans.iter().enumerate() {
            if !touches(span, jj, jj + 1) {
                continue;
            }
            for h in 0..group {
                let qh = qp.add((r * group + h) * d);
                let mut x = s.mul(s.load(qh), T::load16(s, kj));
                for c in 1..dv {
                    x = s.fmadd(s.load(qh.add(16 * c)), T::load16(s, kj.add(16 * c)), x);
                }
                scores[(r * group + h) * n + jj] = logit(s.reduce_add(x));
            }
        }
    }
    part.fill(0.0);
    for (r, &(s0, s1)) in spans.iter().enumerate() {
        for h in 0..group {
            let p = &mut part[(r * group + h) * (d + 2)..][..2];
            (p[0], p[1]) = match s0 < s1 {
                true => exp_shifted(&mut scores[(r * group + h) * n + s0..(r * group + h) * n + s1]),
                false => (f32::NEG_INFINITY, 0.0),
            };
        }
    }
    // Values a chunk of positions at a time (16 KiB of them in f32, so they stay in L1 while
    // every row and head of the tile takes them); each (row, head)'s sums pass through `part`
    // between chunks, which keeps their bits.
    let pp = part.as_mut_ptr();
    let chunk = (4096 / d).max(16);
    for c0 in (0..n).step_by(chunk) {
        let c1 = (c0 + chunk).min(n);
        for (r, &(s0, s1)) in spans.iter().enumerate() {
            let (a, b) = (c0.max(s0), c1.min(s1));
            if a >= b {
                continue;
            }
            for h in 0..group {
                let oh = pp.add((r * group + h) * (d + 2) + 2);
                let p = &scores[(r * group + h) * n + a..(r * group + h) * n + b];
                if DV > 0 {
                    let mut acc = [s.zero(); DV];
                    for (c, x) in acc.iter_mut().enumerate() {
                        *x = s.load(oh.add(16 * c));
                    }
                    for (&pj, &off) in p.iter().zip(&offs[a..b]) {
                        let (w, vj) = (s.splat(pj), vp.add(off));
                        for (c, x) in acc.iter_mut().enumerate() {
                            *x = s.fmadd(w, T::load16(s, vj.add(16 * c)), *x);
                        }
                    }
                    for (c, x) in acc.iter().enumerate() {
                        s.store(oh.add(16 * c), *x);
                    }
                } else {
                    for (&pj, &off) in p.iter().zip(&offs[a..b]) {
                        let (w, vj) = (s.splat(pj), vp.add(off));
                        for c in 0..dv {
                            let oc = oh.add(16 * c);
                            s.store(oc, s.fmadd(w, T::load16(s, vj.add(16 * c)), s.load(oc)));
                        }
                    }
                }
            }
        }
    }
}
