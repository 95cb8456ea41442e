//! `Simd` on NEON (aarch64): four 4-lane registers per sixteen lanes, lanes 0..4 in the first.

use std::arch::aarch64::*;

use super::lanes::{f16_array, Simd};

/// Made only by `Isa::run` (NEON is part of every aarch64 CPU).
#[derive(Clone, Copy)]
pub struct Neon(pub(super) ());

type F = [float32x4_t; 4];
type I = [int32x4_t; 4];
type M = [uint32x4_t; 4];

/// Applies a 4-lane operation to all four quarters.
macro_rules! quarters {
    ($f:ident($($a:expr),*)) => {
        unsafe { [$f($($a[0]),*), $f($($a[1]),*), $f($($a[2]),*), $f($($a[3]),*)] }
    };
}

#[inline(always)]
fn map<T: Copy, U>(a: [T; 4], f: impl Fn(T) -> U) -> [U; 4] {
    [f(a[0]), f(a[1]), f(a[2]), f(a[3])]
}

// SAFETY (every intrinsic call below): NEON is present on every aarch64 CPU.
impl Simd for Neon {
    type F = F;
    type I = I;
    type M = M;
    const REGISTERS: usize = 8;

    #[inline(always)]
    fn splat(self, x: f32) -> F {
        unsafe { [vdupq_n_f32(x); 4] }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> F {
        [vld1q_f32(p), vld1q_f32(p.add(4)), vld1q_f32(p.add(8)), vld1q_f32(p.add(12))]
    }
    #[inline(always)]
    unsafe fn load_n(self, p: *const f32, n: usize) -> F {
        let mut a = [0f32; 16];
        std::ptr::copy_nonoverlapping(p, a.as_mut_ptr(), n.min(16));
        self.load(a.as_ptr())
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: F) {
        for (i, q) in v.iter().enumerate() {
            vst1q_f32(p.add(4 * i), *q);
        }
    }
    #[inline(always)]
    unsafe fn store_n(self, p: *mut f32, n: usize, v: F) {
        let a = self.to_array(v);
        std::ptr::copy_nonoverlapping(a.as_ptr(), p, n.min(16));
    }
    #[inline(always)]
    fn add(self, a: F, b: F) -> F {
        quarters!(vaddq_f32(a, b))
    }
    #[inline(always)]
    fn sub(self, a: F, b: F) -> F {
        quarters!(vsubq_f32(a, b))
    }
    #[inline(always)]
    fn mul(self, a: F, b: F) -> F {
        quarters!(vmulq_f32(a, b))
    }
    #[inline(always)]
    fn div(self, a: F, b: F) -> F {
        quarters!(vdivq_f32(a, b))
    }
    #[inline(always)]
    fn fmadd(self, a: F, b: F, c: F) -> F {
        // vfmaq_f32(c, a, b) = c + a * b, fused.
        quarters!(vfmaq_f32(c, a, b))
    }
    #[inline(always)]
    fn fnmadd(self, a: F, b: F, c: F) -> F {
        // vfmsq_f32(c, a, b) = c - a * b, fused.
        quarters!(vfmsq_f32(c, a, b))
    }
    #[inline(always)]
    fn round_even(self, a: F) -> F {
        quarters!(vrndnq_f32(a))
    }
    #[inline(always)]
    fn reduce_add(self, v: F) -> f32 {
        unsafe {
            // i + i+8: quarters 0, 1 with 2, 3; then i + i+4; then i + i+2 and i + i+1.
            let b = vaddq_f32(vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3]));
            let c = vadd_f32(vget_low_f32(b), vget_high_f32(b));
            vget_lane_f32::<0>(c) + vget_lane_f32::<1>(c)
        }
    }

    #[inline(always)]
    fn splat_i(self, x: i32) -> I {
        unsafe { [vdupq_n_s32(x); 4] }
    }
    #[inline(always)]
    fn splat2_i(self, lo: i32, hi: i32) -> I {
        unsafe { [vdupq_n_s32(lo), vdupq_n_s32(lo), vdupq_n_s32(hi), vdupq_n_s32(hi)] }
    }
    #[inline(always)]
    fn from_i32s(self, a: [i32; 16]) -> I {
        let p = a.as_ptr();
        unsafe { [vld1q_s32(p), vld1q_s32(p.add(4)), vld1q_s32(p.add(8)), vld1q_s32(p.add(12))] }
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> I {
        let b = vld1q_u8(p);
        let (lo, hi) = (vmovl_u8(vget_low_u8(b)), vmovl_u8(vget_high_u8(b)));
        [
            vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))),
            vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo))),
            vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))),
            vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi))),
        ]
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const u8) -> I {
        let b = vld1q_s8(p.cast());
        let (lo, hi) = (vmovl_s8(vget_low_s8(b)), vmovl_s8(vget_high_s8(b)));
        [
            vmovl_s16(vget_low_s16(lo)),
            vmovl_s16(vget_high_s16(lo)),
            vmovl_s16(vget_low_s16(hi)),
            vmovl_s16(vget_high_s16(hi)),
        ]
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> I {
        let (lo, hi) = (vld1q_u16(p), vld1q_u16(p.add(8)));
        [
            vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))),
            vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo))),
            vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))),
            vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi))),
        ]
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> F {
        self.load(f16_array(p).as_ptr())
    }
    #[inline(always)]
    fn and_i(self, a: I, b: I) -> I {
        quarters!(vandq_s32(a, b))
    }
    #[inline(always)]
    fn or_i(self, a: I, b: I) -> I {
        quarters!(vorrq_s32(a, b))
    }
    #[inline(always)]
    fn add_i(self, a: I, b: I) -> I {
        quarters!(vaddq_s32(a, b))
    }
    #[inline(always)]
    fn sub_i(self, a: I, b: I) -> I {
        quarters!(vsubq_s32(a, b))
    }
    #[inline(always)]
    fn min_i(self, a: I, b: I) -> I {
        quarters!(vminq_s32(a, b))
    }
    #[inline(always)]
    fn max_i(self, a: I, b: I) -> I {
        quarters!(vmaxq_s32(a, b))
    }
    #[inline(always)]
    fn srli<const N: i32>(self, a: I) -> I {
        self.srlv(a, self.splat_i(N))
    }
    #[inline(always)]
    fn slli<const N: i32>(self, a: I) -> I {
        // vshlq_s32 shifts left by positive counts.
        map(a, |x| unsafe { vshlq_s32(x, vdupq_n_s32(N)) })
    }
    #[inline(always)]
    fn srlv(self, a: I, counts: I) -> I {
        // vshlq_u32 shifts right by negative counts.
        unsafe {
            [
                vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a[0]), vnegq_s32(counts[0]))),
                vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a[1]), vnegq_s32(counts[1]))),
                vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a[2]), vnegq_s32(counts[2]))),
                vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a[3]), vnegq_s32(counts[3]))),
            ]
        }
    }
    #[inline(always)]
    fn bit_lanes(self, bits: u16) -> I {
        let iota = self.from_i32s(super::lanes::IOTA);
        self.and_i(self.srlv(self.splat_i(bits as i32), iota), self.splat_i(1))
    }
    #[inline(always)]
    fn to_f(self, a: I) -> F {
        quarters!(vcvtq_f32_s32(a))
    }
    #[inline(always)]
    fn round_to_i(self, a: F) -> I {
        quarters!(vcvtnq_s32_f32(a))
    }
    #[inline(always)]
    fn bits_to_f(self, a: I) -> F {
        quarters!(vreinterpretq_f32_s32(a))
    }

    #[inline(always)]
    fn gt(self, a: F, b: F) -> M {
        quarters!(vcgtq_f32(a, b))
    }
    #[inline(always)]
    fn lt_i(self, a: I, b: I) -> M {
        quarters!(vcltq_s32(a, b))
    }
    #[inline(always)]
    fn gt_i(self, a: I, b: I) -> M {
        quarters!(vcgtq_s32(a, b))
    }
    #[inline(always)]
    fn and_not(self, a: M, b: M) -> M {
        // vbicq_u32(a, b) = a & !b.
        quarters!(vbicq_u32(a, b))
    }
    #[inline(always)]
    fn select(self, m: M, a: F, b: F) -> F {
        quarters!(vbslq_f32(m, a, b))
    }

    /// Lane by lane through memory (TurboQuant codes on an ARM CPU; `vqtbl4q_u8` would need
    /// byte indices built per lane).
    #[inline(always)]
    fn lookup16(self, table: F, idx: I) -> F {
        let (t, mut i) = (self.to_array(table), [0i32; 16]);
        let p = i.as_mut_ptr();
        // SAFETY: 16 lanes into 16 values.
        unsafe {
            for (q, v) in idx.iter().enumerate() {
                vst1q_s32(p.add(4 * q), *v);
            }
        }
        let out: [f32; 16] = std::array::from_fn(|j| t[(i[j] & 15) as usize]);
        // SAFETY: 16 values.
        unsafe { self.load(out.as_ptr()) }
    }
}
