//! The kernel of the CPU op, one source for every instruction set: partial softmax states of
//! a tile's rows over one run of keys (`super::PagedAttention::run` cuts the runs and folds
//! the states).
//!
//! Both products are register-blocked small matrix products, so that each key and value read
//! from the cache serves many query heads at once (a tile's rows and their GQA group):
//! - scores: a block of KEY_BLOCK keys is transposed once (`Simd::transpose16`, widened to
//!   f32 on the way), then each vector of 16 keys' scores is sum over c of q[c] * k[c], one
//!   fused multiply-add per c in order, with q[c] broadcast: R query heads x W vectors of keys
//!   per pass over c;
//! - values: sum over positions j, in order, of p_j v_j, one fused multiply-add per j per
//!   lane of dimensions, R query heads x C vectors of dimensions per pass over the positions
//!   that all of those heads' rows see.
//!
//! So a row's result has the same bits whatever the other rows of its tile and on every
//! instruction set: each score and each value sum is the same chain of operations whichever
//! blocks it is computed in (the blocking decides only which chains run side by side and when
//! sums pass through memory), its softmax covers its own span, and positions outside its span
//! never touch its sums.

use super::softmax::exp_shifted;
use crate::ops::kv_elem::KvElem;
use crate::simd::{prefetch_l2, Simd, WithSimd};

/// Keys transposed at a time (a multiple of 16; the scores' rows are padded to a multiple).
const KEY_BLOCK: usize = 64;

/// Positions ahead whose values the values pass asks for. At long contexts the cache streams
/// from DRAM and a position's vectors lie apart from the next one's (the other kv heads sit
/// between them), while a position's work is a few cycles. Measured together with the work
/// items per segment (`JobPlan`): see there. 96 measured no better than 32.
const VALUES_AHEAD: usize = 32;

/// Asks for the `d` values at each of `offs` in `x` (one position's key or value vector each),
/// into the second-level cache: a block of keys is hundreds of lines asked for at once, which
/// into the first level measured 0.79 against 0.62 ms a layer (SmolLM2 at 8,192 positions
/// from DRAM, `cargo bench --bench prefill_attention -- --rows 1 --contexts 8192 --layers
/// 30`, three alternated runs; Gemma-3's shape at 32k: 3.98 against 3.39). Asking for the
/// first block too, before the loop, gave another 5% (0.65 against 0.62).
#[inline(always)]
unsafe fn prefetch_vectors<T>(x: *const T, offs: &[usize], d: usize) {
    let bytes = d * std::mem::size_of::<T>();
    for &off in offs {
        let p = x.wrapping_add(off) as *const u8;
        for b in (0..bytes).step_by(64) {
            prefetch_l2(p.wrapping_add(b));
        }
    }
}

/// Buffers reused from one run of keys to the next, and by every work item a thread runs (a
/// decode row's softmax segments are items of their own: thousands a token at long contexts,
/// each of which allocated and zeroed its own).
#[derive(Default)]
pub(super) struct Scratch {
    /// A block of keys transposed, `[d, KEY_BLOCK]`.
    kt: Vec<f32>,
    /// Scores, then softmax weights, `[rows * group, n rounded up to KEY_BLOCK]`.
    scores: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// `f` with this thread's scratch. Borrowed outside `Simd::run`: code inside it must stay in
/// the instruction set's own functions (a closure there is compiled without its features, and
/// the kernel inlined into it ran 20-30x slower).
pub(super) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with_borrow_mut(f)
}

/// The partial softmax states (m, l, sum of exp(s - m) v) of `rows = spans.len()` query rows
/// of one sequence, each with `group` query heads (`q`: `[rows, group, d]`; `part`: `[rows,
/// group, d + 2]`), over the key/value vectors at `offs` (any cache type, widened to f32 as
/// it is read), row r reading `offs[spans[r].0..spans[r].1]` (m = -inf when that is empty).
///
/// Its fields must hold (`PagedAttention::run` makes them so): `d % 16 == 0`; every `off + d`
/// within `k` and `v`; each span within `offs`; `q` holds `rows * group * d` values and `part`
/// `rows * group * (d + 2)`.
pub(super) struct Partial<'a, T> {
    pub q: &'a [f32],
    pub group: usize,
    pub spans: &'a [(usize, usize)],
    pub offs: &'a [usize],
    pub k: &'a [T],
    pub v: &'a [T],
    pub d: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    pub scratch: &'a mut Scratch,
    pub part: &'a mut [f32],
}

impl<T: KvElem> WithSimd for Partial<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        debug_assert!(self.d.is_multiple_of(16) && self.q.len() >= self.spans.len() * self.group * self.d);
        debug_assert!(self.part.len() == self.spans.len() * self.group * (self.d + 2));
        // SAFETY: as the struct's doc states.
        unsafe { partial(s, self) }
    }
}

#[inline(always)]
unsafe fn partial<S: Simd, T: KvElem>(s: S, a: Partial<'_, T>) {
    let Partial { q, group, spans, offs, k, v, d, scale, softcap, scratch, part } = a;
    let (nq, n) = (spans.len() * group, offs.len());
    let np = n.next_multiple_of(KEY_BLOCK);
    scratch.kt.resize(d * KEY_BLOCK, 0.0);
    scratch.scores.resize(nq * np, 0.0);
    let (kt, sc) = (scratch.kt.as_mut_ptr(), scratch.scores.as_mut_ptr());
    // The first block's keys (the loop asks for each next one while it computes).
    prefetch_vectors(k.as_ptr(), &offs[..n.min(KEY_BLOCK)], d);
    for b0 in (0..n).step_by(KEY_BLOCK) {
        let b1 = (b0 + KEY_BLOCK).min(n);
        // The vectors of 16 keys of the block that rows r0..r1 (meeting it) see.
        let cols = |r0: usize, r1: usize| {
            let lo = spans[r0..r1].iter().map(|sp| sp.0.max(b0)).min().unwrap_or(b0);
            let hi = spans[r0..r1].iter().map(|sp| sp.1.min(b1)).max().unwrap_or(b1);
            ((lo - b0) / 16, (hi - b0).div_ceil(16))
        };
        let runs: Vec<_> = meeting(spans, b0, b1).collect();
        let (Some(w0), Some(w1)) =
            (runs.iter().map(|r| cols(r.0, r.1).0).min(), runs.iter().map(|r| cols(r.0, r.1).1).max())
        else {
            continue;
        };
        // The next block's keys while this one is transposed and scored; after the last, the
        // first values.
        match offs.get(b1..(b1 + KEY_BLOCK).min(n)) {
            Some(next) if !next.is_empty() => prefetch_vectors(k.as_ptr(), next, d),
            _ => prefetch_vectors(v.as_ptr(), &offs[..n.min(VALUES_AHEAD)], d),
        }
        transpose_keys(s, k, &offs[b0..b1], (w0, w1), d, kt);
        for (r0, r1) in runs {
            let (mut q0, q1) = (r0 * group, r1 * group);
            while q0 < q1 {
                let r = score_rows::<S>(q1 - q0);
                let (w0, w1) = cols(q0 / group, (q0 + r - 1) / group + 1);
                let mut w = w0;
                while w < w1 {
                    let wn = (w1 - w).min(score_cols::<S>());
                    let out = sc.add(q0 * np + b0 + 16 * w);
                    scores(s, (r, wn), q.as_ptr().add(q0 * d), kt.add(16 * w), d, scale, out, np);
                    w += wn;
                }
                q0 += r;
            }
        }
    }
    let pp = part.as_mut_ptr();
    for (r, &(s0, s1)) in spans.iter().enumerate() {
        for h in 0..group {
            let qi = r * group + h;
            let p = std::slice::from_raw_parts_mut(pp.add(qi * (d + 2)), d + 2);
            p.fill(0.0);
            if s0 >= s1 {
                p[0] = f32::NEG_INFINITY;
                continue;
            }
            let row = std::slice::from_raw_parts_mut(sc.add(qi * np + s0), s1 - s0);
            if let Some(cap) = softcap {
                row.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
            }
            (p[0], p[1]) = exp_shifted(row);
        }
    }
    // Values, for blocks of query heads: the positions all of a block's rows see at once, and
    // before and after them each row's own, in order.
    let dv = d / 16;
    // Dimension chunks of at most `value_cols` vectors, as even as possible.
    let nch = dv.div_ceil(value_cols::<S>());
    let mut c0 = 0;
    for ci in 0..nch {
        let cw = dv / nch + usize::from(ci < dv % nch);
        // Heads qa..qb over positions a..b (all in the spans of their rows). A macro, not a
        // closure: a closure would not be compiled with the instruction set's features.
        macro_rules! sum {
            ($qa:expr, $qb:expr, $span:expr) => {{
                let (qa, qb, (a, b)): (usize, usize, (usize, usize)) = ($qa, $qb, $span);
                if qa < qb && a < b {
                    let out = pp.add(qa * (d + 2) + 2 + 16 * c0);
                    values(s, qb - qa, cw, sc.add(qa * np), np, (a, b), offs, v.as_ptr(), 16 * c0, out, d + 2);
                }
            }};
        }
        let mut q0 = 0;
        while q0 < nq {
            let q1 = q0 + value_rows::<S>(cw, nq - q0);
            let rows = q0 / group..(q1 - 1) / group + 1;
            // Row r's heads within the block.
            let heads = |r: usize| (q0.max(r * group), q1.min((r + 1) * group));
            let cl = rows.clone().map(|r| spans[r].0).max().unwrap_or(0);
            let ch = rows.clone().map(|r| spans[r].1).min().unwrap_or(0);
            if cl < ch {
                for r in rows.clone() {
                    let (qa, qb) = heads(r);
                    sum!(qa, qb, (spans[r].0, cl));
                }
                sum!(q0, q1, (cl, ch));
                for r in rows {
                    let (qa, qb) = heads(r);
                    sum!(qa, qb, (ch, spans[r].1));
                }
            } else {
                for r in rows {
                    let (qa, qb) = heads(r);
                    sum!(qa, qb, spans[r]);
                }
            }
            q0 = q1;
        }
        c0 += cw;
    }
}

/// The runs `r0..r1` of consecutive rows whose spans meet positions `a..b`, in order.
fn meeting(spans: &[(usize, usize)], a: usize, b: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    let meets = move |r: usize| spans.get(r).is_some_and(|&(s0, s1)| s0 < s1 && s0 < b && a < s1);
    let mut r = 0;
    std::iter::from_fn(move || {
        while r < spans.len() && !meets(r) {
            r += 1;
        }
        let r0 = r;
        while meets(r) {
            r += 1;
        }
        (r0 < r).then_some((r0, r))
    })
}

/// `kt[c * KEY_BLOCK + j]` = key `j`'s lane `c`, for the keys at `offs` (at most KEY_BLOCK)
/// in the vectors of 16 keys `w0..w1`, zero for missing keys.
#[inline(always)]
unsafe fn transpose_keys<S: Simd, T: KvElem>(
    s: S,
    k: &[T],
    offs: &[usize],
    (w0, w1): (usize, usize),
    d: usize,
    kt: *mut f32,
) {
    let kp = k.as_ptr();
    for w in w0..w1 {
        for c in (0..d).step_by(16) {
            let rows: [S::F; 16] = std::array::from_fn(|i| match offs.get(16 * w + i) {
                Some(&off) => T::load16(s, kp.add(off + c)),
                None => s.zero(),
            });
            for (i, x) in s.transpose16(&rows).into_iter().enumerate() {
                s.store(kt.add((c + i) * KEY_BLOCK + 16 * w), x);
            }
        }
    }
}

/// Query heads per pass of `scores` (accumulators R x W: 24 of AVX-512's 32 registers).
#[inline(always)]
fn score_rows<S: Simd>(left: usize) -> usize {
    left.min(if S::REGISTERS >= 32 { 6 } else { 2 })
}

/// Vectors of 16 keys per pass of `scores`.
#[inline(always)]
fn score_cols<S: Simd>() -> usize {
    if S::REGISTERS >= 32 {
        4
    } else {
        2
    }
}

/// `out[i * stride + j]` = scale * (q_i . key j) for `r` query heads at `q` (`[r, d]`) and the
/// `16 * w` keys at `kt` (transposed, rows KEY_BLOCK apart).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn scores<S: Simd>(
    s: S,
    (r, w): (usize, usize),
    q: *const f32,
    kt: *const f32,
    d: usize,
    scale: f32,
    out: *mut f32,
    stride: usize,
) {
    macro_rules! by_shape {
        ($($w:literal: $($r:literal)*;)*) => {
            match (w, r) {
                $($(($w, $r) => scores_rw::<S, $r, $w>(s, q, kt, d, scale, out, stride),)*)*
                _ => unreachable!("score_rows gives at most 6 rows, score_cols 4 columns"),
            }
        };
    }
    if S::REGISTERS >= 32 {
        by_shape! {
            1: 1 2 3 4 5 6;
            2: 1 2 3 4 5 6;
            3: 1 2 3 4 5 6;
            4: 1 2 3 4 5 6;
        }
    } else {
        by_shape! {
            1: 1 2;
            2: 1 2;
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn scores_rw<S: Simd, const R: usize, const W: usize>(
    s: S,
    q: *const f32,
    kt: *const f32,
    d: usize,
    scale: f32,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [[s.zero(); W]; R];
    for c in 0..d {
        let kc: [S::F; W] = std::array::from_fn(|w| s.load(kt.add(c * KEY_BLOCK + 16 * w)));
        for (i, a) in acc.iter_mut().enumerate() {
            let x = s.splat(*q.add(i * d + c));
            for (y, kw) in a.iter_mut().zip(&kc) {
                *y = s.fmadd(x, *kw, *y);
            }
        }
    }
    let sv = s.splat(scale);
    for (i, a) in acc.iter().enumerate() {
        for (w, y) in a.iter().enumerate() {
            s.store(out.add(i * stride + 16 * w), s.mul(*y, sv));
        }
    }
}

/// Vectors of dimensions per pass of `values`.
#[inline(always)]
fn value_cols<S: Simd>() -> usize {
    if S::REGISTERS >= 32 {
        4
    } else {
        2
    }
}

/// Query heads per pass of `values` over `cols` vectors of dimensions (accumulators R x C: at
/// most 24 of AVX-512's registers).
#[inline(always)]
fn value_rows<S: Simd>(cols: usize, left: usize) -> usize {
    left.min(if S::REGISTERS >= 32 { (24 / cols).min(8) } else { 2 })
}

/// For `r` query heads with weights at `p` (`[r, stride]`, indexed by position) and sums at
/// `out` (`[r, out_stride]`), sums += p_j v_j over positions `a..b` in order, on `cols`
/// vectors of dimensions from `c0`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn values<S: Simd, T: KvElem>(
    s: S,
    r: usize,
    cols: usize,
    p: *const f32,
    stride: usize,
    span: (usize, usize),
    offs: &[usize],
    v: *const T,
    c0: usize,
    out: *mut f32,
    out_stride: usize,
) {
    macro_rules! by_shape {
        ($($c:literal: $($r:literal)*;)*) => {
            match (cols, r) {
                $($(($c, $r) => values_rc::<S, T, $r, $c>(s, p, stride, span, offs, v, c0, out, out_stride),)*)*
                _ => unreachable!("value_rows gives at most 8 rows, value_cols 4 columns"),
            }
        };
    }
    if S::REGISTERS >= 32 {
        by_shape! {
            1: 1 2 3 4 5 6 7 8;
            2: 1 2 3 4 5 6 7 8;
            3: 1 2 3 4 5 6 7 8;
            4: 1 2 3 4 5 6;
        }
    } else {
        by_shape! {
            1: 1 2;
            2: 1 2;
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn values_rc<S: Simd, T: KvElem, const R: usize, const C: usize>(
    s: S,
    p: *const f32,
    stride: usize,
    (a, b): (usize, usize),
    offs: &[usize],
    v: *const T,
    c0: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc: [[S::F; C]; R] =
        std::array::from_fn(|i| std::array::from_fn(|c| s.load(out.add(i * out_stride + 16 * c))));
    let pr: [*const f32; R] = std::array::from_fn(|i| p.add(i * stride));
    for j in a..b {
        if let Some(&ahead) = offs.get(j + VALUES_AHEAD) {
            prefetch_vectors(v.add(c0), &[ahead], 16 * C);
        }
        let vj = v.add(*offs.get_unchecked(j) + c0);
        let vc: [S::F; C] = std::array::from_fn(|c| T::load16(s, vj.add(16 * c)));
        for (i, x) in acc.iter_mut().enumerate() {
            let w = s.splat(*pr[i].add(j));
            for (y, vv) in x.iter_mut().zip(&vc) {
                *y = s.fmadd(w, *vv, *y);
            }
        }
    }
    for (i, x) in acc.iter().enumerate() {
        for (c, y) in x.iter().enumerate() {
            s.store(out.add(i * out_stride + 16 * c), *y);
        }
    }
}
