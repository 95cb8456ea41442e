use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Result, Tensor};

use crate::ops::qmatmul::QMatrix;

use crate::weights::{StoredTensor, Weights, WeightsError};

enum Matrix {
    /// `[out, in]` in the model dtype.
    Dense(Tensor),
    /// GGUF block-quantized `[out, in]`, dequantized on the fly against f32 activations.
    Quantized(QMatrix),
}

/// `y = x W^T + b` over rows of `x` (`[T, in]`).
pub struct Linear {
    w: Matrix,
    bias: Option<Tensor>,
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
            StoredTensor::Quantized(q) => Matrix::Quantized(QMatrix::new(q)?),
        };
        let bias = if bias { Some(w.dense(&format!("{prefix}.bias"), &[out_dim])?) } else { None };
        Ok(Linear { w: m, bias })
    }

    /// Shares an embedding table as an output projection (tied weights).
    pub fn from_dense(t: Tensor) -> Self {
        Linear { w: Matrix::Dense(t), bias: None }
    }

    pub fn from_quantized(q: Arc<QTensor>) -> Result<Self> {
        Ok(Linear { w: Matrix::Quantized(QMatrix::new(q)?), bias: None })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.w {
            Matrix::Dense(w) => x.matmul(&w.t()?)?,
            Matrix::Quantized(q) => q.forward(x)?.to_dtype(x.dtype())?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}
