//! `y = x W^T` for the few rows of a decode step, as one pass over the weights on CUDA.
//!
//! At batch 1 a step of a 7B model reads 15 GB of weights and does little else, so each
//! projection should stream its matrix at the card's bandwidth. cuBLAS picks split-K kernels
//! for these shapes that reach 2.5-2.8 TB/s on the q/k/v and o projections of Qwen2.5-7B on an
//! H200 (plus a reduction launch each); `cuda/gemv.cu` gives each output row one warp and
//! streams it in 16-byte loads. The CPU code is the reference it is tested against.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Rows of x the kernel can take.
pub const MAX_ROWS: usize = 8;

/// Rows of x up to which products take this op rather than cuBLAS: each row of x costs the
/// kernel a load and a multiply per weight, and from a few rows on cuBLAS's tensor-core kernels
/// win. `IRIS_CUDA_GEMV=N` sets it (0: never), to compare.
pub fn max_rows() -> usize {
    crate::switches::tuned!("IRIS_CUDA_GEMV", usize, DEFAULT_ROWS).min(MAX_ROWS)
}
const DEFAULT_ROWS: usize = 2;

/// Warps per output row: more where the matrix has few rows, so the grid fills the GPU
/// (about 2,048 blocks), while each warp keeps at least two 16-byte loads per lane.
fn warps_per_row(n: usize, vectors_per_row: usize) -> usize {
    let mut wpr = 1;
    while wpr < 8 && n * wpr / 8 < 2048 && vectors_per_row / (wpr * 2) >= 64 {
        wpr *= 2;
    }
    wpr
}

/// `x W^T`, or with `gated` set, `act(x W_2i^T) * x W_2i+1^T` over W's rows taken in pairs
/// (gate i, up i): the gated MLP's activation applied as the product is written
/// (`forward_gated`), rounded as the separate product and `GatedAct` round.
pub struct Gemv {
    /// Some(gelu): the pairs' gated activation (tanh-GELU, else SiLU).
    gated: Option<bool>,
}

impl Gemv {
    /// Whether `x` (`[M, K]`) times `w^T` (`w`: `[N, K]`) should take this op: on CUDA, a
    /// float type shared by both, K a whole number of 16-byte vectors, and at most
    /// `max_rows()` rows.
    pub fn applies(x: &Tensor, w: &Tensor) -> bool {
        let (Ok((m, k)), Ok((_, wk))) = (x.dims2(), w.dims2()) else { return false };
        x.device().is_cuda()
            && (1..=max_rows()).contains(&m)
            && k == wk
            && x.dtype() == w.dtype()
            && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && k % (16 / x.dtype().size_in_bytes()) == 0
            // The kernel starts reading W before the kernel ahead of it has finished, so W must
            // be a stored matrix, not one a copy just made.
            && w.is_contiguous()
    }

    /// `x`: `[M, K]`, `w`: `[N, K]` (contiguous) -> `[M, N]`.
    pub fn forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op2_no_bwd(w, &Gemv { gated: None })
    }

    /// Whether `forward_gated` takes `x` and `w`: where `applies`, and each pair of rows falls
    /// in one block of the kernel (at most 4 warps per row).
    pub fn applies_gated(x: &Tensor, w: &Tensor) -> bool {
        let (Ok((n, k)), true) = (w.dims2(), Self::applies(x, w)) else { return false };
        n % 2 == 0 && warps_per_row(n, k / (16 / w.dtype().size_in_bytes())) <= 4
    }

    /// `x`: `[M, K]`, `w`: `[2 I, K]` rows in (gate, up) pairs -> `act(gate) * up`, `[M, I]`.
    pub fn forward_gated(x: &Tensor, w: &Tensor, gelu: bool) -> Result<Tensor> {
        x.contiguous()?.apply_op2_no_bwd(w, &Gemv { gated: Some(gelu) })
    }

    fn check(lx: &Layout, lw: &Layout) -> Result<(usize, usize, usize)> {
        let (m, k) = lx.shape().dims2()?;
        let (n, wk) = lw.shape().dims2()?;
        if k != wk || !(1..=MAX_ROWS).contains(&m) || !lx.is_contiguous() || !lw.is_contiguous() {
            candle_core::bail!(
                "gemv: expected contiguous x [M<={MAX_ROWS}, K] and W [N, K], got {:?} and {:?}",
                lx.shape(),
                lw.shape()
            );
        }
        Ok((m, n, k))
    }
}

/// The CPU reference of the decode-step products (this op and `invariant_matmul`): `x W^T` in
/// f32 (x `[m, k]`, W `[n, k]`), or with `gated` (Some(gelu)) the activation of W's (gate, up)
/// row pairs, `[m, n / 2]`.
pub(crate) fn reference(
    x: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    gated: Option<bool>,
) -> (CpuStorage, Shape) {
    let y: Vec<f32> = (0..m * n)
        .map(|i| {
            let (xr, wr) = (&x[(i / n) * k..][..k], &w[(i % n) * k..][..k]);
            xr.iter().zip(wr).map(|(a, b)| a * b).sum()
        })
        .collect();
    match gated {
        None => (CpuStorage::F32(y), Shape::from((m, n))),
        Some(gelu) => {
            let y = y.chunks_exact(2).map(|p| super::gated_act::act(p[0], gelu) * p[1]).collect();
            (CpuStorage::F32(y), Shape::from((m, n / 2)))
        }
    }
}

impl CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "gemv"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = Self::check(lx, lw)?;
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (sx, sw) else {
            candle_core::bail!("gemv: the CPU reference takes f32")
        };
        Ok(reference(&x[lx.start_offset()..], &w[lw.start_offset()..], (m, n, k), self.gated))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;

        let (m, n, k) = Self::check(lx, lw)?;
        let dt = sx.dtype();
        let v = 16 / dt.size_in_bytes();
        if sw.dtype() != dt || k % v != 0 || lx.start_offset() % v != 0 || lw.start_offset() % v != 0 {
            candle_core::bail!("gemv: x and W must share a type and hold whole, aligned 16-byte vectors");
        }
        let dev = sx.device().clone();
        let func = super::cuda::GEMV.func(&dev, &format!("gemv_{}_{m}", super::cuda::dtype_name(dt)?))?;
        const WARPS: usize = 8; // GEMV_THREADS / 32 in gemv.cu
        let wpr = warps_per_row(n, k / v);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(WARPS / wpr) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // -1: a plain product; else the pairs' activation (0 SiLU, 1 tanh-GELU).
        let act = self.gated.map_or(-1, |gelu| gelu as i32);
        if act >= 0 && (n % 2 != 0 || wpr > 4) {
            candle_core::bail!("gemv: gated pairs need an even row count and at most 4 warps per row");
        }
        let out_n = if act >= 0 { n / 2 } else { n };
        let ints = [n as i32, k as i32, wpr as i32, act];
        // SAFETY: gemv_* takes (y, x, w, n, k, wpr, act) and writes all of y [m, out_n]; shapes
        // were checked; it waits for the kernel before it (pdl_wait) before reading x or writing y.
        let y = unsafe {
            super::cuda::launch_product(&func, cfg, (sx, lx.start_offset()), (sw, lw.start_offset()), m * out_n, &ints)
        }?;
        Ok((y, Shape::from((m, out_n))))
    }
}
