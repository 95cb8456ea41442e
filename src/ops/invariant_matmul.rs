//! `y = x W^T` for 16-bit weights on CUDA whose rows do not depend on the batch: row i of y has
//! the same bits whether x has 1 row or 2,000, whatever the other rows hold, and whichever
//! kernel (`cuda/invariant_matmul.cu`: a streaming one for a decode or verify step's few rows,
//! a tiled one for prompt chunks) computed it.
//!
//! cuBLAS picks its algorithm (tile shape, split-K) by M, and the GEMV kernel sums in another
//! order than a tensor-core product: a token decoded alone, in a batch, or as a speculative
//! verify row (K + 1 rows per sequence) then sees logits that differ in the last bits, and a
//! greedy near-tie can turn. Here each output's sum has one order fixed by K alone: K is cut
//! into `slots(K)` slots; each slot's sum runs the m16n8k16 tensor-core products over its
//! 16-wide steps in order from zero, and the slot sums are added in order. The CPU reference
//! (`gemv::reference`) sums in f32 in plain order (close, not the same bits: the tensor core's
//! internal order is its own).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Rows up to which the streaming kernel runs (16 a tile of tensor-core rows, up to 4 tiles);
/// past them the tiled one.
pub const SKINNY_ROWS: usize = 64;

/// Slots K is cut into: the most of 8, 4, 2, 1 that leave whole 16-wide steps. It depends on K
/// alone, which is what makes every row's order the same for every M.
pub fn slots(k: usize) -> usize {
    [8, 4, 2].into_iter().find(|s| k % (16 * s) == 0).unwrap_or(1)
}

/// Rows up to which products take this op without `--batch-invariant` (`IRIS_CUDA_MMA_ROWS=N`,
/// to compare; default 0: only with it). At batch 1 the GEMV kernel streams the MLP's down
/// projection faster, and from 16 rows cuBLAS wins (benches/matmul.rs, docs/benchmarks.md).
pub fn default_rows() -> usize {
    crate::switches::tuned!("IRIS_CUDA_MMA_ROWS", usize, 0)
}

pub struct InvariantMatmul {
    /// Some(gelu): W's rows are (gate, up) pairs and y gets their gated activation.
    gated: Option<bool>,
}

impl InvariantMatmul {
    /// Whether `x` (`[M, K]`) times `w^T` (`w`: `[N, K]`, stored contiguous) takes this op: on
    /// CUDA, both bf16 or both f16, K a multiple of 16, and with `--batch-invariant`
    /// (`device::batch_invariant`) or at most `default_rows()` rows.
    pub fn applies(x: &Tensor, w: &Tensor) -> bool {
        let (Ok((m, k)), Ok((_, wk))) = (x.dims2(), w.dims2()) else { return false };
        x.device().is_cuda()
            && m >= 1
            && (crate::device::batch_invariant() || m <= default_rows())
            && k == wk
            && k % 16 == 0
            && x.dtype() == w.dtype()
            && matches!(x.dtype(), DType::BF16 | DType::F16)
            && w.is_contiguous()
            // The kernels read W in 16-byte vectors and x in pairs (a copy starts at 0).
            && w.layout().start_offset() % 8 == 0
            && (!x.is_contiguous() || x.layout().start_offset() % 2 == 0)
    }

    /// Where `applies`, and W has an even number of rows (pairs).
    pub fn applies_gated(x: &Tensor, w: &Tensor) -> bool {
        Self::applies(x, w) && w.dims2().is_ok_and(|(n, _)| n % 2 == 0)
    }

    /// `x`: `[M, K]`, `w`: `[N, K]` -> `[M, N]`.
    pub fn forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op2_no_bwd(w, &InvariantMatmul { gated: None })
    }

    /// `x`: `[M, K]`, `w`: `[2 I, K]` rows in (gate, up) pairs -> `act(gate) * up`, `[M, I]`.
    pub fn forward_gated(x: &Tensor, w: &Tensor, gelu: bool) -> Result<Tensor> {
        x.contiguous()?.apply_op2_no_bwd(w, &InvariantMatmul { gated: Some(gelu) })
    }

    fn check(lx: &Layout, lw: &Layout, gated: bool) -> Result<(usize, usize, usize)> {
        let (m, k) = lx.shape().dims2()?;
        let (n, wk) = lw.shape().dims2()?;
        if k != wk || k % 16 != 0 || m == 0 || !lx.is_contiguous() || !lw.is_contiguous() || (gated && n % 2 != 0) {
            candle_core::bail!(
                "invariant matmul: expected contiguous x [M, K] and W [N, K] with K a multiple of 16 \
                 (N even when gated), got {:?} and {:?}",
                lx.shape(),
                lw.shape()
            );
        }
        Ok((m, n, k))
    }
}

impl CustomOp2 for InvariantMatmul {
    fn name(&self) -> &'static str {
        "invariant-matmul"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = Self::check(lx, lw, self.gated.is_some())?;
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (sx, sw) else {
            candle_core::bail!("invariant matmul: the CPU reference takes f32")
        };
        Ok(super::gemv::reference(&x[lx.start_offset()..], &w[lw.start_offset()..], (m, n, k), self.gated))
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

        let (m, n, k) = Self::check(lx, lw, self.gated.is_some())?;
        let dt = sx.dtype();
        // x's fragments are read as pairs of elements, W in 16-byte vectors.
        if sw.dtype() != dt || lx.start_offset() % 2 != 0 || lw.start_offset() % 8 != 0 {
            candle_core::bail!("invariant matmul: x and W must share a 16-bit type, W 16-byte aligned");
        }
        let dev = sx.device().clone();
        let s = slots(k);
        let ty = super::cuda::dtype_name(dt)?;
        let (func, cfg) = if m <= SKINNY_ROWS {
            let mt = [1, 2, 4].into_iter().find(|t| m <= 16 * t).unwrap_or(4);
            let f = super::cuda::INVARIANT_MATMUL.func(&dev, &format!("invariant_matmul_skinny_{ty}_{mt}"))?;
            // im_skinny: 8 warps, each a 4-stage ring of 16 rows x (64 + 8) 16-bit values.
            let smem = 8 * 4 * 16 * 72 * 2;
            f.set_max_dynamic_shared(smem)?;
            let rows_per_block = 8 / s * 16;
            let grid = (n.div_ceil(rows_per_block) as u32, 1, 1);
            (f, LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: smem })
        } else {
            let f = super::cuda::INVARIANT_MATMUL.func(&dev, &format!("invariant_matmul_large_{ty}"))?;
            // im_large: 16 warps; 4 stages of 128 rows of x and of W, (32 + 8) 16-bit values each.
            let smem = 4 * 2 * 128 * 40 * 2;
            f.set_max_dynamic_shared(smem)?;
            let grid = (n.div_ceil(128) as u32, m.div_ceil(128) as u32, 1);
            (f, LaunchConfig { grid_dim: grid, block_dim: (512, 1, 1), shared_mem_bytes: smem })
        };
        // -1: a plain product; else the pairs' activation (0 SiLU, 1 tanh-GELU).
        let act = self.gated.map_or(-1, |gelu| gelu as i32);
        let out_n = if act >= 0 { n / 2 } else { n };
        let ints = [m as i32, n as i32, k as i32, s as i32, act];
        // SAFETY: both kernels take (y, x, w, m, n, k, slots, act) and write all of y [m, out_n];
        // shapes were checked; both wait for the kernel before them (pdl_wait) before they read x
        // or write y.
        let y = unsafe {
            super::cuda::launch_product(&func, cfg, (sx, lx.start_offset()), (sw, lw.start_offset()), m * out_n, &ints)
        }?;
        Ok((y, Shape::from((m, out_n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_depend_on_k_alone_and_leave_whole_steps() {
        assert_eq!(slots(3584), 8);
        assert_eq!(slots(18944), 8);
        assert_eq!(slots(1056), 2); // 16 * 66: 4 slots would cut a step
        assert_eq!(slots(64), 4);
        assert_eq!(slots(48), 1);
        for k in (16..4096).step_by(16) {
            assert_eq!(k % (16 * slots(k)), 0, "k {k}");
        }
    }
}
