//! A request's life inside the engine.

use super::finish::FinishReason;
use super::multimodal::MultiModalState;
use super::sampler::{Sampled, SequenceSampler};
use super::sampling_params::SamplingParams;
use crate::kv::BlockTable;

/// Engine-wide id of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq-{}", self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    Finished,
}

pub struct Sequence {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    /// Tokens whose keys and values are in the cache. Everything after them is computed by
    /// the next scheduled chunk; prefill and decode are the same thing at different sizes.
    pub num_computed: usize,
    pub block_table: BlockTable,
    /// Its float-window ring in a TurboQuant cache, while running.
    pub window_ring: Option<u32>,
    pub params: SamplingParams,
    pub sampler: SequenceSampler,
    pub status: SeqStatus,
    pub finish: Option<FinishReason>,
    pub preemptions: u32,
    /// With `params.prompt_logprobs`: entry `i` is prompt token `i + 1` given the ones before
    /// it, filled as prefill chunks are computed (and kept across preemption).
    pub prompt_logprobs: Vec<Sampled>,
    /// Images, M-RoPE positions and image embeddings of a vision-language prompt.
    pub mm: Option<Box<MultiModalState>>,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, params: SamplingParams, eos_token_ids: Vec<u32>) -> Self {
        let sampler = SequenceSampler::new(params.seed).with_eos_token_ids(eos_token_ids);
        Sequence {
            id,
            prompt,
            output: Vec::new(),
            num_computed: 0,
            block_table: BlockTable::default(),
            window_ring: None,
            params,
            sampler,
            status: SeqStatus::Waiting,
            finish: None,
            preemptions: 0,
            prompt_logprobs: Vec::new(),
            mm: None,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    pub fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }

    /// Tokens still to run through the model before the next token can be sampled.
    pub fn num_uncomputed(&self) -> usize {
        self.num_tokens() - self.num_computed
    }
}
