//! Decides what runs each step: continuous batching under a token budget, chunked prefill
//! mixed with decodes, draft tokens to verify, first come first served, preemption by
//! recompute when blocks run out. With `long_prefill_token_threshold` no prompt takes more than
//! that per step, so requests behind a long prompt are admitted while it is computed, and the
//! step time (the running decodes' inter-token latency) stays bounded.

use std::collections::VecDeque;

use super::prefix::{PrefixHasher, PrefixStats};
use super::sequence::{SeqId, SeqStatus, Sequence, Sequences};
use crate::kv::{BlockAllocator, SlotPool};

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Most tokens one step may compute (prefill chunks, decodes and draft tokens).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    pub block_size: usize,
    /// A prompt chunk never ends inside an image (a model whose image tokens see the whole
    /// image, `TextConfig::images_attend_both_ways`): it stops before the image, or, starting
    /// at one, takes it whole even past the budget.
    pub whole_images: bool,
    /// vLLM's `--long-prefill-token-threshold`: a prompt chunk takes at most this many tokens
    /// per step (0: as many as the budget leaves).
    pub long_prefill_token_threshold: usize,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: SeqId,
    /// Of its uncomputed tokens, how many to compute.
    pub num_new: usize,
    /// Of its draft tokens, how many to verify after them (only when `num_new` is 1: a decode).
    pub num_draft: usize,
}

impl ScheduledSeq {
    /// Rows of the step's batch it takes.
    pub fn num_rows(&self) -> usize {
        self.num_new + self.num_draft
    }
}

/// One step's work.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub items: Vec<ScheduledSeq>,
    /// Sequences preempted while planning this step.
    pub preempted: Vec<SeqId>,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(ScheduledSeq::num_rows).sum()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    seqs: Sequences,
    /// In arrival order; preempted sequences go back to the front.
    waiting: VecDeque<SeqId>,
    /// In admission order; the last one is preempted first.
    running: Vec<SeqId>,
    pub allocator: BlockAllocator,
    /// Per-sequence state slots (one per sequence that may run).
    slots: SlotPool,
    pub total_preemptions: u64,
    /// With prefix caching: names full blocks; the allocator keeps them cached.
    prefix: Option<PrefixHasher>,
    pub prefix_stats: PrefixStats,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, num_blocks: usize, prefix: Option<PrefixHasher>) -> Self {
        let allocator = match prefix {
            Some(_) => BlockAllocator::with_prefix_caching(num_blocks),
            None => BlockAllocator::new(num_blocks),
        };
        Scheduler {
            prefix,
            prefix_stats: PrefixStats::default(),
            cfg,
            seqs: Sequences::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            allocator,
            slots: SlotPool::new(cfg.max_num_seqs),
            total_preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq);
    }

    pub fn seqs(&self) -> &Sequences {
        &self.seqs
    }

    pub fn seqs_mut(&mut self) -> &mut Sequences {
        &mut self.seqs
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(id)
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.seqs.get_mut(id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// State slots not held by a running sequence.
    pub fn num_free_slots(&self) -> usize {
        self.slots.num_free()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Removes a sequence (finished, aborted) and frees its blocks and state slot.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(id)?;
        self.waiting.retain(|s| *s != id);
        self.running.retain(|s| *s != id);
        self.release(&mut seq);
        seq.status = SeqStatus::Finished;
        Some(seq)
    }

    /// Makes sure a running sequence's blocks cover `tokens` positions (a drafter writing
    /// ahead of the cache), taking free blocks only; false when they do not suffice.
    pub fn reserve(&mut self, id: SeqId, tokens: usize) -> bool {
        let bs = self.cfg.block_size;
        match self.seqs.get_mut(id) {
            Some(seq) => seq.block_table.grow(tokens, bs, &mut self.allocator),
            None => false,
        }
    }

    /// Publishes a sequence's blocks that are full of computed, committed tokens.
    pub fn publish(&mut self, id: SeqId) {
        if let (Some(p), Some(seq)) = (&self.prefix, self.seqs.get_mut(id)) {
            p.publish(seq, &mut self.allocator);
        }
    }

    fn release(&mut self, seq: &mut Sequence) {
        // What it computed stays cached (a finished prompt, a cancelled one's prefix).
        if let Some(p) = &self.prefix {
            p.publish(seq, &mut self.allocator);
        }
        seq.block_table.release_all(&mut self.allocator);
        seq.num_published = 0;
        if let Some(slot) = seq.state_slot.take() {
            self.slots.release(slot);
        }
    }

    /// Frees a running sequence's blocks and sends it back to wait; its tokens (prompt and
    /// output so far) are recomputed when it runs again.
    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|s| *s != id);
        if let Some(mut seq) = self.seqs.remove(id) {
            self.release(&mut seq);
            seq.num_computed = 0;
            seq.status = SeqStatus::Waiting;
            seq.preemptions += 1;
            self.seqs.insert(seq);
        }
        self.waiting.push_front(id);
        self.total_preemptions += 1;
    }

    /// A sequence's share under `budget`: the uncomputed tokens that fit, then, when that is
    /// a decode (one token), as many of its drafts as fit too.
    fn share(cfg: &SchedulerConfig, seq: &Sequence, budget: usize) -> ScheduledSeq {
        let mut num_new = seq.num_uncomputed().min(budget);
        let threshold = cfg.long_prefill_token_threshold;
        if seq.num_uncomputed() > 1 && threshold > 0 {
            num_new = num_new.min(threshold);
        }
        if let Some(mm) = seq.mm.as_ref().filter(|_| cfg.whole_images) {
            let (start, end) = (seq.num_computed, seq.num_computed + num_new);
            if let Some((a, b)) = mm.image_runs().into_iter().find(|&(a, b)| a < end && end < b) {
                num_new = if a > start { a - start } else { b - start };
            }
        }
        // A decode: its last token is all that is uncomputed (budget > 0 here).
        let num_draft = if seq.num_uncomputed() == 1 { seq.draft.len().min(budget - 1) } else { 0 };
        ScheduledSeq { id: seq.id, num_new, num_draft }
    }

    pub fn schedule(&mut self) -> SchedulerOutput {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut out = SchedulerOutput::default();

        // Running sequences first, oldest first; make room by preempting the youngest.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let item = Self::share(&self.cfg, self.seqs.expect(id), budget);
            // Blocks for the draft rows too (lookahead): their keys and values are written.
            let want = self.seqs.expect(id).num_computed + item.num_rows();
            let mut fits = true;
            while self.seqs.expect(id).block_table.blocks_needed(want, bs) > self.allocator.num_free() {
                let victim = *self.running.last().unwrap_or(&id);
                if victim == id {
                    fits = false;
                    break;
                }
                self.preempt(victim);
                out.preempted.push(victim);
                out.items.retain(|s| s.id != victim);
            }
            if !fits {
                self.preempt(id);
                out.preempted.push(id);
                continue; // running[i] is now the next sequence
            }
            let seq = self.seqs.expect_mut(id);
            seq.block_table.grow(want, bs, &mut self.allocator);
            out.items.push(item);
            budget = budget.saturating_sub(item.num_rows());
            i += 1;
        }

        // Then waiting ones, in order, while budget, blocks and sequence slots last. Not after
        // a preemption: memory is short, and admitting would only cause more.
        if out.preempted.is_empty() {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.front() else { break };
                let seq = self.seqs.expect_mut(id);
                // A sequence that holds no blocks (new, or preempted) starts after the longest
                // cached run of its blocks.
                let cached = self.prefix.map_or(0, |p| p.start_from_cache(seq, &mut self.allocator));
                let item = Self::share(&self.cfg, seq, budget);
                if !seq.block_table.grow(seq.num_computed + item.num_rows(), bs, &mut self.allocator) {
                    // Not now: the cached blocks go back (still cached) until it fits.
                    PrefixHasher::give_back(seq, &mut self.allocator);
                    break;
                }
                if self.prefix.is_some() && seq.params.prompt_logprobs.is_none() {
                    self.prefix_stats.queries += seq.num_tokens() as u64;
                    self.prefix_stats.hits += cached as u64;
                }
                if seq.preemptions == 0 {
                    seq.num_cached_tokens = cached;
                }
                seq.status = SeqStatus::Running;
                // There is a slot for every sequence that may run, and one is free (checked above).
                seq.state_slot = self.slots.allocate();
                self.waiting.pop_front();
                self.running.push(id);
                out.items.push(item);
                budget = budget.saturating_sub(item.num_rows());
            }
        }
        out
    }
}
