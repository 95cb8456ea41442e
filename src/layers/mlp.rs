use candle_core::{Result, Tensor};

use super::linear::{Linear, StackedLinear};
use crate::models::config::Activation;
use crate::ops::gated_act::GatedAct;
use crate::weights::{Weights, WeightsError};

/// `down(act(gate(x)) * up(x))`
pub struct GatedMlp {
    gate_up: StackedLinear,
    down: Linear,
    /// The intermediate width.
    inter: usize,
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

    /// With biases on all three projections (Qwen2.5-VL's vision MLP). Gate and up are read
    /// as `gate_proj` and `up_proj`, or as one `gate_up_proj` holding gate rows then up rows
    /// (GLM-4.1V, Phi-3).
    pub fn load_with_bias(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Activation,
        bias: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let fused = format!("{prefix}.gate_up_proj");
        let gate_up = if w.contains(&format!("{fused}.weight")) {
            StackedLinear::Merged { linear: Linear::load(w, &fused, hidden, 2 * inter, bias)?, widths: vec![inter; 2] }
        } else {
            StackedLinear::load(
                w,
                &[format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")],
                hidden,
                &[inter, inter],
                bias,
            )?
        };
        Ok(GatedMlp {
            gate_up,
            down: Linear::load(w, &format!("{prefix}.down_proj"), inter, hidden, bias)?,
            inter,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(gate_up) = self.gate_up.merged() {
            return self.down.forward(&gated(self.act, &gate_up.forward(x)?, self.inter)?);
        }
        let [g, up]: [Tensor; 2] =
            self.gate_up.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("gate/up: 2 parts".into()))?;
        self.down.forward(&(self.act.apply(&g)? * up)?)
    }
}

/// `act(gate) * up` of a fused gate/up projection `y` (`[T, 2 * inter]`, gate rows first): one
/// pass on CUDA where the fused kernel has the activation (SiLU, tanh-GELU) and the width, op by
/// op otherwise.
pub fn gated(act: Activation, y: &Tensor, inter: usize) -> Result<Tensor> {
    if let Some(fused) = GatedAct::for_activation(act).filter(|_| y.device().is_cuda() && GatedAct::supports(inter)) {
        // One pass instead of act, mul and their strided reads.
        return fused.forward(y);
    }
    act.apply(&y.narrow(1, 0, inter)?)? * y.narrow(1, inter, inter)?
}
