//! Quantized matrices on CUDA, kept quantized: the packed rows (`packed.rs`) uploaded as their
//! codes (`[N][NB][C]` bytes, 16-byte aligned) and one plane per 32-bit word of a block, each
//! plane as narrow as its words allow without a bit changing ([`WordPlane`]): bf16 or f16 where
//! every word is one, one entry per group of 2 or 4 blocks where a row's group shares it. So an
//! MLX checkpoint or a GGUF Q4_0..Q8_0 streams the file's bytes (MLX 4-bit group 64: 4.5 bits a
//! weight, where f32 words per 32-weight block would make 6). `cuda/qgemv.cu` decodes them
//! exactly as the CPU kernels do. 4-bit codes are held in tensor-core tiles and up to
//! `MAX_TILE_ROWS` rows of x take `qtile`; other formats' decode steps (at most
//! `MAX_GEMV_ROWS` rows) take `qgemv`; both are one pass over the quantized bytes. Longer inputs
//! have the matrix dequantized into the activations' dtype and multiplied by cuBLAS.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};

use super::packed::{BlockFormat, PackedRows};

/// Rows of x that take the GEMV kernel (`qgemv`).
pub const MAX_GEMV_ROWS: usize = 8;
/// Rows of x that take the tensor-core kernel (`qtile`, 4-bit codes). Measured on an H100
/// (Qwen2.5-7B's shapes, MLX 4-bit, whole decode steps, 2026-12-05): 8 rows 5.4 ms a step
/// against 17.6 for `qgemv`, 64 rows 23 ms against 20 for dequantizing and cuBLAS. Its cost
/// grows with the n8 slices of x; at four (32 rows) it is estimated, not measured, to stay
/// under the GEMM's.
pub const MAX_TILE_ROWS: usize = 32;

pub struct CudaQMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    form: Form,
    /// The words and codes, in the order `form` says.
    data: Tensor,
}

/// How the device holds a matrix's blocks.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// A plane per word, each in its own form (`layout`: 4 bits a plane, `WordPlane::code`),
    /// one after another, 16-byte aligned, then from byte `codes_at` the codes `[N][NB][C]`
    /// (`qgemv`).
    Blocks { layout: u32, codes_at: usize },
    /// 4-bit codes and their words in tensor-core tiles of 16 rows, the words in one form
    /// (`tile_stream`, `qtile`).
    Tiles(WordPlane),
}

/// How one plane of block words is stored: the narrowest dtype that gives every word back bit
/// for bit, and one entry per `2^shift` blocks of a row where such groups all hold one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WordPlane {
    dtype: WordType,
    shift: u32,
}

/// The dtypes a word can take (a subset of candle's, so that no other can be asked for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WordType {
    F32,
    Bf16,
    F16,
}

impl WordType {
    fn dtype(self) -> DType {
        match self {
            WordType::F32 => DType::F32,
            WordType::Bf16 => DType::BF16,
            WordType::F16 => DType::F16,
        }
    }
}

impl WordPlane {
    /// The narrowest form of `words` (`[rows][nb]`, the f32 bits), groups of at most 4 blocks.
    fn narrowest(words: &[u32], nb: usize) -> Self {
        let shift = (0..=2u32)
            .rev()
            .find(|&s| {
                words.chunks_exact(nb.max(1)).all(|row| row.chunks(1 << s).all(|g| g.iter().all(|&w| w == g[0])))
            })
            .unwrap_or(0);
        // bf16 is the top half of the bits; f16 only for finite values that come back whole
        // (a NaN's payload would not).
        let dtype = if words.iter().all(|&w| w & 0xffff == 0) {
            WordType::Bf16
        } else if words.iter().all(|&w| {
            let f = f32::from_bits(w);
            f.is_finite() && half::f16::from_f32(f).to_f32().to_bits() == w
        }) {
            WordType::F16
        } else {
            WordType::F32
        };
        WordPlane { dtype, shift }
    }

    /// Entries per row of `nb` blocks.
    fn per_row(self, nb: usize) -> usize {
        nb.div_ceil(1 << self.shift)
    }

    fn width(self) -> usize {
        self.dtype.dtype().size_in_bytes()
    }

    /// The plane's bytes for `rows` rows, padded to 16 (`Words` in qgemv.cu).
    fn padded_bytes(self, rows: usize, nb: usize) -> usize {
        (rows * self.per_row(nb) * self.width()).next_multiple_of(16)
    }

    /// The 4 bits `Words` in qgemv.cu reads: dtype (0 f32, 1 bf16, 2 f16), then the shift.
    fn code(self) -> u32 {
        let t = match self.dtype {
            WordType::F32 => 0,
            WordType::Bf16 => 1,
            WordType::F16 => 2,
        };
        t | self.shift << 2
    }

    /// `words` (`[rows][nb]`) in this form, appended to `out`, padded to 16 bytes.
    fn store(self, words: &[u32], nb: usize, out: &mut Vec<u8>) {
        let start = out.len();
        for row in words.chunks_exact(nb.max(1)) {
            for g in row.chunks(1 << self.shift) {
                self.push(g[0], out);
            }
        }
        out.resize(start + self.padded_bytes(words.len() / nb.max(1), nb), 0);
    }

    /// One word (the f32's bits) in this form's dtype.
    fn push(self, w: u32, out: &mut Vec<u8>) {
        match self.dtype {
            WordType::F32 => out.extend_from_slice(&w.to_le_bytes()),
            WordType::Bf16 => out.extend_from_slice(&((w >> 16) as u16).to_le_bytes()),
            WordType::F16 => out.extend_from_slice(&half::f16::from_f32(f32::from_bits(w)).to_le_bytes()),
        }
    }

    /// One form for several planes: the common dtype (else f32), the smallest shift.
    fn common(forms: impl IntoIterator<Item = Self>) -> Self {
        forms
            .into_iter()
            .reduce(|a, b| WordPlane {
                dtype: if a.dtype == b.dtype { a.dtype } else { WordType::F32 },
                shift: a.shift.min(b.shift),
            })
            .unwrap_or(WordPlane { dtype: WordType::F32, shift: 0 })
    }
}

/// Rows of a tensor-core tile.
const TILE: usize = 16;

/// The code of weight `j` (0..32) of a packed 4-bit block (`Block::nibbles`).
fn nibble(codes: &[u8], j: usize) -> u32 {
    u32::from(if j < 16 { codes[j] & 15 } else { codes[j - 16] >> 4 })
}

/// Blocks a chunk of a tile's stream (`TILE_G` in qgemv.cu).
const TILE_G: usize = 4;

/// 4-bit codes (`code(row, k)`) and word planes (`[rows][nb]` each, all in `form`) in `qtile`'s
/// order: per tile of 16 rows, `ceil(nb / TILE_G)` chunks of `TILE_G` blocks (zeros past the
/// last row and block), each
/// - its codes, `[2 pairs][32 lanes][2 blocks][2 k-steps]` u32: lane 4 g + t's u32 of block b,
///   k-step h holds, at nibbles s and 4 + s, the two elements of m16n8k16's A register s: row
///   g + 8 (s & 1), weights 8 t + 4 h + 2 (s >> 1) + {0, 1} of the block (lane t's B fragments
///   are then x's 8 t .. 8 t + 8);
/// - then its words, `[TILE_G >> shift groups][8][W][2]`: lane group g's words of rows g and
///   g + 8 side by side.
fn tile_stream(rows: usize, nb: usize, code: impl Fn(usize, usize) -> u32, planes: &[Vec<u32>], form: WordPlane) -> Vec<u8> {
    let (tiles, chunks) = (rows.div_ceil(TILE), nb.div_ceil(TILE_G));
    let groups = TILE_G >> form.shift;
    let mut out = Vec::with_capacity(tiles * chunks * (1024 + groups * 16 * planes.len() * form.width()));
    for tile in 0..tiles {
        for chunk in 0..chunks {
            for pair in 0..TILE_G / 2 {
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    for bi in 0..2 {
                        let b = chunk * TILE_G + 2 * pair + bi;
                        for h in 0..2 {
                            let mut u = 0u32;
                            for s in 0..4 {
                                let row = tile * TILE + g + 8 * (s & 1);
                                if row >= rows || b >= nb {
                                    continue;
                                }
                                for e in 0..2 {
                                    let k = 32 * b + 8 * t + 4 * h + 2 * (s >> 1) + e;
                                    u |= code(row, k) << (4 * s + 16 * e);
                                }
                            }
                            out.extend_from_slice(&u.to_le_bytes());
                        }
                    }
                }
            }
            for grp in 0..groups {
                let b = chunk * TILE_G + (grp << form.shift);
                for g in 0..8 {
                    for plane in planes {
                        for r in 0..2 {
                            let row = tile * TILE + g + 8 * r;
                            form.push(if row < rows && b < nb { plane[row * nb + b] } else { 0 }, &mut out);
                        }
                    }
                }
            }
        }
    }
    out
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
    /// `p` (`rows` x `cols`) split into its word planes and codes on `dev`.
    pub fn upload(p: &PackedRows, rows: usize, cols: usize, dev: &Device) -> Result<Self> {
        let (f, nb) = (p.format, cols / 32);
        let (w, c) = (f.words(), f.code_bytes());
        // planes[i] = word i of every block, [rows][nb].
        let mut planes = vec![vec![0u32; rows * nb]; w];
        let mut codes = vec![0u8; rows * nb * c];
        for (r, row) in p.data().chunks_exact(p.row_bytes).enumerate() {
            let (heads, code) = row.split_at(4 * w * nb);
            for (i, word) in heads.chunks_exact(4).enumerate() {
                planes[i / nb][r * nb + i % nb] = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            }
            codes[r * nb * c..(r + 1) * nb * c].copy_from_slice(&code[..nb * c]);
        }
        let (mut data, form) = if matches!(f, BlockFormat::Q4_0 | BlockFormat::Q4_1) {
            // 4-bit codes: tensor-core tiles.
            let form = WordPlane::common(planes.iter().map(|p| WordPlane::narrowest(p, nb)));
            let code = |r: usize, k: usize| nibble(&codes[(r * nb + k / 32) * c..], k % 32);
            (tile_stream(rows, nb, code, &planes, form), Form::Tiles(form))
        } else {
            let (mut data, mut layout) = (Vec::new(), 0u32);
            for (i, plane) in planes.iter().enumerate() {
                let form = WordPlane::narrowest(plane, nb);
                form.store(plane, nb, &mut data);
                layout |= form.code() << (4 * i);
            }
            let codes_at = data.len();
            data.extend_from_slice(&codes);
            (data, Form::Blocks { layout, codes_at })
        };
        // One unused byte where there is nothing (Q3 has no code bytes; a matrix no rows).
        data.resize(data.len().max(1), 0);
        let len = data.len();
        let data = Tensor::from_vec(data, len, dev)?;
        Ok(CudaQMatrix { format: f, rows, cols, form, data })
    }

    /// The most rows of x one pass over the quantized bytes takes (more: dequantize, GEMM).
    pub fn max_gemv_rows(&self) -> usize {
        match self.form {
            Form::Blocks { .. } => MAX_GEMV_ROWS,
            Form::Tiles(_) => MAX_TILE_ROWS,
        }
    }

    /// `x` `[.., cols]` (f32, bf16 or f16 on the matrix's device) -> `[.., rows]` of x's dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.contiguous()?;
        if x.layout().start_offset() * x.dtype().size_in_bytes() % 16 != 0 {
            // The kernels read x 16 bytes at a time.
            x = x.copy()?;
        }
        let mut dims = x.dims().to_vec();
        let m = x.elem_count() / self.cols.max(1);
        let x2 = x.reshape((m, self.cols))?;
        let y = if m <= self.max_gemv_rows() {
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
        let like = Tensor::zeros(1, dtype, self.data.device())?;
        like.apply_op1_no_bwd(&QDequant { q: self })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.data.elem_count()
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
        if k != self.q.cols || !(1..=self.q.max_gemv_rows()).contains(&m) {
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
    use candle_core::{DType, Layout, Result, WithDType};

    use super::{format_name, CudaQMatrix, Form, WordPlane, TILE, TILE_G};
    use crate::ops::cuda::{cuda_slice, dtype_name, QGEMV};

    const THREADS: usize = 256; // QGEMV_THREADS in qgemv.cu
    const WARPS: usize = THREADS / 32;

    /// The name of tile kernel `kind` (`qtile`, less its rows of x, or `qtile_dequant`) for
    /// the matrix, its words' form and the activations' dtype.
    fn tile_kernel(kind: &str, q: &CudaQMatrix, form: WordPlane, x: DType) -> Result<String> {
        Ok(format!("{kind}_{}_{}_w{}", format_name(q.format), dtype_name(x)?, dtype_name(form.dtype.dtype())?))
    }

    /// Output rows a warp takes at once for `m` rows of x (`RowsPerWarp` in qgemv.cu).
    fn rows_per_warp(m: usize) -> usize {
        match m {
            1 => 1,
            2 | 3 => 2,
            _ => 4,
        }
    }

    /// Warps per output row: more where the matrix has few rows, so that the grid fills the
    /// GPU, while each warp keeps at least two passes of 32 blocks.
    fn warps_per_row(n: usize, nb: usize) -> usize {
        let mut wpr = 1;
        while wpr < 8 && n * wpr / WARPS < 2048 && nb / (wpr * 2) >= 64 {
            wpr *= 2;
        }
        wpr
    }

    /// Warps per tile of 16 rows: more where the matrix has few tiles, as many as keep the grid
    /// within one wave of `wave_warps` (a second wave of a few blocks idles most of the GPU
    /// while it runs), while each warp keeps 2 chunks or more. (On an H100, MLX 4-bit
    /// Qwen2.5-7B: the gate-up product's 2368 tiles went from two warps each, 592 blocks where a
    /// wave holds 528, to one; with the launch overlapped too, decode rose 1%.)
    fn warps_per_tile(tiles: usize, chunks: usize, wave_warps: usize) -> usize {
        let mut wpr = 1;
        while wpr < WARPS && tiles * wpr * 2 <= wave_warps && chunks / (wpr * 2) >= 2 {
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
            let (ds, _) = q.data.storage_and_layout();
            let data = cuda_slice::<u8>(&ds, "qgemv data")?;
            let (n, nb) = (q.rows, q.cols / 32);
            // SAFETY: the kernel writes every element of y.
            let y = unsafe { dev.alloc::<T>(m * n)? };
            let x = x.slice(l.start_offset()..);
            match q.form {
                Form::Blocks { layout, codes_at } => {
                    let name = format!("qgemv_{}_{}_{m}", format_name(q.format), dtype_name(T::DTYPE)?);
                    let func = QGEMV.func(&dev, &name)?;
                    let wpr = warps_per_row(n, nb);
                    let cfg = LaunchConfig {
                        grid_dim: (n.div_ceil(WARPS / wpr * rows_per_warp(m)) as u32, 1, 1),
                        block_dim: (THREADS as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let (n, nb, wpr) = (n as i32, nb as i32, wpr as i32);
                    let codes = data.slice(codes_at..);
                    let mut b = func.builder();
                    b.arg(&y).arg(&x).arg(data).arg(&layout).arg(&codes).arg(&n).arg(&nb).arg(&wpr);
                    // SAFETY: (y, x, words, layout, codes, n, nb, wpr) are the kernel's
                    // parameters in order and type; x is [m, nb * 32] (checked by the op), the
                    // arrays are the matrix's.
                    unsafe { b.launch(cfg) }.w()?;
                }
                Form::Tiles(form) => {
                    if (l.start_offset() * std::mem::size_of::<T>()) % 16 != 0 {
                        candle_core::bail!("qtile: x must start 16-byte aligned (it reads 16 bytes at once)");
                    }
                    let nt = m.div_ceil(8).next_power_of_two();
                    let func = QGEMV.func(&dev, &format!("{}_{nt}", tile_kernel("qtile", q, form, T::DTYPE)?))?;
                    let tiles = n.div_ceil(TILE);
                    let wpr = warps_per_tile(tiles, nb.div_ceil(TILE_G), func.wave(THREADS as u32)? * WARPS);
                    let cfg = LaunchConfig {
                        grid_dim: (tiles.div_ceil(WARPS / wpr) as u32, 1, 1),
                        block_dim: (THREADS as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let (n, m, nb, wpr, shift) = (n as i32, m as i32, nb as i32, wpr as i32, form.shift as i32);
                    let mut b = func.dependent();
                    b.mem(&y).mem(&x).mem(data).scalar(&shift).scalar(&n).scalar(&m).scalar(&nb).scalar(&wpr);
                    // SAFETY: (y, x, tiles, shift, n, m, nb, wpr) are the kernel's parameters in
                    // order and type; x is [m, nb * 32], 16-byte aligned, m <= 8 nt (checked by
                    // the op), the stream is the matrix's; the kernel waits (pdl_wait) before
                    // it reads x and before it writes.
                    unsafe { b.launch(cfg) }?;
                }
            }
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
            let (ds, _) = q.data.storage_and_layout();
            let data = cuda_slice::<u8>(&ds, "qdequant data")?;
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
            match q.form {
                Form::Blocks { layout, codes_at } => {
                    let func = QGEMV.func(&dev, &format!("qdequant_{}_{}", format_name(q.format), dtype_name(T::DTYPE)?))?;
                    let codes = data.slice(codes_at..);
                    let mut b = func.builder();
                    b.arg(&out).arg(data).arg(&layout).arg(&codes).arg(&n).arg(&nb);
                    // SAFETY: (out, words, layout, codes, n, nb) are the kernel's parameters in
                    // order and type; words and codes are the matrix's.
                    unsafe { b.launch(cfg) }.w()?;
                }
                Form::Tiles(form) => {
                    let func = QGEMV.func(&dev, &tile_kernel("qtile_dequant", q, form, T::DTYPE)?)?;
                    let shift = form.shift as i32;
                    let mut b = func.builder();
                    b.arg(&out).arg(data).arg(&shift).arg(&n).arg(&nb);
                    // SAFETY: (out, tiles, shift, n, nb) are the kernel's parameters in order
                    // and type; the stream is the matrix's.
                    unsafe { b.launch(cfg) }.w()?;
                }
            }
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

#[cfg(test)]
mod tests {
    use super::{tile_stream, WordPlane, WordType, TILE, TILE_G};

    /// Every code lands where m16n8k16's A fragment wants it, and every word beside its chunk's
    /// codes, where `qtile` and `qtile_dequant` read them: lane 4 g + t, register s = (row / 8)
    /// + 2 (w / 2 % 2) of k-step w / 4 % 2 for weight w of a block, t = w / 8.
    #[test]
    fn tile_stream_follows_the_mma_fragment_layout() {
        // A last tile cut short, a last chunk of one block; groups of 2 blocks.
        let (rows, nb) = (37, 5);
        let code = |r: usize, k: usize| ((r * 7 + k * 3) % 16) as u32;
        let planes: Vec<Vec<u32>> = (0..2)
            .map(|p| (0..rows * nb).map(|i| half::bf16::from_f32((p * 1000 + i / 2) as f32).to_f32().to_bits()).collect())
            .collect();
        // Every word of a group equal, as `shift` 1 says.
        let planes: Vec<Vec<u32>> = planes.iter().map(|p| (0..rows * nb).map(|i| p[i - (i % nb) % 2]).collect()).collect();
        let form = WordPlane { dtype: WordType::Bf16, shift: 1 };
        let out = tile_stream(rows, nb, code, &planes, form);
        let (chunks, cb) = (nb.div_ceil(TILE_G), 1024 + 2 * 8 * 2 * 2 * 2);
        assert_eq!(out.len(), rows.div_ceil(TILE) * chunks * cb);
        let u32_at = |o: usize| u32::from_le_bytes(out[o..o + 4].try_into().unwrap());
        for row in 0..rows.div_ceil(TILE) * TILE {
            let (tile, r) = (row / TILE, row % TILE);
            for b in 0..chunks * TILE_G {
                let chunk = (tile * chunks + b / TILE_G) * cb;
                let blk = b % TILE_G;
                for w in 0..32 {
                    let (t, h, s) = (w / 8, w / 4 % 2, r / 8 + 2 * (w / 2 % 2));
                    let lane = 4 * (r % 8) + t;
                    let u = u32_at(chunk + 512 * (blk / 2) + 16 * lane + 4 * (2 * (blk % 2) + h));
                    let got = (u >> (4 * s + 16 * (w % 2))) & 15;
                    let want = if row < rows && b < nb { code(row, 32 * b + w) } else { 0 };
                    assert_eq!(got, want, "row {row} block {b} weight {w}");
                }
                for (p, plane) in planes.iter().enumerate() {
                    let e = chunk + 1024 + (((blk >> 1) * 8 + r % 8) * 2 + p) * 4 + 2 * (r / 8);
                    let got = u32::from(u16::from_le_bytes([out[e], out[e + 1]])) << 16;
                    // A group's word is its first block's (a padding block beside a real one
                    // in its group has zero codes).
                    let first = b & !1;
                    let want = if row < rows && first < nb { plane[row * nb + first] } else { 0 };
                    assert_eq!(got, want, "row {row} block {b} plane {p}");
                }
            }
        }
    }

    /// Word `b` of `row` read back from a stored plane, as `Words::get` in qgemv.cu reads it.
    fn read(form: WordPlane, bytes: &[u8], nb: usize, row: usize, b: usize) -> u32 {
        let e = row * form.per_row(nb) + (b >> form.shift);
        match form.dtype {
            WordType::F32 => u32::from_le_bytes(bytes[4 * e..4 * e + 4].try_into().unwrap()),
            WordType::Bf16 => u32::from(u16::from_le_bytes([bytes[2 * e], bytes[2 * e + 1]])) << 16,
            WordType::F16 => half::f16::from_le_bytes([bytes[2 * e], bytes[2 * e + 1]]).to_f32().to_bits(),
        }
    }

    fn check(words: &[u32], nb: usize, want: WordPlane) {
        let form = WordPlane::narrowest(words, nb);
        assert_eq!(form, want);
        let mut bytes = vec![7u8; 3]; // a plane after another's
        form.store(words, nb, &mut bytes);
        assert_eq!((bytes.len() - 3) % 16, 0, "a plane is padded to 16 bytes");
        for (i, &w) in words.iter().enumerate() {
            assert_eq!(read(form, &bytes[3..], nb, i / nb, i % nb), w, "word {i} of {form:?}");
        }
    }

    #[test]
    fn a_plane_is_stored_as_narrow_as_its_words_allow_and_read_back_bit_for_bit() {
        let (rows, nb) = (5, 6);
        let f = |i: usize| (i as f32 * 0.37 - 3.1).sin() * 0.05;
        // MLX: bf16 scales, a group of 64 weights = 2 blocks.
        let bf = |i: usize| half::bf16::from_f32(f(i)).to_f32().to_bits();
        let mlx: Vec<u32> = (0..rows * nb).map(|i| bf(i / 2)).collect();
        check(&mlx, nb, WordPlane { dtype: WordType::Bf16, shift: 1 });
        // Groups of 128 = 4 blocks, the last group of a row cut short (6 blocks).
        let g4: Vec<u32> = (0..rows * nb).map(|i| bf(i / nb * 2 + i % nb / 4)).collect();
        check(&g4, nb, WordPlane { dtype: WordType::Bf16, shift: 2 });
        // GGUF Q4_0..Q8_0: f16 scales, one per block.
        let h: Vec<u32> = (0..rows * nb).map(|i| half::f16::from_f32(f(i)).to_f32().to_bits()).collect();
        check(&h, nb, WordPlane { dtype: WordType::F16, shift: 0 });
        // k-quants' d * sc: f32.
        let w: Vec<u32> = (0..rows * nb).map(|i| f(i).to_bits()).collect();
        check(&w, nb, WordPlane { dtype: WordType::F32, shift: 0 });
        // Groups are per row: equal neighbours across a row's end do not make a group.
        let across: Vec<u32> = (0..rows * 3).map(|i| f((i + 1) / 2).to_bits()).collect();
        check(&across, 3, WordPlane { dtype: WordType::F32, shift: 0 });
        // Bit fields (Q5's fifth bits): a NaN's pattern is never narrowed to f16.
        let nan: Vec<u32> = (0..rows * nb).map(|i| if i == 7 { 0x7fc0_0001 } else { h[i] }).collect();
        check(&nan, nb, WordPlane { dtype: WordType::F32, shift: 0 });
        let low: Vec<u32> = (0..rows * nb).map(|i| (i as u32 * 0x9e37) & 0xffff).collect();
        let form = WordPlane::narrowest(&low, nb);
        assert_ne!(form.dtype, WordType::Bf16);
        check(&low, nb, form);
    }
}
