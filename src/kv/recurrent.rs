//! The recurrent state of a hybrid model's linear-attention layer: per state slot (one per
//! sequence that may run), the convolution's last inputs and the delta rule's matrices, in f32,
//! allocated at start. A sequence's slot is zeroed when it computes its first position (a new
//! sequence, or one recomputed after preemption), so a slot needs no clearing when freed.

use std::sync::Mutex;

use crate::config::LinearAttnConfig;

pub struct RecurrentState {
    pub dims: LinearAttnConfig,
    /// `[slots, K - 1, conv_dim]`.
    conv: Mutex<Vec<f32>>,
    /// `[slots, Hv, Dk, Dv]`.
    ssm: Mutex<Vec<f32>>,
    slots: usize,
}

impl RecurrentState {
    pub fn new(dims: LinearAttnConfig, slots: usize) -> Self {
        let (c, s) = dims.state_len();
        RecurrentState { dims, conv: Mutex::new(vec![0.0; slots * c]), ssm: Mutex::new(vec![0.0; slots * s]), slots }
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn bytes(&self) -> usize {
        let (c, s) = self.dims.state_len();
        4 * self.slots * (c + s)
    }

    /// Runs `f` on slot `slot`'s (conv, delta-rule) state, zeroed first when `fresh`.
    pub fn with_slot<R>(
        &self,
        slot: u32,
        fresh: bool,
        f: impl FnOnce(&mut [f32], &mut [f32]) -> R,
    ) -> candle_core::Result<R> {
        let slot = slot as usize;
        if slot >= self.slots {
            candle_core::bail!("state slot {slot} of a recurrent layer with {} slots", self.slots);
        }
        let (cl, sl) = self.dims.state_len();
        // A panic while a step held the lock leaves no state worth keeping; the sequence is
        // failed by that step, and the next user of the slot starts from zero.
        let mut conv = self.conv.lock().unwrap_or_else(|p| p.into_inner());
        let mut ssm = self.ssm.lock().unwrap_or_else(|p| p.into_inner());
        let (c, s) = (&mut conv[slot * cl..(slot + 1) * cl], &mut ssm[slot * sl..(slot + 1) * sl]);
        if fresh {
            c.fill(0.0);
            s.fill(0.0);
        }
        Ok(f(c, s))
    }
}
