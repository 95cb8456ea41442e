//! The residual add fused with the RMSNorm that reads its result: `h = x + delta`,
//! `y = h / rms(h) * w`, one pass on CUDA (the layer computes the same op by op on the CPU).

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::kv_elem::f32_slice;

pub struct AddRmsNorm {
    pub eps: f32,
}

/// Rows the kernel takes: whole 16-byte vectors, at most 4096 of them (held in registers).
pub fn supports(dim: usize) -> bool {
    dim % 8 == 0 && dim <= 16 * 1024
}

impl AddRmsNorm {
    /// `x`, `delta`: `[T, dim]`; `w`: `[dim]`. Returns `(h, y)`, `[T, dim]` each.
    pub fn forward(&self, x: &Tensor, delta: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
        let out = x.contiguous()?.apply_op3_no_bwd(&delta.contiguous()?, w, self)?;
        Ok((out.get(0)?, out.get(1)?))
    }

    fn check(x: &Layout, d: &Layout, w: &Layout) -> Result<(usize, usize)> {
        let (t, dim) = x.shape().dims2()?;
        if d.dims() != x.dims() || w.dims() != [dim] || !supports(dim) {
            candle_core::bail!("add-rms-norm: shapes {:?} + {:?}, weight {:?}", x.dims(), d.dims(), w.dims());
        }
        Ok((t, dim))
    }
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        d: &CpuStorage,
        dl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (t, dim) = Self::check(xl, dl, wl)?;
        let (x, d, w) =
            (f32_slice(x, xl, "add-rms-norm")?, f32_slice(d, dl, "add-rms-norm")?, f32_slice(w, wl, "add-rms-norm")?);
        let mut out = vec![0f32; 2 * t * dim];
        let (h, y) = out.split_at_mut(t * dim);
        for r in 0..t {
            let hr = &mut h[r * dim..(r + 1) * dim];
            for ((h, a), b) in hr.iter_mut().zip(&x[r * dim..]).zip(&d[r * dim..]) {
                *h = a + b;
            }
            let inv = 1.0 / (hr.iter().map(|v| v * v).sum::<f32>() / dim as f32 + self.eps).sqrt();
            for ((y, h), w) in y[r * dim..(r + 1) * dim].iter_mut().zip(hr.iter()).zip(w) {
                *y = h * inv * w;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((2, t, dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        d: &candle_core::CudaStorage,
        dl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::Kernel;
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S};

        let (t, dim) = Self::check(xl, dl, wl)?;
        let dev = x.device().clone();
        let func =
            super::cuda::ADD_RMS_NORM.func(&dev, &format!("add_rms_norm_{}", super::cuda::dtype_name(x.dtype())?))?;
        let vecs = dim / (16 / x.dtype().size_in_bytes());
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (vecs.div_ceil(32).min(32) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let offs = [xl.start_offset(), dl.start_offset(), wl.start_offset()];
        if offs.iter().any(|o| o % 8 != 0) {
            candle_core::bail!("add-rms-norm: inputs must start on a 16-byte boundary");
        }
        #[allow(clippy::too_many_arguments)]
        fn launch<T: CudaDType + DeviceRepr>(
            dev: &candle_core::cuda_backend::CudaDevice,
            func: &Kernel,
            cfg: LaunchConfig,
            (x, d, w): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
            offs: [usize; 3],
            (t, dim): (usize, usize),
            eps: f32,
        ) -> Result<CudaStorage> {
            // SAFETY: the kernel writes every element.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * t * dim)? };
            let (x, d, w) = (x.slice(offs[0]..), d.slice(offs[1]..), w.slice(offs[2]..));
            let (rows, dim) = (t as i32, dim as i32);
            let mut b = func.dependent();
            b.mem(&out).mem(&x).mem(&d).mem(&w).scalar(&rows).scalar(&dim).scalar(&eps);
            // SAFETY: argument types and counts match the kernel's signature; shapes were checked;
            // the kernel waits (pdl_wait) before it reads or writes.
            unsafe { b.launch(cfg) }?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let td = (t, dim);
        let out = match (&x.slice, &d.slice, &w.slice) {
            (S::F32(x), S::F32(d), S::F32(w)) => launch(&dev, &func, cfg, (x, d, w), offs, td, self.eps)?,
            (S::BF16(x), S::BF16(d), S::BF16(w)) => launch(&dev, &func, cfg, (x, d, w), offs, td, self.eps)?,
            (S::F16(x), S::F16(d), S::F16(w)) => launch(&dev, &func, cfg, (x, d, w), offs, td, self.eps)?,
            _ => candle_core::bail!("add-rms-norm: unsupported dtypes {:?}", x.dtype()),
        };
        Ok((out, Shape::from((2, t, dim))))
    }
}
