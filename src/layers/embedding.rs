use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor};

use super::linear::Linear;
use crate::weights::{StoredTensor, Weights, WeightsError};

/// Token embedding table `[vocab, hidden]`, dense or kept quantized (rows dequantized on lookup).
pub enum Embedding {
    Dense(Tensor),
    Quantized(Arc<QTensor>),
}

impl Embedding {
    pub fn load(w: &Weights, name: &str, vocab: usize, hidden: usize) -> std::result::Result<Self, WeightsError> {
        Ok(match w.stored(name, &[vocab, hidden])? {
            StoredTensor::Dense(t) => Embedding::Dense(t.to_dtype(w.dtype())?),
            StoredTensor::Quantized(q) => Embedding::Quantized(q),
        })
    }

    pub fn forward(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => t.index_select(ids, 0),
            Embedding::Quantized(q) => q.embedding(ids)?.to_dtype(dtype),
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
            Embedding::Quantized(q) => Linear::from_quantized(q.clone()),
        }
    }
}
