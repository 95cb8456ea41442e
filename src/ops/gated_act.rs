//! `act(gate) * up` over a fused gate/up projection `[T, 2 * inter]`, in one pass. The
//! projection's columns are the gate then the up halves, or interleaved pairs (gate i, up i)
//! where the layer stores its weights that way (`GatedMlp` on CUDA, so that a decode step's
//! product can apply the activation as it writes: `Gemv::forward_gated`). `GatedHalves` is
//! the same over a gate and an up tensor apart (on the CPU, where the layer's two matrices
//! could not be stacked).
//!
//! On the CPU both activations are computed as `x / (1 + exp(-z))` with `exp_det` (16 lanes
//! at a time on every instruction set, the same bits as the scalar tail): candle's tanh-GELU (libm's `tanhf`
//! and `expm1f`) was a sixth of Gemma-3's prefill. The CUDA kernel computes tanh-GELU as
//! `0.5 x (1 + tanh(u))`: the same function, checked against this one within f32 rounding.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::activation;
use super::team::{team, OutPtr};
use crate::config::Activation;
use crate::simd::{exp_det, exp_det_v, Isa, Simd, WithSimd};

pub struct GatedAct {
    /// GELU (tanh approximation) instead of SiLU.
    pub gelu: bool,
    /// Columns (gate i, up i) in pairs instead of the gate half then the up half.
    pub interleaved: bool,
}

/// tanh-GELU's `2 sqrt(2 / pi)`.
const GELU_2C: f32 = 2.0 * 0.797_884_6;

/// SiLU `x sigmoid(x)`, or tanh-GELU `0.5 x (1 + tanh(u))` written as `x sigmoid(2u)` (the same
/// function, without the cancellation of `1 + tanh(u)` where `tanh(u)` nears -1).
pub(crate) fn act(x: f32, gelu: bool) -> f32 {
    let z = if gelu { GELU_2C * (0.044715 * x * x).mul_add(x, x) } else { x };
    x / (1.0 + exp_det(-z))
}

/// `out[i] = act(gate[i]) * up[i]`, on `isa`: whole vectors of 16, each lane running `act`'s
/// operations in its order, then the tail by `act` itself, so a value does not depend on
/// which path computed it.
fn gate_row(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32], gelu: bool) {
    struct Row<'a>(&'a [f32], &'a [f32], &'a mut [f32], bool);
    impl WithSimd for Row<'_> {
        type Output = usize;
        #[inline(always)]
        fn run<S: Simd>(self, s: S) -> usize {
            let Row(gate, up, out, gelu) = self;
            let n = gate.len().min(up.len()).min(out.len()) / 16 * 16;
            let one = s.splat(1.0);
            for i in (0..n).step_by(16) {
                // SAFETY: i + 16 <= n, inside all three slices.
                unsafe {
                    let x = s.load(gate.as_ptr().add(i));
                    let z = match gelu {
                        true => s.mul(s.splat(GELU_2C), s.fmadd(s.mul(s.mul(s.splat(0.044715), x), x), x, x)),
                        false => x,
                    };
                    let a = s.div(x, s.add(one, exp_det_v(s, s.sub(s.zero(), z))));
                    s.store(out.as_mut_ptr().add(i), s.mul(a, s.load(up.as_ptr().add(i))));
                }
            }
            n
        }
    }
    let done = isa.run(Row(gate, up, out, gelu));
    for ((o, &g), &u) in out[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
        *o = act(g, gelu) * u;
    }
}

/// `act(gate) * up` for `[T, inter]` rows `gate_at(r)`, `up_at(r)`, rows spread over the team.
fn gate_rows<'a>(
    t: usize,
    inter: usize,
    gelu: bool,
    gate_at: impl Fn(usize) -> &'a [f32] + Sync,
    up_at: impl Fn(usize) -> &'a [f32] + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; t * inter];
    let dst = OutPtr(out.as_mut_ptr());
    team().for_each(t, |r| {
        // SAFETY: row r of `out` is written by this item only.
        let row = unsafe { std::slice::from_raw_parts_mut(dst.at(r * inter), inter) };
        gate_row(Isa::active(), &gate_at(r)[..inter], &up_at(r)[..inter], row, gelu);
    });
    out
}

impl GatedAct {
    /// The fused kernel for `act`, where it has it (SiLU, tanh-GELU).
    pub fn for_activation(act: Activation) -> Option<Self> {
        match act {
            Activation::Silu => Some(GatedAct { gelu: false, interleaved: false }),
            Activation::GeluTanh => Some(GatedAct { gelu: true, interleaved: false }),
            Activation::Gelu | Activation::QuickGelu => None,
        }
    }

    /// `y`: `[T, 2 * inter]` (rows with unit inner stride) -> `[T, inter]`.
    pub fn forward(&self, y: &Tensor) -> Result<Tensor> {
        y.apply_op1_no_bwd(self)
    }

    /// Widths the CUDA kernel takes: whole 16-byte vectors.
    pub fn supports(inter: usize) -> bool {
        inter % 8 == 0
    }

    /// Whether the op takes `y`, `[T, 2 * inter]`: rows with unit inner stride, f32 on the CPU;
    /// on CUDA any float dtype in whole 16-byte vectors.
    pub fn takes(y: &Tensor) -> bool {
        let cuda = y.device().is_cuda();
        (cuda || y.dtype() == candle_core::DType::F32) && Self::check(y.layout(), cuda).is_ok()
    }

    /// `(T, inter, row stride)`; `vectors`: rows in whole 16-byte vectors (the CUDA kernel's
    /// loads), which the CPU does not need.
    fn check(l: &Layout, vectors: bool) -> Result<(usize, usize, usize)> {
        let (t, w) = l.shape().dims2()?;
        let aligned = Self::supports(w / 2) && l.stride()[0] % 8 == 0 && l.start_offset() % 8 == 0;
        if w % 2 != 0 || l.stride()[1] != 1 || (vectors && !aligned) {
            candle_core::bail!("gated-act: expected [T, 2 * inter] rows with unit stride, got {:?}", l.shape());
        }
        Ok((t, w / 2, l.stride()[0]))
    }
}

impl CustomOp1 for GatedAct {
    fn name(&self) -> &'static str {
        "gated-act"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (t, inter, stride) = Self::check(l, false)?;
        let CpuStorage::F32(y) = s else { candle_core::bail!("gated-act: the CPU op takes f32") };
        let y = &y[l.start_offset()..];
        let out = if self.interleaved {
            // CUDA's layout; here only as the reference its kernels are checked against.
            (0..t * inter)
                .map(|i| {
                    let (row, c) = (&y[(i / inter) * stride..], i % inter);
                    act(row[2 * c], self.gelu) * row[2 * c + 1]
                })
                .collect()
        } else {
            gate_rows(t, inter, self.gelu, |r| &y[r * stride..], |r| &y[r * stride + inter..])
        };
        Ok((CpuStorage::F32(out), Shape::from((t, inter))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::Kernel;
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S};

        let (t, inter, stride) = Self::check(l, true)?;
        let dev = s.device().clone();
        let func = super::cuda::GATED_ACT.func(&dev, &format!("gated_act_{}", super::cuda::dtype_name(s.dtype())?))?;
        let n = t * inter;
        let vecs = n / (16 / s.dtype().size_in_bytes());
        let cfg = LaunchConfig {
            grid_dim: (vecs.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [stride as i32, inter as i32, t as i32, self.gelu as i32, self.interleaved as i32];
        fn launch<T: CudaDType + DeviceRepr>(
            dev: &candle_core::cuda_backend::CudaDevice,
            func: &Kernel,
            cfg: LaunchConfig,
            y: &CudaSlice<T>,
            off: usize,
            n: usize,
            args: [i32; 5],
        ) -> Result<CudaStorage> {
            // SAFETY: the kernel writes every element.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            let y = y.slice(off..);
            let mut b = func.dependent();
            b.mem(&out).mem(&y);
            for a in &args {
                b.scalar(a);
            }
            // SAFETY: argument types and counts match the kernel's signature; the shape was checked;
            // the kernel waits (pdl_wait) before it reads or writes.
            unsafe { b.launch(cfg) }?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let off = l.start_offset();
        let out = match &s.slice {
            S::F32(y) => launch(&dev, &func, cfg, y, off, n, args)?,
            S::BF16(y) => launch(&dev, &func, cfg, y, off, n, args)?,
            S::F16(y) => launch(&dev, &func, cfg, y, off, n, args)?,
            _ => candle_core::bail!("gated-act: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, Shape::from((t, inter))))
    }
}

/// `act(gate) * up` for a gate and an up tensor apart, `[T, inter]` each, f32, on the CPU.
pub struct GatedHalves {
    pub gelu: bool,
}

impl GatedHalves {
    /// `act(gate) * up`: this op where it applies (SiLU or tanh-GELU, f32 on the CPU), op by
    /// op otherwise.
    pub fn apply(act: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let rows = |t: &Tensor| t.rank() == 2 && t.stride()[1] == 1 && t.dtype() == candle_core::DType::F32;
        let fused = GatedAct::for_activation(act).filter(|_| gate.device().is_cpu() && rows(gate) && rows(up));
        match fused {
            Some(a) if gate.shape() == up.shape() => gate.apply_op2_no_bwd(up, &GatedHalves { gelu: a.gelu }),
            _ => activation::apply(act, gate)? * up,
        }
    }
}

impl CustomOp2 for GatedHalves {
    fn name(&self) -> &'static str {
        "gated-halves"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (t, inter) = l1.shape().dims2()?;
        let rows = |s: &'_ CpuStorage, l: &Layout| -> Result<usize> {
            if l.shape().dims2()? != (t, inter) || l.stride()[1] != 1 || !matches!(s, CpuStorage::F32(_)) {
                candle_core::bail!("gated-halves: expected two f32 [T, inter] tensors with unit inner stride");
            }
            Ok(l.stride()[0])
        };
        let (sg, su) = (rows(s1, l1)?, rows(s2, l2)?);
        let (CpuStorage::F32(g), CpuStorage::F32(u)) = (s1, s2) else { unreachable!("checked above") };
        let (g, u) = (&g[l1.start_offset()..], &u[l2.start_offset()..]);
        let out = gate_rows(t, inter, self.gelu, |r| &g[r * sg..], |r| &u[r * su..]);
        Ok((CpuStorage::F32(out), Shape::from((t, inter))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// tanh-GELU and SiLU in f64, as transformers writes them.
    fn reference(x: f64, gelu: bool) -> f64 {
        if gelu {
            0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        } else {
            x / (1.0 + (-x).exp())
        }
    }

    /// Gate values from -100 to 100, dense near 0, with a row width that leaves a scalar tail.
    fn inputs(t: usize, inter: usize) -> Vec<f32> {
        (0..t * inter).map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * if i % 7 == 0 { 200.0 } else { 12.0 }).collect()
    }

    #[test]
    fn the_cpu_ops_match_the_formula_and_their_scalar_path() {
        let (t, inter) = (5, 56);
        let dev = Device::Cpu;
        for gelu in [false, true] {
            let y = Tensor::from_vec(inputs(t, 2 * inter), (t, 2 * inter), &dev).unwrap();
            let fused: Vec<Vec<f32>> = GatedAct { gelu, interleaved: false }.forward(&y).unwrap().to_vec2().unwrap();
            let (g, u) = (y.narrow(1, 0, inter).unwrap(), y.narrow(1, inter, inter).unwrap());
            let act = if gelu { Activation::GeluTanh } else { Activation::Silu };
            let halves: Vec<Vec<f32>> = GatedHalves::apply(act, &g, &u).unwrap().to_vec2().unwrap();
            let (gv, uv): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (g.to_vec2().unwrap(), u.to_vec2().unwrap());
            for r in 0..t {
                for c in 0..inter {
                    let (x, up) = (gv[r][c], uv[r][c]);
                    // Vector lanes and the scalar tail (columns 48..56) give `act`'s bits.
                    let scalar = act_bits(x, up, gelu);
                    assert_eq!(fused[r][c].to_bits(), scalar, "gelu={gelu} ({r},{c}) x={x}");
                    assert_eq!(halves[r][c].to_bits(), scalar, "halves gelu={gelu} ({r},{c})");
                    // Far in the negative tail the result is x e^z: a relative error of z's
                    // few roundings, |z| ulp, comes through whole; below ~1e-38 f32 is subnormal.
                    let want = reference(x as f64, gelu) * up as f64;
                    let z = if gelu { 1.6 * (x as f64 + 0.044715 * (x as f64).powi(3)) } else { x as f64 };
                    let err = (fused[r][c] as f64 - want).abs();
                    let tol = 3e-7 * (1.0 + z.abs().min(200.0)) * want.abs() + 1e-37;
                    assert!(err <= tol, "gelu={gelu} x={x}: {} vs {want}", fused[r][c]);
                }
            }
        }
    }

    /// Every instruction set's vector lanes give the scalar `act`'s bits.
    #[test]
    fn every_instruction_set_gives_the_scalar_bits() {
        let (gate, up) = (inputs(1, 120), inputs(1, 120).iter().map(|v| v * 0.5 + 1.0).collect::<Vec<_>>());
        for gelu in [false, true] {
            for isa in Isa::available() {
                let mut out = vec![0f32; gate.len()];
                gate_row(isa, &gate, &up, &mut out, gelu);
                for (i, o) in out.iter().enumerate() {
                    assert_eq!(o.to_bits(), act_bits(gate[i], up[i], gelu), "{isa:?} gelu={gelu} x={}", gate[i]);
                }
            }
        }
    }

    fn act_bits(x: f32, up: f32, gelu: bool) -> u32 {
        (act(x, gelu) * up).to_bits()
    }

    #[test]
    fn other_dtypes_and_activations_take_the_op_by_op_path() {
        let dev = Device::Cpu;
        let g = Tensor::from_vec(inputs(2, 16), (2, 16), &dev).unwrap();
        let u = Tensor::ones((2, 16), candle_core::DType::F32, &dev).unwrap();
        let want: Vec<Vec<f32>> = g.gelu_erf().unwrap().to_vec2().unwrap();
        let got: Vec<Vec<f32>> = GatedHalves::apply(Activation::Gelu, &g, &u).unwrap().to_vec2().unwrap();
        assert_eq!(got, want, "exact GELU is not the fused op's");
        let bf = |t: &Tensor| t.to_dtype(candle_core::DType::BF16).unwrap();
        let got = GatedHalves::apply(Activation::Silu, &bf(&g), &bf(&u)).unwrap();
        let want = (bf(&g).silu().unwrap() * bf(&u)).unwrap();
        assert_eq!(got.dtype(), candle_core::DType::BF16);
        assert_eq!(
            got.to_dtype(candle_core::DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            want.to_dtype(candle_core::DType::F32).unwrap().to_vec2::<f32>().unwrap()
        );
        // A stacked projection whose rows the CUDA kernel could not load as vectors (inter
        // 13, rows at an odd offset) still takes the CPU op, and gives the halves' values.
        let y = Tensor::from_vec(inputs(3, 27), (3, 27), &dev).unwrap().narrow(1, 1, 26).unwrap();
        assert!(GatedAct::takes(&y), "the CPU op takes any f32 rows with unit inner stride");
        let stacked: Vec<Vec<f32>> =
            GatedAct { gelu: true, interleaved: false }.forward(&y).unwrap().to_vec2().unwrap();
        let (g, u) = (y.narrow(1, 0, 13).unwrap(), y.narrow(1, 13, 13).unwrap());
        let halves: Vec<Vec<f32>> = GatedHalves::apply(Activation::GeluTanh, &g, &u).unwrap().to_vec2().unwrap();
        assert_eq!(stacked, halves);
    }
}
