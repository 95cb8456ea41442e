use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::linear::Linear;
use crate::ops::qmatmul::QMatrix;
use crate::parallel::{Collective, Communicator};
use crate::weights::{StoredTensor, Weights, WeightsError};

/// Token embedding table `[vocab, hidden]`, dense or kept quantized (rows dequantized on lookup).
pub enum Embedding {
    Dense(Tensor),
    /// Shared with the output head when the embeddings are tied.
    Quantized(Arc<QMatrix>),
    /// Under tensor parallelism, this rank's rows of the table, from id `start` on: a lookup
    /// gives zeros for ids outside them, and the ranks' lookups are added up.
    Divided {
        rows: Tensor,
        start: u32,
        comm: Arc<dyn Communicator>,
    },
}

impl Embedding {
    pub fn load(w: &Weights, name: &str, vocab: usize, hidden: usize) -> std::result::Result<Self, WeightsError> {
        if let Some(shard) = w.shard() {
            let part = vocab / shard.world();
            let rows = w.dense(name, &[part, hidden])?;
            let start = (shard.rank() * part) as u32;
            return Ok(Embedding::Divided { rows, start, comm: shard.comm.clone() });
        }
        let e = match w.stored(name, &[vocab, hidden])? {
            StoredTensor::Dense(t) => Embedding::Dense(t.to_dtype(w.dtype())?),
            StoredTensor::Quantized(q) => Self::quantized(w, QMatrix::new(q)?)?,
            StoredTensor::Affine(a) => Self::quantized(w, QMatrix::from_affine(&a)?)?,
        };
        w.hold(match &e {
            Embedding::Dense(t) | Embedding::Divided { rows: t, .. } => t.elem_count() * t.dtype().size_in_bytes(),
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
            Embedding::Divided { rows, start, comm } => {
                // On the ids' device, with no read back: ids are exact in f32 (below 2^24).
                let n = rows.dim(0)?;
                let local = (ids.to_dtype(DType::F32)? - *start as f64)?;
                let mine = local.ge(0f32)?.mul(&local.lt(n as f32)?)?;
                let index = local.clamp(0f32, (n - 1) as f32)?.to_dtype(DType::U32)?;
                let looked_up = rows.index_select(&index, 0)?;
                let mine = mine.to_dtype(rows.dtype())?.unsqueeze(1)?;
                comm.all_reduce(&looked_up.broadcast_mul(&mine)?)
            }
        }
    }

    /// The output projection: `lm_head.weight`, or this table when tied (or when the
    /// checkpoint has no separate head). Under tensor parallelism each rank projects onto its
    /// range of the vocabulary, and the ranks' logits are put side by side.
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
            Linear::load(w, "lm_head", hidden, vocab / w.shard().map_or(1, |s| s.world()), false)
        }
    }

    /// The same table as an output projection, for tied embeddings.
    pub fn as_linear(&self) -> Result<Linear> {
        match self {
            Embedding::Dense(t) => Ok(Linear::from_dense(t.clone())),
            Embedding::Quantized(q) => Ok(Linear::from_qmatrix(q.clone())),
            Embedding::Divided { rows, comm, .. } => {
                Ok(Linear::from_dense(rows.clone()).completed_by(Collective::Gather(comm.clone())))
            }
        }
    }
}
