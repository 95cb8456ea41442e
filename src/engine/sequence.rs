//! A request's life inside the engine: one record holds all of a sequence's state.

use std::collections::HashMap;

use super::detokenizer::IncrementalDetokenizer;
use super::grammar::Constraint;
use super::multimodal::MultiModalState;
use super::sampler::{DraftDist, Sampled, SequenceSampler};
use super::sampling_params::SamplingParams;
use super::stop::StopChecker;
use crate::kv::{BlockHash, BlockTable};

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

/// Text-side state: incremental detokenization and stop strings.
pub struct TextState {
    pub detok: IncrementalDetokenizer,
    pub stop: StopChecker,
}

pub struct Sequence {
    pub id: SeqId,
    /// The prompt, then the output so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the cache. Everything after them is computed by
    /// the next scheduled chunk; prefill and decode are the same thing at different sizes.
    pub num_computed: usize,
    pub block_table: BlockTable,
    /// Its slot in the per-sequence state pool (a TurboQuant float window's ring), while running.
    pub state_slot: Option<u32>,
    /// Tokens a drafter proposed to follow `tokens`, for the scheduler to verify next step.
    pub draft: Vec<u32>,
    /// The distribution each draft was drawn from, one per draft (`SequenceSampler::draw_draft`),
    /// or empty: every draft a point mass. Cleared with `draft` after each step, so a
    /// drafter that sets `draft` alone leaves point masses.
    pub draft_q: Vec<DraftDist>,
    pub params: SamplingParams,
    pub sampler: SequenceSampler,
    pub text: TextState,
    pub status: SeqStatus,
    pub preemptions: u32,
    /// With `params.prompt_logprobs`: entry `i` is prompt token `i + 1` given the ones before
    /// it, filled as prefill chunks are computed (and kept across preemption).
    pub prompt_logprobs: Vec<Sampled>,
    /// Images, M-RoPE positions and image embeddings of a vision-language prompt.
    pub mm: Option<Box<MultiModalState>>,
    /// Where the output stands in `params.grammar`: it has consumed exactly the output so far
    /// (drafts only while they are verified), so preemption, which keeps the output, keeps it.
    pub constraint: Option<Constraint>,
    /// Hashes of its first full blocks (`engine::prefix`), computed as they are needed.
    pub block_hashes: Vec<BlockHash>,
    /// Leading blocks of its table that are published to the prefix cache (or came from it).
    pub num_published: usize,
    /// Prompt tokens its first admission found in the prefix cache (usage's `cached_tokens`).
    pub num_cached_tokens: usize,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, params: SamplingParams, eos_token_ids: Vec<u32>, text: TextState) -> Self {
        let sampler = SequenceSampler::new(params.seed).with_eos_token_ids(eos_token_ids);
        let constraint = params.grammar.as_ref().map(|g| g.constraint());
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            block_table: BlockTable::default(),
            state_slot: None,
            draft: Vec::new(),
            draft_q: Vec::new(),
            params,
            sampler,
            text,
            status: SeqStatus::Waiting,
            preemptions: 0,
            prompt_logprobs: Vec::new(),
            mm: None,
            constraint,
            block_hashes: Vec::new(),
            num_published: 0,
            num_cached_tokens: 0,
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Prompt and output.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn push_output(&mut self, token: u32) {
        self.tokens.push(token);
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn token(&self, i: usize) -> u32 {
        self.tokens[i]
    }

    /// What sampling the sequence's next tokens reads, borrowed apart from its generator.
    pub fn sampling(&mut self) -> SamplingView<'_> {
        let (prompt, output) = self.tokens.split_at(self.prompt_len);
        SamplingView {
            sampler: &mut self.sampler,
            params: &self.params,
            prompt,
            output,
            draft: &self.draft,
            draft_q: &self.draft_q,
        }
    }

    /// Tokens still to run through the model before the next token can be sampled.
    pub fn num_uncomputed(&self) -> usize {
        self.num_tokens() - self.num_computed
    }
}

/// A sequence's sampler with what it reads (`Sequence::sampling`).
pub struct SamplingView<'a> {
    pub sampler: &'a mut SequenceSampler,
    pub params: &'a SamplingParams,
    pub prompt: &'a [u32],
    pub output: &'a [u32],
    pub draft: &'a [u32],
    pub draft_q: &'a [DraftDist],
}

/// Every live sequence, by id.
#[derive(Default)]
pub struct Sequences(HashMap<SeqId, Sequence>);

impl Sequences {
    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.0.get(&id)
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.0.get_mut(&id)
    }

    /// A sequence the engine itself scheduled (and so knows to exist).
    pub fn expect(&self, id: SeqId) -> &Sequence {
        self.0.get(&id).unwrap_or_else(|| panic!("{id} is scheduled but not live"))
    }

    pub fn expect_mut(&mut self, id: SeqId) -> &mut Sequence {
        self.0.get_mut(&id).unwrap_or_else(|| panic!("{id} is scheduled but not live"))
    }

    /// The sequences of `ids` (distinct, each scheduled), mutably at once, in that order.
    pub fn expect_many_mut(&mut self, ids: &[SeqId]) -> Vec<&mut Sequence> {
        let mut by_id: HashMap<SeqId, &mut Sequence> = self.0.iter_mut().map(|(&id, s)| (id, s)).collect();
        ids.iter().map(|id| by_id.remove(id).unwrap_or_else(|| panic!("{id} is scheduled but not live"))).collect()
    }

    pub fn insert(&mut self, seq: Sequence) {
        self.0.insert(seq.id, seq);
    }

    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        self.0.remove(&id)
    }
}
