//! The CPU kernels' SIMD: `Simd` (lanes.rs), sixteen f32 lanes on every instruction set
//! (avx512.rs, avx2.rs, neon.rs, portable.rs), the choice of set (isa.rs: `Isa`,
//! `IRIS_CPU_ISA`), and the small kernels built on them here: dot products, axpy, the
//! deterministic exp. The bottom of the crate, next to `config`: the ops and the TurboQuant
//! codec build on them; they use nothing else of iris.
//!
//! Every kernel is one generic source; the sets differ only in how they spell the sixteen-lane
//! operations, so a kernel's results have the same bits on every machine (lanes.rs says why).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod isa;
mod lanes;
#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;

pub use isa::{run, Isa, IsaError, WithSimd};
pub use lanes::Simd;

/// Asks for the cache line holding `p` to be brought in (into every level): only a hint, so
/// any address is allowed. Kernels that stream from DRAM call it well ahead of their loads.
#[inline(always)]
pub fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; any address is allowed.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `prefetch` into the second-level cache only: for streams asked for many lines at once
/// (a block of keys, hundreds of lines), which into the first level would queue behind its
/// few fill buffers and evict what the loop is using. The paged attention's decode from DRAM
/// ran 0.62 against 0.79 ms a layer with it (see `ops/paged_attention/kernel.rs`).
#[inline(always)]
pub fn prefetch_l2(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; any address is allowed.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T1)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Dot product of two equal-length f32 slices: two 16-lane accumulators over 32 values at a
/// time, one more 16, their sum reduced, then the tail one product at a time.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    struct Dot<'a>(&'a [f32], &'a [f32]);
    impl WithSimd for Dot<'_> {
        type Output = f32;
        #[inline(always)]
        fn run<S: Simd>(self, s: S) -> f32 {
            dot(s, self.0, self.1)
        }
    }
    run(Dot(a, b))
}

/// `dot_f32` inside a kernel.
#[inline(always)]
pub fn dot<S: Simd>(s: S, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut acc0, mut acc1) = (s.zero(), s.zero());
    let mut i = 0;
    // SAFETY: every load reads 16 values below n.
    unsafe {
        while i + 32 <= n {
            acc0 = s.fmadd(s.load(pa.add(i)), s.load(pb.add(i)), acc0);
            acc1 = s.fmadd(s.load(pa.add(i + 16)), s.load(pb.add(i + 16)), acc1);
            i += 32;
        }
        if i + 16 <= n {
            acc0 = s.fmadd(s.load(pa.add(i)), s.load(pb.add(i)), acc0);
            i += 16;
        }
    }
    let mut sum = s.reduce_add(s.add(acc0, acc1));
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// `y += a * x` over equal-length slices (fused lanes, then the tail unfused).
#[inline]
pub fn axpy_f32(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    struct Axpy<'a>(&'a mut [f32], f32, &'a [f32]);
    impl WithSimd for Axpy<'_> {
        type Output = ();
        #[inline(always)]
        fn run<S: Simd>(self, s: S) {
            axpy(s, self.0, self.1, self.2)
        }
    }
    run(Axpy(y, a, x))
}

/// `axpy_f32` inside a kernel.
#[inline(always)]
pub fn axpy<S: Simd>(s: S, y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    let (py, px) = (y.as_mut_ptr(), x.as_ptr());
    let av = s.splat(a);
    let mut i = 0;
    // SAFETY: every access is below n.
    unsafe {
        while i + 16 <= n {
            s.store(py.add(i), s.fmadd(av, s.load(px.add(i)), s.load(py.add(i))));
            i += 16;
        }
    }
    while i < n {
        y[i] += a * x[i];
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

/// The largest of `x`, -inf when it is empty; NaNs are passed over, as `f32::max` does (the
/// same value as a fold of `f32::max`, up to the sign of a zero maximum), 16 lanes at a time.
#[inline]
pub fn max_f32(x: &[f32]) -> f32 {
    struct Max<'a>(&'a [f32]);
    impl WithSimd for Max<'_> {
        type Output = f32;
        #[inline(always)]
        fn run<S: Simd>(self, s: S) -> f32 {
            let (n, p) = (self.0.len(), self.0.as_ptr());
            let mut acc = s.splat(f32::NEG_INFINITY);
            let mut i = 0;
            // SAFETY: every load reads 16 values below n.
            unsafe {
                while i + 16 <= n {
                    let v = s.load(p.add(i));
                    acc = s.select(s.gt(v, acc), v, acc);
                    i += 16;
                }
            }
            s.to_array(acc).into_iter().chain(self.0[i..].iter().copied()).fold(f32::NEG_INFINITY, f32::max)
        }
    }
    run(Max(x))
}

/// In place: x <- exp_det(x - m); returns the sum of the results, accumulated in 16 running
/// sums (element i into sum i mod 16) added in order at the end: the same bits on every
/// machine. (A softmax's exponentials: libm's scalar expf was a fifth of the time of attention
/// on TurboQuant codes in a CPU prefill.)
#[inline]
pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    struct ExpSubSum<'a>(&'a mut [f32], f32);
    impl WithSimd for ExpSubSum<'_> {
        type Output = f32;
        #[inline(always)]
        fn run<S: Simd>(self, s: S) -> f32 {
            let (n, p) = (self.0.len(), self.0.as_mut_ptr());
            let mv = s.splat(self.1);
            let mut acc = s.zero();
            let mut i = 0;
            // SAFETY: every access is below n.
            unsafe {
                while i + 16 <= n {
                    let e = exp_det_v(s, s.sub(s.load(p.add(i)), mv));
                    s.store(p.add(i), e);
                    acc = s.add(acc, e);
                    i += 16;
                }
                if i < n {
                    // The tail's missing lanes load and add 0, as a masked add leaves them.
                    let k = n - i;
                    s.store_n(p.add(i), k, exp_det_v(s, s.sub(s.load_n(p.add(i), k), mv)));
                    acc = s.add(acc, s.load_n(p.add(i), k));
                }
            }
            s.to_array(acc).iter().fold(0.0, |t, &a| t + a)
        }
    }
    run(ExpSubSum(x, m))
}

/// exp_det of each lane, by the same operations in the same order.
#[inline(always)]
pub fn exp_det_v<S: Simd>(s: S, x: S::F) -> S::F {
    let valid = s.gt(x, s.splat(-87.0));
    let big = s.gt(x, s.splat(89.0));
    let n = s.round_even(s.mul(x, s.splat(EXP_LOG2E)));
    let r = s.fnmadd(n, s.splat(EXP_LN2_HI), x);
    let r = s.fnmadd(n, s.splat(EXP_LN2_LO), r);
    let mut q = s.splat(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        q = s.fmadd(q, r, s.splat(*c));
    }
    let e = s.round_to_i(n);
    let tiny = s.lt_i(e, s.splat_i(-126));
    let huge = s.gt_i(e, s.splat_i(127));
    let ec = s.max_i(s.min_i(e, s.splat_i(127)), s.splat_i(-126));
    let scale = s.bits_to_f(s.slli::<23>(s.add_i(ec, s.splat_i(127))));
    let y = s.mul(q, scale);
    let y = s.select(huge, s.mul(y, s.splat(2.0)), y);
    let y = s.select(s.and_not(valid, tiny), y, s.zero());
    s.select(big, s.splat(f32::INFINITY), y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `k` on every set this CPU has; the results, with the set's name.
    pub(crate) fn on_each<K: WithSimd + Clone>(k: K) -> Vec<(Isa, K::Output)> {
        Isa::available().into_iter().map(|isa| (isa, isa.run(k.clone()))).collect()
    }

    /// Mixed magnitudes, so that another order of the adds would round otherwise.
    fn mixed(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * seed).sin() * 10f32.powi(i as i32 % 7 - 3)).collect()
    }

    #[derive(Clone)]
    struct Reduce16(Vec<f32>);
    impl WithSimd for Reduce16 {
        type Output = Vec<u32>;
        fn run<S: Simd>(self, s: S) -> Vec<u32> {
            // SAFETY: 256 values, read 16 at a time.
            let a: [S::F; 16] = std::array::from_fn(|i| unsafe { s.load(self.0.as_ptr().add(16 * i)) });
            let one: Vec<u32> = a.iter().map(|v| s.reduce_add(*v).to_bits()).collect();
            let all: Vec<u32> = s.to_array(s.reduce_add16(&a)).iter().map(|v| v.to_bits()).collect();
            assert_eq!(one, all, "reduce_add16 is 16 reduce_adds");
            one
        }
    }

    /// `reduce_add`'s tree is `_mm512_reduce_add_ps`'s, and every set folds the same way.
    #[test]
    fn reductions_have_the_same_bits_on_every_set() {
        let x = mixed(256, 0.731);
        let runs = on_each(Reduce16(x.clone()));
        for (isa, got) in &runs {
            assert_eq!(got, &runs[0].1, "{isa:?} against {:?}", runs[0].0);
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.supported() {
            use std::arch::x86_64::*;
            // SAFETY: AVX-512F is present; 16 values per load.
            let want: Vec<u32> = (0..16)
                .map(|i| unsafe { _mm512_reduce_add_ps(_mm512_loadu_ps(x.as_ptr().add(16 * i))).to_bits() })
                .collect();
            assert_eq!(runs[0].1, want);
        }
        assert!(runs.iter().any(|(i, _)| *i == Isa::Portable));
    }

    #[derive(Clone)]
    struct Transpose(Vec<f32>);
    impl WithSimd for Transpose {
        type Output = Vec<u32>;
        fn run<S: Simd>(self, s: S) -> Vec<u32> {
            // SAFETY: 256 values, read 16 at a time.
            let a: [S::F; 16] = std::array::from_fn(|i| unsafe { s.load(self.0.as_ptr().add(16 * i)) });
            s.transpose16(&a).iter().flat_map(|v| s.to_array(*v)).map(f32::to_bits).collect()
        }
    }

    /// `transpose16` is the transpose on every set (NaN payloads and signed zeros kept).
    #[test]
    fn transpose16_transposes_on_every_set() {
        let mut x = mixed(256, 0.53);
        (x[17], x[100], x[255]) = (f32::from_bits(0x7fc0_1234), -0.0, f32::NEG_INFINITY);
        let want: Vec<u32> = (0..256).map(|n| x[(n % 16) * 16 + n / 16].to_bits()).collect();
        for (isa, got) in on_each(Transpose(x)) {
            assert_eq!(got, want, "{isa:?}");
        }
    }

    #[derive(Clone)]
    struct Kernels(Vec<f32>, Vec<f32>, f32);
    impl WithSimd for Kernels {
        type Output = (u32, Vec<u32>, u32, Vec<u32>);
        fn run<S: Simd>(self, s: S) -> Self::Output {
            let d = dot(s, &self.0, &self.1).to_bits();
            let mut y = self.1.clone();
            axpy(s, &mut y, 0.7, &self.0);
            let mut e = self.0.clone();
            let m = self.2;
            let (n, p) = (e.len(), e.as_mut_ptr());
            let mut acc = 0f32;
            for i in (0..n).step_by(16) {
                let k = (n - i).min(16);
                // SAFETY: k values at i.
                unsafe {
                    let v = exp_det_v(s, s.sub(s.load_n(p.add(i), k), s.splat(m)));
                    s.store_n(p.add(i), k, v);
                }
            }
            for v in &e {
                acc += v;
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (d, bits(&y), acc.to_bits(), bits(&e))
        }
    }

    #[test]
    fn dot_axpy_and_exp_have_the_same_bits_on_every_set() {
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 100, 257, 576] {
            let mut a = mixed(n, 0.37);
            for (i, v) in a.iter_mut().enumerate() {
                match i % 11 {
                    3 => *v = f32::NEG_INFINITY,
                    5 => *v = f32::NAN,
                    7 => *v = -200.0,
                    8 => *v = 95.0,
                    _ => {}
                }
            }
            let b = mixed(n, 0.11);
            let runs = on_each(Kernels(a.clone(), b.clone(), 3.0));
            for (isa, got) in &runs {
                assert_eq!(got, &runs[0].1, "{isa:?} against {:?}, n={n}", runs[0].0);
            }
            // exp_det_v lane by lane is the scalar exp_det.
            let want: Vec<u32> = a.iter().map(|x| exp_det(x - 3.0).to_bits()).collect();
            assert_eq!(runs[0].1 .3, want, "n={n}");
        }
    }

    #[test]
    fn dot_and_axpy_match_f64() {
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 100, 576] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_f32(&a, &b) as f64 - want).abs() < 1e-4, "n={n}");
            let mut y = b.clone();
            axpy_f32(&mut y, 0.7, &a);
            let want: Vec<f64> = b.iter().zip(&a).map(|(y, x)| *y as f64 + 0.7 * *x as f64).collect();
            assert!(y.iter().zip(&want).all(|(a, b)| (*a as f64 - b).abs() < 1e-6), "n={n}");
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

    /// `exp_sub_sum` gives exp_det's bits in every lane and its sum folds the 16 running sums
    /// in order, at every tail length and over the whole range (underflow, -inf included).
    #[test]
    fn exp_sub_sum_is_exp_det_and_its_sum() {
        for n in [0, 1, 15, 16, 17, 31, 33, 100, 257] {
            let base: Vec<f32> = (0..n)
                .map(|i| match i % 11 {
                    3 => f32::NEG_INFINITY,
                    7 => -200.0,
                    _ => (i as f32 * 0.7).sin() * 90.0 - 3.0,
                })
                .collect();
            let m = base.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut acc = [0f32; 16];
            let want: Vec<u32> = base
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    let e = exp_det(x - m);
                    acc[i % 16] += e;
                    e.to_bits()
                })
                .collect();
            let mut got = base.clone();
            let sum = exp_sub_sum(&mut got, m);
            assert_eq!(sum.to_bits(), acc.iter().fold(0.0f32, |s, &a| s + a).to_bits(), "n={n}");
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
        }
    }

    /// `max_f32` is the fold of `f32::max`, at every tail length, with NaNs and infinities.
    #[test]
    fn max_f32_is_the_fold_of_max() {
        for n in [0, 1, 15, 16, 17, 31, 33, 100, 257] {
            let mut x = mixed(n, 0.29);
            for (i, v) in x.iter_mut().enumerate() {
                match i % 13 {
                    4 => *v = f32::NAN,
                    9 => *v = f32::NEG_INFINITY,
                    _ => {}
                }
            }
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_f32(&x).to_bits(), want.to_bits(), "n={n}");
            if n > 20 {
                x[n - 20] = f32::INFINITY;
                assert_eq!(max_f32(&x), f32::INFINITY, "n={n}");
            }
        }
        assert_eq!(max_f32(&[f32::NAN; 20]), f32::NEG_INFINITY);
    }

    #[test]
    fn iris_cpu_isa_names_are_checked() {
        assert!(Isa::available().contains(&Isa::Portable));
        assert_eq!(Isa::best(), Isa::available()[0]);
        for isa in Isa::ALL {
            assert_eq!(Isa::ALL.iter().find(|i| i.name() == isa.name()), Some(&isa));
        }
    }
}
