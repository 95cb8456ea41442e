use candle_core::{Result, Tensor};

use super::linear::{Linear, StackedLinear};
use crate::models::config::Activation;
use crate::weights::{Weights, WeightsError};

/// `down(act(gate(x)) * up(x))`
pub struct GatedMlp {
    gate_up: StackedLinear,
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
        Self::load_with_bias(w, prefix, hidden, inter, act, false)
    }

    /// With biases on all three projections (Qwen2.5-VL's vision MLP).
    pub fn load_with_bias(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Activation,
        bias: bool,
    ) -> std::result::Result<Self, WeightsError> {
        Ok(GatedMlp {
            gate_up: StackedLinear::load(
                w,
                &[format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")],
                hidden,
                &[inter, inter],
                bias,
            )?,
            down: Linear::load(w, &format!("{prefix}.down_proj"), inter, hidden, bias)?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [g, up]: [Tensor; 2] =
            self.gate_up.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("gate/up: 2 parts".into()))?;
        self.down.forward(&(self.act.apply(&g)? * up)?)
    }
}
