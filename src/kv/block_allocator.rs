pub use super::block_id::BlockId;
use super::prefix_cache::{BlockHash, PrefixIndex};

/// Hands out physical blocks, reference counted so that sequences can share a cached prefix.
///
/// With prefix caching, a full block whose keys are computed may be published under its hash
/// (`kv::prefix_cache`); when its last holder releases it, it stays cached but counts as free:
/// blocks that were never named are handed out first, then cached ones, least recently
/// released first. So the cache only ever holds memory nobody else wants.
#[derive(Debug)]
pub struct BlockAllocator {
    /// Free blocks without a name.
    free: Vec<BlockId>,
    refs: Vec<u32>,
    /// None: prefix caching off.
    index: Option<PrefixIndex>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        // Pop from the end, so hand out low ids first (easier to read in logs).
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        BlockAllocator { free, refs: vec![0; num_blocks], index: None }
    }

    /// An allocator that keeps released full blocks cached by their hash.
    pub fn with_prefix_caching(num_blocks: usize) -> Self {
        BlockAllocator { index: Some(PrefixIndex::new(num_blocks)), ..Self::new(num_blocks) }
    }

    pub fn prefix_caching(&self) -> bool {
        self.index.is_some()
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks nobody holds: never named, or cached and evictable.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.index.as_ref().map_or(0, PrefixIndex::num_evictable)
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Blocks cached under a hash (held or not).
    pub fn num_cached(&self) -> usize {
        self.index.as_ref().map_or(0, PrefixIndex::len)
    }

    /// Cached blocks evicted (handed out for other keys) so far.
    pub fn num_evicted(&self) -> u64 {
        self.index.as_ref().map_or(0, |ix| ix.evictions)
    }

    /// Sum of every block's reference count (0 once every sequence has ended).
    pub fn total_refs(&self) -> u64 {
        self.refs.iter().map(|&r| r as u64).sum()
    }

    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            // Only when no unnamed block is left: the cache gives up its oldest block.
            None => self.index.as_mut()?.evict_lru()?,
        };
        self.refs[b.0 as usize] = 1;
        Some(b)
    }

    /// Drops one reference; the block is free again when none remain (cached, if it has a name).
    pub fn release(&mut self, b: BlockId) {
        let r = &mut self.refs[b.0 as usize];
        debug_assert!(*r > 0, "double free of {b:?}");
        *r = r.saturating_sub(1);
        if *r == 0 {
            match self.index.as_mut().filter(|ix| ix.is_cached(b)) {
                Some(ix) => ix.push_evictable(b),
                None => self.free.push(b),
            }
        }
    }

    /// The longest run of `hashes`, from the first, that is cached: their blocks, in order
    /// (not yet held: `acquire` each).
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let Some(ix) = &self.index else { return Vec::new() };
        hashes.iter().map_while(|h| ix.get(h)).collect()
    }

    /// One more reference to a cached block (from `lookup`).
    pub fn acquire(&mut self, b: BlockId) {
        let r = &mut self.refs[b.0 as usize];
        if *r == 0 {
            if let Some(ix) = self.index.as_mut() {
                ix.take_evictable(b);
            }
        }
        *r += 1;
    }

    /// Names held block `b`, whose every token's keys and values are computed and final, by
    /// `hash`, so that later sequences may share it. False when caching is off or the hash or
    /// block is named already.
    pub fn publish(&mut self, b: BlockId, hash: BlockHash) -> bool {
        debug_assert!(self.refs[b.0 as usize] > 0, "publishing free block {b:?}");
        self.index.as_mut().is_some_and(|ix| ix.insert(b, hash))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_until_empty_and_reuses_released() {
        let mut a = BlockAllocator::new(3);
        let x: Vec<_> = (0..3).map(|_| a.allocate().unwrap()).collect();
        assert!(a.allocate().is_none());
        assert_eq!(a.num_used(), 3);
        a.release(x[1]);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.allocate(), Some(x[1]));
    }

    #[test]
    fn cached_blocks_count_as_free_and_go_last_oldest_first() {
        let h = |i: u8| BlockHash([i; 32]);
        let mut a = BlockAllocator::with_prefix_caching(3);
        let x: Vec<_> = (0..3).map(|_| a.allocate().unwrap()).collect();
        assert!(a.publish(x[0], h(0)) && a.publish(x[1], h(1)));
        assert!(!a.publish(x[2], h(0)), "a hash keeps its first block");
        for &b in &x {
            a.release(b);
        }
        // Nothing is held: all three are free, two of them still cached.
        assert_eq!((a.num_free(), a.num_cached(), a.total_refs()), (3, 2, 0));
        assert_eq!(a.lookup(&[h(0), h(1), h(2)]), vec![x[0], x[1]]);
        assert_eq!(a.lookup(&[h(1)]), vec![x[1]]);
        assert!(a.lookup(&[h(5), h(0)]).is_empty(), "a run starts at the first block");
        // A hit is held again: no longer free, and not evicted by allocation.
        a.acquire(x[1]);
        assert_eq!(a.num_free(), 2);
        // The unnamed block goes first, then the oldest cached one.
        assert_eq!(a.allocate(), Some(x[2]));
        assert_eq!(a.allocate(), Some(x[0]));
        assert!(a.lookup(&[h(0)]).is_empty(), "block 0 was evicted");
        assert_eq!(a.allocate(), None, "block 1 is held");
        a.release(x[1]);
        assert_eq!(a.lookup(&[h(1)]), vec![x[1]], "released, it is cached still");
        // Two holders: free only once both let go.
        a.acquire(x[1]);
        a.acquire(x[1]);
        a.release(x[1]);
        assert_eq!(a.num_free(), 0);
        a.release(x[1]);
        assert_eq!(a.num_free(), 1);
    }
}
