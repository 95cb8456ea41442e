//! Drafts from a drafter model that reads the target's state: the target's input embedding
//! of each sequence's last token, the target's final hidden row that produced it, and the
//! target's paged keys and values (read only). Each of K steps runs every drafting sequence
//! at once and takes the argmax; the step's hidden output feeds the next (Gemma 4's
//! assistant; an MTP layer has the same shape).

use candle_core::{Result, Tensor};

use crate::batch::{AttentionMeta, SeqSlice};
use crate::kv::KvCache;
use crate::models::gemma4::Gemma4Assistant;
use crate::models::TextModel;

/// One step of a drafter model for S sequences: `[S, vocab]` f32 logits and the `[S, hidden]`
/// rows the next step reads.
pub trait DraftModel: Send {
    fn draft_step(
        &self,
        embeds: &Tensor,
        hidden: &Tensor,
        positions: &[u32],
        kv: &KvCache,
        meta: &AttentionMeta,
    ) -> Result<(Tensor, Tensor)>;
}

impl DraftModel for Gemma4Assistant {
    fn draft_step(
        &self,
        embeds: &Tensor,
        hidden: &Tensor,
        positions: &[u32],
        kv: &KvCache,
        meta: &AttentionMeta,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.step(embeds, hidden, positions, kv, meta)?;
        Ok((s.logits, s.hidden))
    }
}

/// What one sequence drafts from.
pub struct DraftInput {
    /// Its last token (sampled, not yet in the cache).
    pub last_token: u32,
    /// Tokens in the cache (the last token's position).
    pub cached: usize,
    pub block_table: Vec<u32>,
    /// Its row in the step's sampled hidden rows: the one that produced `last_token`.
    pub hidden_row: usize,
    /// Most tokens to draft.
    pub max: usize,
}

pub struct ModelDrafter {
    model: Box<dyn DraftModel>,
}

impl ModelDrafter {
    pub fn new(model: Box<dyn DraftModel>) -> Self {
        ModelDrafter { model }
    }

    /// Each input's drafts (up to its `max`). `hidden`: the step's sampled hidden rows.
    pub fn propose(
        &self,
        target: &dyn TextModel,
        kv: &KvCache,
        block_size: usize,
        hidden: &Tensor,
        inputs: &[DraftInput],
    ) -> Result<Vec<Vec<u32>>> {
        let k = inputs.iter().map(|i| i.max).max().unwrap_or(0);
        if k == 0 {
            return Ok(vec![Vec::new(); inputs.len()]);
        }
        let dev = hidden.device();
        let rows: Vec<u32> = inputs.iter().map(|i| i.hidden_row as u32).collect();
        let mut h = hidden.index_select(&Tensor::new(rows.as_slice(), dev)?, 0)?;
        // One row per sequence at its last cached position: its context is what is cached.
        let seqs = inputs
            .iter()
            .enumerate()
            .map(|(r, i)| SeqSlice { q_start: r, q_len: 1, context_len: i.cached, block_table: i.block_table.clone() })
            .collect();
        let meta = AttentionMeta::new(block_size, seqs);
        let positions: Vec<u32> = inputs.iter().map(|i| i.cached as u32).collect();
        let mut last: Vec<u32> = inputs.iter().map(|i| i.last_token).collect();
        let mut drafts = vec![Vec::new(); inputs.len()];
        for _ in 0..k {
            let embeds = target.input_embeddings(&Tensor::new(last.as_slice(), dev)?)?;
            let (logits, next) = self.model.draft_step(&embeds, &h, &positions, kv, &meta)?;
            last = logits.argmax(1)?.to_vec1::<u32>()?;
            for ((d, &t), i) in drafts.iter_mut().zip(&last).zip(inputs) {
                if d.len() < i.max {
                    d.push(t);
                }
            }
            h = next;
        }
        Ok(drafts)
    }
}
