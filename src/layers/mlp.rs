use candle_core::{Result, Tensor};

use super::linear::Linear;
use crate::models::config::Activation;
use crate::weights::{Weights, WeightsError};

/// `down(act(gate(x)) * up(x))`
pub struct GatedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: Activation,
}

impl GatedMlp {
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Activation,
    ) -> std::result::Result<Self, WeightsError> {
        Ok(GatedMlp {
            gate: Linear::load(w, &format!("{prefix}.gate_proj"), hidden, inter, false)?,
            up: Linear::load(w, &format!("{prefix}.up_proj"), hidden, inter, false)?,
            down: Linear::load(w, &format!("{prefix}.down_proj"), inter, hidden, false)?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = self.gate.forward(x)?;
        let g = match self.act {
            Activation::Silu => candle_nn::ops::silu(&g)?,
            Activation::GeluTanh => g.gelu()?,
        };
        self.down.forward(&(g * self.up.forward(x)?)?)
    }
}
