//! `Simd`: sixteen f32 lanes (and the i32 lanes that decode weight codes), the one vocabulary
//! every CPU kernel is written in, implemented for each instruction set.
//!
//! The width is sixteen on every instruction set, whatever its registers: an AVX-512 register,
//! two AVX2 registers, four NEON ones, or an array. A kernel written against `Simd` therefore
//! does the same operations in the same order on every machine (the same lane holds the same
//! partial sum, and `reduce_add` folds the lanes by one fixed tree), so its outputs have the
//! same bits everywhere: the AVX-512 path, the AVX2 one, NEON and the portable reference. No
//! operation here is allowed to round differently on another set: the multiply-adds are fused
//! on all of them, conversions are exact or round to nearest-even, and table lookups compute
//! the very values a conversion would (`lut16`).
//!
//! Why not `pulp`'s `Simd` (already in the tree through `gemm`): its vectors are as wide as the
//! instruction set's registers (16 lanes on AVX-512, 8 on AVX2, 4 on NEON), so sums would be
//! accumulated in another order on each machine, and it has none of the integer widenings and
//! lookups the weight decoders need. The dispatch follows its pattern (`WithSimd`).

/// One instruction set's sixteen lanes. Values of the types are only made by a set the CPU
/// has (`Isa::run` checks before it hands one out), so the arithmetic is safe to call; loads
/// and stores through raw pointers are not.
///
/// Every method is `#[inline(always)]` in the implementations: kernels are generic functions
/// that inline into `Isa::run`'s per-set entry points, compiled with that set's features.
pub trait Simd: Copy + Send + Sync + 'static {
    /// Sixteen f32.
    type F: Copy;
    /// Sixteen i32.
    type I: Copy;
    /// Sixteen lane masks.
    type M: Copy;
    /// How many 16-lane vectors the set keeps in registers (kernels size their tiles by it).
    const REGISTERS: usize;

    fn splat(self, x: f32) -> Self::F;
    #[inline(always)]
    fn zero(self) -> Self::F {
        self.splat(0.0)
    }
    /// # Safety
    /// 16 values readable at `p`.
    unsafe fn load(self, p: *const f32) -> Self::F;
    /// The first `n` lanes from `p` (n <= 16), the rest 0.
    ///
    /// # Safety
    /// `n` values readable at `p`.
    unsafe fn load_n(self, p: *const f32, n: usize) -> Self::F;
    /// # Safety
    /// 16 values writable at `p`.
    unsafe fn store(self, p: *mut f32, v: Self::F);
    /// The first `n` lanes to `p` (n <= 16).
    ///
    /// # Safety
    /// `n` values writable at `p`.
    unsafe fn store_n(self, p: *mut f32, n: usize, v: Self::F);
    #[inline(always)]
    fn to_array(self, v: Self::F) -> [f32; 16] {
        let mut a = [0f32; 16];
        // SAFETY: `a` holds 16 values.
        unsafe { self.store(a.as_mut_ptr(), v) };
        a
    }

    fn add(self, a: Self::F, b: Self::F) -> Self::F;
    fn sub(self, a: Self::F, b: Self::F) -> Self::F;
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    fn div(self, a: Self::F, b: Self::F) -> Self::F;
    /// `a * b + c`, one rounding.
    fn fmadd(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c - a * b`, one rounding.
    fn fnmadd(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// To the nearest integer, ties to even.
    fn round_even(self, a: Self::F) -> Self::F;
    /// The sum of the lanes by one tree: lanes i + i+8, then i + i+4, i + i+2, i + i+1 (as
    /// `_mm512_reduce_add_ps` adds them).
    fn reduce_add(self, v: Self::F) -> f32;
    /// The 16 vectors' `reduce_add`s at once, in lane order (sets with cross-register
    /// shuffles do it in fewer instructions, with the same bits).
    #[inline(always)]
    fn reduce_add16(self, a: &[Self::F; 16]) -> Self::F {
        let sums: [f32; 16] = std::array::from_fn(|i| self.reduce_add(a[i]));
        // SAFETY: 16 values.
        unsafe { self.load(sums.as_ptr()) }
    }

    /// The 16 x 16 matrix whose rows are `a`, transposed: lane j of vector i is lane i of
    /// `a[j]`. Only moves values (the same bits on every set); sets with cross-lane shuffles
    /// override it, the others go through memory.
    #[inline(always)]
    fn transpose16(self, a: &[Self::F; 16]) -> [Self::F; 16] {
        let rows = a.map(|v| self.to_array(v));
        std::array::from_fn(|i| {
            let col: [f32; 16] = std::array::from_fn(|j| rows[j][i]);
            // SAFETY: 16 values.
            unsafe { self.load(col.as_ptr()) }
        })
    }

    fn splat_i(self, x: i32) -> Self::I;
    /// Lanes 0..8 `lo`, lanes 8..16 `hi`.
    fn splat2_i(self, lo: i32, hi: i32) -> Self::I;
    fn from_i32s(self, a: [i32; 16]) -> Self::I;
    /// 16 bytes at `p`, zero-extended.
    ///
    /// # Safety
    /// 16 bytes readable at `p`.
    unsafe fn load_u8(self, p: *const u8) -> Self::I;
    /// 16 bytes at `p`, sign-extended.
    ///
    /// # Safety
    /// 16 bytes readable at `p`.
    unsafe fn load_i8(self, p: *const u8) -> Self::I;
    /// 16 u16 at `p`, zero-extended.
    ///
    /// # Safety
    /// 16 values readable at `p`.
    unsafe fn load_u16(self, p: *const u16) -> Self::I;
    /// 16 IEEE half floats at `p` (as bits), widened exactly.
    ///
    /// # Safety
    /// 16 values readable at `p`.
    unsafe fn load_f16(self, p: *const u16) -> Self::F;
    fn and_i(self, a: Self::I, b: Self::I) -> Self::I;
    fn or_i(self, a: Self::I, b: Self::I) -> Self::I;
    fn add_i(self, a: Self::I, b: Self::I) -> Self::I;
    fn sub_i(self, a: Self::I, b: Self::I) -> Self::I;
    fn min_i(self, a: Self::I, b: Self::I) -> Self::I;
    fn max_i(self, a: Self::I, b: Self::I) -> Self::I;
    /// Logical shift right by `N` (1..32).
    fn srli<const N: i32>(self, a: Self::I) -> Self::I;
    /// Shift left by `N` (0..32).
    fn slli<const N: i32>(self, a: Self::I) -> Self::I;
    /// Lane-wise logical shift right by `counts` (each in 0..32).
    fn srlv(self, a: Self::I, counts: Self::I) -> Self::I;
    /// Lane i: bit i of `bits`, as 0 or 1.
    fn bit_lanes(self, bits: u16) -> Self::I;
    /// Exact conversion of each lane (|x| < 2^24).
    fn to_f(self, a: Self::I) -> Self::F;
    /// Each lane to the nearest integer (ties to even); lanes outside i32 are unspecified.
    fn round_to_i(self, a: Self::F) -> Self::I;
    /// The lanes' bits read as f32.
    fn bits_to_f(self, a: Self::I) -> Self::F;

    /// `a > b` (false where either is NaN).
    fn gt(self, a: Self::F, b: Self::F) -> Self::M;
    fn lt_i(self, a: Self::I, b: Self::I) -> Self::M;
    fn gt_i(self, a: Self::I, b: Self::I) -> Self::M;
    /// `a & !b`.
    fn and_not(self, a: Self::M, b: Self::M) -> Self::M;
    /// `m ? a : b` per lane.
    fn select(self, m: Self::M, a: Self::F, b: Self::F) -> Self::F;

    /// `f(q)` for the code q in the low 4 bits of each lane of both `idx` vectors, where `f`
    /// maps a vector of codes as floats to their values lane by lane. Sets with a 16-entry
    /// permute (AVX-512) evaluate `f` once on the codes 0..16 and look the lanes up; the others
    /// evaluate it on the lanes (converting codes costs them less than lookups built from
    /// narrower permutes or byte tables): the same values either way.
    #[inline(always)]
    fn lut16(self, idx: [Self::I; 2], f: impl Fn(Self::F) -> Self::F) -> [Self::F; 2] {
        let m = self.splat_i(15);
        [f(self.to_f(self.and_i(idx[0], m))), f(self.to_f(self.and_i(idx[1], m)))]
    }
    /// `table[idx]` per lane, by the low 4 bits of each index.
    fn lookup16(self, table: Self::F, idx: Self::I) -> Self::F;
    /// `lut16` for 5-bit codes (the low 5 bits of each lane).
    #[inline(always)]
    fn lut32(self, idx: [Self::I; 2], f: impl Fn(Self::F) -> Self::F) -> [Self::F; 2] {
        let m = self.splat_i(31);
        [f(self.to_f(self.and_i(idx[0], m))), f(self.to_f(self.and_i(idx[1], m)))]
    }
}

/// The codes 0..16 as floats, `[0, 1, .., 15]`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const CODES: [f32; 16] = [0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.];

/// `[0, 1, .., 15]` as i32 lanes.
#[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
pub(crate) const IOTA: [i32; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// 16 half floats widened by `half` (exact), for the sets with no conversion instruction at
/// hand (NEON's needs the unstable f16 types; the portable reference).
///
/// # Safety
/// 16 values readable at `p`.
#[inline(always)]
pub(crate) unsafe fn f16_array(p: *const u16) -> [f32; 16] {
    let mut a = [0f32; 16];
    for (i, x) in a.iter_mut().enumerate() {
        *x = half::f16::from_bits(p.add(i).read_unaligned()).to_f32();
    }
    a
}
