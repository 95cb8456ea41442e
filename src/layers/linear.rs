use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Result, Tensor};

use crate::ops::gemv::Gemv;
use crate::ops::invariant_matmul::InvariantMatmul;
use crate::ops::qmatmul::{CudaQMatrix, QMatrix};
use crate::parallel::Collective;

use crate::weights::{AffineMatrix, StoredTensor, Weights, WeightsError};

enum Matrix {
    /// `[out, in]` in the model dtype.
    Dense(Tensor),
    /// GGUF block-quantized or MLX affine `[out, in]`, dequantized on the fly against f32
    /// activations.
    Quantized(Arc<QMatrix>),
    /// The same on a CUDA device (against activations of any float dtype).
    DeviceQuantized(Arc<CudaQMatrix>),
}

impl Matrix {
    /// Bytes held, in the form kept (for the load's weight figure).
    fn bytes(&self) -> usize {
        match self {
            Matrix::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Matrix::Quantized(q) => q.held_bytes(),
            Matrix::DeviceQuantized(c) => c.bytes(),
        }
    }

    /// A quantized matrix where the weights live: on the CPU as it is; on CUDA dequantized
    /// into the compute dtype at load, unless `IRIS_CUDA_QUANT=1` keeps it quantized where the
    /// format has kernels. Opt-in: the kernels read fewer bytes but were measured slower than
    /// bf16 past batch 1 (Qwen2.5-7B shape on an H200, MLX 4-bit: b1 276 vs 240 tok/s, b8 447
    /// vs 1529, prefill 88k vs 148k tok/s), so by default a GPU spends memory for speed.
    fn quantized(q: QMatrix, w: &Weights) -> Result<Matrix> {
        let dev = w.device();
        if !dev.is_cuda() {
            return Ok(Matrix::Quantized(Arc::new(q)));
        }
        if crate::switches::tuned!("IRIS_CUDA_QUANT", u32, 0) == 1 {
            if let Some(c) = q.upload(dev)? {
                return Ok(Matrix::DeviceQuantized(Arc::new(c)));
            }
        }
        Ok(Matrix::Dense(q.dequantize_all()?.to_dtype(w.dtype())?.to_device(dev)?))
    }
}

/// `y = x W^T + b` over rows of `x` (`[T, in]`).
pub struct Linear {
    w: Matrix,
    bias: Option<Tensor>,
    /// Under tensor parallelism, what completes this rank's part of the product (before the
    /// bias, which every rank holds whole).
    collective: Option<Collective>,
}

impl Linear {
    pub fn load(
        w: &Weights,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let name = format!("{prefix}.weight");
        let m = match w.stored(&name, &[out_dim, in_dim])? {
            StoredTensor::Dense(t) => Matrix::Dense(t.to_dtype(w.dtype())?),
            StoredTensor::Quantized(q) => Matrix::quantized(QMatrix::new(q)?, w)?,
            StoredTensor::Affine(a) => Matrix::quantized(QMatrix::from_affine(&a)?, w)?,
        };
        w.hold(m.bytes());
        let bias = if bias { Some(w.dense(&format!("{prefix}.bias"), &[out_dim])?) } else { None };
        let collective = w.shard().and_then(|s| s.collective_after(&name));
        Ok(Linear { w: m, bias, collective })
    }

    /// Shares an embedding table as an output projection (tied weights).
    pub fn from_dense(t: Tensor) -> Self {
        Self::plain(Matrix::Dense(t), None)
    }

    fn plain(w: Matrix, bias: Option<Tensor>) -> Self {
        Linear { w, bias, collective: None }
    }

    /// The same product completed by `c` (a vocabulary-parallel output head shared with its
    /// embedding table).
    pub fn completed_by(mut self, c: Collective) -> Self {
        self.collective = Some(c);
        self
    }

    /// Takes the collective that completes this product, leaving its output partial: for a
    /// layer that adds other partial sums to it before one collective of its own.
    pub fn take_collective(&mut self) -> Option<Collective> {
        self.collective.take()
    }

    /// A dense `[out, in]` matrix and bias `[out]` (convolutions applied as matrix products).
    pub fn from_dense_with_bias(w: Tensor, bias: Tensor) -> Self {
        Self::plain(Matrix::Dense(w), Some(bias))
    }

    /// Shares a quantized embedding table as an output projection (tied weights).
    pub fn from_qmatrix(q: Arc<QMatrix>) -> Self {
        Self::plain(Matrix::Quantized(q), None)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_unbiased(x)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// `x W^T`, the bias left for the caller to fuse into what follows.
    pub fn forward_unbiased(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.product(x)?;
        match &self.collective {
            Some(c) => c.apply(&y),
            None => Ok(y),
        }
    }

    fn product(&self, x: &Tensor) -> Result<Tensor> {
        match &self.w {
            Matrix::Dense(w) if InvariantMatmul::applies(x, w) => InvariantMatmul::forward(x, w),
            Matrix::Dense(w) if Gemv::applies(x, w) => Gemv::forward(x, w),
            Matrix::Dense(w) => x.matmul(&w.t()?),
            Matrix::Quantized(q) => q.forward(x)?.to_dtype(x.dtype()),
            Matrix::DeviceQuantized(q) => q.forward(x),
        }
    }

    /// A projection onto the output rows `ids` only (an MTP head's draft vocabulary). Quantized
    /// rows are requantized to 8-bit blocks (Q8_0), which keeps the few bytes per row that make
    /// a small head fast; None on a device that keeps matrices quantized (not supported there).
    pub fn rows(&self, ids: &[u32]) -> Result<Option<Linear>> {
        let w = match &self.w {
            Matrix::Dense(w) => Matrix::Dense(w.index_select(&Tensor::new(ids, w.device())?, 0)?),
            Matrix::Quantized(q) => {
                let (_, cols) = q.dims();
                let f = Tensor::from_vec(q.dequantize_rows(ids)?, (ids.len(), cols), &candle_core::Device::Cpu)?;
                let q8 = QTensor::quantize(&f, candle_core::quantized::GgmlDType::Q8_0)?;
                Matrix::Quantized(Arc::new(QMatrix::new(Arc::new(q8))?))
            }
            Matrix::DeviceQuantized(_) => return Ok(None),
        };
        if self.collective.is_some() {
            return Ok(None);
        }
        let bias = self.bias.as_ref().map(|b| b.index_select(&Tensor::new(ids, b.device())?, 0)).transpose()?;
        Ok(Some(Self::plain(w, bias)))
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The same projection with its two halves of output rows interleaved (row i of the
    /// first half, then row i of the second, ...): a gated MLP's (gate i, up i) pairs side by
    /// side, for `Gemv::forward_gated`. None for quantized matrices (kept as they are).
    pub fn interleave_halves(&self) -> Result<Option<Linear>> {
        let Matrix::Dense(w) = &self.w else { return Ok(None) };
        let (n, k) = w.dims2()?;
        if n % 2 != 0 {
            return Ok(None);
        }
        let pairs = |t: &Tensor, tail: &[usize]| -> Result<Tensor> {
            let mut halves = vec![2, n / 2];
            halves.extend_from_slice(tail);
            let mut flat = vec![n];
            flat.extend_from_slice(tail);
            t.reshape(halves)?.transpose(0, 1)?.contiguous()?.reshape(flat)
        };
        let bias = self.bias.as_ref().map(|b| pairs(b, &[])).transpose()?;
        Ok(Some(Linear { w: Matrix::Dense(pairs(w, &[k])?), bias, collective: self.collective.clone() }))
    }

    /// `act(x W_gate^T) * x W_up^T` in one streaming pass, for a projection made by
    /// `interleave_halves` without bias, where `Gemv::applies_gated` (a decode step's few rows on
    /// CUDA); None where it does not apply (or with `IRIS_CUDA_GATED_GEMV=0`, to compare).
    pub fn forward_gated(&self, x: &Tensor, gelu: bool) -> Option<Result<Tensor>> {
        let on = crate::switches::switched_on!("IRIS_CUDA_GATED_GEMV");
        match &self.w {
            _ if self.collective.is_some() => None,
            Matrix::Dense(w) if on && self.bias.is_none() && InvariantMatmul::applies_gated(x, w) => {
                Some(InvariantMatmul::forward_gated(x, w, gelu))
            }
            Matrix::Dense(w) if on && self.bias.is_none() && Gemv::applies_gated(x, w) => {
                Some(Gemv::forward_gated(x, w, gelu))
            }
            _ => None,
        }
    }
}

/// Several projections of one input computed as a single matrix product (q/k/v, gate/up):
/// fewer, larger multiplications, each weight row still read once per step. Parts whose
/// storage cannot be stacked (GGUF files and mixed MLX recipes may quantize q, k and v
/// differently) stay separate.
pub enum StackedLinear {
    Merged { linear: Linear, widths: Vec<usize> },
    Separate(Vec<Linear>),
}

impl StackedLinear {
    pub fn load(
        w: &Weights,
        prefixes: &[String],
        in_dim: usize,
        out_dims: &[usize],
        bias: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let stored = prefixes
            .iter()
            .zip(out_dims)
            .map(|(p, &o)| w.stored(&format!("{p}.weight"), &[o, in_dim]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let merged = if let Some(ts) = stored
            .iter()
            .map(|s| match s {
                StoredTensor::Dense(t) => Some(t.to_dtype(w.dtype())),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
        {
            Some(Matrix::Dense(Tensor::cat(&ts.into_iter().collect::<Result<Vec<_>>>()?, 0)?))
        } else if let Some(qs) = stored
            .iter()
            .map(|s| match s {
                StoredTensor::Quantized(q) => Some(q),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
        {
            stack_quantized(&qs)?.map(|q| Matrix::quantized(QMatrix::new(Arc::new(q))?, w)).transpose()?
        } else if let Some(parts) = stored
            .iter()
            .map(|s| match s {
                StoredTensor::Affine(a) => Some(a),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
        {
            AffineMatrix::concat_rows(&parts).map(|a| Matrix::quantized(QMatrix::from_affine(&a)?, w)).transpose()?
        } else {
            None
        };
        Ok(match merged {
            Some(m) => {
                w.hold(m.bytes());
                let biases = if bias {
                    let b = prefixes
                        .iter()
                        .zip(out_dims)
                        .map(|(p, &o)| w.dense(&format!("{p}.bias"), &[o]))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    Some(Tensor::cat(&b, 0)?)
                } else {
                    None
                };
                StackedLinear::Merged { linear: Linear::plain(m, biases), widths: out_dims.to_vec() }
            }
            None => StackedLinear::Separate(
                prefixes
                    .iter()
                    .zip(out_dims)
                    .map(|(p, &o)| Linear::load(w, p, in_dim, o, bias))
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            ),
        })
    }

    /// The single product of all parts, when they are stacked.
    pub fn merged(&self) -> Option<&Linear> {
        match self {
            StackedLinear::Merged { linear, .. } => Some(linear),
            StackedLinear::Separate(_) => None,
        }
    }

    /// One output per part, `[T, out_i]` each.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            StackedLinear::Merged { linear, widths } => {
                let y = linear.forward(x)?;
                let mut off = 0;
                widths
                    .iter()
                    .map(|&wd| {
                        let part = y.narrow(1, off, wd);
                        off += wd;
                        part
                    })
                    .collect()
            }
            StackedLinear::Separate(parts) => parts.iter().map(|l| l.forward(x)).collect(),
        }
    }
}

/// Concatenates the rows of quantized matrices of one type and width (rows are whole blocks).
fn stack_quantized(parts: &[&Arc<QTensor>]) -> Result<Option<QTensor>> {
    let Some(first) = parts.first() else { return Ok(None) };
    let (dt, cols) = (first.dtype(), first.shape().dims2()?.1);
    let mut rows = 0;
    let mut bytes = Vec::new();
    for q in parts {
        let (r, c) = q.shape().dims2()?;
        if q.dtype() != dt || c != cols {
            return Ok(None);
        }
        rows += r;
        bytes.extend_from_slice(&q.data()?);
    }
    let storage = candle_core::quantized::QStorage::from_data(std::borrow::Cow::Owned(bytes), &first.device(), dt)?;
    Ok(Some(QTensor::new(storage, (rows, cols))?))
}
