//! What a step's sampled rows give back from the device: their logits, the tokens drawn
//! there, or logits left there to be masked and drawn. Shared by the runner and the CUDA graphs.

use candle_core::{Result, Tensor};

use crate::ops::argmax::Argmax;
use crate::ops::sample::{Draw, Sample, PARAMS_PER_ROW};
use crate::ops::token_mask::TokenMasks;

/// What a batch's sampled rows gave.
pub enum StepOutput {
    /// `[rows, vocab]` logits of the sampled rows, in order.
    Logits(Vec<Vec<f32>>),
    /// The token drawn for each sampled row, in order.
    Tokens(Vec<u32>),
    /// The sampled rows' `[rows, vocab]` logits, still on the device, and their draws: a step
    /// with grammar masks, which are computed while the model runs and applied on the device
    /// before the draw (`drawn`).
    Undrawn { logits: Tensor, draws: Vec<Draw> },
}

impl StepOutput {
    /// `Undrawn` logits masked by `masks(vocab)` and drawn on their device; any other output as
    /// it is.
    pub fn drawn(self, masks: impl FnOnce(usize) -> TokenMasks) -> Result<Self> {
        let StepOutput::Undrawn { logits, draws } = self else { return Ok(self) };
        let masks = masks(logits.dim(1)?);
        let logits = if masks.any() { masks.apply(&logits)? } else { logits };
        Ok(StepOutput::Tokens(draw_on_device(&logits, None, &draws)?))
    }
}

/// Each row's token, drawn where `logits` (`[rows, vocab]` f32) are; `argmax` holds the rows'
/// argmax when the caller has it already (used when every draw is greedy).
pub fn draw_on_device(logits: &Tensor, argmax: Option<&Tensor>, draws: &[Draw]) -> Result<Vec<u32>> {
    let ids = if draws.iter().all(|d| d.inv_temperature == 0.0) {
        match argmax {
            Some(ids) => ids.clone(),
            None => Argmax::forward(logits)?,
        }
    } else {
        let params: Vec<f32> = draws.iter().flat_map(|d| d.to_params()).collect();
        Sample::forward(logits, &Tensor::from_vec(params, (draws.len(), PARAMS_PER_ROW), logits.device())?)?
    };
    ids.to_vec1()
}
