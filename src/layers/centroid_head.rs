//! An output head that scores only part of the vocabulary (Gemma 4 assistant's "ordered
//! embeddings"): the vocabulary is grouped into clusters of equal size; a small linear picks
//! the `top_k` clusters whose centroids score highest, the head's rows score those clusters'
//! tokens, and every other token gets (lowest computed logit - 1), so it ranks below them all.

use candle_core::{DType, Result, Tensor};

use crate::weights::{Weights, WeightsError};

pub struct CentroidHead {
    /// `[clusters, hidden]`.
    centroids: Tensor,
    /// Vocabulary ids of cluster c at `[c * per_cluster ..][..per_cluster]`.
    ordering: Vec<u32>,
    top_k: usize,
}

impl CentroidHead {
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        vocab: usize,
        clusters: usize,
        top_k: usize,
    ) -> std::result::Result<Self, WeightsError> {
        let centroids = w.dense(&format!("{prefix}.centroids.weight"), &[clusters, hidden])?;
        // Ids are below 2^24, exact in f32 whatever integer type the checkpoint stores.
        let ordering: Vec<u32> = w
            .dense_f32(&format!("{prefix}.token_ordering"), &[vocab])?
            .to_vec1::<f32>()?
            .iter()
            .map(|&v| v as u32)
            .collect();
        if ordering.iter().any(|&t| t as usize >= vocab) {
            return Err(WeightsError::Config {
                path: w.origin_of(&format!("{prefix}.token_ordering")).to_path_buf(),
                msg: format!("token_ordering names ids beyond the vocabulary of {vocab}"),
            });
        }
        Ok(CentroidHead { centroids, ordering, top_k })
    }

    /// `hidden` `[N, h]`, `head` `[vocab, h]` -> logits `[N, vocab]` (f32). The filler is per
    /// row (transformers takes the minimum over the whole batch: the same for one row, and no
    /// token's rank changes either way).
    pub fn forward(&self, hidden: &Tensor, head: &Tensor) -> Result<Tensor> {
        let (n, vocab) = (hidden.dim(0)?, self.ordering.len());
        let per = vocab / self.centroids.dim(0)?;
        let scores = hidden.matmul(&self.centroids.t()?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let mut out = Vec::with_capacity(n * vocab);
        for (r, s) in scores.iter().enumerate() {
            let mut order: Vec<usize> = (0..s.len()).collect();
            order.sort_by(|&a, &b| s[b].total_cmp(&s[a]));
            let ids: Vec<u32> = order[..self.top_k]
                .iter()
                .flat_map(|&c| self.ordering[c * per..(c + 1) * per].iter().copied())
                .collect();
            let rows = head.index_select(&Tensor::new(ids.as_slice(), head.device())?, 0)?;
            let logits =
                hidden.narrow(0, r, 1)?.matmul(&rows.t()?)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let fill = logits.iter().copied().fold(f32::INFINITY, f32::min) - 1.0;
            let mut row = vec![fill; vocab];
            for (&t, &l) in ids.iter().zip(&logits) {
                row[t as usize] = l;
            }
            out.extend(row);
        }
        Tensor::from_vec(out, (n, vocab), hidden.device())
    }
}
