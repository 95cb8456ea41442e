use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::linear::Linear;
use crate::ops::qmatmul::QMatrix;
use crate::weights::{StoredTensor, Weights, WeightsError};

/// Token embedding table `[vocab, hidden]`, dense or kept quantized (rows dequantized on lookup).
pub enum Embedding {
    Dense(Tensor),
    /// Shared with the output head when the embeddings are tied.
    Quantized(Arc<QMatrix>),
}

impl Embedding {
    pub fn load(w: &Weights, name: &str, vocab: usize, hidden: usize) -> std::result::Result<Self, WeightsError> {
        let e = match w.stored(name, &[vocab, hidden])? {
            StoredTensor::Dense(t) => Embedding::Dense(t.to_dtype(w.dtype())?),
            StoredTensor::Quantized(q) => Self::quantized(w, QMatrix::new(q)?)?,
            StoredTensor::Affine(a) => Self::quantized(w, QMatrix::from_affine(&a)?)?,
        };
        w.hold(match &e {
            Embedding::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Embedding::Quantized(q) => q.held_bytes(),
        });
        Ok(e)
    }

    fn quantized(w: &Weights, q: QMatrix) -> std::result::Result<Self, WeightsError> {
        // Lookups on a GPU gather rows on the device (a quantized table's lookup runs on the
        // host, which a captured decode graph cannot do): the table is dequantized there.
        if w.device().is_cuda() {
            return Ok(Embedding::Dense(q.dequantize_all()?.to_dtype(w.dtype())?.to_device(w.device())?));
        }
        Ok(Embedding::Quantized(Arc::new(q)))
    }

    pub fn forward(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => t.index_select(ids, 0),
            Embedding::Quantized(q) => {
                let device = ids.device().clone();
                let ids = ids.to_vec1::<u32>()?;
                let rows = q.dequantize_rows(&ids)?;
                Tensor::from_vec(rows, (ids.len(), q.dims().1), &device)?.to_dtype(dtype)
            }
        }
    }

    /// The output projection: `lm_head.weight`, or this table when tied (or when the
    /// checkpoint has no separate head).
    pub fn output_head(
        &self,
        w: &Weights,
        tied: bool,
        vocab: usize,
        hidden: usize,
    ) -> std::result::Result<Linear, WeightsError> {
        if tied || !w.contains("lm_head.weight") {
            Ok(self.as_linear()?)
        } else {
            Linear::load(w, "lm_head", hidden, vocab, false)
        }
    }

    /// The same table as an output projection, for tied embeddings.
    pub fn as_linear(&self) -> Result<Linear> {
        match self {
            Embedding::Dense(t) => Ok(Linear::from_dense(t.clone())),
            Embedding::Quantized(q) => Ok(Linear::from_qmatrix(q.clone())),
        }
    }
}
