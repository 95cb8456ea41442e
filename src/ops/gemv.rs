//! `y = x W^T` for a handful of rows (decode batches) as one stream over the weights: at these
//! sizes the product is bound by reading W once, which a dedicated kernel does closer to the
//! card's bandwidth than a general GEMM.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::kv_elem::f32_slice;

/// Most rows of x the kernel takes.
pub const MAX_ROWS: usize = 8;

pub struct Gemv;

impl Gemv {
    /// `x`: `[m, k]` (m <= MAX_ROWS, unit inner stride), `w`: `[n, k]` contiguous -> `[m, n]`.
    pub fn forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        x.apply_op2_no_bwd(w, &Gemv)
    }

    fn check(xl: &Layout, wl: &Layout) -> Result<(usize, usize, usize, usize)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, k2) = wl.shape().dims2()?;
        if k != k2 || m == 0 || m > MAX_ROWS || xl.stride()[1] != 1 || !wl.is_contiguous() {
            candle_core::bail!("gemv: x {:?} (at most {MAX_ROWS} rows) against w {:?}", xl.shape(), wl.shape());
        }
        Ok((m, n, k, xl.stride()[0]))
    }
}

impl CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "gemv"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, n, k, stride) = Self::check(xl, wl)?;
        let CpuStorage::F32(xs) = x else { candle_core::bail!("gemv: the CPU reference takes f32") };
        let x = &xs[xl.start_offset()..];
        let w = f32_slice(w, wl, "gemv w")?;
        let mut y = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * stride + i] * w[c * k + i]).sum();
            }
        }
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S, WrapErr};

        use super::cuda::Kernel;

        let (m, n, k, stride) = Self::check(xl, wl)?;
        let vec = 16 / x.dtype().size_in_bytes();
        if k % vec != 0 || stride % vec != 0 || xl.start_offset() % vec != 0 {
            candle_core::bail!("gemv: rows of {k} values are not whole 16-byte vectors");
        }
        let dev = x.device().clone();
        let func = super::cuda::GEMV.func(&dev, &format!("gemv_{}_{m}", super::cuda::dtype_name(x.dtype())?))?;
        // Rows of W per warp, as the kernel instantiates them; eight warps per block.
        let per_warp = if m <= 2 { 4 } else { 2 };
        let cfg = LaunchConfig { grid_dim: (n.div_ceil(8 * per_warp) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        fn launch<T: CudaDType + DeviceRepr>(
            dev: &candle_core::cuda_backend::CudaDevice,
            func: &Kernel,
            cfg: LaunchConfig,
            (x, xo): (&CudaSlice<T>, usize),
            (w, wo): (&CudaSlice<T>, usize),
            (m, n, k, stride): (usize, usize, usize, usize),
        ) -> Result<CudaStorage> {
            // SAFETY: the kernel writes every element.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(m * n)? };
            let (x, w) = (x.slice(xo..), w.slice(wo..));
            let (stride, n, k) = (stride as i32, n as i32, k as i32);
            let mut b = func.builder();
            b.arg(&y).arg(&x).arg(&stride).arg(&w).arg(&n).arg(&k);
            // SAFETY: argument types and counts match the kernel's signature; shapes were checked.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let dims = (m, n, k, stride);
        let (xo, wo) = (xl.start_offset(), wl.start_offset());
        let y = match (&x.slice, &w.slice) {
            (S::F32(x), S::F32(w)) => launch(&dev, &func, cfg, (x, xo), (w, wo), dims)?,
            (S::BF16(x), S::BF16(w)) => launch(&dev, &func, cfg, (x, xo), (w, wo), dims)?,
            (S::F16(x), S::F16(w)) => launch(&dev, &func, cfg, (x, xo), (w, wo), dims)?,
            _ => candle_core::bail!("gemv: unsupported dtypes {:?} x {:?}", x.dtype(), w.dtype()),
        };
        Ok((y, Shape::from((m, n))))
    }
}
