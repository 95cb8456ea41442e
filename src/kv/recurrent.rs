//! The recurrent state of a hybrid model's linear-attention layer: per state slot (one per
//! sequence that may run), the convolution's last inputs and the delta rule's matrices, in f32,
//! allocated at start. A sequence's slot is zeroed when it computes its first position (a new
//! sequence, or one recomputed after preemption), so a slot needs no clearing when freed.
//! On a GPU the states live in device memory (`device`), where the kernels of
//! `ops::gated_delta_cuda` read and advance them; on the CPU in host memory.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::config::LinearAttnConfig;

pub struct RecurrentState {
    pub dims: LinearAttnConfig,
    /// `[slots, K - 1, conv_dim]` (empty when the state is on a device).
    conv: Mutex<Vec<f32>>,
    /// `[slots, Hv, Dk, Dv]` (empty when the state is on a device).
    ssm: Mutex<Vec<f32>>,
    /// The same two on a GPU, f32 tensors of those shapes.
    device: Option<(Tensor, Tensor)>,
    slots: usize,
}

impl RecurrentState {
    /// `slots` zeroed states, in device memory on a GPU.
    pub fn new(dims: LinearAttnConfig, slots: usize, device: &Device) -> candle_core::Result<Self> {
        let (c, s) = dims.state_len();
        let (hv, dk, dv) = (dims.num_value_heads, dims.key_head_dim, dims.value_head_dim);
        let (host, device) = match device {
            Device::Cpu => ((vec![0.0; slots * c], vec![0.0; slots * s]), None),
            gpu => {
                let conv = Tensor::zeros((slots, dims.conv_kernel - 1, dims.conv_dim()), DType::F32, gpu)?;
                (Default::default(), Some((conv, Tensor::zeros((slots, hv, dk, dv), DType::F32, gpu)?)))
            }
        };
        Ok(RecurrentState { dims, conv: Mutex::new(host.0), ssm: Mutex::new(host.1), device, slots })
    }

    /// The (conv, delta-rule) states in device memory, when they live there.
    pub fn device_tensors(&self) -> Option<(&Tensor, &Tensor)> {
        self.device.as_ref().map(|(c, s)| (c, s))
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
        if self.device.is_some() {
            candle_core::bail!("this recurrent state lives in device memory: the device kernels advance it");
        }
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
