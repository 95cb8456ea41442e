//! Matrix products with GGUF block-quantized weights and f32 activations.
//!
//! candle's quantized matmul rounds the activations to 8 bits before the dot products, as
//! llama.cpp does. That moves logits enough to flip near-ties (SmolLM2's answer to "What is
//! the capital of France?" changes), so iris keeps activations in f32 and dequantizes the
//! weights on the fly: y = x · dequant(W)^T, exact up to f32 summation order.

use std::sync::Arc;

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kv_elem::f32_slice;
use super::simd::dot_f32;

/// A quantized `[rows, cols]` weight matrix (rows = output features).
pub struct QMatrix {
    q: Arc<QTensor>,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    dequant_row: fn(&[u8], &mut [f32]),
}

fn dequant_as<T: GgmlType>(bytes: &[u8], out: &mut [f32]) {
    let n = bytes.len() / std::mem::size_of::<T>();
    // SAFETY: `bytes` is a whole number of blocks cut from the QTensor's own block vector,
    // so it is aligned for and fully initialised as `T`.
    let blocks = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, n) };
    T::to_float(blocks, out);
}

impl QMatrix {
    pub fn new(q: Arc<QTensor>) -> Result<Self> {
        let (rows, cols) = q.shape().dims2()?;
        let dt = q.dtype();
        if cols % dt.block_size() != 0 {
            candle_core::bail!("quantized matrix with {cols} columns is not a whole number of {dt:?} blocks");
        }
        let dequant_row: fn(&[u8], &mut [f32]) = match dt {
            GgmlDType::Q4_0 => dequant_as::<BlockQ4_0>,
            GgmlDType::Q4_1 => dequant_as::<BlockQ4_1>,
            GgmlDType::Q5_0 => dequant_as::<BlockQ5_0>,
            GgmlDType::Q5_1 => dequant_as::<BlockQ5_1>,
            GgmlDType::Q8_0 => dequant_as::<BlockQ8_0>,
            GgmlDType::Q2K => dequant_as::<BlockQ2K>,
            GgmlDType::Q3K => dequant_as::<BlockQ3K>,
            GgmlDType::Q4K => dequant_as::<BlockQ4K>,
            GgmlDType::Q5K => dequant_as::<BlockQ5K>,
            GgmlDType::Q6K => dequant_as::<BlockQ6K>,
            other => candle_core::bail!("quantized type {other:?} is not supported for matrices"),
        };
        Ok(QMatrix { row_bytes: cols / dt.block_size() * dt.type_size(), q, rows, cols, dequant_row })
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub fn qtensor(&self) -> &Arc<QTensor> {
        &self.q
    }

    /// `x` `[m, cols]` -> `[m, rows]` (f32).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
        x.apply_op1_no_bwd(self)
    }

    fn matmul(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let data = self.q.data()?;
        let (n, k) = (self.rows, self.cols);
        // Tasks of a few rows each: enough of them to balance, few enough to keep the
        // dequantized row and x hot in cache.
        let rows_per_task = (n / (rayon::current_num_threads() * 8)).clamp(1, 64);
        let chunks: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(rows_per_task))
            .into_par_iter()
            .map(|c| {
                let r0 = c * rows_per_task;
                let r1 = (r0 + rows_per_task).min(n);
                let mut w = vec![0f32; k];
                let mut part = vec![0f32; (r1 - r0) * m];
                for r in r0..r1 {
                    (self.dequant_row)(&data[r * self.row_bytes..(r + 1) * self.row_bytes], &mut w);
                    for i in 0..m {
                        part[i * (r1 - r0) + (r - r0)] = dot_f32(&w, &x[i * k..(i + 1) * k]);
                    }
                }
                (r0, part)
            })
            .collect();
        let mut out = vec![0f32; m * n];
        for (r0, part) in chunks {
            let width = part.len() / m.max(1);
            for i in 0..m {
                out[i * n + r0..i * n + r0 + width].copy_from_slice(&part[i * width..(i + 1) * width]);
            }
        }
        Ok(out)
    }

    /// Rows of the dequantized matrix (embedding lookups).
    pub fn rows_f32(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let data = self.q.data()?;
        let mut out = vec![0f32; ids.len() * self.cols];
        for (i, &id) in ids.iter().enumerate() {
            let r = id as usize;
            if r >= self.rows {
                candle_core::bail!("row {r} out of range ({} rows)", self.rows);
            }
            (self.dequant_row)(
                &data[r * self.row_bytes..(r + 1) * self.row_bytes],
                &mut out[i * self.cols..(i + 1) * self.cols],
            );
        }
        Ok(out)
    }
}

impl CustomOp1 for QMatrix {
    fn name(&self) -> &'static str {
        "qmatmul-f32"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, "qmatmul x")?;
        let dims = l.dims();
        let k = *dims.last().unwrap_or(&0);
        if k != self.cols {
            candle_core::bail!("qmatmul: x has {k} columns, the matrix {}", self.cols);
        }
        let m = x.len() / k.max(1);
        let out = self.matmul(x, m)?;
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("non-empty shape") = self.rows;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}
