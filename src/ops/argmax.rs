//! Greedy token choice over rows of logits: the largest finite logit, lowest id on ties.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::kv_elem::f32_slice;

/// Index of the largest finite value (lowest index on ties); None if no value is finite.
pub fn argmax_row(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_finite() && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// `[rows, vocab]` f32 logits -> `[rows]` u32 token ids (0 for a row with nothing finite).
pub struct Argmax;

impl Argmax {
    pub fn forward(logits: &Tensor) -> Result<Tensor> {
        logits.apply_op1_no_bwd(&Argmax)
    }
}

impl CustomOp1 for Argmax {
    fn name(&self) -> &'static str {
        "argmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let x = f32_slice(s, l, "argmax")?;
        let out = (0..rows).map(|r| argmax_row(&x[r * vocab..(r + 1) * vocab]).unwrap_or(0)).collect();
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};

        let (rows, vocab) = l.shape().dims2()?;
        let (S::F32(x), Some((a, b))) = (&s.slice, l.contiguous_offsets()) else {
            candle_core::bail!("argmax: expected contiguous f32 logits")
        };
        let dev = s.device().clone();
        // SAFETY: the kernel writes one id per row.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        if rows > 0 {
            let func = super::cuda::SAMPLING.func(&dev, "argmax_f32")?;
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            let x = x.slice(a..b);
            let vocab = vocab as i32;
            let mut builder = func.builder();
            builder.arg(&x).arg(&out).arg(&vocab);
            // SAFETY: argument types and counts match the kernel's signature.
            unsafe { builder.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}
