//! Automatic prefix caching, the engine's side: a sequence's block hashes (its tokens, its
//! images by pixel hash, its M-RoPE positions), the cached run of blocks a sequence that holds
//! none starts from, and publishing blocks once each of their tokens is computed and final.
//!
//! What may be published: blocks below `num_computed`, which counts only committed tokens
//! (prompt, accepted output). A verify step also writes keys for its draft tokens, but those
//! sit at `num_computed` and after it; a rejected draft's are overwritten later, so a block
//! that holds one is never full of computed tokens until they are. A published block is never
//! written again: a sequence writes only at and after its `num_computed`, and one that starts
//! from cached blocks starts after them (always computing at least its last token itself).

use super::sequence::Sequence;
use crate::kv::prefix_cache::block_hash;
use crate::kv::{BlockAllocator, BlockExtra, BlockHash};

/// Fewest prompt tokens a sequence starting from cached blocks computes itself. A CPU matmul
/// rounds a row differently when it is one of fewer than ~5 rows (gemm picks another kernel),
/// so a repeated prompt whose last token alone were computed would get logits a bit or two off
/// those of the same prompt computed whole; with this many rows it gets the same bits. It
/// costs at most this many tokens more per hit.
pub const MIN_COMPUTED: usize = 8;

/// Names a pool's full blocks (`kv::prefix_cache`): the chain's root and the block size.
#[derive(Debug, Clone, Copy)]
pub struct PrefixHasher {
    root: BlockHash,
    block_size: usize,
}

/// Counters of the cache's use (vLLM's `prefix_cache_queries` / `prefix_cache_hits`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefixStats {
    /// Tokens of sequences that looked for a cached prefix when they started.
    pub queries: u64,
    /// Of those, tokens found cached (not computed).
    pub hits: u64,
}

impl PrefixHasher {
    pub fn new(root: BlockHash, block_size: usize) -> Self {
        PrefixHasher { root, block_size }
    }

    /// Hashes the sequence's full blocks among its first `upto` tokens that are not yet hashed.
    fn extend(&self, seq: &mut Sequence, upto: usize) {
        let bs = self.block_size;
        let full = upto.min(seq.num_tokens()) / bs;
        while seq.block_hashes.len() < full {
            let k = seq.block_hashes.len();
            let parent = seq.block_hashes.last().copied().unwrap_or(self.root);
            let range = k * bs..(k + 1) * bs;
            // A sequence with images has three-axis positions that follow its images, and its
            // image tokens stand for embeddings: both are part of the block's name.
            let (positions, images) = match &seq.mm {
                Some(mm) => {
                    (Some(range.clone().map(|i| mm.position(i)).collect::<Vec<_>>()), mm.image_spans(range.clone()))
                }
                None => (None, Vec::new()),
            };
            let extra = BlockExtra { positions: positions.as_deref(), images: &images };
            let h = block_hash(&parent, &seq.tokens()[range], extra);
            seq.block_hashes.push(h);
        }
    }

    /// Gives a sequence that holds no blocks the longest cached run of its full blocks (never
    /// its last `MIN_COMPUTED` tokens: the last one's logits are needed, see `MIN_COMPUTED`
    /// for the others) and marks those tokens computed. Returns
    /// how many tokens that is. A sequence that wants prompt logprobs computes every prompt
    /// token itself (their logits are what it asks for).
    pub fn start_from_cache(&self, seq: &mut Sequence, alloc: &mut BlockAllocator) -> usize {
        if !alloc.prefix_caching() || seq.params.prompt_logprobs.is_some() || !seq.block_table.blocks().is_empty() {
            return 0;
        }
        let bs = self.block_size;
        let max_blocks = seq.num_tokens().saturating_sub(MIN_COMPUTED.max(1)) / bs;
        self.extend(seq, max_blocks * bs);
        let hits = alloc.lookup(&seq.block_hashes[..max_blocks]);
        for &b in &hits {
            alloc.acquire(b);
        }
        let n = hits.len();
        seq.block_table.adopt(hits);
        seq.num_computed = n * bs;
        seq.num_published = n;
        n * bs
    }

    /// Undoes `start_from_cache` for a sequence that could not be admitted after all.
    pub fn give_back(seq: &mut Sequence, alloc: &mut BlockAllocator) {
        seq.block_table.release_all(alloc);
        seq.num_computed = 0;
        seq.num_published = 0;
    }

    /// Publishes the sequence's blocks whose every token is computed and committed.
    pub fn publish(&self, seq: &mut Sequence, alloc: &mut BlockAllocator) {
        if !alloc.prefix_caching() {
            return;
        }
        let full = seq.num_computed.min(seq.num_tokens()) / self.block_size;
        if full <= seq.num_published {
            return;
        }
        self.extend(seq, full * self.block_size);
        for k in seq.num_published..full {
            alloc.publish(seq.block_table.blocks()[k], seq.block_hashes[k]);
        }
        seq.num_published = full;
    }
}
