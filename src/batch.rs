//! One engine step's input: the scheduled tokens of every sequence, flattened.
//!
//! There is no padding and no batch-wide offset: every token carries its own position, and
//! every sequence its own slice of the batch, context length and block table. A sequence
//! therefore computes the same values whatever else shares its step.

use candle_core::{Device, Tensor};

/// Where one sequence's tokens sit in the flat batch, and what they attend to.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    /// First row of this sequence in the flat batch.
    pub q_start: usize,
    /// Rows scheduled for it this step (a prefill chunk, or 1 for a decode).
    pub q_len: usize,
    /// Tokens in its cache after this step, the new ones included.
    pub context_len: usize,
    /// Physical block ids holding its tokens, in order.
    pub block_table: Vec<u32>,
}

impl SeqSlice {
    /// Absolute position of the first scheduled token.
    pub fn first_position(&self) -> usize {
        self.context_len - self.q_len
    }
}

/// Attention metadata for a paged KV cache.
#[derive(Debug, Clone)]
pub struct AttentionMeta {
    pub block_size: usize,
    pub seqs: Vec<SeqSlice>,
    /// Cache slot (block * block_size + offset) each row's key and value go to.
    pub slot_mapping: Vec<u32>,
    /// Index into `seqs` for each row.
    pub row_seq: Vec<u32>,
    /// Per sequence, its float-window ring in a TurboQuant cache (empty when there is none).
    pub window_rings: Vec<u32>,
}

impl AttentionMeta {
    pub fn new(block_size: usize, seqs: Vec<SeqSlice>) -> Self {
        let total: usize = seqs.iter().map(|s| s.q_len).sum();
        let mut slot_mapping = Vec::with_capacity(total);
        let mut row_seq = Vec::with_capacity(total);
        for (i, s) in seqs.iter().enumerate() {
            for pos in s.first_position()..s.context_len {
                let block = s.block_table[pos / block_size];
                slot_mapping.push(block * block_size as u32 + (pos % block_size) as u32);
                row_seq.push(i as u32);
            }
        }
        AttentionMeta { block_size, seqs, slot_mapping, row_seq, window_rings: Vec::new() }
    }

    pub fn num_rows(&self) -> usize {
        self.slot_mapping.len()
    }
}

/// Token positions for rotary embeddings. 1-D for text models; M-RoPE models will add
/// a three-axis variant here.
#[derive(Debug, Clone)]
pub enum Positions {
    Flat(Vec<u32>),
}

/// A step's model input.
pub struct Batch {
    /// Token ids, `[T]` u32.
    pub token_ids: Tensor,
    pub positions: Positions,
    pub attn: AttentionMeta,
}

impl Batch {
    /// Builds a batch of text tokens: `tokens[i]` are the new tokens of `seqs[i]`.
    pub fn from_tokens(
        device: &Device,
        block_size: usize,
        seqs: Vec<SeqSlice>,
        tokens: &[u32],
    ) -> candle_core::Result<Self> {
        let attn = AttentionMeta::new(block_size, seqs);
        if tokens.len() != attn.num_rows() {
            candle_core::bail!("batch has {} tokens for {} scheduled rows", tokens.len(), attn.num_rows());
        }
        let positions = attn.seqs.iter().flat_map(|s| (s.first_position()..s.context_len).map(|p| p as u32)).collect();
        Ok(Batch { token_ids: Tensor::new(tokens, device)?, positions: Positions::Flat(positions), attn })
    }

    pub fn num_rows(&self) -> usize {
        self.attn.num_rows()
    }
}
