//! Element types a dense KV cache can store.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result};
use half::{bf16, f16};

use crate::simd::Simd;

pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// The values as f32 without conversion, when they already are.
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
    /// The 16 values at `p` as f32 (exactly: every element type here widens without rounding).
    ///
    /// # Safety
    /// 16 values readable at `p`.
    unsafe fn load16<S: Simd>(s: S, p: *const Self) -> S::F;
}

/// `s` as f32: borrowed when already f32, else converted into `buf`.
#[inline]
pub fn to_f32_slice<'a, T: KvElem>(s: &'a [T], buf: &'a mut [f32]) -> &'a [f32] {
    match T::as_f32(s) {
        Some(f) => f,
        None => {
            for (x, y) in buf.iter_mut().zip(s) {
                *x = y.to_f32();
            }
            buf
        }
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    unsafe fn load16<S: Simd>(s: S, p: *const Self) -> S::F {
        s.load(p)
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    /// bf16 is f32's upper half: widen each to 32 bits and shift it up.
    #[inline(always)]
    unsafe fn load16<S: Simd>(s: S, p: *const Self) -> S::F {
        s.bits_to_f(s.slli::<16>(s.load_u16(p.cast())))
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    unsafe fn load16<S: Simd>(s: S, p: *const Self) -> S::F {
        s.load_f16(p.cast())
    }
}

/// The contiguous f32 data of a CPU tensor (inputs to our ops are made contiguous f32).
pub fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let data = match s {
        CpuStorage::F32(d) => d.as_slice(),
        other => candle_core::bail!("{what}: expected f32, got {:?}", other.dtype()),
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what}: expected a contiguous tensor"),
    }
}
