//! `act(gate) * up` over a fused gate/up projection `[T, 2 * inter]`, in one pass on CUDA
//! (the layer computes the same op by op on the CPU). The projection's columns are the gate
//! then the up halves, or interleaved pairs (gate i, up i) where the layer stores its weights
//! that way (`GatedMlp` on CUDA, so that a decode step's product can apply the activation as it
//! writes: `Gemv::forward_gated`).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::models::config::Activation;

pub struct GatedAct {
    /// GELU (tanh approximation) instead of SiLU.
    pub gelu: bool,
    /// Columns (gate i, up i) in pairs instead of the gate half then the up half.
    pub interleaved: bool,
}

pub(crate) fn act(x: f32, gelu: bool) -> f32 {
    if gelu {
        0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())
    } else {
        x / (1.0 + (-x).exp())
    }
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

    /// Widths the kernel takes: whole 16-byte vectors.
    pub fn supports(inter: usize) -> bool {
        inter % 8 == 0
    }

    fn check(l: &Layout) -> Result<(usize, usize, usize)> {
        let (t, w) = l.shape().dims2()?;
        if w % 2 != 0
            || !Self::supports(w / 2)
            || l.stride()[1] != 1
            || l.stride()[0] % 8 != 0
            || l.start_offset() % 8 != 0
        {
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
        let (t, inter, stride) = Self::check(l)?;
        let CpuStorage::F32(y) = s else { candle_core::bail!("gated-act: the CPU reference takes f32") };
        let y = &y[l.start_offset()..];
        let out = (0..t * inter)
            .map(|i| {
                let (row, c) = (&y[(i / inter) * stride..], i % inter);
                let (g, u) = if self.interleaved { (row[2 * c], row[2 * c + 1]) } else { (row[c], row[inter + c]) };
                act(g, self.gelu) * u
            })
            .collect();
        Ok((CpuStorage::F32(out), Shape::from((t, inter))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::Kernel;
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S};

        let (t, inter, stride) = Self::check(l)?;
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
