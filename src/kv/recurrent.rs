//! The recurrent state of a hybrid model's linear-attention layer: per state slot (one per
//! sequence that may run), the convolution's last inputs and the delta rule's matrices, in f32,
//! allocated at start. A sequence's slot is zeroed when it computes its first position (a new
//! sequence, or one recomputed after preemption), so a slot needs no clearing when freed.
//! On a GPU the states live in device memory (`device`), where the kernels of
//! `ops::gated_delta_cuda` read and advance them; on the CPU in host memory.
//!
//! With speculation each slot holds `checkpoints` copies of its state, laid out
//! `[slot][checkpoint]`: copy 0 is the live state; a verify step keeps the state after each of
//! its rows r but the last in copy r + 1, so that once the drafts are judged the live state can
//! be put back to the state after the last kept row (`restore`), without running the model
//! again. Checkpoints live in host memory only: on a GPU, speculation is refused for these
//! models at start.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::config::LinearAttnConfig;

pub struct RecurrentState {
    pub dims: LinearAttnConfig,
    /// `[slots, checkpoints, K - 1, conv_dim]` (empty when the state is on a device).
    conv: Mutex<Vec<f32>>,
    /// `[slots, checkpoints, Hv, Dk, Dv]` (empty when the state is on a device).
    ssm: Mutex<Vec<f32>>,
    /// The same two on a GPU, f32 tensors of those shapes.
    device: Option<(Tensor, Tensor)>,
    slots: usize,
    checkpoints: usize,
}

impl RecurrentState {
    /// `checkpoints` copies per slot (at least 1, the live state): 1 + the most draft tokens
    /// when speculating, which only the host keeps.
    pub fn with_checkpoints(
        dims: LinearAttnConfig,
        slots: usize,
        checkpoints: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let (c, s) = dims.state_len();
        let checkpoints = checkpoints.max(1);
        let n = slots * checkpoints;
        let (hv, dk, dv) = (dims.num_value_heads, dims.key_head_dim, dims.value_head_dim);
        let (host, device) = match device {
            Device::Cpu => ((vec![0.0; n * c], vec![0.0; n * s]), None),
            _ if checkpoints > 1 => {
                candle_core::bail!("recurrent state checkpoints are kept in host memory only (speculation on a GPU is refused for these models)")
            }
            gpu => {
                let conv = Tensor::zeros((slots, dims.conv_kernel - 1, dims.conv_dim()), DType::F32, gpu)?;
                (Default::default(), Some((conv, Tensor::zeros((slots, hv, dk, dv), DType::F32, gpu)?)))
            }
        };
        Ok(RecurrentState { dims, conv: Mutex::new(host.0), ssm: Mutex::new(host.1), device, slots, checkpoints })
    }

    /// The (conv, delta-rule) states in device memory, when they live there.
    pub fn device_tensors(&self) -> Option<(&Tensor, &Tensor)> {
        self.device.as_ref().map(|(c, s)| (c, s))
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Copies of the state per slot, the live one included.
    pub fn checkpoints(&self) -> usize {
        self.checkpoints
    }

    pub fn bytes(&self) -> usize {
        let (c, s) = self.dims.state_len();
        4 * self.slots * self.checkpoints * (c + s)
    }

    /// Runs `f` on slot `slot`'s live (conv, delta-rule) state, zeroed first when `fresh`.
    pub fn with_slot<R>(
        &self,
        slot: u32,
        fresh: bool,
        f: impl FnOnce(&mut [f32], &mut [f32]) -> R,
    ) -> candle_core::Result<R> {
        let (cl, sl) = self.dims.state_len();
        self.with_slot_checkpoints(slot, fresh, |c, s| f(&mut c[..cl], &mut s[..sl]))
    }

    /// Runs `f` on every copy of slot `slot`'s state, `[checkpoints, conv len]` and
    /// `[checkpoints, delta-rule len]` with the live copy first; the live copy is zeroed first
    /// when `fresh`.
    pub fn with_slot_checkpoints<R>(
        &self,
        slot: u32,
        fresh: bool,
        f: impl FnOnce(&mut [f32], &mut [f32]) -> R,
    ) -> candle_core::Result<R> {
        let slot = slot as usize;
        if self.device.is_some() {
            candle_core::bail!("this recurrent state lives in device memory: the device kernels advance it");
        }
        if slot >= self.slots {
            candle_core::bail!("state slot {slot} of a recurrent layer with {} slots", self.slots);
        }
        let (cl, sl) = self.dims.state_len();
        let (cl, sl) = (cl * self.checkpoints, sl * self.checkpoints);
        // A panic while a step held the lock leaves no state worth keeping; the sequence is
        // failed by that step, and the next user of the slot starts from zero.
        let mut conv = self.conv.lock().unwrap_or_else(|p| p.into_inner());
        let mut ssm = self.ssm.lock().unwrap_or_else(|p| p.into_inner());
        let (c, s) = (&mut conv[slot * cl..(slot + 1) * cl], &mut ssm[slot * sl..(slot + 1) * sl]);
        if fresh {
            let (c0, s0) = self.dims.state_len();
            c[..c0].fill(0.0);
            s[..s0].fill(0.0);
        }
        Ok(f(c, s))
    }

    /// Makes checkpoint `checkpoint` of slot `slot` its live state (the state after the
    /// verify step's row `checkpoint - 1`); checkpoint 0 is the live state already.
    pub fn restore(&self, slot: u32, checkpoint: usize) -> candle_core::Result<()> {
        if checkpoint >= self.checkpoints {
            candle_core::bail!("state checkpoint {checkpoint} of a recurrent layer with {}", self.checkpoints);
        }
        let (cl, sl) = self.dims.state_len();
        self.with_slot_checkpoints(slot, false, |c, s| {
            c.copy_within(checkpoint * cl..(checkpoint + 1) * cl, 0);
            s.copy_within(checkpoint * sl..(checkpoint + 1) * sl, 0);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: LinearAttnConfig =
        LinearAttnConfig { num_key_heads: 1, num_value_heads: 2, key_head_dim: 2, value_head_dim: 3, conv_kernel: 3 };

    /// Each slot's copies lie side by side, the live one first: `with_slot` and a fresh start
    /// touch only the live copy, and `restore` copies one checkpoint over it and nothing else.
    #[test]
    fn checkpoints_are_per_slot_and_restore_only_the_live_copy() {
        let r = RecurrentState::with_checkpoints(DIMS, 2, 3, &Device::Cpu).unwrap();
        assert_eq!(r.bytes(), 4 * 2 * 3 * (2 * DIMS.conv_dim() + 2 * 2 * 3));
        // Copy c of slot s holds 10 s + c everywhere.
        for s in 0..2 {
            r.with_slot_checkpoints(s, false, |c, m| {
                let (cl, sl) = DIMS.state_len();
                (0..3).for_each(|k| c[k * cl..(k + 1) * cl].fill((10 * s) as f32 + k as f32));
                (0..3).for_each(|k| m[k * sl..(k + 1) * sl].fill((10 * s) as f32 + k as f32));
            })
            .unwrap();
        }
        let live = |s: u32| r.with_slot(s, false, |c, m| (c.to_vec(), m.to_vec())).unwrap();
        assert!(live(1).0.iter().chain(&live(1).1).all(|&v| v == 10.0));
        r.restore(1, 2).unwrap();
        assert!(live(1).0.iter().chain(&live(1).1).all(|&v| v == 12.0));
        assert!(live(0).0.iter().chain(&live(0).1).all(|&v| v == 0.0), "slot 0 untouched");
        let all = r.with_slot_checkpoints(1, true, |c, m| (c.to_vec(), m.to_vec())).unwrap();
        let (cl, sl) = DIMS.state_len();
        assert!(all.0[..cl].iter().chain(&all.1[..sl]).all(|&v| v == 0.0), "a fresh start zeroes the live copy");
        assert!(all.0[cl..2 * cl].iter().chain(&all.1[sl..2 * sl]).all(|&v| v == 11.0), "checkpoint 1 kept");
        assert!(r.restore(1, 3).is_err() && r.restore(2, 0).is_err());
    }
}
