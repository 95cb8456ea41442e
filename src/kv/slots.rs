//! Per-sequence state slots: fixed storage reserved at start, one slot per running sequence
//! (a TurboQuant float window's ring today; a recurrent layer's state and its speculation
//! checkpoints are the next users). The pool hands out slot indices; the storage behind them
//! lives with the layers that use it.

/// Free slot indices out of `capacity`.
#[derive(Debug, Clone)]
pub struct SlotPool {
    free: Vec<u32>,
    capacity: usize,
}

impl SlotPool {
    pub fn new(capacity: usize) -> Self {
        // Pop from the end: low slots first.
        SlotPool { free: (0..capacity as u32).rev().collect(), capacity }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn allocate(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub fn release(&mut self, slot: u32) {
        debug_assert!((slot as usize) < self.capacity && !self.free.contains(&slot), "bad release of slot {slot}");
        self.free.push(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_each_slot_once_until_released() {
        let mut p = SlotPool::new(2);
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        assert_ne!(a, b);
        assert!(p.allocate().is_none());
        p.release(a);
        assert_eq!((p.num_free(), p.allocate()), (1, Some(a)));
    }
}
