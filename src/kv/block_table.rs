use super::block_allocator::{BlockAllocator, BlockId};

/// The blocks holding one sequence's tokens, in order.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn ids(&self) -> Vec<u32> {
        self.blocks.iter().map(|b| b.0).collect()
    }

    /// Blocks still to allocate so that `tokens` tokens fit.
    pub fn blocks_needed(&self, tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size).saturating_sub(self.blocks.len())
    }

    /// Grows the table to hold `tokens` tokens; all or nothing.
    pub fn grow(&mut self, tokens: usize, block_size: usize, alloc: &mut BlockAllocator) -> bool {
        let need = self.blocks_needed(tokens, block_size);
        if need > alloc.num_free() {
            return false;
        }
        for _ in 0..need {
            match alloc.allocate() {
                Some(b) => self.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Starts an empty table with cached blocks the caller has acquired (a shared prefix).
    pub fn adopt(&mut self, shared: Vec<BlockId>) {
        debug_assert!(self.blocks.is_empty(), "a shared prefix goes first");
        self.blocks = shared;
    }

    /// Releases every block, the last first: a cached prefix's later blocks then become
    /// evictable before its first ones, which more prompts share.
    pub fn release_all(&mut self, alloc: &mut BlockAllocator) {
        for b in self.blocks.drain(..).rev() {
            alloc.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_all_or_nothing() {
        let mut a = BlockAllocator::new(2);
        let mut t = BlockTable::default();
        assert!(t.grow(17, 16, &mut a));
        assert_eq!(t.blocks().len(), 2);
        assert!(!t.grow(33, 16, &mut a));
        assert_eq!(t.blocks().len(), 2);
        t.release_all(&mut a);
        assert_eq!(a.num_free(), 2);
    }
}
