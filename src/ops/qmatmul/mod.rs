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

use super::kv_elem::f32_slice;
use super::team::{team, OutPtr};
use crate::simd::{dot_f32, Isa};

// The kernels' launches exist only in CUDA builds; elsewhere the type is never made.
mod affine;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda;
mod fused;
mod packed;

pub use affine::{AffineMatrix, AffineParams};

pub use cuda::CudaQMatrix;

use fused::{DequantRow, DotRows};
use packed::{BlockFormat, PackedRows};

/// Batches up to this many rows use the fused kernels; larger ones dequantize tiles of the
/// matrix and run a GEMM on them (the dequantization is then amortised over many rows).
const FUSED_MAX_ROWS: usize = 16;
/// Most weight rows one task of the fused path takes.
const MAX_TASK_ROWS: usize = 64;
/// Bytes of a dequantized GEMM tile: it stays in L2, and is wide enough that the GEMM's
/// packing of the activations is amortised.
const TILE_BYTES: usize = 1 << 20;

/// A quantized `[rows, cols]` weight matrix (rows = output features).
pub struct QMatrix {
    storage: Storage,
    rows: usize,
    cols: usize,
    /// The instruction set the fused kernels run with (the process's; tests pick each).
    isa: Isa,
}

enum Storage {
    /// Formats with fused kernels: repacked at load.
    Packed(PackedRows),
    /// Anything else, in the file's layout, dequantized row by row with candle's code.
    Ggml { q: Arc<QTensor>, row_bytes: usize, dequant_row: fn(&[u8], &mut [f32]) },
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
        let storage = match BlockFormat::for_ggml(dt) {
            Some(format) => Storage::Packed(PackedRows::from_ggml(dt, format, &q.data()?, rows, cols)),
            None => Storage::Ggml { row_bytes: cols / dt.block_size() * dt.type_size(), q, dequant_row },
        };
        Ok(QMatrix { storage, rows, cols, isa: Isa::active() })
    }

    /// An MLX affine matrix, repacked for the fused kernels (see `PackedRows::from_affine`).
    pub fn from_affine(m: &AffineMatrix) -> Result<Self> {
        if m.cols % 32 != 0 {
            candle_core::bail!("affine matrix with {} columns is not a whole number of 32-weight blocks", m.cols);
        }
        let storage = Storage::Packed(PackedRows::from_affine(m));
        Ok(QMatrix { storage, rows: m.rows, cols: m.cols, isa: Isa::active() })
    }

    /// The matrix on CUDA device `dev`, kept quantized. Formats without a packed form (Q2_K)
    /// have no CUDA kernels: None.
    pub fn upload(&self, dev: &candle_core::Device) -> Result<Option<CudaQMatrix>> {
        let Storage::Packed(p) = &self.storage else { return Ok(None) };
        CudaQMatrix::upload(p, self.rows, self.cols, dev).map(Some)
    }

    /// The whole matrix dequantized, `[rows, cols]` f32 on the host.
    pub fn dequantize_all(&self) -> Result<Tensor> {
        let ids: Vec<u32> = (0..self.rows as u32).collect();
        Tensor::from_vec(self.dequantize_rows(&ids)?, (self.rows, self.cols), &candle_core::Device::Cpu)
    }

    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes held: the packed rows, or the file's blocks.
    pub fn held_bytes(&self) -> usize {
        match &self.storage {
            Storage::Packed(p) => p.data().len(),
            Storage::Ggml { q, .. } => q.storage_size_in_bytes(),
        }
    }

    /// Rows `ids` dequantized, `[ids.len(), cols]` f32 (embedding lookups).
    pub fn dequantize_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let data = self.bytes()?;
        let mut out = vec![0f32; ids.len() * self.cols];
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(self.cols.max(1))) {
            if id as usize >= self.rows {
                candle_core::bail!("row {id} is outside the {}-row matrix", self.rows);
            }
            self.dequant(&data, id as usize, o);
        }
        Ok(out)
    }

    /// The packed rows, or the file's bytes.
    fn bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>> {
        match &self.storage {
            Storage::Packed(p) => Ok(std::borrow::Cow::Borrowed(p.data())),
            Storage::Ggml { q, .. } => q.data(),
        }
    }

    /// `x` `[m, cols]` -> `[m, rows]` (f32).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
        x.apply_op1_no_bwd(self)
    }

    fn row_bytes(&self) -> usize {
        match &self.storage {
            Storage::Packed(p) => p.row_bytes,
            Storage::Ggml { row_bytes, .. } => *row_bytes,
        }
    }

    fn dequant(&self, data: &[u8], r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let bytes = &data[r * rb..(r + 1) * rb];
        match &self.storage {
            Storage::Packed(p) => self.isa.run(DequantRow { fmt: p.format, row: bytes, out }),
            Storage::Ggml { dequant_row, .. } => dequant_row(bytes, out),
        }
    }

    fn fused(&self) -> Option<BlockFormat> {
        match &self.storage {
            Storage::Packed(p) => Some(p.format),
            Storage::Ggml { .. } => None,
        }
    }

    fn matmul(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let data = self.bytes()?;
        let (n, k) = (self.rows, self.cols);
        let fused = self.fused();
        let mut out = vec![0f32; m * n];
        let dst = OutPtr(out.as_mut_ptr());
        if m > FUSED_MAX_ROWS {
            self.matmul_tiled(&data, x, m, dst);
        } else {
            let rows_per_task = (n / (team().threads() * 8)).clamp(1, MAX_TASK_ROWS);
            team().for_each(n.div_ceil(rows_per_task), |c| {
                let (r0, r1) = (c * rows_per_task, ((c + 1) * rows_per_task).min(n));
                // SAFETY (both arms): (i, r) is inside `out`, and row r belongs to this task only.
                match fused {
                    Some(fmt) => {
                        let row_bytes = self.row_bytes();
                        let rows = &data[r0 * row_bytes..r1 * row_bytes];
                        // On the stack: a matmul has thousands of tasks (an LM head's rows).
                        let mut res = [0f32; 8 * MAX_TASK_ROWS];
                        for i0 in (0..m).step_by(8) {
                            let g = (m - i0).min(8);
                            self.fused_rows(fmt, g, rows, row_bytes, &x[i0 * k..(i0 + g) * k], &mut res);
                            for r in r0..r1 {
                                for i in 0..g {
                                    unsafe { *dst.at((i0 + i) * n + r) = res[(r - r0) * g + i] };
                                }
                            }
                        }
                    }
                    _ => {
                        let mut w = vec![0f32; k];
                        for r in r0..r1 {
                            self.dequant(&data, r, &mut w);
                            for i in 0..m {
                                unsafe { *dst.at(i * n + r) = dot_f32(&w, &x[i * k..(i + 1) * k]) };
                            }
                        }
                    }
                }
            });
        }
        Ok(out)
    }

    /// A group of up to 8 activation rows `xs` against whole packed rows, by the fused kernel
    /// of that group size; `out` gets `g` values per weight row.
    fn fused_rows(&self, fmt: BlockFormat, g: usize, rows: &[u8], row_bytes: usize, xs: &[f32], out: &mut [f32]) {
        let (isa, k) = (self.isa, self.cols);
        match g {
            1 => isa.run(DotRows::<1> { fmt, rows, row_bytes, x: xs, k, out }),
            2 => isa.run(DotRows::<2> { fmt, rows, row_bytes, x: xs, k, out }),
            3 => isa.run(DotRows::<3> { fmt, rows, row_bytes, x: xs, k, out }),
            4 => isa.run(DotRows::<4> { fmt, rows, row_bytes, x: xs, k, out }),
            5 => isa.run(DotRows::<5> { fmt, rows, row_bytes, x: xs, k, out }),
            6 => isa.run(DotRows::<6> { fmt, rows, row_bytes, x: xs, k, out }),
            7 => isa.run(DotRows::<7> { fmt, rows, row_bytes, x: xs, k, out }),
            _ => isa.run(DotRows::<8> { fmt, rows, row_bytes, x: xs, k, out }),
        }
    }

    /// Large batches: dequantize a tile of weight rows at a time and multiply them with
    /// all of `x` by a GEMM, each tile writing its own columns of the output.
    fn matmul_tiled(&self, data: &[u8], x: &[f32], m: usize, dst: OutPtr) {
        let (n, k) = (self.rows, self.cols);
        // Wide tiles, but at least two per thread so that both cores stay busy.
        let by_cache = (TILE_BYTES / (4 * k)).max(16);
        let by_balance = n.div_ceil(team().threads() * 2).max(16);
        let tile_rows = by_cache.min(by_balance).next_multiple_of(16);
        team().for_each(n.div_ceil(tile_rows), |t| {
            let (r0, r1) = (t * tile_rows, ((t + 1) * tile_rows).min(n));
            let mut tile = vec![0f32; (r1 - r0) * k];
            for r in r0..r1 {
                self.dequant(data, r, &mut tile[(r - r0) * k..(r - r0 + 1) * k]);
            }
            // SAFETY: pointers and strides describe x [m, k], tile^T [k, r1 - r0] and the
            // output columns r0..r1 of [m, n]; no other task writes those columns.
            unsafe {
                gemm::gemm(
                    m,
                    r1 - r0,
                    k,
                    dst.at(r0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    tile.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    const FORMATS: [GgmlDType; 10] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// `x · W^T` on every instruction set this CPU has, each against f64 sums of the scalar
    /// dequantizer's weights, and all sets with the same bits as the portable one.
    fn check(dt: GgmlDType, n: usize, k: usize) {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dt).unwrap());
        let wd: Vec<Vec<f32>> = q.dequantize(&dev).unwrap().to_vec2().unwrap();
        let mut qm = QMatrix::new(q).unwrap();
        for m in [1, 3, 8, 9, 16, 17, 40] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let xv: Vec<Vec<f32>> = x.to_vec2().unwrap();
            let mut reference: Option<Vec<u32>> = None;
            for isa in Isa::available().into_iter().rev() {
                qm.isa = isa;
                let got: Vec<Vec<f32>> = qm.forward(&x).unwrap().to_vec2().unwrap();
                for i in 0..m {
                    for r in 0..n {
                        let want: f64 = (0..k).map(|j| xv[i][j] as f64 * wd[r][j] as f64).sum();
                        let tol = 1e-4 * (k as f64).sqrt() * 4.0;
                        assert!(
                            (got[i][r] as f64 - want).abs() < tol,
                            "{dt:?} {isa:?} m={m} ({i},{r}): {} vs {want}",
                            got[i][r]
                        );
                    }
                }
                let bits: Vec<u32> = got.iter().flatten().map(|v| v.to_bits()).collect();
                match &reference {
                    None => reference = Some(bits),
                    Some(p) => assert!(p == &bits, "{dt:?} m={m}: {isa:?} differs from the portable kernels"),
                }
            }
        }
    }

    /// The fused decoders compute each weight exactly as candle's scalar dequantizer does, on
    /// every instruction set this CPU has.
    #[test]
    fn fused_decoders_equal_the_scalar_dequantizer_bit_for_bit() {
        let dev = Device::Cpu;
        // 8 and 25 blocks per row: a partial group of 16 scales, and a full one plus a partial;
        // the k-quants with 1 and 3 super-blocks per row.
        let small = [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q8_0];
        let k_quants = [GgmlDType::Q3K, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];
        let cases = small.into_iter().flat_map(|dt| [(dt, 256), (dt, 800)]);
        for (dt, cols) in cases.chain(k_quants.into_iter().flat_map(|dt| [(dt, 256), (dt, 768)])) {
            assert!(BlockFormat::for_ggml(dt).is_some(), "{dt:?} has a fused kernel");
            let w = Tensor::randn(0f32, 1.0, (8, cols), &dev).unwrap();
            let q = Arc::new(QTensor::quantize(&w, dt).unwrap());
            let want: Vec<Vec<f32>> = q.dequantize(&dev).unwrap().to_vec2().unwrap();
            let mut qm = QMatrix::new(q).unwrap();
            for isa in Isa::available() {
                qm.isa = isa;
                let data = qm.bytes().unwrap();
                for (r, want) in want.iter().enumerate() {
                    let mut got = vec![0f32; cols];
                    qm.dequant(&data, r, &mut got);
                    assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{dt:?} {isa:?} row {r}");
                }
            }
        }
    }

    /// A random MLX affine matrix (negative scales included, as mlx makes them).
    fn random_affine(rows: usize, cols: usize, params: AffineParams, seed: u64) -> AffineMatrix {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let groups = rows * cols / params.group;
        AffineMatrix {
            rows,
            cols,
            params,
            codes: (0..rows * params.packed_words(cols)).map(|_| next() as u32).collect(),
            scales: (0..groups).map(|_| (next() % 2000) as f32 / 1e4 - 0.1).collect(),
            biases: (0..groups).map(|_| (next() % 2000) as f32 / 1e3 - 1.0).collect(),
        }
    }

    /// MLX affine matrices through the fused kernels: each weight decodes to the bits of
    /// `scale · q + bias`, and products match f64 sums, for every width and group size.
    #[test]
    fn affine_matrices_decode_exactly_and_multiply() {
        let dev = Device::Cpu;
        for bits in AffineParams::BITS {
            for group in AffineParams::GROUPS {
                let (n, k) = (5, 3 * group);
                let a = random_affine(n, k, AffineParams { bits, group }, u64::from(bits) * 1000 + group as u64);
                let want: Vec<Vec<f32>> = a.dequantize(&dev).unwrap().to_vec2().unwrap();
                let mut qm = QMatrix::from_affine(&a).unwrap();
                let x = Tensor::randn(0f32, 1.0, (3, k), &dev).unwrap();
                let xv: Vec<Vec<f32>> = x.to_vec2().unwrap();
                for isa in Isa::available() {
                    qm.isa = isa;
                    let data = qm.bytes().unwrap();
                    for (r, want) in want.iter().enumerate() {
                        let mut got = vec![0f32; k];
                        qm.dequant(&data, r, &mut got);
                        let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{bits}-bit group {group} {isa:?} row {r}");
                    }
                    let got: Vec<Vec<f32>> = qm.forward(&x).unwrap().to_vec2().unwrap();
                    for i in 0..3 {
                        for r in 0..n {
                            let exact: f64 = (0..k).map(|j| xv[i][j] as f64 * want[r][j] as f64).sum();
                            assert!((got[i][r] as f64 - exact).abs() < 1e-4 * (k as f64).sqrt() * 4.0);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_path_matches_dequantize_then_matmul() {
        for dt in FORMATS {
            check(dt, 70, 512);
            check(dt, 9, if dt.block_size() == 32 { 800 } else { 768 });
        }
    }
}
