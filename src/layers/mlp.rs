use candle_core::{Result, Tensor};

use super::linear::{Linear, StackedLinear};
use crate::config::Activation;
use crate::ops::activation;
use crate::ops::gated_act::{GatedAct, GatedHalves};
use crate::weights::{Weights, WeightsError};

/// `down(act(gate(x)) * up(x))`
pub struct GatedMlp {
    gate_up: GateUp,
    down: Linear,
    /// The intermediate width.
    inter: usize,
    act: Activation,
}

/// The gate and up projections.
enum GateUp {
    /// The gate rows then the up rows (or two matrices).
    Halves(StackedLinear),
    /// Rows in (gate i, up i) pairs (CUDA, where the fused activation kernel applies): a decode
    /// step's product applies the activation as it writes (`Linear::forward_gated`), others run
    /// the product, then `act` over its paired columns.
    Pairs { linear: Linear, act: GatedAct },
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
        let paired = match (GatedAct::for_activation(act), gate_up.merged()) {
            (Some(a), Some(l)) if w.device().is_cuda() && GatedAct::supports(inter) => {
                l.interleave_halves()?.map(|linear| GateUp::Pairs { linear, act: GatedAct { interleaved: true, ..a } })
            }
            _ => None,
        };
        Ok(GatedMlp {
            gate_up: paired.unwrap_or(GateUp::Halves(gate_up)),
            down: Linear::load(w, &format!("{prefix}.down_proj"), inter, hidden, bias)?,
            inter,
            act,
        })
    }

    /// Takes the collective that completes the down projection (a row-parallel MLP's), leaving
    /// its output partial (see `Linear::take_collective`).
    pub fn take_collective(&mut self) -> Option<crate::parallel::Collective> {
        self.down.take_collective()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate_up = match &self.gate_up {
            GateUp::Pairs { linear, act } => {
                let h = match linear.forward_gated(x, act.gelu) {
                    Some(h) => h?,
                    None => act.forward(&linear.forward(x)?)?,
                };
                return self.down.forward(&h);
            }
            GateUp::Halves(g) => g,
        };
        if let Some(gate_up) = gate_up.merged() {
            return self.down.forward(&gated(self.act, &gate_up.forward(x)?, self.inter)?);
        }
        let [g, up]: [Tensor; 2] =
            gate_up.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("gate/up: 2 parts".into()))?;
        self.down.forward(&GatedHalves::apply(self.act, &g, &up)?)
    }
}

/// `act(gate) * up` of a fused gate/up projection `y` (`[T, 2 * inter]`, gate rows first): one
/// pass where the fused op has the activation (SiLU, tanh-GELU) and takes `y`'s layout and
/// dtype (`GatedAct::takes`), op by op otherwise.
pub fn gated(act: Activation, y: &Tensor, inter: usize) -> Result<Tensor> {
    if let Some(fused) = GatedAct::for_activation(act).filter(|_| GatedAct::takes(y)) {
        // One pass instead of act, mul and their strided reads.
        return fused.forward(y);
    }
    activation::apply(act, &y.narrow(1, 0, inter)?)? * y.narrow(1, inter, inter)?
}
