//! Decides what runs each step: continuous batching under a token budget, chunked prefill
//! mixed with decodes, first come first served, preemption by recompute when blocks run out.

use std::collections::{HashMap, VecDeque};

use super::sequence::{SeqId, SeqStatus, Sequence};
use crate::kv::BlockAllocator;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Most tokens one step may compute (prefill chunks plus decodes).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    pub block_size: usize,
}

/// One step's work: for each sequence, how many of its uncomputed tokens to compute.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub items: Vec<(SeqId, usize)>,
    /// Sequences preempted while planning this step.
    pub preempted: Vec<SeqId>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|(_, n)| n).sum()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    seqs: HashMap<SeqId, Sequence>,
    /// In arrival order; preempted sequences go back to the front.
    waiting: VecDeque<SeqId>,
    /// In admission order; the last one is preempted first.
    running: Vec<SeqId>,
    pub allocator: BlockAllocator,
    /// Float-window rings not held by a running sequence (one per sequence slot).
    free_rings: Vec<u32>,
    pub total_preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, num_blocks: usize) -> Self {
        Scheduler {
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            allocator: BlockAllocator::new(num_blocks),
            free_rings: (0..cfg.max_num_seqs as u32).rev().collect(),
            total_preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq.id, seq);
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.seqs.get_mut(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Removes a sequence (finished, aborted) and frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        self.waiting.retain(|s| *s != id);
        self.running.retain(|s| *s != id);
        seq.block_table.release_all(&mut self.allocator);
        self.free_rings.extend(seq.window_ring.take());
        seq.status = SeqStatus::Finished;
        Some(seq)
    }

    /// Frees a running sequence's blocks and sends it back to wait; its tokens (prompt and
    /// output so far) are recomputed when it runs again.
    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|s| *s != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.block_table.release_all(&mut self.allocator);
            self.free_rings.extend(seq.window_ring.take());
            seq.num_computed = 0;
            seq.status = SeqStatus::Waiting;
            seq.preemptions += 1;
        }
        self.waiting.push_front(id);
        self.total_preemptions += 1;
    }

    pub fn schedule(&mut self) -> Plan {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = Plan::default();

        // Running sequences first, oldest first; make room by preempting the youngest.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let n = seq.num_uncomputed().min(budget);
            let want = seq.num_computed + n;
            let mut fits = true;
            while self.seqs[&id].block_table.blocks_needed(want, bs) > self.allocator.num_free() {
                let victim = *self.running.last().unwrap_or(&id);
                if victim == id {
                    fits = false;
                    break;
                }
                self.preempt(victim);
                plan.preempted.push(victim);
                plan.items.retain(|(s, _)| *s != victim);
            }
            if !fits {
                self.preempt(id);
                plan.preempted.push(id);
                continue; // running[i] is now the next sequence
            }
            let seq = self.seqs.get_mut(&id).expect("running sequence exists");
            seq.block_table.grow(want, bs, &mut self.allocator);
            plan.items.push((id, n));
            budget -= n;
            i += 1;
        }

        // Then waiting ones, in order, while budget, blocks and sequence slots last. Not after
        // a preemption: memory is short, and admitting would only cause more.
        if plan.preempted.is_empty() {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.front() else { break };
                let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
                let n = seq.num_uncomputed().min(budget);
                if !seq.block_table.grow(seq.num_computed + n, bs, &mut self.allocator) {
                    break;
                }
                seq.status = SeqStatus::Running;
                // There is a ring for every sequence slot, and a slot is free (checked above).
                seq.window_ring = self.free_rings.pop();
                self.waiting.pop_front();
                self.running.push(id);
                plan.items.push((id, n));
                budget -= n;
            }
        }
        plan
    }
}
