//! Quantized matrices on CUDA, kept quantized: the packed rows (`packed.rs`) uploaded as two
//! arrays, each block's 32-bit words word-major (`[W][N][NB]` f32, so a warp's loads of one
//! word are contiguous) and its codes (`[N][NB][C]` bytes, 16-byte aligned), and decoded by
//! `cuda/qgemv.cu` exactly as the CPU kernels decode them. A decode step's few rows (at most
//! `gemv::MAX_ROWS`) take `qgemv`, one pass over the quantized bytes; longer inputs have the
//! matrix dequantized into the activations' dtype (`qdequant`) and multiplied by cuBLAS.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};

use super::packed::{BlockFormat, PackedRows};

/// Rows of x that take the GEMV kernel.
pub const MAX_GEMV_ROWS: usize = 8;

pub struct CudaQMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    /// `[W * N * NB]` f32.
    words: Tensor,
    /// `[N * NB * C]` u8 (one unused byte for Q3, which has no code bytes).
    codes: Tensor,
}

/// The kernels' name for a block format.
fn format_name(f: BlockFormat) -> &'static str {
    match f {
        BlockFormat::Q4_0 => "q4_0",
        BlockFormat::Q4_1 => "q4_1",
        BlockFormat::Q5_0 => "q5_0",
        BlockFormat::Q5_1 => "q5_1",
        BlockFormat::Q8_0 => "q8_0",
        BlockFormat::Q6 => "q6",
        BlockFormat::Q3 => "q3",
        BlockFormat::A8 => "a8",
    }
}

impl CudaQMatrix {
    /// `p` (`rows` x `cols`) split into its word and code arrays on `dev`.
    pub fn upload(p: &PackedRows, rows: usize, cols: usize, dev: &Device) -> Result<Self> {
        let (f, nb) = (p.format, cols / 32);
        let (w, c) = (f.words(), f.code_bytes());
        let mut words = vec![0f32; w * rows * nb];
        let mut codes = vec![0u8; (rows * nb * c).max(1)];
        for (r, row) in p.data().chunks_exact(p.row_bytes).enumerate() {
            let (heads, code) = row.split_at(4 * w * nb);
            for (i, word) in heads.chunks_exact(4).enumerate() {
                let (wi, b) = (i / nb, i % nb);
                words[(wi * rows + r) * nb + b] = f32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            }
            codes[r * nb * c..(r + 1) * nb * c].copy_from_slice(&code[..nb * c]);
        }
        let words = Tensor::from_vec(words, w * rows * nb, dev)?;
        let len = codes.len();
        let codes = Tensor::from_vec(codes, len, dev)?;
        Ok(CudaQMatrix { format: f, rows, cols, words, codes })
    }

    /// `x` `[.., cols]` (f32, bf16 or f16 on the matrix's device) -> `[.., rows]` of x's dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let mut dims = x.dims().to_vec();
        let m = x.elem_count() / self.cols.max(1);
        let x2 = x.reshape((m, self.cols))?;
        let y = if m <= MAX_GEMV_ROWS {
            x2.apply_op1_no_bwd(&QGemv { q: self })?
        } else {
            let w = self.dequantize(x.dtype())?;
            x2.matmul(&w.t()?)?
        };
        *dims.last_mut().expect("x has a last axis") = self.rows;
        y.reshape(dims)
    }

    /// The whole matrix, `[rows, cols]` of `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        // The op's input only carries the dtype and device; its data is not read.
        let like = Tensor::zeros(1, dtype, self.words.device())?;
        like.apply_op1_no_bwd(&QDequant { q: self })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        4 * self.words.elem_count() + self.codes.elem_count()
    }
}

struct QGemv<'a> {
    q: &'a CudaQMatrix,
}

struct QDequant<'a> {
    q: &'a CudaQMatrix,
}

impl CustomOp1 for QGemv<'_> {
    fn name(&self) -> &'static str {
        "qgemv"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("qgemv runs on CUDA only (the CPU has QMatrix's own kernels)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        if k != self.q.cols || !(1..=MAX_GEMV_ROWS).contains(&m) {
            candle_core::bail!("qgemv: x is {:?}, the matrix {}x{}", l.shape(), self.q.rows, self.q.cols);
        }
        launch::gemv(self.q, s, l, m).map(|y| (y, Shape::from((m, self.q.rows))))
    }
}

impl CustomOp1 for QDequant<'_> {
    fn name(&self) -> &'static str {
        "qdequant"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("qdequant runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        launch::dequant(self.q, s).map(|y| (y, Shape::from((self.q.rows, self.q.cols))))
    }
}

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S, WrapErr};
    use candle_core::{Layout, Result, WithDType};

    use super::{format_name, CudaQMatrix};
    use crate::ops::cuda::{cuda_slice, dtype_name, QGEMV};

    const THREADS: usize = 256; // QGEMV_THREADS in qgemv.cu
    const WARPS: usize = THREADS / 32;

    /// Warps per output row: more where the matrix has few rows, so that the grid fills the
    /// GPU, while each warp keeps at least two passes of 32 blocks.
    fn warps_per_row(n: usize, nb: usize) -> usize {
        let mut wpr = 1;
        while wpr < 8 && n * wpr / WARPS < 2048 && nb / (wpr * 2) >= 64 {
            wpr *= 2;
        }
        wpr
    }

    pub fn gemv(q: &CudaQMatrix, s: &CudaStorage, l: &Layout, m: usize) -> Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr + WithDType>(
            q: &CudaQMatrix,
            s: &CudaStorage,
            x: &CudaSlice<T>,
            l: &Layout,
            m: usize,
        ) -> Result<CudaStorage> {
            let dev = s.device().clone();
            let name = format!("qgemv_{}_{}_{m}", format_name(q.format), dtype_name(T::DTYPE)?);
            let func = QGEMV.func(&dev, &name)?;
            let (ws, _) = q.words.storage_and_layout();
            let (cs, _) = q.codes.storage_and_layout();
            let (words, codes) = (cuda_slice::<f32>(&ws, "qgemv words")?, cuda_slice::<u8>(&cs, "qgemv codes")?);
            let (n, nb) = (q.rows, q.cols / 32);
            let wpr = warps_per_row(n, nb);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(WARPS / wpr) as u32, 1, 1),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel writes every element of y.
            let y = unsafe { dev.alloc::<T>(m * n)? };
            let x = x.slice(l.start_offset()..);
            let (n, nb, wpr) = (n as i32, nb as i32, wpr as i32);
            let mut b = func.builder();
            b.arg(&y).arg(&x).arg(words).arg(codes).arg(&n).arg(&nb).arg(&wpr);
            // SAFETY: (y, x, words, codes, n, nb, wpr) are the kernel's parameters in order and
            // type; x is [m, nb * 32] (checked by the op), the arrays are the matrix's.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        match &s.slice {
            S::F32(x) => run(q, s, x, l, m),
            S::BF16(x) => run(q, s, x, l, m),
            S::F16(x) => run(q, s, x, l, m),
            _ => candle_core::bail!("qgemv: x must be f32, bf16 or f16"),
        }
    }

    pub fn dequant(q: &CudaQMatrix, s: &CudaStorage) -> Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr + WithDType>(q: &CudaQMatrix, s: &CudaStorage) -> Result<CudaStorage> {
            let dev = s.device().clone();
            let name = format!("qdequant_{}_{}", format_name(q.format), dtype_name(T::DTYPE)?);
            let func = QGEMV.func(&dev, &name)?;
            let (ws, _) = q.words.storage_and_layout();
            let (cs, _) = q.codes.storage_and_layout();
            let (words, codes) = (cuda_slice::<f32>(&ws, "qdequant words")?, cuda_slice::<u8>(&cs, "qdequant codes")?);
            let (n, nb) = (q.rows, q.cols / 32);
            let blocks = n * nb;
            let cfg = LaunchConfig {
                grid_dim: (blocks.div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel writes all 32 weights of every block.
            let out = unsafe { dev.alloc::<T>(n * q.cols)? };
            let (n, nb) = (n as i32, nb as i32);
            let mut b = func.builder();
            b.arg(&out).arg(words).arg(codes).arg(&n).arg(&nb);
            // SAFETY: (out, words, codes, n, nb) are the kernel's parameters in order and type.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match &s.slice {
            S::F32(_) => run::<f32>(q, s),
            S::BF16(_) => run::<half::bf16>(q, s),
            S::F16(_) => run::<half::f16>(q, s),
            _ => candle_core::bail!("qdequant: f32, bf16 or f16 only"),
        }
    }
}
