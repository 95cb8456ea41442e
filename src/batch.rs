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

/// Token positions for rotary embeddings, one per row.
#[derive(Debug, Clone)]
pub enum Positions {
    Flat(Vec<u32>),
    /// M-RoPE (temporal, height, width) per row; each sequence computed its own at admission.
    MRope(Vec<[u32; 3]>),
}

impl Positions {
    pub fn len(&self) -> usize {
        match self {
            Positions::Flat(p) => p.len(),
            Positions::MRope(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Rows whose input is an image embedding instead of their token's embedding.
pub struct ImageRows {
    /// `[T]` u32: row i of the model input is row `source[i]` of `[token embeddings; embeds]`.
    source: Tensor,
    /// `[n, hidden]` embeddings of the image rows, in row order.
    embeds: Tensor,
}

impl ImageRows {
    /// `rows[k]` (ascending) takes `embeds[k]`; `num_rows` is the batch size.
    pub fn new(rows: &[u32], embeds: Tensor, num_rows: usize) -> candle_core::Result<Self> {
        if rows.len() != embeds.dim(0)? {
            candle_core::bail!("{} image rows for {} image embeddings", rows.len(), embeds.dim(0)?);
        }
        let mut source: Vec<u32> = (0..num_rows as u32).collect();
        for (k, &r) in rows.iter().enumerate() {
            let slot = source
                .get_mut(r as usize)
                .ok_or_else(|| candle_core::Error::Msg(format!("image row {r} outside a batch of {num_rows}")))?;
            *slot = (num_rows + k) as u32;
        }
        let source = Tensor::new(source.as_slice(), embeds.device())?;
        Ok(ImageRows { source, embeds })
    }

    /// Token embeddings `[T, hidden]` with the image rows replaced.
    pub fn merge(&self, token_embeds: &Tensor) -> candle_core::Result<Tensor> {
        let embeds = self.embeds.to_dtype(token_embeds.dtype())?;
        Tensor::cat(&[token_embeds, &embeds], 0)?.index_select(&self.source, 0)
    }
}

/// A step's model input.
pub struct Batch {
    /// Token ids, `[T]` u32.
    pub token_ids: Tensor,
    pub positions: Positions,
    pub attn: AttentionMeta,
    /// Image embeddings placed at image-pad rows (vision-language models).
    pub images: Option<ImageRows>,
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
        Ok(Batch { token_ids: Tensor::new(tokens, device)?, positions: Positions::Flat(positions), attn, images: None })
    }

    /// A batch with explicit per-row positions and, optionally, image embeddings.
    pub fn new(
        device: &Device,
        block_size: usize,
        seqs: Vec<SeqSlice>,
        tokens: &[u32],
        positions: Positions,
        images: Option<ImageRows>,
    ) -> candle_core::Result<Self> {
        let attn = AttentionMeta::new(block_size, seqs);
        if tokens.len() != attn.num_rows() || positions.len() != attn.num_rows() {
            candle_core::bail!(
                "batch has {} tokens and {} positions for {} scheduled rows",
                tokens.len(),
                positions.len(),
                attn.num_rows()
            );
        }
        Ok(Batch { token_ids: Tensor::new(tokens, device)?, positions, attn, images })
    }

    /// The input embeddings: token embeddings with any image rows replaced.
    pub fn input_embeds(&self, token_embeds: Tensor) -> candle_core::Result<Tensor> {
        match &self.images {
            Some(img) => img.merge(&token_embeds),
            None => Ok(token_embeds),
        }
    }

    pub fn num_rows(&self) -> usize {
        self.attn.num_rows()
    }
}
