//! `Simd` in plain Rust, lane by lane over arrays: the reference the other sets are tested
//! against, and the path of CPUs with none of them.

use super::lanes::{f16_array, Simd};

#[derive(Clone, Copy)]
pub struct Portable;

type F = [f32; 16];
type I = [i32; 16];
type M = [bool; 16];

#[inline(always)]
fn map<T: Copy, U: Copy + Default>(a: [T; 16], f: impl Fn(T) -> U) -> [U; 16] {
    let mut o = [U::default(); 16];
    for (o, a) in o.iter_mut().zip(a) {
        *o = f(a);
    }
    o
}

#[inline(always)]
fn zip<T: Copy, U: Copy + Default>(a: [T; 16], b: [T; 16], f: impl Fn(T, T) -> U) -> [U; 16] {
    let mut o = [U::default(); 16];
    for i in 0..16 {
        o[i] = f(a[i], b[i]);
    }
    o
}

impl Simd for Portable {
    type F = F;
    type I = I;
    type M = M;
    const REGISTERS: usize = 8;

    #[inline(always)]
    fn splat(self, x: f32) -> F {
        [x; 16]
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> F {
        p.cast::<F>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn load_n(self, p: *const f32, n: usize) -> F {
        let mut a = [0f32; 16];
        std::ptr::copy_nonoverlapping(p, a.as_mut_ptr(), n.min(16));
        a
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: F) {
        p.cast::<F>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn store_n(self, p: *mut f32, n: usize, v: F) {
        std::ptr::copy_nonoverlapping(v.as_ptr(), p, n.min(16));
    }
    #[inline(always)]
    fn add(self, a: F, b: F) -> F {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(self, a: F, b: F) -> F {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn mul(self, a: F, b: F) -> F {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn div(self, a: F, b: F) -> F {
        zip(a, b, |x, y| x / y)
    }
    #[inline(always)]
    fn fmadd(self, a: F, b: F, c: F) -> F {
        let mut o = [0f32; 16];
        for i in 0..16 {
            o[i] = a[i].mul_add(b[i], c[i]);
        }
        o
    }
    #[inline(always)]
    fn fnmadd(self, a: F, b: F, c: F) -> F {
        let mut o = [0f32; 16];
        for i in 0..16 {
            o[i] = (-a[i]).mul_add(b[i], c[i]);
        }
        o
    }
    #[inline(always)]
    fn round_even(self, a: F) -> F {
        map(a, f32::round_ties_even)
    }
    #[inline(always)]
    fn reduce_add(self, v: F) -> f32 {
        let a: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
        let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
        (b[0] + b[2]) + (b[1] + b[3])
    }

    #[inline(always)]
    fn splat_i(self, x: i32) -> I {
        [x; 16]
    }
    #[inline(always)]
    fn splat2_i(self, lo: i32, hi: i32) -> I {
        std::array::from_fn(|i| if i < 8 { lo } else { hi })
    }
    #[inline(always)]
    fn from_i32s(self, a: [i32; 16]) -> I {
        a
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> I {
        std::array::from_fn(|i| *p.add(i) as i32)
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const u8) -> I {
        std::array::from_fn(|i| *p.add(i) as i8 as i32)
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> I {
        std::array::from_fn(|i| p.add(i).read_unaligned() as i32)
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> F {
        f16_array(p)
    }
    #[inline(always)]
    fn and_i(self, a: I, b: I) -> I {
        zip(a, b, |x, y| x & y)
    }
    #[inline(always)]
    fn or_i(self, a: I, b: I) -> I {
        zip(a, b, |x, y| x | y)
    }
    #[inline(always)]
    fn add_i(self, a: I, b: I) -> I {
        zip(a, b, i32::wrapping_add)
    }
    #[inline(always)]
    fn sub_i(self, a: I, b: I) -> I {
        zip(a, b, i32::wrapping_sub)
    }
    #[inline(always)]
    fn min_i(self, a: I, b: I) -> I {
        zip(a, b, i32::min)
    }
    #[inline(always)]
    fn max_i(self, a: I, b: I) -> I {
        zip(a, b, i32::max)
    }
    #[inline(always)]
    fn srli<const N: i32>(self, a: I) -> I {
        map(a, |x| ((x as u32) >> N) as i32)
    }
    #[inline(always)]
    fn slli<const N: i32>(self, a: I) -> I {
        map(a, |x| ((x as u32) << N) as i32)
    }
    #[inline(always)]
    fn srlv(self, a: I, counts: I) -> I {
        zip(a, counts, |x, n| ((x as u32) >> n) as i32)
    }
    #[inline(always)]
    fn bit_lanes(self, bits: u16) -> I {
        std::array::from_fn(|i| (bits as i32 >> i) & 1)
    }
    #[inline(always)]
    fn to_f(self, a: I) -> F {
        map(a, |x| x as f32)
    }
    #[inline(always)]
    fn round_to_i(self, a: F) -> I {
        map(a, |x| x.round_ties_even() as i32)
    }
    #[inline(always)]
    fn bits_to_f(self, a: I) -> F {
        map(a, |x| f32::from_bits(x as u32))
    }

    #[inline(always)]
    fn gt(self, a: F, b: F) -> M {
        zip(a, b, |x, y| x > y)
    }
    #[inline(always)]
    fn lt_i(self, a: I, b: I) -> M {
        zip(a, b, |x, y| x < y)
    }
    #[inline(always)]
    fn gt_i(self, a: I, b: I) -> M {
        zip(a, b, |x, y| x > y)
    }
    #[inline(always)]
    fn and_not(self, a: M, b: M) -> M {
        zip(a, b, |x, y| x & !y)
    }
    #[inline(always)]
    fn select(self, m: M, a: F, b: F) -> F {
        std::array::from_fn(|i| if m[i] { a[i] } else { b[i] })
    }

    #[inline(always)]
    fn lookup16(self, table: F, idx: I) -> F {
        std::array::from_fn(|i| table[(idx[i] & 15) as usize])
    }
}
