/// Index of a physical KV block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Hands out physical blocks; reference-counted so that sequences can later share prefixes.
#[derive(Debug)]
pub struct BlockAllocator {
    free: Vec<BlockId>,
    refs: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        // Pop from the end, so hand out low ids first (easier to read in logs).
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        BlockAllocator { free, refs: vec![0; num_blocks] }
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        self.refs[b.0 as usize] = 1;
        Some(b)
    }

    /// Drops one reference; the block is free again when none remain.
    pub fn release(&mut self, b: BlockId) {
        let r = &mut self.refs[b.0 as usize];
        debug_assert!(*r > 0, "double free of {b:?}");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(b);
        }
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
}
